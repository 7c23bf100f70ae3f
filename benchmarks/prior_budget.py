"""Trials the joint search needs to come within a tolerance of the oracle, with and without the roofline prior.

On SYNTHETIC replay tables (tuner/simulate.py: nothing here is a measurement), for several table seeds and
search seeds: the first trial count after which the per-problem choice's geometric-mean slowdown against the
table's oracle (the best config of the table on each problem) is at most 1 / ``--target`` (0.97: within
about 3%), for ``SearchOptions(prior=False)`` (a random first round, the learned model alone) and the default
(the roofline's first round and blend). ``None``: not reached within ``--budget``::

    python -m benchmarks.prior_budget [--budget 640] [--configs 200] [--tables 3] [--seeds 3] [--round-size 64]
        [--json F]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuner.hardware import get_profile  # noqa: E402
from tuner.measure import ReplayMeasurer  # noqa: E402
from tuner.search import SearchOptions, TuningResult, tune_joint  # noqa: E402
from tuner.simulate import SyntheticCase, bert_dense_case  # noqa: E402
from tuner.space import Family, enumerate_space  # noqa: E402

__all__ = ["trials_to_reach", "run"]

FAMILY = Family("gemm", "float16", "sm_90")
VARIANTS: dict[str, dict] = {"random_first": {"prior": False}, "prior": {}}


def geomean_slowdown(case: SyntheticCase, result: TuningResult, choice: Sequence) -> float:
    logs = [math.log(case.seconds[(c.key(), p)] / case.oracle(p)) if c is not None else 5.0
            for c, p in zip(choice, result.problems)]
    return math.exp(sum(logs) / len(logs))


def trials_to_reach(case: SyntheticCase, result: TuningResult, target: float) -> int | None:
    """The first trial count whose choice is within ``target`` (speed vs the oracle) of the oracle."""
    for record in result.history:
        if geomean_slowdown(case, result, record.choice) <= 1.0 / target:
            return record.trials
    return None


def run(budget: int, configs: int, tables: int, seeds: int, target: float, work: Path, round_size: int = 64,
        sigma: float | None = None, variants: dict | None = None) -> list[dict]:
    profile = get_profile("sm_90")
    space = enumerate_space(FAMILY)
    rows = []
    for table_seed in range(7, 7 + tables):
        case = bert_dense_case(work, profile, space, n_configs=configs, seed=table_seed, roofline_sigma=sigma)
        for seed in range(seeds):
            row: dict = {"table_seed": table_seed, "search_seed": seed}
            for name, extra in (variants or VARIANTS).items():
                opts = SearchOptions(max_trials=budget, round_size=round_size, seed=seed, progress=False,
                                     patience=budget, **extra)
                result = tune_joint(FAMILY, [(p, 1.0) for p in case.problems], case.configs,
                                    ReplayMeasurer(case.path), profile, opts)
                row[name] = trials_to_reach(case, result, target)
                row[name + "_first_round"] = round(1.0 / geomean_slowdown(case, result, result.history[0].choice), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=640)
    parser.add_argument("--configs", type=int, default=200, help="configs per synthetic table (of the space)")
    parser.add_argument("--tables", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--round-size", type=int, default=64)
    parser.add_argument("--roofline-sigma", type=float, help="time the table by the roofline x a per-kernel "
                        "log-normal factor of this sigma (simulate.roofline_table) instead of simulate_table")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        rows = run(args.budget, args.configs, args.tables, args.seeds, args.target, Path(work), args.round_size,
                   args.roofline_sigma)
    for name in VARIANTS:
        reached = [r[name] for r in rows if r[name] is not None]
        print(f"{name}: reached {len(reached)}/{len(rows)}, trials "
              f"median {sorted(reached)[len(reached) // 2] if reached else None}, max {max(reached, default=None)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
