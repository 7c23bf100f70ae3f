"""The analytic measurer's time model: a roofline with occupancy for one call of one micro-kernel on one problem.

Nothing here is measured; it ranks configs where no GPU can time them (``--measure analytic``). The call's
G = tiles x batch x SPLIT_K programs spread over the SMs, one per SM first, so B = min(G, SMs) SMs are busy
and the busiest runs P = ceil(G / SMs) programs; each program makes ``k_steps`` BLOCK_K steps (K padded to
BLOCK_K x SPLIT_K). The call takes

    max(mma, sm_memory, dram) + issue + reduce + launch (+ memset under split-K)

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
  H100, less on small-M calls): a TMA twin is predicted a little faster than its pointer-load config, never
  slower.
- ``sm_memory``: the busiest SM's bytes (its programs' operand slices, and its output tile or, under
  split-K, its fp32 partial) at a per-SM cap of ``SM_BANDWIDTH_FACTOR`` x its even share of DRAM bandwidth.
  So the achievable bandwidth is min(DRAM bandwidth, B x cap): a call on few SMs cannot use the whole
  device's, which is why split-K (more programs, more busy SMs) pays for small-M calls.
- ``dram``: the bytes that must cross DRAM, A, B and C once (operand re-reads across tiles hit the L2: 40 MB
  on the A100, 48 MB on the L4 and 50 MB on the H100 hold the project's GEMM operands) plus, under split-K,
  the fp32 workspace written (SPLIT_K partials per tile) and read back (the last split of a tile reads all
  SPLIT_K of them, tuner/templates.py ``_split_k_reduce``) at the device's bandwidth.
- ``reduce``: split-K's last split of a tile reads the SPLIT_K partials and writes the output after every split
  has stored its partial, on one SM at the per-SM cap: a serial tail no other program hides.
- persistent configs (``MicroKernel.persistent``, sm_90): the same tiles on the same SMs, so the same terms,
  except that the busiest SM's partial last round is credited half its saving: it runs
  ceil(T) - ``PERSISTENT_TAIL_CREDIT`` x (ceil(T) - T) tiles' worth of MMAs, issue and bytes for T = G / SMs,
  since its programs load their next tile while others finish (no per-tile launch or prologue) but still
  finish whole tiles. An assumption, as the learned model's ``cost_model.tail_alpha`` credit is.
- ``launch``: ``LAUNCH_SECONDS`` per call, plus ``MEMSET_SECONDS`` under split-K for zeroing the tile counters
  (the launcher's cuMemsetD8Async of 4 bytes per tile on the kernel's stream), which is one more command the
  GPU's front end dispatches, not another kernel launch.

Each term is non-decreasing in M, N, K and batch for a fixed config, so the predicted time is too.

Constants (all but the first two are assumptions, named so a GPU run can replace them):
- ``SM_BANDWIDTH_FACTOR`` = 2: one SM can pull at most twice its even share of DRAM bandwidth (H100: 2 x 3.35
  TB/s / 132 = 51 GB/s), so half the SMs saturate DRAM. The L2 bounds it from above: the A100 whitepaper
  quotes 5,120 B/clk of L2 read bandwidth, 7.2 TB/s at 1,410 MHz, 3.5x its 2,039 GB/s of DRAM; below that, a
  block keeps only its pipeline's 2-4 stages of a small tile (16-48 KB) in flight over a DRAM round trip of
  several hundred ns (Little's law), which is what limits the small-M calls split-K serves.
- ``LAUNCH_SECONDS`` = 3 us per kernel launch (the figure the analytic measurer always used and attention's
  analytic cost uses); ``MEMSET_SECONDS`` = 0.5 us for split-K's counter memset.
- The clock that turns issue cycles into seconds is the profile's (``HardwareProfile.tensor_clock_hz``: the
  clock its datasheet peak is quoted at, 1,830 MHz on the H100 SXM5), the peaks and bandwidths are the
  datasheets' (tuner/hardware.py: H100 SXM5 989.4 TFLOP/s dense fp16, 3.35 TB/s, 132 SMs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.hardware import HardwareProfile
from tuner.space import DTYPE_BYTES, MicroKernel
from tuner.workload import Problem

__all__ = ["RooflineTerms", "roofline", "SM_BANDWIDTH_FACTOR", "LAUNCH_SECONDS", "MEMSET_SECONDS",
           "POINTER_LOAD_INSTRUCTIONS", "TMA_LOAD_INSTRUCTIONS", "MODEL_VERSION", "PERSISTENT_TAIL_CREDIT"]

MODEL_VERSION = 3  # part of the analytic measurer's device key: answers of another version are not reused
SM_BANDWIDTH_FACTOR = 2.0
LAUNCH_SECONDS = 3e-6
MEMSET_SECONDS = 0.5e-6
POINTER_LOAD_INSTRUCTIONS = 2  # warp instructions per 16-byte chunk a warp copies: cp.async + pointer add
PERSISTENT_TAIL_CREDIT = 0.5  # share of the partial last round a persistent config saves (an assumption)
TMA_LOAD_INSTRUCTIONS = 2  # per BLOCK_K step: one cp.async.bulk.tensor for A and one for B, from one thread
_SCHEDULERS = 4  # warp schedulers (partitions, one tensor core each) per SM: [CG], cc 8.x and 9.0
_CHUNK = 16  # bytes per cp.async


@dataclass(frozen=True)
class RooflineTerms:
    """The pieces of one prediction (seconds unless named otherwise), for tests and reports."""

    programs: int  # G = tiles x batch x SPLIT_K
    busy_sms: int  # B = min(G, SMs)
    programs_per_sm: int  # P = ceil(G / SMs), on the busiest SM
    k_steps: int  # BLOCK_K steps per program
    mma: float  # the busiest SM's MMAs
    issue: float  # the busiest SM's load issue (pointer loads or TMA copies)
    sm_memory: float
    dram: float
    reduce: float
    launch: float

    @property
    def seconds(self) -> float:
        return max(self.mma, self.sm_memory, self.dram) + self.issue + self.reduce + self.launch


def roofline(config: MicroKernel, problem: Problem, profile: HardwareProfile, dtype: str, peak_flops: float,
             blocks_per_sm: int) -> RooflineTerms | None:
    """The terms of ``config`` on ``problem`` (None when it cannot launch: 0 resident blocks per SM).

    ``peak_flops``: the config's device-wide peak (``cost_model.config_peak_flops``); ``blocks_per_sm``: its
    residency (``cost_model.blocks_per_sm``)."""
    if blocks_per_sm <= 0:
        return None
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    elem = DTYPE_BYTES[dtype]
    sms = profile.num_sms
    tiles = math.ceil(problem.m / bm) * math.ceil(problem.n / bn) * problem.batch
    programs = tiles * split
    busy = min(programs, sms)
    per_sm = math.ceil(programs / sms)
    rounds: float = per_sm  # the busiest SM's tiles' worth of work
    if config.persistent:
        rounds = per_sm - PERSISTENT_TAIL_CREDIT * (per_sm - programs / sms)
    k_steps = math.ceil(problem.k / (bk * split))
    concurrent = min(per_sm, blocks_per_sm)
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

    cap = SM_BANDWIDTH_FACTOR * profile.dram_bandwidth_gbs * 1e9 / sms
    partial = bm * bn * 4.0  # an fp32 partial tile in the split-K workspace
    program_bytes = k_steps * step_bytes + (partial if split > 1 else bm * bn * elem)
    reduce_bytes = split * partial + bm * bn * elem if split > 1 else 0.0
    reductions = math.ceil(tiles / sms) if split > 1 else 0  # on the busiest SM
    sm_memory = (rounds * program_bytes + max(reductions - 1, 0) * reduce_bytes) / cap

    operands = (problem.m * problem.k + problem.k * problem.n + problem.m * problem.n) * elem * problem.batch
    workspace = 2.0 * tiles * split * partial if split > 1 else 0.0
    dram = (operands + workspace) / (profile.dram_bandwidth_gbs * 1e9)

    reduce = reduce_bytes / cap
    launch = LAUNCH_SECONDS + (MEMSET_SECONDS if split > 1 else 0.0)
    return RooflineTerms(programs, busy, per_sm, k_steps, mma, issue, sm_memory, dram, reduce, launch)
