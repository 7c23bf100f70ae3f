"""The shape-generic search space: micro-kernel configs derived from the target GPU's limits only.

DietCode's point is that every shape of a dynamic workload searches the *same* candidate set, so one
measurement teaches the cost model about all shapes. ``enumerate_space(family)`` therefore takes no
shapes: a family is (op, dtype, target) and the space is the product of the axes below minus what the
target's hardware profile rules out.

Axes (chosen so each family keeps a few hundred candidates, which a tuner measuring 64 per round can
cover in a handful of rounds):
- BLOCK_M, BLOCK_N in {16, 32, 64, 128, 256}: 16 is Triton's smallest ``tl.dot`` tile and serves M = 1
  decode rows; 256 is the largest tile that fits registers with 8 warps.
- BLOCK_K in {16, 32, 64, 128}.
- num_warps in {2, 4, 8}; num_stages in {2, 3, 4} (software-pipelining depth), and 5 on sm_90 for the
  configs that use wgmma (rule ``wgmma``): elsewhere 5 rarely beats 4 and only costs shared memory, while a
  wgmma kernel issues its MMAs asynchronously and keeps more loads in flight, and 227 KB per block holds a
  fifth stage of most of its tiles.
- GROUP_M = 8 (tile-row swizzle for L2 reuse; with fewer tile rows than 8 it degenerates to row-major,
  so it never hurts and the value 1 is not worth doubling the space).
- SPLIT_K in {1, 2, 4, 8}, every dtype, only on tiles no taller than wide (BLOCK_M <= BLOCK_N) with
  BLOCK_M * BLOCK_N <= 64 * 64. Split-K exists for outputs with too few tiles to fill the GPU: few rows
  (M = 1..128 tokens) and a long reduction, e.g. BERT-base's N = 768 projections: at M = 16 a 16x64 tile grid
  is 12 programs on a 132-SM H100 (108 on an A100), and splits of 2, 4 and 8 give 24, 48 and 96, so each
  value is the one that fills a wave for some (M, N) of such models (8: N = 768 at M <= 32; 4: N = 768 at
  M = 64 or N = 3072 at M = 16; 2: N = 3072 at M = 32). 16 would exceed a wave for every one of them and
  leave splits of K = 768 at BLOCK_K = 64 empty. Taller-than-wide tiles serve many rows, which need no split;
  larger tiles make enough programs by themselves. The splits meet in an fp32 workspace (tuner/templates.py),
  so float16 / bfloat16 keep the fp32 accumulation and any epilogue.
- tma in {0, 1} on sm_90 (0 elsewhere): 1 reads A and B through Tensor Memory Accelerator descriptors made on
  the device (``templates._tma_loop``: ``cp.async.bulk.tensor`` copies into shared memory instead of the
  ``cp.async`` pointer loads, 256 B of global scratch per program that the launcher passes). Only for the
  configs that use wgmma (rule ``tma``), gemm and bmm (conv gathers its rows), so each such config gets a TMA
  twin and the tuner measures which loads a shape prefers. A TMA kernel is compiled assuming a, b, K and N (and
  the batch strides) divisible by 16 (``aot.tma_div16``: TMA needs 16-byte aligned bases and row strides), so a
  call breaking one runs the vendor path. Its key ends in ``t`` (``m64n64k64w4s3g8k1t``); other keys are as before.
- persistent in {0, 1, 2} on sm_90 (0 elsewhere): n > 0 is a persistent kernel (``templates.gemm_kernel``'s
  PERSISTENT): the launcher runs min(tiles x batch, SMs x n) programs (n programs per SM, from the device's SM
  count at run time) and each loops over tiles pid, pid + programs, ... in the grouped order, instead of one
  program per tile. What that saves is per-tile work outside the K loop: launching and retiring a CTA, its
  prologue (for a TMA config, making its two tensor descriptors in global scratch and fencing them, once per
  program instead of once per tile, and 256 B of scratch per program instead of per tile), and part of the
  last wave's tail, since a program starts its next tile as soon as its own previous one ends. Rule
  ``persistent`` keeps exactly one persistent twin of each TMA config without split-K (split-K exists to make
  *more* programs; a persistent kernel makes fewer): the TMA configs are where the per-tile prologue is largest
  (descriptor creation) and the wgmma tiles are large (few tiles per wave), and twinning only them keeps the
  sm_90 16-bit spaces at +222 configs (twins of the pointer-load wgmma configs too would add 444). Its n is the
  number of its blocks the register and shared memory estimates fit on one SM, capped at 2
  (``persistent_programs``): one for the big tiles that fill an SM, two for smaller ones, so that one program's
  epilogue overlaps the other's main loop. Its key adds ``p<n>`` (``m128n128k64w8s4g8k1tp1``).

Pruning rules, each counted in ``prune_report`` (a config is charged to the first rule it fails):
- ``threads``: num_warps * warp_size <= max_threads_per_block.
- ``mma_tile``: BLOCK_M >= mma m, BLOCK_N >= mma n, BLOCK_K >= mma k scaled to the dtype (k=16 for
  16-bit types, 8 for tf32); Triton's ``tl.dot`` additionally needs every dim >= 16.
- ``k_bytes``: BLOCK_K * dtype bytes >= 64, so each operand row slice loaded per stage spans at least two
  32-byte DRAM sectors (drops BLOCK_K = 16 for 16-bit types; their k16 MMA would run once per stage).
- ``warp_tile``: every warp owns at least 4 MMA tiles, BLOCK_M * BLOCK_N >= num_warps * m * n * 4, so
  each loaded operand fragment is reused (fewer and the warps mostly wait on loads).
- ``shared_memory``: num_stages * (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * dtype bytes <= smem_per_block_optin.
- ``registers``: fp32 accumulator BLOCK_M*BLOCK_N/threads + one stage of operand fragments
  (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * bytes/4/threads + 32 for addresses and indices <= regs_per_thread;
  conv adds num_stages * BLOCK_M*BLOCK_K/threads * 3 (a pipelined gather keeps a 64-bit address and a
  predicate per input element in flight; without this term most large conv tiles compile to spills).
- ``split_k``: split-K only on tiles with BLOCK_M <= BLOCK_N and BLOCK_M * BLOCK_N <= 4096 (see above).
- ``wgmma`` (sm_90 only): on Hopper Triton lowers ``tl.dot`` to the warpgroup MMA (wgmma) only for
  num_warps a multiple of 4, BLOCK_M a multiple of 64, 16-bit operands (or tf32) and BLOCK_K >= 16
  (``wgmma_eligible``, checked against every config of the compiled float16 and bfloat16 gemm spaces
  before and after this rule and of the float16 conv space: benchmarks/results/compile/sm90-mma*.csv);
  otherwise it emits mma.sync, which reaches about 2/3 of the
  H100's tensor-core peak (tuner/hardware.py). In the 16-bit spaces a config that cannot use wgmma is kept
  only as a decode tile (BLOCK_M <= 32, which a 64-row wgmma tile would mostly pad): this drops the 2-warp
  configs with BLOCK_M >= 64; the float32 spaces in tf32 precision (tensor cores, wgmma) follow the same rule.
  num_stages 5 is kept only for wgmma configs (so the float32 spaces in ieee precision, without tensor
  cores, keep the other targets' stages). Compiled with the compile
  filter's bias + gelu epilogue (benchmarks/results/compile/sm90-mma-space.csv), 47 of the 341 unsplit float16
  configs spill: 38 wgmma tiles whose accumulator takes 128 registers per thread (128x128, 64x256, 256x64
  on 4 warps; 128x256, 256x128 on 8), which compile without spills under a bias alone (the erf costs the
  registers: sm90-spills-bias-only.txt), so the space keeps them for the GEMMs without gelu, and 9
  mma.sync decode tiles with BLOCK_N = 256 that spill under any epilogue.
- ``tma`` (sm_90 only): tma = 1 only on a gemm or bmm config that uses wgmma (``wgmma_eligible``; so 16-bit
  types and float32 in tf32 precision, never ieee float32).
- ``persistent`` (sm_90 only): persistent = n > 0 only on a TMA config with split_k 1 and n =
  ``persistent_programs`` (see the axis above).

``compile_filter`` then compiles candidates (``tuner.aot``) and drops those whose real metadata breaks a
limit (``shared`` > smem_per_block_optin, register spills > 0).

Measured sizes of ``enumerate_space`` per family (of 3600 axis combinations, 28800 on sm_90 with its fifth
stage and the tma and persistent axes; gemm and bmm share a space, conv's gather costs registers;
tests/test_space.py checks this table against the code). Before split-K went to every dtype (and before the
``wgmma`` rule) they were 591 / 335 / 90 (sm_80 gemm f32 / f16 / conv f16), 460 / 269 / 81 (sm_89) and
624 / 350 / 91 (sm_90). sm_90's float16 gemm space is 1229 configs (713 before the tma axis, 1007 before the
persistent one): 294 wgmma configs with pointer loads, their 294 TMA twins, the 222 persistent twins of the TMA
ones without split-K (77 with one program per SM, 145 with two) and 419 mma.sync decode tiles (BLOCK_M <= 32);
444 are split-K, 72 + 72 of them wgmma (64x64 tiles on 4 warps). The float32 spaces depend on
``fp32_precision`` (``enumerate_space``), on sm_90 only: an ieee dot runs on the FMA units, so its space keeps
every target's rules (no fifth stage, no TMA, no persistent twins: 811 configs); a tf32 dot (optimize's
default, as ONNX Runtime's CUDA EP) uses wgmma like a 16-bit one, so its space follows the same ``wgmma``,
``tma`` and ``persistent`` rules: 1344 configs, 319 wgmma configs with pointer loads (66 of them with the fifth
stage), their 319 TMA twins, 235 persistent twins (89 with one program per SM) and 471 mma.sync decode tiles;
507 are split-K, 84 + 84 of them wgmma. fp32's 4-byte elements leave BLOCK_K = 16 in (k_bytes) and fill shared
memory sooner, so its counts differ from float16's. A tf32 conv space gets the wgmma rule but no TMA (441
configs against ieee's 429). Elsewhere the precision changes nothing (sm_80 and sm_89 have neither wgmma nor
TMA). The conv spaces have no TMA or persistent configs:

    target  op    f32-tf32  f32-ieee  float16  bfloat16
    sm_80   gemm       770       770      710       710
    sm_80   bmm        770       770      710       710
    sm_80   conv       424       424      273       273
    sm_89   gemm       605       605      587       587
    sm_89   bmm        605       605      587       587
    sm_89   conv       374       374      246       246
    sm_90   gemm      1344       811     1229      1229
    sm_90   bmm       1344       811     1229      1229
    sm_90   conv       441       429      283       283
"""
from __future__ import annotations

import itertools
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dietcode_ort.errors import DietcodeError
from tuner.hardware import HardwareProfile, TARGETS, get_profile, resident_blocks
from tuner.workload import DTYPES, OPS, ConvParams, Epilogue

if TYPE_CHECKING:
    from tuner.aot import CompiledKernel

__all__ = ["MicroKernel", "Family", "FAMILIES", "AXES", "RULES", "DTYPE_BYTES", "enumerate_space",
           "prune_report", "validate", "check_family", "estimate_shared", "estimate_registers",
           "wgmma_eligible", "persistent_programs", "axes_for", "COMPILE_RULES", "REFERENCE_CONV", "CompiledSpace", "compile_filter",
           "representative_epilogue", "space_command",
           "FP32_PRECISIONS", "DEFAULT_FP32_PRECISION", "check_fp32_precision", "uses_tf32"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# How float32 dots are computed: "tf32" (tensor cores, operands rounded to TF32) or "ieee" (FMA units, exact
# float32 products). ONNX Runtime's CUDA EP computes float32 MatMul/Gemm (cuBLAS) and Conv (cuDNN) in TF32
# unless its provider option use_tf32 is 0: TF32 was already its default (microsoft/onnxruntime issue #15407,
# 2023), and the option to turn it off came with ONNX Runtime 1.18 (PRs #19357 for GEMMs, #19426 for Conv),
# default 1: `bool use_tf32{true}` in onnxruntime/core/providers/cuda/cuda_execution_provider_info.h. The tuned
# kernels (tuner.aot compiles them) and the float32 spaces follow the same default.
FP32_PRECISIONS: tuple[str, ...] = ("tf32", "ieee")
DEFAULT_FP32_PRECISION = "tf32"

AXES: dict[str, tuple[int, ...]] = {
    "block_m": (16, 32, 64, 128, 256),
    "block_n": (16, 32, 64, 128, 256),
    "block_k": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (2, 3, 4),
    "group_m": (8,),
    "split_k": (1, 2, 4, 8),
    "tma": (0,),
    "persistent": (0,),
}

RULES = ("threads", "mma_tile", "k_bytes", "warp_tile", "shared_memory", "registers", "split_k", "wgmma", "tma",
         "persistent")
_WGMMA_STAGES = (5,)  # added on GPUs with wgmma, for wgmma configs only
_TMA = (0, 1)  # the tma axis on GPUs with wgmma: TMA operand loads, for wgmma gemm / bmm configs only
_TMA_OPS = ("gemm", "bmm")  # the templates with a TMA loop (conv gathers its rows: no tensor descriptor)
_PERSISTENT = (0, 1, 2)  # the persistent axis on GPUs with wgmma: programs per SM, for TMA configs only
_PERSISTENT_MAX = _PERSISTENT[-1]
_DECODE_BLOCK_M = 32  # tiles this short serve decode-size M: kept on mma.sync
_SPLIT_K_MAX_TILE = 64 * 64
_REG_OVERHEAD = 32
_MMA_PER_WARP = 4
_MIN_K_BYTES = 64
_KEY = re.compile(r"m(\d+)n(\d+)k(\d+)w(\d+)s(\d+)g(\d+)k(\d+)(t?)(?:p([1-9]\d*))?")


@dataclass(frozen=True, order=True)
class MicroKernel:
    """One micro-kernel: a tile program's compile-time configuration."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1
    tma: int = 0  # 1: A and B read through TMA tensor descriptors (sm_90 wgmma gemm / bmm configs)
    persistent: int = 0  # n > 0: a persistent kernel launched as n programs per SM, each looping over tiles

    def key(self) -> str:
        """A stable short name, e.g. ``m64n64k32w4s3g8k1`` (the trailing k is split_k), with a ``t`` suffix
        for a TMA config (``m64n64k64w4s3g8k1t``) and ``p<n>`` for a persistent one of n programs per SM
        (``m128n128k64w8s4g8k1tp1``): the keys of the other configs keep their names."""
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
                f"g{self.group_m}k{self.split_k}" + ("t" if self.tma else "")
                + (f"p{self.persistent}" if self.persistent else ""))

    @classmethod
    def from_key(cls, key: str) -> "MicroKernel":
        match = _KEY.fullmatch(key)
        if match is None:
            raise DietcodeError(f"bad micro-kernel key {key!r}; expected the form m64n64k32w4s3g8k1 (a trailing "
                                "t for TMA, then p<n> for persistent)")
        *numbers, tma, persistent = match.groups()
        return replace(cls(*(int(g) for g in numbers)), tma=int(tma == "t"), persistent=int(persistent or 0))

    def to_dict(self) -> dict[str, int]:
        """The fields, ``tma`` and ``persistent`` only when set (records of other configs keep their form)."""
        data = asdict(self)
        for name in ("tma", "persistent"):
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> "MicroKernel":
        return cls(**{f.name: int(data[f.name]) for f in fields(cls) if f.name in data})

    @property
    def threads(self) -> int:
        return self.num_warps * 32


@dataclass(frozen=True, order=True)
class Family:
    """Workloads that share one search space: same op template, dtype and target GPU."""

    op: str
    dtype: str
    target: str

    @property
    def profile(self) -> HardwareProfile:
        return get_profile(self.target)


FAMILIES: tuple[Family, ...] = tuple(Family(op, dtype, target)
                                     for target in TARGETS for op in OPS for dtype in DTYPES)


def check_family(family: Family) -> HardwareProfile:
    """Validate op, dtype and target of ``family``; return its hardware profile."""
    if family.op not in OPS:
        raise DietcodeError(f"unknown op {family.op!r}; allowed: {', '.join(OPS)}")
    if family.dtype not in DTYPES:
        raise DietcodeError(f"unknown dtype {family.dtype!r}; allowed: {', '.join(DTYPES)}")
    return get_profile(family.target)


def check_fp32_precision(precision: str) -> str:
    """``precision`` when it is one of FP32_PRECISIONS, else a DietcodeError naming the allowed values."""
    if precision not in FP32_PRECISIONS:
        raise DietcodeError(f"unknown float32 precision {precision!r}; allowed: {', '.join(FP32_PRECISIONS)}")
    return precision


def uses_tf32(dtype: str, precision: str) -> bool:
    """Whether a ``dtype`` kernel is compiled with TF32 dots (``allow_tf32``) under ``precision``: float32
    kernels in "tf32" precision; 16-bit kernels use their own tensor-core type either way."""
    return dtype == "float32" and check_fp32_precision(precision) == "tf32"


def estimate_shared(config: MicroKernel, dtype: str) -> int:
    """Pipelined operand buffers in shared memory: stages x (A tile + B tile) x element size."""
    tile = config.block_m * config.block_k + config.block_k * config.block_n
    return config.num_stages * tile * DTYPE_BYTES[dtype]


def estimate_registers(config: MicroKernel, dtype: str, warp_size: int = 32, op: str = "gemm",
                       channels_last: bool = False) -> int:
    """Registers per thread: fp32 accumulator + one stage of operand fragments + a fixed overhead; conv
    also keeps, per pipeline stage, a 64-bit address and a predicate for each gathered input element, or with
    ``channels_last`` (the template's NHWC form) for each 16-byte vector of them."""
    threads = config.num_warps * warp_size
    acc = config.block_m * config.block_n // threads
    operands = (config.block_m * config.block_k + config.block_k * config.block_n) * DTYPE_BYTES[dtype]
    vector = 16 // DTYPE_BYTES[dtype] if channels_last else 1
    gather = config.num_stages * -(-config.block_m * config.block_k // (threads * vector)) * 3 if op == "conv" else 0
    return acc + -(-operands // (4 * threads)) + gather + _REG_OVERHEAD


def wgmma_eligible(config: MicroKernel, dtype: str, profile: HardwareProfile, tf32: bool = False) -> bool:
    """Whether Triton 3.9 lowers the templates' ``tl.dot`` with ``config`` to wgmma (MMAv3) on ``profile``.

    Triton's AccelerateMatmul pass tries MMAv3 first on sm_90 and takes it when ``supportMMA(dot, 3)``
    holds (lib/Analysis/Utility.cpp): num_warps a multiple of 4 (whole warpgroups), the dot's M (BLOCK_M)
    a multiple of 64 and N a multiple of 8, K >= 256 / element bits, and 16-bit (or fp8 / int8) operands, or
    fp32 ones only in tf32 precision; otherwise it falls back to mma.sync (MMAv2), and an ieee fp32 dot uses
    no tensor core. Checked config by config against the compiled PTX:
    benchmarks/results/compile/sm90-mma.csv (tests/test_hopper.py)."""
    if not profile.wgmma or config.num_warps % 4 or config.block_m % 64 or config.block_n % 8:
        return False
    if dtype == "float32" and not tf32:
        return False
    return config.block_k >= 256 // (DTYPE_BYTES[dtype] * 8)


def axes_for(profile: HardwareProfile) -> dict[str, tuple[int, ...]]:
    """The axes of ``profile``'s spaces: ``AXES``, plus num_stages 5 on a GPU with wgmma (sm_90, whose 227 KB
    of shared memory per block holds a fifth stage of the 64-row-multiple tiles the warpgroup MMA wants)."""
    if not profile.wgmma:
        return AXES
    return {**AXES, "num_stages": AXES["num_stages"] + _WGMMA_STAGES, "tma": _TMA, "persistent": _PERSISTENT}


def persistent_programs(config: MicroKernel, dtype: str, profile: HardwareProfile) -> int:
    """The programs per SM of ``config``'s persistent twin: as many of its blocks as the register and shared
    memory estimates fit on one SM, at least 1 and at most 2 (rule ``persistent``)."""
    resident = resident_blocks(profile, config.threads, estimate_registers(config, dtype, profile.warp_size),
                               estimate_shared(config, dtype))
    return max(1, min(_PERSISTENT_MAX, resident))


def _failed_rule(config: MicroKernel, op: str, dtype: str, p: HardwareProfile, tf32: bool = False,
                 channels_last: bool = False) -> str | None:
    mma_m, mma_n, mma_k = p.mma_min_tile
    k_min = max(16, mma_k * 2 // DTYPE_BYTES[dtype])
    if config.num_warps * p.warp_size > p.max_threads_per_block:
        return "threads"
    if config.block_m < max(16, mma_m) or config.block_n < max(16, mma_n) or config.block_k < k_min:
        return "mma_tile"
    if config.block_k * DTYPE_BYTES[dtype] < _MIN_K_BYTES:
        return "k_bytes"
    if config.block_m * config.block_n < config.num_warps * mma_m * mma_n * _MMA_PER_WARP:
        return "warp_tile"
    if estimate_shared(config, dtype) > p.smem_per_block_optin:
        return "shared_memory"
    if estimate_registers(config, dtype, p.warp_size, op, channels_last) > p.regs_per_thread:
        return "registers"
    if config.split_k > 1 and (config.block_m > config.block_n or config.block_m * config.block_n > _SPLIT_K_MAX_TILE):
        return "split_k"
    tensor_cores = DTYPE_BYTES[dtype] == 2 or tf32
    if p.wgmma and not wgmma_eligible(config, dtype, p, tf32) and (
            config.num_stages in _WGMMA_STAGES or (tensor_cores and config.block_m > _DECODE_BLOCK_M)):
        return "wgmma"
    if config.tma and (op not in _TMA_OPS or not wgmma_eligible(config, dtype, p, tf32)):
        return "tma"
    if config.persistent and (not config.tma or config.split_k != 1
                              or config.persistent != persistent_programs(config, dtype, p)):
        return "persistent"
    return None


def _product(profile: HardwareProfile) -> list[MicroKernel]:
    return [MicroKernel(*values) for values in itertools.product(*axes_for(profile).values())]


def enumerate_space(family: Family, fp32_precision: str = DEFAULT_FP32_PRECISION,
                    channels_last: bool = False) -> list[MicroKernel]:
    """All configs of the axes that pass every pruning rule for ``family``, sorted (deterministic).
    ``channels_last``: a conv family's space for the template's NHWC form, whose gathers cost registers per
    16-byte vector instead of per element (rule ``registers``): larger tiles pass.

    ``fp32_precision`` (how float32 dots are computed, ``FP32_PRECISIONS``) shapes the float32 spaces only: a
    tf32 dot runs on the tensor cores, so on sm_90 its space follows the 16-bit spaces' ``wgmma`` and ``tma``
    rules; an ieee one keeps the FMA units' space. It is not a shape: every shape still shares the space."""
    profile = check_family(family)
    tf32 = uses_tf32(family.dtype, fp32_precision)
    return sorted(c for c in _product(profile)
                  if _failed_rule(c, family.op, family.dtype, profile, tf32, channels_last) is None)


def prune_report(family: Family, fp32_precision: str = DEFAULT_FP32_PRECISION) -> dict[str, int]:
    """How many configs each rule removed, plus ``total`` (the axes' product) and ``kept``."""
    profile = check_family(family)
    tf32 = uses_tf32(family.dtype, fp32_precision)
    counts = {rule: 0 for rule in RULES}
    kept = 0
    configs = _product(profile)
    for config in configs:
        rule = _failed_rule(config, family.op, family.dtype, profile, tf32)
        if rule is None:
            kept += 1
        else:
            counts[rule] += 1
    return {"total": len(configs), **counts, "kept": kept}


def validate(family: Family, config: MicroKernel, fp32_precision: str = DEFAULT_FP32_PRECISION) -> None:
    """Raise DietcodeError unless ``config`` belongs to ``family``'s space (under ``fp32_precision``), naming
    the allowed values."""
    profile = check_family(family)
    tf32 = uses_tf32(family.dtype, fp32_precision)
    for name, allowed in axes_for(profile).items():
        value = getattr(config, name)
        if value not in allowed:
            raise DietcodeError(f"{config.key()}: {name}={value} is outside the space; allowed: "
                                f"{', '.join(map(str, allowed))}")
    rule = _failed_rule(config, family.op, family.dtype, profile, tf32)
    if rule is not None:
        precision = f" ({fp32_precision})" if family.dtype == "float32" else ""
        raise DietcodeError(
            f"{config.key()} is pruned from the {family.op}/{family.dtype}/{family.target}{precision} space by rule "
            f"{rule!r} (shared estimate {estimate_shared(config, family.dtype)} B of "
            f"{profile.smem_per_block_optin} B, registers estimate "
            f"{estimate_registers(config, family.dtype, profile.warp_size, family.op)} of {profile.regs_per_thread}, "
            f"{config.threads} threads of {profile.max_threads_per_block}); allowed rules: {', '.join(RULES)}")


# ---- compile-time filter (compiles with tuner.aot; imported lazily, aot imports this module) ----

COMPILE_RULES = ("compile_error", "compiled_shared", "spills")
REFERENCE_CONV = ConvParams(in_channels=64, out_channels=64, kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1))


def representative_epilogue(config: MicroKernel, op: str = "gemm") -> Epilogue:
    """The heaviest epilogue ``config`` admits: bias, gelu and (gemm, conv) the residual. The same for every config
    since split-K takes any epilogue (the last split of a tile applies it); ``config`` stays a parameter so
    that a rule per config has one place to live. The tanh Gelu and SiLU (one exp each) compile within a few
    registers of the erf Gelu, either side (float16 64x64x32, 4 warps, bias + residual, sm_90: 180 erf, 193
    tanh, 193 silu, 192 relu6; sm_80: 243, 245, 237, 220; a 128x128x64 tile that spills under all of them, sm_90:
    9356 spill bytes erf, 12024 tanh, 9440 silu): the filter's verdict under gelu approximates theirs."""
    return Epilogue(bias=True, activation="gelu", residual=op in ("gemm", "conv"))


@dataclass(frozen=True)
class CompiledSpace:
    """The candidates that survived compilation, with their kernels, and what was dropped and why."""

    family: Family
    kept: tuple[tuple[MicroKernel, "CompiledKernel"], ...]
    dropped: tuple[tuple[MicroKernel, str, str], ...]  # (config, rule, detail)
    seconds: float

    def counts(self) -> dict[str, int]:
        counts = {rule: 0 for rule in COMPILE_RULES}
        for _, rule, _ in self.dropped:
            counts[rule] += 1
        return {**counts, "kept": len(self.kept)}


def compile_filter(family: Family, configs: list[MicroKernel] | None = None, *, workers: int | None = None,
                   cache_dir: Path | None = None, conv: ConvParams | None = None,
                   fp32_precision: str = DEFAULT_FP32_PRECISION) -> CompiledSpace:
    """Compile ``configs`` (default: the whole space) with their heaviest epilogue and the pipelined
    (div16) variant, and drop those whose metadata breaks the profile: shared > smem_per_block_optin,
    spills > 0, or a compile error. Conv families compile against ``conv`` (default a 3x3 64->64 layer);
    tile resources do not depend on the layer's geometry. float32 kernels are compiled in ``fp32_precision``."""
    from tuner.aot import CompileJob, aligned_params, compile_many

    profile = check_family(family)
    configs = enumerate_space(family, fp32_precision) if configs is None else configs
    for config in configs:
        validate(family, config, fp32_precision)
    layer = (conv or REFERENCE_CONV) if family.op == "conv" else None
    tf32 = uses_tf32(family.dtype, fp32_precision)
    jobs = [CompileJob(family, c, representative_epilogue(c, family.op), conv=layer,
                       div16=aligned_params(family.op, residual=family.op in ("gemm", "conv")), allow_tf32=tf32,
                       cache_dir=cache_dir)
            for c in configs]
    start = time.perf_counter()
    results = compile_many(jobs, workers)
    kept: list[tuple[MicroKernel, CompiledKernel]] = []
    dropped: list[tuple[MicroKernel, str, str]] = []
    for config, result in zip(configs, results):
        kernel = result.kernel
        if kernel is None:
            dropped.append((config, "compile_error", result.error))
        elif kernel.shared > profile.smem_per_block_optin:
            dropped.append((config, "compiled_shared", f"{kernel.shared} B > {profile.smem_per_block_optin} B"))
        elif kernel.n_spills:
            dropped.append((config, "spills", f"{kernel.n_spills} B spilled ({kernel.n_regs} registers)"))
        else:
            kept.append((config, kernel))
    return CompiledSpace(family, tuple(kept), tuple(dropped), time.perf_counter() - start)


def space_command(target: str, op: str, dtype: str, *, as_json: bool = False, compile_: bool = False,
                  workers: int | None = None, cache_dir: Path | None = None,
                  fp32_precision: str = DEFAULT_FP32_PRECISION) -> int:
    """``dietcode-ort space``: the family's space for people (rich tables) or as JSON.

    Without ``compile_`` the shared bytes are the estimate (``shared_source`` says which); with it every
    candidate is compiled (cached) and ``shared_bytes`` is the compiled kernel's, after the compile filter.
    ``fp32_precision``: the float32 dots' (``FP32_PRECISIONS``; it shapes the float32 spaces only).
    """
    import json

    family = Family(op, dtype, target)
    profile = check_family(family)
    check_fp32_precision(fp32_precision)
    configs = enumerate_space(family, fp32_precision)
    report = prune_report(family, fp32_precision)
    compiled = (compile_filter(family, configs, workers=workers, cache_dir=cache_dir, fp32_precision=fp32_precision)
                if compile_ else None)
    rows = ([(c, k.shared, k.n_regs, k.n_spills, k.mma) for c, k in compiled.kept] if compiled is not None
            else [(c, estimate_shared(c, dtype), estimate_registers(c, dtype, op=op), None, None) for c in configs])
    kinds = {kind: sum(row[4] == kind for row in rows) for kind in sorted({row[4] for row in rows if row[4]})}
    if as_json:
        out: dict[str, object] = {"target": target, "op": op, "dtype": dtype,
               **({"fp32_precision": fp32_precision} if dtype == "float32" else {}), "limits": profile.limits(),
               "axes": {k: list(v) for k, v in axes_for(profile).items()}, "prune": report,
               "shared_source": "compiled" if compiled is not None else "estimate",
               "configs": [{**c.to_dict(), "shared_bytes": shared,
                            **({"n_regs": regs, "n_spills": spills, "mma": mma} if compiled is not None else {})}
                           for c, shared, regs, spills, mma in rows]}
        if compiled is not None:
            out["compile_filter"] = compiled.counts()
            out["mma"] = kinds
            out["compile_seconds"] = round(compiled.seconds, 2)
        print(json.dumps(out, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    precision = f" ({fp32_precision} dots)" if dtype == "float32" else ""
    console.print(f"[bold]{op}/{dtype}{precision} on {target}[/] ({profile.name}): {report['kept']} of {report['total']} "
                  f"configs kept by the profile rules" + (f", {len(rows)} after compiling" if compiled else ""))
    rules = Table("rule", "pruned", title="pruning (a config counts under the first rule it fails)")
    for rule in RULES:
        rules.add_row(rule, str(report[rule]))
    if compiled is not None:
        for rule, count in compiled.counts().items():
            if rule != "kept":
                rules.add_row(f"compiled: {rule}", str(count))
    console.print(rules)
    source = "compiled" if compiled is not None else "estimated"
    columns = ("config", "threads", f"shared B ({source})", f"regs ({source})") + (("MMA",) if compiled else ())
    table = Table(*columns, title=f"{len(rows)} micro-kernels (key: m=BLOCK_M n=BLOCK_N k=BLOCK_K w=warps "
                                  f"s=stages g=group_m k=split_k)")
    for c, shared, regs, _, mma in rows:
        table.add_row(c.key(), str(c.threads), str(shared), str(regs), *((mma,) if compiled else ()))
    console.print(table)
    if compiled is not None:
        console.print("MMA in the compiled PTX: " + ", ".join(f"{kind} {n}" for kind, n in kinds.items()))
    return 0
