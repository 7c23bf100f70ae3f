"""DietCode's micro-kernel cost model: throughput(m, i) = f_MK(m) x f_adapt(m, i).

- ``f_adapt`` is analytic and needs no measurement: the padding ratio (useful / computed work over M, N
  and K) times the wave occupancy ``G / roundup(G, num_SMs x resident blocks per SM)`` where G is the
  number of programs (tiles x batch x SPLIT_K; each split covers ceil(K / SPLIT_K) of K in whole BLOCK_K
  steps) times, under split-K, the share of the programs' memory traffic that is their operand tiles rather
  than the fp32 workspace (each split writes its BLOCK_M x BLOCK_N partial, the last split of a tile reads
  all SPLIT_K back, its own too: ``split_k_partials``). Traffic, not FLOPs, because split-K tiles (at most
  64x64) are load-bound: a 64x64 fp16 tile does 32 FLOPs per operand byte, far below any target's ridge point
  (about 300 on an H100). A partial last wave runs faster than a full one (its blocks do not share their SM
  with as many others), so the occupancy carries a correction exponent ``alpha``: the last wave, filled to
  fraction r, costs ``r ** alpha`` of a full wave. alpha = 0 is the plain formula above (a partial wave costs
  a whole wave), alpha = 1 ignores wave quantization. alpha is *fitted per device* from measurements
  (``calibrate_device``) and stored with the model; it is never a copied constant.
  A persistent config (n programs per SM, each looping over tiles) fills num_SMs x min(n, resident blocks)
  slots (``slots_per_sm``) and its partial last round costs ``r ** tail_alpha``, halfway from alpha to 1
  (``tail_alpha``): no per-tile launch or prologue, but whole tiles still.
- A fixed per-launch latency (seconds, also fitted per device) times ``launch_weight`` (1 kernel launch, plus
  under split-K another launch's worth, fitted when the launcher zeroed the counters per call) is added to
  every prediction: small problems on a fast GPU are dominated by it, and leaving it in the label would make
  f_MK depend on the shape.
- ``f_MK`` depends on the micro-kernel only. ``LearnedCostModel`` learns it with scikit-learn's gradient
  boosting from micro-kernel features; its label is the measured throughput (after the latency) divided by f_adapt, so a
  measurement on any shape teaches the model about every shape.

Units, used consistently by every model here: ``predict`` returns **predicted seconds**
(latency + useful FLOPs / (f_MK x f_adapt)) for each
(config, problem) pair, ``update`` takes **measured seconds** (``inf`` for a failed kernel, which is
remembered and predicted as ``inf``). Throughput is useful FLOP/s: 2 * m * n * k * batch / seconds.
"""
from __future__ import annotations

import math
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dietcode_ort.errors import DietcodeError
from tuner.hardware import HardwareProfile, resident_blocks
from tuner.space import DTYPE_BYTES, MicroKernel, estimate_registers, estimate_shared, wgmma_eligible
from tuner.workload import Problem

__all__ = ["AdaptTerms", "adapt_terms", "f_adapt", "f_adapt_matrix", "blocks_per_sm", "tail_alpha",
           "useful_flops", "launch_weight", "slots_per_sm", "persistent_loops", "split_k_partials",
           "workspace_bytes_moved", "operand_bytes_moved", "PERSISTENT_TAIL_CREDIT", "LAUNCH_SECONDS",
           "MEMSET_SECONDS", "peak_flops", "config_peak_flops", "kernel_features", "FEATURE_NAMES",
           "calibrate_device", "CostModel", "AnalyticCostModel", "LearnedCostModel", "load_model"]

Pair = tuple[MicroKernel, Problem]
_ALPHA_GRID = np.linspace(0.0, 1.0, 21)
_MODEL_MAGIC = "dietcode-cost-model-v5"  # v2: kernel_features gained "wgmma" (older regressors take 13); v3:
# "persistent" (they take 14); v4: LearnedCostModel keeps other workloads' measurements (warm_start); v5: a
# split-K call's latency weighs two launches (MEMSET_SECONDS), so a v4 model's fitted latency means another thing


PERSISTENT_TAIL_CREDIT = 0.5  # share of a partial last round's saving a persistent config gets (assumed)
LAUNCH_SECONDS = 3e-6  # the analytic fixed cost of one kernel launch (tuner/roofline.py, attention's cost)
MEMSET_SECONDS = 3e-6  # split-K's fixed cost per call, fitted when it included a counter memset per call: as much
# as a launch (tuner/roofline.py's docstring; launch_weight says what has changed since)


def persistent_loops(persistent: Any, tiles: Any, num_sms: int) -> Any:
    """Whether a persistent config's programs loop over more than one tile: the launcher's grid
    min(tiles x batch, SMs x n) (``templates.programs``, dc_kernel_grid) is smaller than the tiles x batch.
    Otherwise it launches one program per tile, as a plain config does. ``persistent`` (n, 0 for a plain
    config) and ``tiles`` (tiles x batch) are ints or arrays."""
    return (persistent > 0) & (tiles > num_sms * persistent)


def tail_alpha(config: MicroKernel, alpha: float, loops: bool) -> float:
    """The partial-wave exponent of ``config``: ``alpha`` (fitted per device), or for a persistent config
    whose programs loop over tiles (``loops``: ``persistent_loops``) ``PERSISTENT_TAIL_CREDIT`` of the way
    from it to 1 (no quantization at all). A persistent program starts its next tile as soon as its own
    previous one ends, with no CTA to retire and launch and no per-tile prologue (a TMA program makes its
    descriptors once), so the last round's tail is partly hidden; but it still computes whole tiles,
    ceil(tiles / programs) of them for the busiest program, so the tail is not gone: only half of what the
    fitted exponent says a partial wave saves is credited. A persistent config that does not loop (no more
    tiles than its grid of SMs x n) launches one program per tile like a plain one and gets no credit. The
    analytic roofline (tuner/roofline.py) uses the same exponent at alpha = 0, its own partial-round rule."""
    return alpha + PERSISTENT_TAIL_CREDIT * (1.0 - alpha) if config.persistent and loops else alpha


def slots_per_sm(config: MicroKernel, blocks_per_sm: int) -> int:
    """Programs one SM runs at once: its resident blocks, or a persistent config's n if fewer (the launcher's
    persistent grid is min(tiles x batch, SMs x n), ``templates.programs`` / dc_kernel_grid, so no SM is given
    more than n programs)."""
    return min(blocks_per_sm, config.persistent) if config.persistent else blocks_per_sm


def _roundup(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def launch_weight(config: MicroKernel, memset_s: float = MEMSET_SECONDS) -> float:
    """A call's fixed cost in kernel launches: one kernel launch per call (dc_launch_fit, custom_ops/launch.cc),
    and for a split-K config ``memset_s`` / ``LAUNCH_SECONDS`` of a launch more: a whole one by default, as the
    H100 table says (its split-K configs ran 1.25x to 1.35x slower than the roofline predicted with a sixth of a
    launch; tuner/roofline.py). The table was timed when the launcher zeroed the tile counters with a
    cuMemsetD8Async before every split-K launch; since C ABI 14 it keeps them per stream and zeroes them once
    (docs/abi.md, "The split-K counters"), so part of that fitted cost may be gone: the next recorded table
    refits it (benchmarks/calibrate_roofline.py). The learned model's fitted per-launch latency and the analytic
    roofline's ``LAUNCH_SECONDS`` are both multiplied by it."""
    return 1.0 + (memset_s / LAUNCH_SECONDS if config.split_k > 1 else 0.0)


def split_k_partials(split_k: Any) -> Any:
    """fp32 partial tiles (written, read) through the split-K workspace per output tile, for a split_k (an
    int, or an array of them): each of the SPLIT_K splits writes its partial and the split that arrives last
    reads all SPLIT_K back in split order, its own included (``templates._split_k_reduce``: ld.global.cg, so
    the sum does not depend on which split came last; docs/abi.md "The split-K workspace"). (0, 0) without
    split-K."""
    moved = split_k * (split_k > 1)
    return moved, moved


def workspace_bytes_moved(config: MicroKernel, problem: Problem) -> float:
    """Split-K workspace traffic of one call: ``split_k_partials`` fp32 partial tiles written and read per
    (batch, tile), 2 x SPLIT_K of them (0 without split-K). The counters' atomics and reset (4 bytes each) and
    the memset are not counted here (``launch_weight``)."""
    written, read = split_k_partials(config.split_k)
    tiles = (-(-problem.m // config.block_m)) * (-(-problem.n // config.block_n)) * problem.batch
    return float(tiles * (written + read) * config.block_m * config.block_n * 4)


def useful_flops(problem: Problem) -> float:
    """Multiply-adds of the problem counted as 2 FLOPs each (no padding)."""
    return 2.0 * problem.m * problem.n * problem.k * problem.batch


def peak_flops(profile: HardwareProfile, dtype: str, tf32: bool = False) -> float:
    """Dense peak FLOP/s for ``dtype``: the tensor cores' for 16-bit types and for float32 with TF32 dots
    (``tf32``, tuner.aot's default precision), the FMA units' for ieee float32."""
    if dtype in ("float16", "bfloat16"):
        return profile.fp16_tensor_tflops * 1e12
    if dtype == "float32":
        return (profile.tf32_tensor_tflops if tf32 else profile.fp32_tflops) * 1e12
    raise DietcodeError(f"unknown dtype {dtype!r}; allowed: float32, float16, bfloat16")


def config_peak_flops(config: MicroKernel, profile: HardwareProfile, dtype: str, tf32: bool = False) -> float:
    """The peak ``config`` can reach: ``peak_flops``, except that on a GPU with wgmma (sm_90) a tensor-core
    config (16-bit, or float32 with ``tf32``) that Triton lowers to mma.sync instead (``space.wgmma_eligible``)
    gets ``profile.mma_sync_fraction`` of it. ieee float32 runs on the FMA units either way."""
    tf32 = tf32 and dtype == "float32"
    peak = peak_flops(profile, dtype, tf32)
    tensor_cores = dtype != "float32" or tf32
    if profile.wgmma and tensor_cores and not wgmma_eligible(config, dtype, profile, tf32=tf32):
        return peak * profile.mma_sync_fraction
    return peak


def blocks_per_sm(config: MicroKernel, profile: HardwareProfile, dtype: str) -> int:
    """Resident blocks per SM from the space's register and shared-memory estimates (0: cannot launch)."""
    threads = config.num_warps * profile.warp_size
    return resident_blocks(profile, threads, estimate_registers(config, dtype, profile.warp_size),
                           estimate_shared(config, dtype))


@dataclass(frozen=True)
class AdaptTerms:
    """The pieces of f_adapt for one (config, problem), for tests and ``inspect``."""

    padding: float  # useful / computed work, in (0, 1]
    tiles: int  # G: programs launched (tiles x batch x split_k)
    waves: int  # ceil(G / (num_SMs x blocks_per_sm))
    occupancy: float  # wave occupancy with the partial-wave correction, in (0, 1]
    value: float  # padding x occupancy x reduction
    reduction: float = 1.0  # split-K: operand tile bytes / (those + workspace bytes) of all programs


def operand_bytes_moved(config: MicroKernel, problem: Problem, dtype: str) -> float:
    """Operand bytes the programs of one call load: each loads a BLOCK_M and a BLOCK_N wide slice of A and B
    over its share of K (K padded to BLOCK_K x SPLIT_K)."""
    tiles = (-(-problem.m // config.block_m)) * (-(-problem.n // config.block_n)) * problem.batch
    k = _roundup(problem.k, config.block_k * config.split_k)
    return float(tiles * (config.block_m + config.block_n) * k * DTYPE_BYTES[dtype])


def adapt_terms(config: MicroKernel, problem: Problem, profile: HardwareProfile, blocks_per_sm: int,
                alpha: float = 0.0, dtype: str = "float16") -> AdaptTerms:
    """f_adapt and its terms. K is padded to BLOCK_K x SPLIT_K (each split covers whole BLOCK_K steps);
    ``dtype`` is the operands' (their bytes weigh against the split-K workspace's)."""
    if blocks_per_sm <= 0:
        return AdaptTerms(0.0, 0, 0, 0.0, 0.0)
    bm, bn, bk = config.block_m, config.block_n, config.block_k * config.split_k
    padding = (problem.m / _roundup(problem.m, bm)) * (problem.n / _roundup(problem.n, bn)) \
        * (problem.k / _roundup(problem.k, bk))
    tiles = (-(-problem.m // bm)) * (-(-problem.n // bn)) * problem.batch * config.split_k
    slots = profile.num_sms * slots_per_sm(config, blocks_per_sm)
    waves = -(-tiles // slots)
    last = tiles / slots - (waves - 1)  # fill of the last wave, in (0, 1]
    loops = persistent_loops(config.persistent, tiles, profile.num_sms)
    occupancy = (tiles / slots) / ((waves - 1) + last ** tail_alpha(config, alpha, loops))
    operands = operand_bytes_moved(config, problem, dtype)
    reduction = operands / (operands + workspace_bytes_moved(config, problem))
    return AdaptTerms(padding, tiles, waves, occupancy, padding * occupancy * reduction, reduction)


def f_adapt(config: MicroKernel, problem: Problem, profile: HardwareProfile, blocks_per_sm: int,
            alpha: float = 0.0, dtype: str = "float16") -> float:
    """DietCode's f_adapt: padding ratio x wave occupancy (partial-wave exponent ``alpha``) x the split-K
    workspace share (``adapt_terms``)."""
    return adapt_terms(config, problem, profile, blocks_per_sm, alpha, dtype).value


def f_adapt_matrix(configs: Sequence[MicroKernel], problems: Sequence[Problem], profile: HardwareProfile,
                   dtype: str, alpha: float = 0.0) -> np.ndarray:
    """f_adapt for every (config, problem): array [len(configs), len(problems)], vectorized."""
    cfg = np.array([[c.block_m, c.block_n, c.block_k * c.split_k, c.split_k] for c in configs],
                   dtype=np.float64).reshape(-1, 4)
    bps = np.array([blocks_per_sm(c, profile, dtype) for c in configs], dtype=np.float64)
    per_sm = np.array([slots_per_sm(c, blocks_per_sm(c, profile, dtype)) for c in configs], dtype=np.float64)
    persistent = np.array([c.persistent for c in configs], dtype=np.float64)[:, None]
    credited = np.array([tail_alpha(c, alpha, True) for c in configs], dtype=np.float64)[:, None]
    prb = np.array([[p.m, p.n, p.k, p.batch] for p in problems], dtype=np.float64).reshape(-1, 4)
    bm, bn, bk, sk = (cfg[:, i:i + 1] for i in range(4))
    m, n, k, b = (prb[:, i][None, :] for i in range(4))
    tm, tn, tk = np.ceil(m / bm), np.ceil(n / bn), np.ceil(k / bk)
    padding = (m / (tm * bm)) * (n / (tn * bn)) * (k / (tk * bk))
    tiles = tm * tn * b * sk
    slots = np.maximum(profile.num_sms * per_sm, 1.0)[:, None]
    waves = np.ceil(tiles / slots)
    last = tiles / slots - (waves - 1)
    tail = np.where(persistent_loops(persistent, tiles, profile.num_sms), credited, alpha)  # tail_alpha
    occupancy = (tiles / slots) / ((waves - 1) + last ** tail)
    operands = tm * tn * b * (bm + bn) * tk * bk * DTYPE_BYTES[dtype]  # operand_bytes_moved
    written, read = split_k_partials(sk)
    moved = tm * tn * b * (written + read) * bm * bn * 4.0  # workspace_bytes_moved
    reduction = operands / (operands + moved)
    return np.where(bps[:, None] > 0, padding * occupancy * reduction, 0.0)


FEATURE_NAMES = ("log2_block_m", "log2_block_n", "log2_block_k", "num_warps", "num_stages", "log2_group_m",
                 "log2_split_k", "threads", "log2_shared", "registers", "tile_intensity",
                 "acc_per_thread", "blocks_per_sm", "wgmma", "persistent")


def kernel_features(configs: Sequence[MicroKernel], profile: HardwareProfile, dtype: str,
                    tf32: bool = False) -> np.ndarray:
    """Features of f_MK, which depend on the micro-kernel only (never on a shape).

    tile_intensity is the FLOPs per byte of one BLOCK_K step of the tile (2*BM*BN*BK over the A and B
    tile bytes); acc_per_thread is the fp32 accumulator share of each thread; wgmma is 1 when Triton
    lowers the config's dot to Hopper's warpgroup MMA on this target (``space.wgmma_eligible``), 0 for
    mma.sync or no tensor core: on sm_90 the two run at different peak rates; persistent is the programs per
    SM of a persistent config (0: one program per tile), whose tiles skip the per-CTA launch and prologue.
    """
    rows = []
    for c in configs:
        threads = c.num_warps * profile.warp_size
        shared = estimate_shared(c, dtype)
        tile_bytes = (c.block_m * c.block_k + c.block_k * c.block_n) * DTYPE_BYTES[dtype]
        rows.append([math.log2(c.block_m), math.log2(c.block_n), math.log2(c.block_k), c.num_warps,
                     c.num_stages, math.log2(c.group_m), math.log2(c.split_k), threads, math.log2(shared),
                     estimate_registers(c, dtype, profile.warp_size),
                     2.0 * c.block_m * c.block_n * c.block_k / tile_bytes,
                     c.block_m * c.block_n / threads, blocks_per_sm(c, profile, dtype),
                     float(wgmma_eligible(c, dtype, profile, tf32=tf32)), float(c.persistent)])
    return np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))


def calibrate_device(pairs: Sequence[Pair], seconds: Sequence[float], profile: HardwareProfile,
                         dtype: str, min_configs: int = 3) -> tuple[float, float] | None:
    """Fit the partial-wave exponent alpha and the fixed latency (seconds) from measurements of the
    same config on different problems.

    f_MK depends on the config only, so for the right (alpha, latency) the label
    useful FLOPs / (seconds - latency) / f_adapt of one config is the same on every problem: pick the pair
    on a grid (alpha over [0, 1], latency over [0, 0.95 x the fastest measurement per launch]) that minimizes the
    within-config variance of log(label), over the configs without persistence when at least ``min_configs`` of
    them qualify. Returns None when fewer than ``min_configs`` configs were measured on two or more problems
    (not enough evidence; keep the previous values).
    """
    by_config: dict[MicroKernel, list[tuple[Problem, float]]] = {}
    for (config, problem), sec in zip(pairs, seconds):
        if math.isfinite(sec) and sec > 0:
            by_config.setdefault(config, []).append((problem, sec))
    groups = {c: rows for c, rows in by_config.items() if len({p for p, _ in rows}) >= 2}
    if len(groups) < min_configs:
        return None
    # alpha is fitted where the tail shows whole: on one-program-per-tile configs when there are enough (a
    # persistent config's exponent, tail_alpha, moves half as much with alpha, so its noise would dominate)
    plain = {c: rows for c, rows in groups.items() if not c.persistent}
    if len(plain) >= min_configs:
        groups = plain
    fastest = min(s / launch_weight(c) for c, rows in groups.items() for _, s in rows)
    latencies = np.linspace(0.0, 0.95 * fastest, 20)
    loss = np.zeros((len(_ALPHA_GRID), len(latencies)))
    count = 0
    for config, rows in groups.items():
        bps = blocks_per_sm(config, profile, dtype)
        secs = np.array([s for _, s in rows])
        flops = np.array([useful_flops(p) for p, _ in rows])
        terms = [adapt_terms(config, p, profile, bps, dtype=dtype) for p, _ in rows]
        fill = np.array([t.tiles / (profile.num_sms * slots_per_sm(config, bps)) for t in terms])  # in waves
        waves = np.array([t.waves for t in terms], dtype=np.float64)
        padding = np.array([t.padding * t.reduction for t in terms])
        last = fill - (waves - 1)
        exponents = np.array([[tail_alpha(config, float(a), persistent_loops(config.persistent, t.tiles,
                                                                             profile.num_sms)) for t in terms]
                              for a in _ALPHA_GRID])  # [alpha, row]
        occupancy = fill[None, :] / ((waves - 1)[None, :] + last[None, :] ** exponents)  # [alpha, row]
        busy = secs[None, :] - launch_weight(config) * latencies[:, None]  # [latency, row]
        logs = (np.log(flops)[None, None, :] - np.log(busy)[None, :, :]
                - np.log(np.maximum(padding[None, :] * occupancy, 1e-12))[:, None, :])  # [alpha, latency, row]
        loss += ((logs - logs.mean(axis=2, keepdims=True)) ** 2).sum(axis=2)
        count += len(rows) - 1
    a, t = np.unravel_index(int(np.argmin(loss)), loss.shape)
    return float(_ALPHA_GRID[a]), float(latencies[t])


def _checked(what: str, pairs: Sequence[Pair], seconds: Sequence[float]) -> list[tuple[Pair, float | None]]:
    """(pair, seconds) per measurement, None for a failure (inf, or not positive); refuses unequal lengths."""
    if len(pairs) != len(seconds):
        raise DietcodeError(f"{what}: {len(pairs)} pairs but {len(seconds)} measurements")
    return [(pair, float(sec) if math.isfinite(sec) and sec > 0 else None) for pair, sec in zip(pairs, seconds)]


class CostModel(ABC):
    """update(pairs, measured seconds) / predict(pairs) -> predicted seconds / save / load."""

    tf32 = False  # what models pickled before the float32 precision existed were (ieee)

    def __init__(self, profile: HardwareProfile, dtype: str, tf32: bool = False) -> None:
        self.profile = profile
        self.dtype = dtype
        self.tf32 = tf32 and dtype == "float32"  # float32 dots in TF32 (the peak of config_peak_flops)
        self.alpha = 0.0  # partial-wave exponent, fitted by calibrate_device
        self.latency = 0.0  # fixed seconds per launch, fitted by calibrate_device
        peak_flops(profile, dtype)  # validates dtype

    @abstractmethod
    def f_mk(self, configs: Sequence[MicroKernel]) -> np.ndarray:
        """Predicted f_MK (FLOP/s at f_adapt = 1) per config; inf seconds is expressed as f_MK = 0."""

    def update(self, pairs: Sequence[Pair], seconds: Sequence[float]) -> None:
        """Learn from measurements (seconds; inf = failed). The analytic model ignores them."""

    def warm_start(self, pairs: Sequence[Pair], seconds: Sequence[float]) -> None:
        """Learn from other workloads' measurements on the same device (``LearnedCostModel``); the analytic
        model ignores them."""

    @property
    def warm_samples(self) -> int:
        """How many of other workloads' measurements the model learned from."""
        return 0

    def predict(self, pairs: Sequence[Pair]) -> np.ndarray:
        """Predicted seconds per (config, problem): latency + useful FLOPs / (f_MK x f_adapt)."""
        if not pairs:
            return np.zeros(0)
        configs = sorted({c for c, _ in pairs})
        index = {c: i for i, c in enumerate(configs)}
        fmk = self.f_mk(configs)
        out = np.empty(len(pairs))
        for j, (config, problem) in enumerate(pairs):
            adapt = f_adapt(config, problem, self.profile, blocks_per_sm(config, self.profile, self.dtype),
                            self.alpha, self.dtype)
            through = fmk[index[config]] * adapt
            out[j] = self.latency * launch_weight(config) + useful_flops(problem) / through if through > 0 \
                else math.inf
        return out

    def save(self, path: str | Path) -> None:
        """Pickle the model (regressor, fitted alpha, profile) with a format tag."""
        with open(path, "wb") as fh:
            pickle.dump((_MODEL_MAGIC, self), fh)


def load_model(path: str | Path) -> CostModel:
    """Load a model written by ``CostModel.save``; a foreign or damaged file raises DietcodeError."""
    try:
        with open(path, "rb") as fh:
            magic, model = pickle.load(fh)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise DietcodeError(f"cannot load cost model {path}: {exc}") from None
    if magic != _MODEL_MAGIC or not isinstance(model, CostModel):
        raise DietcodeError(f"{path} is not a dietcode cost model (tag {magic!r})")
    return model


class AnalyticCostModel(CostModel):
    """A trivial, measurement-free f_MK: a roofline of one tile step (tests and no-data fallback).

    f_MK = peak x min(1, tile_intensity / ridge) x pipelining (1 - 0.5 ** num_stages): large tiles reuse
    operands from shared memory, deeper pipelines hide load latency. Ridge = peak / DRAM bandwidth. The peak
    is the config's own (``config_peak_flops``: on sm_90, mma.sync configs get the mma.sync rate). On the
    H100 profile no tile of the space reaches the ridge (tile intensity <= 86 FLOP/B, a 256x128 tile's,
    against 295 for wgmma and 197 for mma.sync), so there this f_MK is intensity x bandwidth and the two
    rates rank alike: telling them apart is left to the learned model's ``wgmma`` feature.
    """

    def f_mk(self, configs: Sequence[MicroKernel]) -> np.ndarray:
        peak = np.array([config_peak_flops(c, self.profile, self.dtype, self.tf32) for c in configs])
        ridge = peak / (self.profile.dram_bandwidth_gbs * 1e9)
        feats = kernel_features(configs, self.profile, self.dtype, self.tf32)
        intensity = feats[:, FEATURE_NAMES.index("tile_intensity")]
        stages = feats[:, FEATURE_NAMES.index("num_stages")]
        launchable = feats[:, FEATURE_NAMES.index("blocks_per_sm")] > 0
        return np.where(launchable, peak * np.minimum(1.0, intensity / ridge) * (1 - 0.5 ** stages), 0.0)


class LearnedCostModel(CostModel):
    """f_MK learned from measurements with gradient-boosted trees over ``kernel_features``.

    Target: log(throughput / f_adapt). Configs measured at least once are answered from their own labels
    (geometric mean), which are exact where the regressor would only approximate; failed configs predict
    inf seconds. Before any measurement f_MK is a constant, so predictions rank by f_adapt alone.

    ``warm_start`` gives it measurements of the same configs on other workloads of the same device and op
    (f_MK is the micro-kernel's, whatever the shape: DietCode's premise, so another workload's label is
    evidence about this one's): they train the regressor and the device fit (alpha, latency) with this
    workload's own, and answer for a config this workload has not measured; a config measured here is
    answered from its own labels alone.
    """

    def __init__(self, profile: HardwareProfile, dtype: str, seed: int = 0, n_estimators: int = 120,
                 tf32: bool = False) -> None:
        super().__init__(profile, dtype, tf32)
        self.seed = seed
        self.n_estimators = n_estimators
        self._pairs: list[Pair] = []
        self._seconds: list[float] = []
        self._warm_pairs: list[Pair] = []  # other workloads' measurements (warm_start)
        self._warm_seconds: list[float] = []
        self._known: dict[MicroKernel, float] = {}  # config -> mean log label
        self._own: set[MicroKernel] = set()  # configs with labels of this workload's own
        self._failed: set[MicroKernel] = set()
        self._regressor = None
        self._prior = 0.0

    @property
    def samples(self) -> int:
        return len(self._seconds)

    @property
    def warm_samples(self) -> int:
        """How many of other workloads' measurements ``warm_start`` gave it."""
        return len(self._warm_seconds)

    def update(self, pairs: Sequence[Pair], seconds: Sequence[float]) -> None:
        for pair, sec in _checked("update", pairs, seconds):
            if sec is None:
                self._failed.add(pair[0])
            else:
                self._pairs.append(pair)
                self._seconds.append(sec)
        self._refit()

    def warm_start(self, pairs: Sequence[Pair], seconds: Sequence[float]) -> None:
        """Learn from measurements of other workloads (same device, dtype and op; their problems are theirs).
        Failures there say nothing of this workload's calls (a refusal is per shape) and are skipped."""
        for pair, sec in _checked("warm_start", pairs, seconds):
            if sec is not None:
                self._warm_pairs.append(pair)
                self._warm_seconds.append(sec)
        self._refit()

    def _refit(self) -> None:
        fitted = calibrate_device(self._warm_pairs + self._pairs, self._warm_seconds + self._seconds,
                                  self.profile, self.dtype)
        if fitted is not None:
            self.alpha, self.latency = fitted
        self._fit()

    def _labels(self, pairs: Sequence[Pair], seconds: Sequence[float]) -> dict[MicroKernel, float]:
        """Per config, the mean log of useful FLOP/s / f_adapt (after the launch latency) over ``pairs``."""
        logs: dict[MicroKernel, list[float]] = {}
        for (config, problem), sec in zip(pairs, seconds):
            adapt = f_adapt(config, problem, self.profile, blocks_per_sm(config, self.profile, self.dtype),
                            self.alpha, self.dtype)
            busy = max(sec - self.latency * launch_weight(config), 1e-3 * sec)
            logs.setdefault(config, []).append(math.log(useful_flops(problem) / busy / max(adapt, 1e-12)))
        return {c: float(np.mean(v)) for c, v in logs.items()}

    def _fit(self) -> None:
        from sklearn.ensemble import GradientBoostingRegressor

        # this workload's own labels win over the other workloads' for a config measured in both
        own = self._labels(self._pairs, self._seconds)
        self._known = {**self._labels(self._warm_pairs, self._warm_seconds), **own}
        self._own = set(own)
        if not self._known:
            return
        configs = sorted(self._known)
        y = np.array([self._known[c] for c in configs])
        self._prior = float(np.median(y))
        if len(configs) < 4:
            self._regressor = None
            return
        trees = min(self.n_estimators, max(20, 2 * len(configs)))  # few samples: few trees (and fast)
        reg = GradientBoostingRegressor(n_estimators=trees, max_depth=3, learning_rate=0.1,
                                        subsample=0.9, random_state=self.seed)
        reg.fit(kernel_features(configs, self.profile, self.dtype, self.tf32), y)
        self._regressor = reg

    def f_mk(self, configs: Sequence[MicroKernel]) -> np.ndarray:
        logs = np.full(len(configs), self._prior)
        if self._regressor is not None and len(configs):
            logs = self._regressor.predict(kernel_features(configs, self.profile, self.dtype, self.tf32))
        for i, config in enumerate(configs):
            if config in self._known:
                logs[i] = self._known[config]
        out = np.exp(logs)
        for i, config in enumerate(configs):
            if config in self._failed and config not in self._own:  # failed here: another workload's label says nothing
                out[i] = 0.0
        return out
