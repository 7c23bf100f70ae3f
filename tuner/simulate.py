"""A SYNTHETIC timing-table generator, so the search and dispatcher can be exercised without a GPU.

Nothing here is a measurement. Every table it writes has ``synthetic`` in its file name, a
``synthetic`` column set to 1 and a device key starting with ``synthetic:``; ``ReplayMeasurer`` then
reports the device as synthetic, so such rows can never be mistaken for (or mixed with) real ones in
the measurement database.

The model, deterministic under ``seed``:
- per-kernel efficiency (a stand-in for f_MK): larger tiles reuse more operands (tile intensity),
  num_warps has a sweet spot that grows with the tile, software pipelining helps with diminishing
  returns (num_stages), BLOCK_K of 16 or 128 is slightly worse than 32/64, and each kernel has its own log-normal "implementation luck" (sigma 0.12);
- per-problem time: the tiles run in waves of num_SMs x resident blocks; a partial last wave filled to
  fraction r costs r ** 0.55 of a full one (the true partial-wave exponent the cost model should
  recover; a persistent config's tail costs r ** ((1 + 0.55) / 2), cost_model.tail_alpha, over SMs x min(its
  programs per SM, resident blocks) slots, once its programs loop over tiles); K is padded to BLOCK_K x
  SPLIT_K; each split-K program also moves its share of the fp32
  workspace (its partial tile written, and one partial read on average: the last split reads all) at its SM's
  share of DRAM bandwidth; a memory roofline with operand re-reads per tile row/column (L2 absorbs most of
  them) bounds it from below; a launch overhead of 4 us plus 1 us for split-K's fixed cost (once a counter memset per call) is added; each (kernel, problem) gets 1.5% log-normal measurement noise;
- a failure: configs that cannot launch (0 resident blocks) have seconds = inf and an error;
- a "vendor" time per problem: the best kernel of a hidden reference set (every config of the space,
  measured without noise) times a log-normal factor around 1.04 (sigma 0.06): sometimes faster than
  any tuned kernel, usually a little slower.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dietcode_ort.errors import DietcodeError
from tuner.cost_model import (blocks_per_sm, peak_flops, persistent_loops, slots_per_sm, split_k_partials,
                              tail_alpha)
from tuner.hardware import HardwareProfile
from tuner.space import DTYPE_BYTES, MicroKernel
from tuner.workload import Problem

__all__ = ["SyntheticRow", "SyntheticCase", "bert_dense_case", "simulate_seconds", "simulate_vendor", "simulate_table",
           "roofline_table", "write_synthetic_table",
           "synthetic_table_name", "synthetic_device_key", "TRUE_WAVE_ALPHA", "VENDOR_KEY"]

TRUE_WAVE_ALPHA = 0.55
VENDOR_KEY = "vendor"
_LAUNCH_S = 4e-6
_SPLIT_K_S = 1e-6
_L2_REUSE = 8.0


def _unit_normal(*parts: object) -> float:
    """A deterministic standard-normal draw from a hash of ``parts`` (stable across runs and platforms)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    u1 = (int.from_bytes(digest[:8], "big") + 1) / (2 ** 64 + 2)
    u2 = int.from_bytes(digest[8:16], "big") / 2 ** 64
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def synthetic_device_key(profile: HardwareProfile, seed: int) -> str:
    """The device key written into synthetic tables: never equal to a real device's key."""
    return f"synthetic:sm_{profile.arch}:seed{seed}"


def synthetic_table_name(profile: HardwareProfile, dtype: str, seed: int) -> str:
    return f"synthetic-sm_{profile.arch}-{dtype}-seed{seed}.csv.gz"


def _efficiency(config: MicroKernel, seed: int) -> float:
    intensity = config.block_m * config.block_n / (config.block_m + config.block_n)  # 8 .. 128
    eff = intensity / (intensity + 20.0)
    ideal_warps = min(8.0, max(2.0, config.block_m * config.block_n / 2048.0))
    eff *= math.exp(-0.35 * math.log2(config.num_warps / ideal_warps) ** 2)
    eff *= 1.0 - 0.4 * 0.5 ** (config.num_stages - 1)
    eff *= {16: 0.82, 32: 0.97, 64: 1.0, 128: 0.9}.get(config.block_k, 0.85)
    eff *= math.exp(0.12 * _unit_normal(seed, "kernel", config.key()))
    return min(eff, 0.95)


def simulate_seconds(config: MicroKernel, problem: Problem, profile: HardwareProfile, dtype: str,
                     seed: int, noise: bool = True) -> float:
    """Synthetic seconds of ``config`` on ``problem`` (inf when the config cannot launch)."""
    bps = blocks_per_sm(config, profile, dtype)
    if bps <= 0:
        return math.inf
    kpad = -(-problem.k // (config.block_k * config.split_k)) * config.block_k
    tiles = (-(-problem.m // config.block_m)) * (-(-problem.n // config.block_n)) * problem.batch * config.split_k
    per_sm = peak_flops(profile, dtype) / profile.num_sms * _efficiency(config, seed)
    written, read = split_k_partials(config.split_k)  # per tile: each split writes, the last reads all
    workspace = (written + read) / config.split_k * config.block_m * config.block_n * 4  # bytes per program
    wave = bps * (2.0 * config.block_m * config.block_n * kpad / per_sm
                  + workspace * profile.num_sms / (profile.dram_bandwidth_gbs * 1e9))
    slots = profile.num_sms * slots_per_sm(config, bps)
    waves = -(-tiles // slots)
    last = tiles / slots - (waves - 1)
    loops = persistent_loops(config.persistent, tiles, profile.num_sms)
    compute = wave * ((waves - 1) + last ** tail_alpha(config, TRUE_WAVE_ALPHA, loops))
    elem = DTYPE_BYTES[dtype]
    reads = (problem.m * problem.k * -(-problem.n // config.block_n)
             + problem.k * problem.n * -(-problem.m // config.block_m)) / _L2_REUSE
    bytes_moved = (problem.m * problem.k + problem.k * problem.n + reads + problem.m * problem.n) \
        * elem * problem.batch
    memory = bytes_moved / (profile.dram_bandwidth_gbs * 1e9)
    seconds = max(compute, memory) + _LAUNCH_S + (_SPLIT_K_S if config.split_k > 1 else 0.0)
    if noise:
        seconds *= math.exp(0.015 * _unit_normal(seed, "noise", config.key(), problem))
    return seconds


def simulate_vendor(problem: Problem, reference: Sequence[MicroKernel], profile: HardwareProfile, dtype: str,
                    seed: int) -> float:
    """Synthetic vendor-library seconds: the best noiseless reference kernel x log-normal(1.04, 0.06)."""
    best = min(simulate_seconds(c, problem, profile, dtype, seed, noise=False) for c in reference)
    return best * 1.04 * math.exp(0.06 * _unit_normal(seed, "vendor", problem))


@dataclass(frozen=True)
class SyntheticRow:
    config: str  # MicroKernel key or VENDOR_KEY
    problem: Problem
    seconds: float
    error: str | None


def simulate_table(configs: Sequence[MicroKernel], problems: Sequence[Problem], profile: HardwareProfile,
                   dtype: str, seed: int, reference: Sequence[MicroKernel] | None = None,
                   vendor: bool = True) -> list[SyntheticRow]:
    """Every (config, problem) row plus one vendor row per problem (``reference`` defaults to configs)."""
    if not configs or not problems:
        raise DietcodeError("simulate_table needs at least one config and one problem")
    rows = []
    for problem in problems:
        for config in configs:
            sec = simulate_seconds(config, problem, profile, dtype, seed)
            rows.append(SyntheticRow(config.key(), problem, sec,
                                     None if math.isfinite(sec) else "synthetic: cannot launch (0 blocks/SM)"))
        if vendor:
            rows.append(SyntheticRow(VENDOR_KEY, problem,
                                     simulate_vendor(problem, reference or configs, profile, dtype, seed), None))
    return rows


def write_synthetic_table(path: str | Path, rows: Sequence[SyntheticRow], profile: HardwareProfile,
                          seed: int) -> Path:
    """Write ``rows`` as CSV (gzip when the name ends in .gz) in ReplayMeasurer's format.

    The file name must contain "synthetic" so a synthetic table is recognisable on disk.
    """
    path = Path(path)
    if "synthetic" not in path.name:
        raise DietcodeError(f"synthetic table file names must contain 'synthetic' (got {path.name!r}); "
                            f"e.g. {synthetic_table_name(profile, 'float16', seed)}")
    device = synthetic_device_key(profile, seed)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as fh:  # type: ignore[operator]
        writer = csv.writer(fh)
        writer.writerow(["config", "m", "n", "k", "batch", "seconds", "device", "error", "synthetic"])
        for row in rows:
            p = row.problem
            writer.writerow([row.config, p.m, p.n, p.k, p.batch, repr(row.seconds), device, row.error or "", 1])
    return path


@dataclass(frozen=True)
class SyntheticCase:
    """A ready synthetic tuning case: the space subset, the problems, the table on disk and its rows."""

    configs: tuple[MicroKernel, ...]
    problems: tuple[Problem, ...]
    path: Path
    seconds: dict[tuple[str, Problem], float]  # (config key or "vendor", problem) -> synthetic seconds

    def oracle(self, problem: Problem) -> float:
        """The best synthetic time of any config of the case on ``problem``."""
        return min(self.seconds[(c.key(), problem)] for c in self.configs)


def bert_dense_case(directory: str | Path, profile: HardwareProfile, space: Sequence[MicroKernel],
                    n_configs: int = 200, t_values: Sequence[int] = tuple(range(1, 65)), hidden: int = 768,
                    dtype: str = "float16", seed: int = 7, roofline_sigma: float | None = None) -> SyntheticCase:
    """BERT's dense layer M = 16T, N = K = ``hidden`` over ``t_values``, on a seeded subset of ``space``
    (``n_configs`` configs), written as a synthetic replay table in ``directory``. With ``roofline_sigma``
    the times are ``roofline_table``'s (the analytic roofline's, each kernel off by a log-normal factor of
    that sigma) instead of ``simulate_table``'s."""
    import random

    rng = random.Random(seed)
    configs = tuple(sorted(rng.sample(list(space), min(n_configs, len(space)))))
    problems = tuple(Problem(16 * t, hidden, hidden) for t in t_values)
    if roofline_sigma is None:
        rows = simulate_table(configs, problems, profile, dtype, seed)
        name = synthetic_table_name(profile, dtype, seed)
    else:
        rows = roofline_table(configs, problems, profile, dtype, seed, roofline_sigma)
        name = "roofline-" + synthetic_table_name(profile, dtype, seed)
    path = write_synthetic_table(Path(directory) / name, rows, profile, seed)
    return SyntheticCase(configs, problems, path, {(r.config, r.problem): r.seconds for r in rows})


def roofline_table(configs: Sequence[MicroKernel], problems: Sequence[Problem], profile: HardwareProfile,
                   dtype: str, seed: int, sigma: float = 0.15) -> list[SyntheticRow]:
    """Every (config, problem) row, timed by the analytic roofline (tuner/roofline.py) times a per-kernel
    log-normal factor of ``sigma`` (the kernel's "implementation luck", the same on every problem) and 1.5%
    per-row noise, plus a vendor row per problem (the best noiseless row x 1.04): a table on which the
    roofline is informative to a known degree, for testing the search's use of it as a prior."""
    from tuner.roofline import roofline_matrix

    if not configs or not problems:
        raise DietcodeError("roofline_table needs at least one config and one problem")
    base = roofline_matrix(configs, problems, profile, dtype)
    luck = [math.exp(sigma * _unit_normal(seed, "roofline-kernel", c.key())) for c in configs]
    rows = []
    for j, problem in enumerate(problems):
        best = math.inf
        for i, config in enumerate(configs):
            sec = float(base[i, j]) * luck[i]
            best = min(best, sec)
            if math.isfinite(sec):
                sec *= math.exp(0.015 * _unit_normal(seed, "noise", config.key(), problem))
            rows.append(SyntheticRow(config.key(), problem, sec,
                                     None if math.isfinite(sec) else "synthetic: cannot launch (0 blocks/SM)"))
        rows.append(SyntheticRow(VENDOR_KEY, problem, best * 1.04, None))
    return rows
