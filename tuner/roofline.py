"""The analytic measurer's time model: a roofline with occupancy for one call of one micro-kernel on one problem.

Nothing here is measured; it ranks configs where no GPU can time them (``--measure analytic``). The call's
G = tiles x batch x SPLIT_K programs spread over the SMs, one per SM first, so B = min(G, SMs) SMs are busy
and the busiest runs P = ceil(G / SMs) programs, R = min(P, resident blocks, a persistent config's n) of them
at once (``cost_model.slots_per_sm``); each program makes ``k_steps`` BLOCK_K steps (K padded to BLOCK_K x
SPLIT_K). The call takes

    max(mma, sm_memory, dram, pipeline) + issue + reduce + launch

- ``mma``: the busiest SM's MMAs at its share of the config's peak (``cost_model.config_peak_flops``:
  sm_90's mma.sync configs at 2/3 of the wgmma rate), so tensor-core throughput scales with busy SMs and tile
  quantization is counted per SM (P whole programs), not per FLOP. An SM reaches its share only with a warp
  on each of its four scheduler partitions (one tensor core each, [CG] and the whitepapers' SM diagrams): a
  resident block set of fewer warps gets warps / 4 of it.
- ``issue``: each BLOCK_K step's load issue on the busiest SM, executed by the warps that then wait for the
  data, so neither the MMAs nor the copies hide it. Pointer loads (``cp.async``) take
  ``POINTER_LOAD_INSTRUCTIONS`` warp instructions per 16 bytes a warp copies (the copy and its 64-bit
  pointer increment) on the blocks' schedulers; a TMA config (key suffix ``t``, sm_90 only) issues one tensor
  copy per operand from one thread (``TMA_LOAD_INSTRUCTIONS``) and leaves the address generation to the
  copy engine. That is TMA's whole advantage here, and a modest one (about 2% of a large fp16 GEMM on the
  H100, less on small-M calls), against its descriptors' ``setup`` (below).
- ``sm_memory``: the busiest SM's bytes (its programs' operand slices, and its output tile or, under
  split-K, its fp32 partial) at a per-SM cap of ``SM_BANDWIDTH_FACTOR`` x its even share of DRAM bandwidth.
  So the achievable bandwidth is min(DRAM bandwidth, B x cap): a call on few SMs cannot use the whole
  device's, which is why split-K (more programs, more busy SMs) pays for small-M calls.
- ``pipeline``: latency hiding, by Little's law (bytes in flight = bandwidth x latency). Triton's software
  pipeline keeps num_stages - 1 BLOCK_K steps of loads in flight per program while it computes on one more
  (``cp.async`` groups or TMA copies with their barriers), so the busiest SM has R x (num_stages - 1) x step
  bytes in flight and pulls at most that many bytes per ``DRAM_LATENCY_SECONDS``. Below latency x the per-SM
  cap (about 25 KB on the H100: 50.8 GB/s x 500 ns), the loads, not the bandwidth, bound the call: each
  program's loop takes a round trip per num_stages - 1 steps (one for the whole loop when it is shorter), and
  the SM runs max(1, rounds / R) such loops back to back. So a shallow pipeline on a load-bound tile (few
  resident programs: the small-M calls, or large tiles at one block per SM) is charged, and a deeper one, or
  more resident programs, hides the latency; on compute-bound calls the term stays below ``mma``. The stage
  count's other effect is through shared memory: more stages, fewer resident blocks.
- ``dram``: the bytes that must cross DRAM, A, B and C once (operand re-reads across tiles hit the L2: 40 MB
  on the A100, 48 MB on the L4 and 50 MB on the H100 hold the project's GEMM operands) plus, under split-K,
  the fp32 workspace (``cost_model.workspace_bytes_moved``: each split writes its partial and the last split
  of a tile reads all SPLIT_K back, its own included, 2 x SPLIT_K partials per tile, tuner/templates.py
  ``_split_k_reduce``) at the device's bandwidth.
- ``reduce``: split-K's last split of a tile reads the SPLIT_K partials and writes the output after every split
  has stored its partial, on one SM at the per-SM cap: a serial tail no other program hides.
- persistent configs (``MicroKernel.persistent`` = n, sm_90): the launcher runs min(tiles x batch, SMs x n)
  programs (``templates.programs``, dc_kernel_grid), so an SM runs at most n of them at once (R above) and the
  same tiles land on the same SMs. When the programs loop (more tiles than that grid,
  ``cost_model.persistent_loops``), the busiest SM's partial last round, filled to r, costs
  r ** ``cost_model.tail_alpha`` (the learned model's exponent at alpha = 0: ``PERSISTENT_TAIL_CREDIT`` of
  the way to no quantization) instead of a whole round, since its programs load their next tile while
  others finish (no per-tile launch or prologue) but still finish whole tiles. An assumption, shared with the
  learned model. A persistent config that does not loop launches one program per tile and gets no credit.
- ``launch``: ``LAUNCH_SECONDS`` x ``cost_model.launch_weight``: one kernel launch per call, plus under
  split-K ``memset_s``, fitted when the launcher zeroed the tile counters with a cuMemsetD8Async before every
  split-K launch (it keeps them per stream since C ABI 14). The learned model weighs its fitted latency the
  same way.
- ``setup``: a TMA config's in-kernel descriptors (``tma_setup_s``), once per call.

Each term is non-decreasing in M, N, K and batch for a fixed config, so the predicted time is too.

Constants: the peaks and bandwidths are the datasheets' (tuner/hardware.py: H100 SXM5 989.4 TFLOP/s dense fp16,
3.35 TB/s, 132 SMs) and the clock that turns issue cycles into seconds is the profile's
(``HardwareProfile.tensor_clock_hz``: the clock its datasheet peak is quoted at, 1,830 MHz on the H100 SXM5).
``LAUNCH_SECONDS`` = 3 us per kernel launch (tuner/cost_model.py, which owns the launch accounting) shifts every
config alike. The four that no datasheet gives (``RooflineConstants``) are fitted to the measurement table
recorded on an H100 (``benchmarks/results/nvidia-h100-80gb-hbm3/device-run/stage2/table.csv.gz``: 97 to 113 of
the space's configs on BERT's three dense GEMMs at 128 sizes each, L2 flushed before every launch) by
``benchmarks/calibrate_roofline.py``, which ranks each instance's configs by the model and scores the first
pick against the instance's best, and the spread of log(measured / predicted):

- ``dram_latency_s`` = 750 ns (was an assumed 500 ns): a load's round trip to DRAM under load, L2 cold.
- ``sm_bandwidth_factor`` = 4 (was an assumed 2): one SM pulls at most 4x its even share of DRAM bandwidth
  (H100: 4 x 3.35 TB/s / 132 = 102 GB/s, about 56 bytes per clock), so a quarter of the SMs saturate DRAM.
- ``memset_s`` = 3 us (``cost_model.MEMSET_SECONDS``, was an assumed 0.5 us): split-K's counter memset costs
  a kernel launch's worth (the table's split-K configs ran 1.25x to 1.35x slower than the model said, split 8
  worse than split 2); the learned model's fitted latency counts it the same way (``cost_model.launch_weight``).
  The table was timed with a memset before every split-K launch, which the launcher no longer issues (C ABI
  14, docs/abi.md "The split-K counters"); the constant stays what that table says until a table recorded
  since refits it.
- ``tma_setup_s`` = 1.5 us (was none): a TMA config makes its descriptors in the kernel (global scratch, then a
  tensormap fence) before its first copy, on every call's critical path; the table's TMA configs ran about 8%
  slower than the others on small calls, so a TMA twin is now predicted slower than its pointer-load config on
  a launch-bound call and faster (its cheaper load issue) only on a large one.

Fitted on the three dense sets with each held out in turn (``--hold-out``), only ``tma_setup_s`` moved (to 0.5 us
without the 768x3072 set); the model's first pick per instance runs 1.02x to 1.11x the instance's best sampled
config, against 1.20x to 1.35x with the assumed constants. The table's attention sets were not fitted:
their kernels were compiled before the batch strides' alignment was assumed, loaded operands element by
element, and ran about twice what any constant here predicts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tuner.cost_model import (LAUNCH_SECONDS, MEMSET_SECONDS, PERSISTENT_TAIL_CREDIT, blocks_per_sm,
                              config_peak_flops, launch_weight, persistent_loops, slots_per_sm, split_k_partials,
                              tail_alpha, workspace_bytes_moved)
from tuner.hardware import HardwareProfile
from tuner.space import DTYPE_BYTES, MicroKernel
from tuner.workload import Problem

__all__ = ["RooflineTerms", "RooflineConstants", "CONSTANTS", "roofline", "roofline_matrix", "SM_BANDWIDTH_FACTOR",
           "LAUNCH_SECONDS", "MEMSET_SECONDS", "POINTER_LOAD_INSTRUCTIONS", "TMA_LOAD_INSTRUCTIONS", "MODEL_VERSION",
           "PERSISTENT_TAIL_CREDIT", "DRAM_LATENCY_SECONDS"]

MODEL_VERSION = 5  # part of the analytic measurer's device key: answers of another version are not reused


@dataclass(frozen=True)
class RooflineConstants:
    """The model's constants that no datasheet gives (the module docstring says where the defaults come from)."""

    dram_latency_s: float = 750e-9  # a load's round trip to DRAM under load
    sm_bandwidth_factor: float = 4.0  # one SM's bandwidth cap, in even shares of DRAM bandwidth
    memset_s: float = MEMSET_SECONDS  # split-K's counter memset
    tma_setup_s: float = 1.5e-6  # a TMA config's in-kernel descriptors, once per call

    def __post_init__(self) -> None:
        if not (self.dram_latency_s > 0 and self.sm_bandwidth_factor > 0 and self.memset_s >= 0
                and self.tma_setup_s >= 0):
            raise ValueError(f"roofline constants out of range: {self}")


CONSTANTS = RooflineConstants()
SM_BANDWIDTH_FACTOR = CONSTANTS.sm_bandwidth_factor
DRAM_LATENCY_SECONDS = CONSTANTS.dram_latency_s
POINTER_LOAD_INSTRUCTIONS = 2  # warp instructions per 16-byte chunk a warp copies: cp.async + pointer add
TMA_LOAD_INSTRUCTIONS = 2  # per BLOCK_K step: one cp.async.bulk.tensor for A and one for B, from one thread
_SCHEDULERS = 4  # warp schedulers (partitions, one tensor core each) per SM: [CG], cc 8.x and 9.0
_CHUNK = 16  # bytes per cp.async


@dataclass(frozen=True)
class RooflineTerms:
    """The pieces of one prediction (seconds unless named otherwise), for tests and reports."""

    programs: int  # G = tiles x batch x SPLIT_K: the tiles' work units (a persistent grid runs them in fewer)
    busy_sms: int  # B = min(G, SMs)
    programs_per_sm: int  # P = ceil(G / SMs), on the busiest SM
    k_steps: int  # BLOCK_K steps per program
    mma: float  # the busiest SM's MMAs
    issue: float  # the busiest SM's load issue (pointer loads or TMA copies)
    sm_memory: float
    dram: float
    reduce: float
    launch: float
    resident: int = 1  # programs the busiest SM runs at once: min(P, resident blocks, a persistent one's n)
    pipeline: float = 0.0  # the busiest SM's loads at the rate its pipelines' bytes in flight allow
    setup: float = 0.0  # a TMA config's descriptors

    @property
    def seconds(self) -> float:
        bound = max(self.mma, self.sm_memory, self.dram, self.pipeline)
        return bound + self.issue + self.reduce + self.launch + self.setup


def roofline(config: MicroKernel, problem: Problem, profile: HardwareProfile, dtype: str, peak_flops: float,
             blocks_per_sm: int, constants: RooflineConstants = CONSTANTS) -> RooflineTerms | None:
    """The terms of ``config`` on ``problem`` (None when it cannot launch: 0 resident blocks per SM).

    ``peak_flops``: the config's device-wide peak (``cost_model.config_peak_flops``); ``blocks_per_sm``: its
    residency (``cost_model.blocks_per_sm``); ``constants``: the fitted ones unless a calibration tries others."""
    if blocks_per_sm <= 0:
        return None
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    elem = DTYPE_BYTES[dtype]
    sms = profile.num_sms
    tiles = math.ceil(problem.m / bm) * math.ceil(problem.n / bn) * problem.batch
    programs = tiles * split
    busy = min(programs, sms)
    per_sm = math.ceil(programs / sms)
    last = programs / sms - (per_sm - 1)  # the busiest SM's last round, filled to this share, in (0, 1]
    loops = persistent_loops(config.persistent, programs, sms)
    rounds = (per_sm - 1) + last ** tail_alpha(config, 0.0, loops)  # tiles' worth of work on the busiest SM
    k_steps = math.ceil(problem.k / (bk * split))
    concurrent = min(per_sm, slots_per_sm(config, blocks_per_sm))
    warps = config.num_warps * concurrent
    clock = profile.tensor_clock_hz

    step_flops = 2.0 * bm * bn * bk
    step_bytes = (bm + bn) * bk * elem
    mma_cycles = step_flops / (peak_flops / (sms * clock)) / min(1.0, warps / _SCHEDULERS)
    pointer_issue = POINTER_LOAD_INSTRUCTIONS * step_bytes / (_CHUNK * profile.warp_size) / min(_SCHEDULERS, warps)
    tma = config.tma and profile.wgmma  # TMA is sm_90's (the space offers it nowhere else)
    issue_cycles = min(pointer_issue, float(TMA_LOAD_INSTRUCTIONS)) if tma else pointer_issue
    mma = rounds * k_steps * mma_cycles / clock
    issue = rounds * k_steps * issue_cycles / clock

    cap = constants.sm_bandwidth_factor * profile.dram_bandwidth_gbs * 1e9 / sms
    partial = bm * bn * 4.0  # an fp32 partial tile in the split-K workspace
    _, read = split_k_partials(split)  # the last split of a tile reads all SPLIT_K partials
    program_bytes = k_steps * step_bytes + (partial if split > 1 else bm * bn * elem)  # its partial or C tile
    reduce_bytes = read * partial + bm * bn * elem if split > 1 else 0.0
    reductions = math.ceil(tiles / sms) if split > 1 else 0  # on the busiest SM
    sm_memory = (rounds * program_bytes + max(reductions - 1, 0) * reduce_bytes) / cap
    # Little's law: a program keeps at most num_stages - 1 BLOCK_K steps in flight (the pipeline's prefetch
    # depth, no more than its loop has), so its loop takes at least one DRAM round trip per that many steps
    depth = max(1, min(config.num_stages - 1, k_steps))
    pipeline = max(1.0, rounds / concurrent) * k_steps / depth * constants.dram_latency_s

    operands = (problem.m * problem.k + problem.k * problem.n + problem.m * problem.n) * elem * problem.batch
    dram = (operands + workspace_bytes_moved(config, problem)) / (profile.dram_bandwidth_gbs * 1e9)

    reduce = reduce_bytes / cap
    launch = LAUNCH_SECONDS * launch_weight(config, constants.memset_s)
    setup = constants.tma_setup_s if tma else 0.0
    return RooflineTerms(programs, busy, per_sm, k_steps, mma, issue, sm_memory, dram, reduce, launch,
                         concurrent, pipeline, setup)


def roofline_matrix(configs: Sequence[MicroKernel], problems: Sequence[Problem], profile: HardwareProfile,
                    dtype: str, tf32: bool = False, constants: RooflineConstants = CONSTANTS) -> np.ndarray:
    """Predicted seconds of every (config, problem): array [len(configs), len(problems)], inf where a config
    cannot launch. The analytic measurer's answers (same peaks and residency), computed once per config for
    the search's prior (tuner/search.py).

    Each config's row is ``roofline``'s arithmetic over all problems at once (``_seconds_row``: the same
    operations in the same order on int64 and float64 arrays, so the answers are the same floats); a workload
    of a thousand instances takes a second here where a call per pair took half a minute. Problems whose byte
    counts could pass int64 take the per-pair path."""
    out = np.full((len(configs), len(problems)), np.inf)
    if not problems:
        return out
    if _largest_count(configs, problems, dtype) >= 2 ** 53:
        return _roofline_matrix_per_pair(configs, problems, profile, dtype, tf32, constants, out)
    m, n, k, batch = (np.array([getattr(p, f) for p in problems], dtype=np.int64) for f in ("m", "n", "k", "batch"))
    operands = (m * k + k * n + m * n) * DTYPE_BYTES[dtype] * batch
    for i, config in enumerate(configs):
        resident = blocks_per_sm(config, profile, dtype)
        if resident > 0:
            out[i] = _seconds_row(config, m, n, k, batch, operands, profile, dtype,
                                  config_peak_flops(config, profile, dtype, tf32), resident, constants)
    return out


def _largest_count(configs: Sequence[MicroKernel], problems: Sequence[Problem], dtype: str) -> int:
    """A bound of the integer counts ``_seconds_row`` forms in int64 (operand bytes, split-K workspace bytes,
    a program's operand bytes): below 2^53 none wraps and each converts to the float Python's int would."""
    if not configs:
        return 0
    bm, bn, bk, split = (max(getattr(c, f) for c in configs) for f in ("block_m", "block_n", "block_k", "split_k"))
    elem = DTYPE_BYTES[dtype]
    return max(max((p.m * p.k + p.k * p.n + p.m * p.n) * elem * p.batch,
                   (p.m + bm) * (p.n + bn) * p.batch * 2 * split * 4,
                   (p.k + 1) * (bm + bn) * bk * elem) for p in problems)


def _roofline_matrix_per_pair(configs: Sequence[MicroKernel], problems: Sequence[Problem],
                              profile: HardwareProfile, dtype: str, tf32: bool, constants: RooflineConstants,
                              out: np.ndarray) -> np.ndarray:
    for i, config in enumerate(configs):
        peak = config_peak_flops(config, profile, dtype, tf32)
        resident = blocks_per_sm(config, profile, dtype)
        if resident <= 0:
            continue
        for j, problem in enumerate(problems):
            terms = roofline(config, problem, profile, dtype, peak, resident, constants)
            if terms is not None:
                out[i, j] = terms.seconds
    return out


def _seconds_row(config: MicroKernel, m: np.ndarray, n: np.ndarray, k: np.ndarray, batch: np.ndarray,
                 operands: np.ndarray, profile: HardwareProfile, dtype: str, peak_flops: float,
                 blocks_per_sm: int, constants: RooflineConstants) -> np.ndarray:
    """``roofline(config, problem, ...).seconds`` for every problem (m, n, k, batch: int64 arrays; operands:
    their A, B and C bytes), term by term as ``roofline`` computes them. Keep the two in step: a test compares
    them over the whole space (tests/test_search.py)."""
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    elem = DTYPE_BYTES[dtype]
    sms = profile.num_sms
    tiles = -(-m // bm) * -(-n // bn) * batch
    programs = tiles * split
    per_sm = -(-programs // sms)
    last = programs / sms - (per_sm - 1)
    loops = persistent_loops(config.persistent, programs, sms)
    exponent = np.where(loops, tail_alpha(config, 0.0, True), tail_alpha(config, 0.0, False))
    rounds = (per_sm - 1) + last ** exponent
    k_steps = -(-k // (bk * split))
    concurrent = np.minimum(per_sm, slots_per_sm(config, blocks_per_sm))
    warps = config.num_warps * concurrent
    clock = profile.tensor_clock_hz

    step_flops = 2.0 * bm * bn * bk
    step_bytes = (bm + bn) * bk * elem
    mma_cycles = step_flops / (peak_flops / (sms * clock)) / np.minimum(1.0, warps / _SCHEDULERS)
    pointer_issue = POINTER_LOAD_INSTRUCTIONS * step_bytes / (_CHUNK * profile.warp_size) / np.minimum(_SCHEDULERS,
                                                                                                       warps)
    tma = config.tma and profile.wgmma
    issue_cycles = np.minimum(pointer_issue, float(TMA_LOAD_INSTRUCTIONS)) if tma else pointer_issue
    mma = rounds * k_steps * mma_cycles / clock
    issue = rounds * k_steps * issue_cycles / clock

    cap = constants.sm_bandwidth_factor * profile.dram_bandwidth_gbs * 1e9 / sms
    partial = bm * bn * 4.0
    written, read = split_k_partials(split)
    program_bytes = k_steps * step_bytes + (partial if split > 1 else bm * bn * elem)
    reduce_bytes = read * partial + bm * bn * elem if split > 1 else 0.0
    reductions = -(-tiles // sms) if split > 1 else np.zeros_like(tiles)
    sm_memory = (rounds * program_bytes + np.maximum(reductions - 1, 0) * reduce_bytes) / cap
    depth = np.maximum(1, np.minimum(config.num_stages - 1, k_steps))
    pipeline = np.maximum(1.0, rounds / concurrent) * k_steps / depth * constants.dram_latency_s

    workspace = (tiles * (written + read) * bm * bn * 4).astype(np.float64)  # cost_model.workspace_bytes_moved
    dram = (operands + workspace) / (profile.dram_bandwidth_gbs * 1e9)

    reduce = reduce_bytes / cap
    launch = LAUNCH_SECONDS * launch_weight(config, constants.memset_s)
    setup = constants.tma_setup_s if tma else 0.0
    bound = np.maximum(np.maximum(np.maximum(mma, sm_memory), dram), pipeline)
    return bound + issue + reduce + launch + setup
