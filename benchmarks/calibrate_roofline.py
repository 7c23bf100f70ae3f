"""Fit the analytic roofline's constants (tuner.roofline.RooflineConstants) to a recorded measurement table.

The roofline (tuner/roofline.py) ranks configs where no GPU times them and picks the joint search's first round
everywhere; four of its constants come from no datasheet: a DRAM round trip under load, one SM's bandwidth cap,
split-K's counter memset and a TMA config's in-kernel descriptors. This grid-searches them against a table from
``benchmarks/record_table.py`` (every sampled config timed on every instance of each set): per set, the model
ranks each instance's configs, and the fit scores

- ``top1``: the measured time of the model's first pick over the instance's best sampled config (geomean over
  the instances: what the search's first round starts from), and
- ``spread``: the variance of log(measured / predicted) over every cell (the prior's share in the search's
  blend is earned by this error), scale-free,

minimising ``top1 + 2 x spread`` summed over the fitted sets. ``--hold-out`` fits once per set with that set
left out, to see how far the constants move. Nothing is written: the constants the tuner ships are set in
tuner/roofline.py by hand, with the figures this prints::

    python benchmarks/calibrate_roofline.py benchmarks/results/<device>/device-run/stage2/table.csv.gz \\
        [--sets dense] [--hold-out] [--target sm_90]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dietcode_ort.errors import DietcodeError  # noqa: E402
from report_table import TagTable, load_table, table_device  # noqa: E402
from tuner.hardware import HardwareProfile, device_profile, get_profile  # noqa: E402
from tuner.roofline import CONSTANTS, RooflineConstants, roofline_matrix  # noqa: E402
from tuner.space import MicroKernel  # noqa: E402

__all__ = ["ASSUMED", "GRID", "Score", "score", "fit", "main"]

# the constants before any table fitted them (tuner/roofline.py's docstring names them)
ASSUMED = RooflineConstants(dram_latency_s=500e-9, sm_bandwidth_factor=2.0, memset_s=0.5e-6, tma_setup_s=0.0)
GRID = {"dram_latency_s": (0.5e-6, 0.75e-6, 1e-6, 1.5e-6), "sm_bandwidth_factor": (2.0, 3.0, 4.0, 6.0),
        "memset_s": (0.5e-6, 1.5e-6, 3e-6, 4.5e-6), "tma_setup_s": (0.0, 0.5e-6, 1e-6, 1.5e-6, 2e-6)}


@dataclass(frozen=True)
class Score:
    top1: float  # geomean over instances of measured(model's pick) / measured(best)
    spread: float  # variance of log(measured / predicted)

    @property
    def objective(self) -> float:
        return self.top1 + 2.0 * self.spread


def score(t: TagTable, constants: RooflineConstants, profile: HardwareProfile | None = None,
          dtype: str = "float16") -> Score:
    """How well the roofline with ``constants`` on ``profile`` (default: sm_90's) ranks and times ``t``."""
    configs = [MicroKernel.from_key(c) for c in t.configs]
    pred = roofline_matrix(configs, t.problems, profile or get_profile("sm_90"), dtype, constants=constants).T
    ok = np.isfinite(t.times) & np.isfinite(pred)
    if not ok.any(axis=1).all():
        raise DietcodeError(f"set {t.tag}: an instance has no config both timed and launchable")
    first = np.where(ok, pred, np.inf).argmin(axis=1)
    picked = t.times[np.arange(len(t.problems)), first]
    best = np.where(ok, t.times, np.inf).min(axis=1)
    logs = np.log(t.times[ok] / pred[ok])
    return Score(float(np.exp(np.mean(np.log(picked / best)))), float(np.var(logs)))


def fit(tables: Sequence[TagTable], profile: HardwareProfile | None = None) -> tuple[RooflineConstants, float]:
    """The grid's constants with the least summed objective over ``tables``, and that objective."""
    grid = (RooflineConstants(**dict(zip(GRID, values))) for values in itertools.product(*GRID.values()))
    total, best = min(((sum(score(t, c, profile).objective for t in tables), c) for c in grid), key=lambda x: x[0])
    return best, total


def _line(name: str, c: RooflineConstants, tables: Sequence[TagTable], profile: HardwareProfile) -> str:
    scores = {t.tag: score(t, c, profile) for t in tables}
    sets = ", ".join(f"{tag} {s.top1:.3f} ({s.spread:.3f})" for tag, s in scores.items())
    return (f"{name:8s} latency {c.dram_latency_s * 1e9:.0f} ns, SM bandwidth x{c.sm_bandwidth_factor:g}, memset "
            f"{c.memset_s * 1e6:g} us, TMA setup {c.tma_setup_s * 1e6:g} us: first pick / best (spread): {sets}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path, help="table.csv.gz from record_table.py")
    p.add_argument("--sets", default="dense", help="fit the sets whose tag starts with one of these (comma list)")
    p.add_argument("--target", default="sm_90", help="the table's GPU architecture (default sm_90); the profile is "
                   "its device's (table.json's name: an H200's bandwidth), else the architecture's")
    p.add_argument("--hold-out", action="store_true", help="also fit once per set with that set left out")
    args = p.parse_args(argv)
    try:
        tables = load_table(args.table)
        prefixes = tuple(s.strip() for s in args.sets.split(",") if s.strip())
        chosen = [t for tag, t in sorted(tables.items()) if tag.startswith(prefixes)]
        if not chosen:
            raise DietcodeError(f"no set of {args.table} starts with {args.sets!r}; it has {sorted(tables)}")
        profile = device_profile(table_device(args.table), args.target)
        print(f"profile: {profile.name} ({profile.dram_bandwidth_gbs:g} GB/s, {profile.num_sms} SMs)")
        fitted, _ = fit(chosen, profile)
        print(_line("assumed", ASSUMED, chosen, profile))
        print(_line("shipped", CONSTANTS, chosen, profile))
        print(_line("fitted", fitted, chosen, profile))
        if args.hold_out and len(chosen) > 1:
            for held in chosen:
                c, _ = fit([t for t in chosen if t is not held], profile)
                print(_line(f"w/o {held.tag}", c, [held], profile))
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
