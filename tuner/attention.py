"""Fused attention: the micro-kernel space of ``templates.attention_kernel`` and its JIT launcher.

One attention computation is ``softmax(Q @ Kt * scale + mask) @ V`` over ``z = batch * heads`` independent
heads, Q ``[z, seq_q, d]``, Kt ``[z, d, seq_k]`` (the second operand of the graph's first MatMul), V
``[z, seq_k, d]``. The template walks the keys ``BLOCK_N`` at a time with an online softmax, so the
``seq_q x seq_k`` scores never reach memory. The head dim ``d`` is a constexpr of the workload (padded to a
power of two, at least 16, inside the kernel); the micro-kernel is ``(BLOCK_M, BLOCK_N, num_warps,
num_stages)``, the same set for every sequence length (DietCode's shape-generic space).

Space axes: BLOCK_M (query rows per program) in {16, 32, 64, 128}, BLOCK_N (keys per step) in
{16, 32, 64, 128}, num_warps in {2, 4, 8}, num_stages in {1, 2, 3}. Pruning rules, like ``tuner.space``'s:
- ``threads``: num_warps * warp_size <= max_threads_per_block;
- ``warp_rows``: each warp owns at least 16 query rows of the MMA (BLOCK_M >= 16 * num_warps / 2), fewer and
  warps duplicate the softmax statistics;
- ``shared_memory``: Q tile + num_stages * (K tile + V tile) in the element type <= smem_per_block_optin;
- ``registers``: fp32 scores BLOCK_M*BLOCK_N + accumulator BLOCK_M*d + the Q fragment, per thread, plus a
  fixed overhead <= regs_per_thread.

These keep 90 of the 144 combinations for float16, d = 64 (sm_80 and sm_90). The estimates are a first cut:
``compile_attention_space`` compiles them and drops those that spill. Measured (Triton 3.9, d = 64, float16,
with a mask): sm_90 keeps 63 with a one-row mask (BERT's), 54 with a per-row mask; sm_80 keeps 54 with a
one-row mask; every other config spills.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dietcode_ort.errors import DietcodeError
from tuner.hardware import HardwareProfile, get_profile

if TYPE_CHECKING:
    import torch

    from tuner.aot import CompileToolchain

__all__ = ["AttentionConfig", "ATTENTION_AXES", "ATTENTION_RULES", "ATTENTION_DTYPES", "block_d",
           "attention_space", "attention_prune_report", "attention_constexprs", "mask_strides", "run_attention",
           "reference_attention", "CompiledAttention", "compile_attention", "AttentionCompileJob",
           "CompiledAttentionSpace",
           "compile_attention_space", "LAYOUT_BITS", "PACKED_QKV", "check_layout", "layout_text", "bshd_layout"]

ATTENTION_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
ATTENTION_AXES: dict[str, tuple[int, ...]] = {
    "block_m": (16, 32, 64, 128),
    "block_n": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
}
ATTENTION_RULES = ("threads", "warp_rows", "shared_memory", "registers")
_REG_OVERHEAD = 40
MAX_HEAD_DIM = 256
# The operands' layouts as a bit set (the node's ``layout`` attribute, the bundle kernel's flags bits 2..5,
# docs/abi.md "attention layouts"): a set bit reads (writes) that operand as [batch, seq, heads, d], the head
# split's Reshape output before its Transpose (K: the keys before the Transpose making Kt); a clear bit the
# contiguous [z, seq, d] (Kt: [z, d, seq_k]). 0 is the default and compiles as before the layouts existed.
# "packed" (with q, k and v): the three are read in place from ONE projection [batch, seq, 3 * heads * d] (the q,
# k, v projections concatenated on the last axis, each head-split): q (b, s, h, j) at ((b * seq + s) * 3 + 0) *
# heads * d + h * d + j, k at part 1, v at part 2; the node takes that tensor as each of its first three inputs.
LAYOUT_BITS = {"q": 1, "k": 2, "v": 4, "out": 8, "packed": 16}
_LAYOUT_CONSTEXPRS = {"q": "Q_BSHD", "k": "K_BSHD", "v": "V_BSHD", "out": "O_BSHD", "packed": "QKV_PACKED"}
PACKED_QKV = LAYOUT_BITS["q"] | LAYOUT_BITS["k"] | LAYOUT_BITS["v"] | LAYOUT_BITS["packed"]


def check_layout(layout: int) -> int:
    """``layout`` if it is a bit set of LAYOUT_BITS (packed only with q, k and v), else DietcodeError."""
    if not isinstance(layout, int) or isinstance(layout, bool) or not 0 <= layout < 32:
        raise DietcodeError(f"attention: layout {layout!r} is not a bit set of {LAYOUT_BITS}")
    if layout & LAYOUT_BITS["packed"] and layout & PACKED_QKV != PACKED_QKV:
        raise DietcodeError(f"attention: layout {layout} is packed without q, k and v all [batch, seq, heads, d]")
    return layout


def layout_text(layout: int) -> str:
    """``q=BSHD,k=BHDS,...``: each operand's layout in words (Kt's contiguous layout is [z, d, seq_k]), and
    ``,packed`` when q, k and v are the parts of one packed projection."""
    check_layout(layout)
    return ",".join(f"{op}={'BSHD' if layout & bit else ('BHDS' if op == 'k' else 'BHSD')}"
                    for op, bit in LAYOUT_BITS.items() if op != "packed") + \
        (",packed" if layout & LAYOUT_BITS["packed"] else "")


def bshd_layout(layout: int, op: str) -> bool:
    return bool(check_layout(layout) & LAYOUT_BITS[op])


@dataclass(frozen=True, order=True)
class AttentionConfig:
    """One attention micro-kernel: query rows and keys per step, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def key(self) -> str:
        """A stable short name, e.g. ``am64n32w4s2``."""
        return f"am{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two of at least 16 (``tl.arange`` and ``tl.dot`` need both)."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise DietcodeError(f"attention: head dim {head_dim} is outside 1..{MAX_HEAD_DIM}")
    return max(16, 1 << (head_dim - 1).bit_length())


def _failed_rule(c: AttentionConfig, dtype: str, head_dim: int, p: HardwareProfile) -> str | None:
    size = ATTENTION_DTYPES[dtype]
    d = block_d(head_dim)
    threads = c.num_warps * p.warp_size
    if threads > p.max_threads_per_block:
        return "threads"
    if c.block_m * 2 < 16 * c.num_warps:
        return "warp_rows"
    if (c.block_m * d + c.num_stages * 2 * c.block_n * d) * size > p.smem_per_block_optin:
        return "shared_memory"
    regs = (c.block_m * c.block_n + c.block_m * d) // threads + -(-c.block_m * d * size // (4 * threads))
    if regs + _REG_OVERHEAD > p.regs_per_thread:
        return "registers"
    return None


def _product() -> list[AttentionConfig]:
    return [AttentionConfig(*values) for values in itertools.product(*ATTENTION_AXES.values())]


def _check(dtype: str, target: str) -> HardwareProfile:
    if dtype not in ATTENTION_DTYPES:
        raise DietcodeError(f"attention: unknown dtype {dtype!r}; allowed: {', '.join(ATTENTION_DTYPES)}")
    return get_profile(target)


def attention_space(dtype: str, target: str, head_dim: int) -> list[AttentionConfig]:
    """Every config of the axes that passes the pruning rules for (dtype, target, head dim), sorted."""
    profile = _check(dtype, target)
    return sorted(c for c in _product() if _failed_rule(c, dtype, head_dim, profile) is None)


def attention_prune_report(dtype: str, target: str, head_dim: int) -> dict[str, int]:
    """How many configs each rule removed, plus ``total`` and ``kept``."""
    profile = _check(dtype, target)
    counts = {rule: 0 for rule in ATTENTION_RULES}
    configs = _product()
    for config in configs:
        rule = _failed_rule(config, dtype, head_dim, profile)
        if rule is not None:
            counts[rule] += 1
    return {"total": len(configs), **counts, "kept": len(configs) - sum(counts.values())}


def attention_constexprs(config: AttentionConfig, head_dim: int, *, scale: float, has_mask: bool,
                         mask_rows: bool = True, causal: bool = False, nan_to_zero: bool = False,
                         dot_precision: str = "ieee", layout: int = 0) -> dict[str, object]:
    """The constexprs of ``attention_kernel`` for one workload and config. ``mask_rows``: the mask varies
    along the queries (False: one row for all, BERT's ``[batch, 1, 1, T_k]``, a cheaper vector load);
    ``layout``: the operands' layouts (LAYOUT_BITS)."""
    check_layout(layout)
    if not math.isfinite(scale):
        raise DietcodeError(f"attention: scale {scale} is not finite")
    return {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "SCALE": float(scale), "HAS_MASK": has_mask,
            "MASK_ROWS": has_mask and mask_rows,
            "CAUSAL": causal, "NAN_TO_ZERO": nan_to_zero, "DOT_PRECISION": dot_precision, "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            **{name: bool(layout & LAYOUT_BITS[op]) for op, name in _LAYOUT_CONSTEXPRS.items()}}


def mask_strides(mask_shape: tuple[int, ...], batch: int, heads: int, seq_q: int,
                 seq_k: int) -> tuple[int, int, int, int]:
    """Element strides (batch, head, query, key) of a contiguous additive mask that ONNX broadcasting
    stretches to ``[batch, heads, seq_q, seq_k]``; 0 for a broadcast axis. A mask of more than four dims,
    or with a dim that is neither 1 nor the full extent, cannot be expressed and is refused."""
    if len(mask_shape) > 4:
        raise DietcodeError(f"attention: mask of rank {len(mask_shape)} has more than 4 dims")
    full = (batch, heads, seq_q, seq_k)
    shape = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    strides = [0, 0, 0, 0]
    step = 1
    for axis in range(3, -1, -1):
        if shape[axis] == full[axis] and full[axis] != 1:
            strides[axis] = step
        elif shape[axis] != 1:
            raise DietcodeError(f"attention: mask shape {list(mask_shape)} does not broadcast to {list(full)}")
        step *= shape[axis]
    return strides[0], strides[1], strides[2], strides[3]


def run_attention(config: AttentionConfig, q: "torch.Tensor", kt: "torch.Tensor", v: "torch.Tensor", *,
                  mask: "torch.Tensor | None" = None, scale: float = 1.0, causal: bool = False,
                  nan_to_zero: bool = False, allow_tf32: bool = False, layout: int = 0,
                  head_dim: int = 0) -> "torch.Tensor":
    """Launch ``attention_kernel`` through Triton's JIT: q [..., T_q, d], kt [..., d, T_k], v [..., T_k, d]
    with equal leading dims (``[batch, heads]`` or one batch dim), ``mask`` broadcastable to
    ``[batch, heads, T_q, T_k]``. Returns ``[..., T_q, d]`` in q's dtype. With ``layout`` bits (LAYOUT_BITS)
    the operands they name are given (and the output returned) as ``[batch, seq, heads, d]`` (K: the keys
    ``[batch, T_k, heads, d]``, not Kt), all of rank 4. With the packed layout, q, kt and v are one contiguous
    packed projection ``[batch, seq, 3 * heads * head_dim]`` (``head_dim`` given)."""
    import torch
    import triton

    from tuner.templates import attention_kernel

    check_layout(layout)
    given = (q, kt, v)
    packed = bool(layout & LAYOUT_BITS["packed"])
    if packed:
        if any(t is not q for t in given) or q.dim() != 3 or head_dim < 1 or q.shape[-1] % (3 * head_dim):
            raise DietcodeError(f"attention: the packed layout takes one [batch, seq, 3 * heads * d] tensor as q, "
                                f"kt and v, got {tuple(q.shape)} with head_dim {head_dim}")
        if not q.is_contiguous():
            raise DietcodeError("attention: the packed projection must be contiguous")
        parts = q.view(q.shape[0], q.shape[1], 3, q.shape[2] // (3 * head_dim), head_dim).unbind(2)
        q, kt, v = parts  # the [batch, seq, heads, d] views the checks below speak of; the kernel reads the tensor
    if layout:
        if any(t.dim() != 4 for t in (q, kt, v)):
            raise DietcodeError(f"attention: layout {layout_text(layout)} needs rank-4 q, k, v")
        # the contiguous views the checks below and the grid speak of; the kernel reads the given tensors
        q = q.transpose(1, 2) if layout & LAYOUT_BITS["q"] else q
        kt = kt.permute(0, 2, 3, 1) if layout & LAYOUT_BITS["k"] else kt
        v = v.transpose(1, 2) if layout & LAYOUT_BITS["v"] else v
    if q.dim() < 3 or kt.dim() != q.dim() or v.dim() != q.dim():
        raise DietcodeError(f"attention: q, kt, v must have one rank >= 3, got {q.dim()}, {kt.dim()}, {v.dim()}")
    lead = tuple(q.shape[:-2])
    seq_q, head_dim = q.shape[-2:]
    seq_k = kt.shape[-1]
    if (tuple(kt.shape) != (*lead, head_dim, seq_k) or tuple(v.shape) != (*lead, seq_k, head_dim)
            or q.dtype != kt.dtype or q.dtype != v.dtype):
        raise DietcodeError(f"attention: shapes/dtypes disagree: q {tuple(q.shape)} {q.dtype}, kt "
                            f"{tuple(kt.shape)} {kt.dtype}, v {tuple(v.shape)} {v.dtype}")
    heads = lead[-1] if len(lead) >= 2 else 1
    z = math.prod(lead)
    batch = z // heads if heads else 0
    out_bshd = bool(layout & LAYOUT_BITS["out"])
    out_shape = (lead[0], seq_q, lead[1], head_dim) if out_bshd else tuple(q.shape)
    if z == 0 or seq_q == 0 or seq_k == 0:  # no keys: an empty softmax times an empty V is 0, as in ONNX
        return q.new_zeros(out_shape)
    out = q.new_empty(out_shape)
    strides = (0, 0, 0, 0)
    if mask is not None:
        mask = mask.contiguous()
        strides = mask_strides(tuple(mask.shape), batch, heads, seq_q, seq_k)
        if seq_q * strides[2] + seq_k * strides[3] >= 2 ** 31:
            raise DietcodeError(f"attention: a mask slice of {seq_q} x {seq_k} needs offsets past int32")
    precision = "tf32" if (q.dtype == torch.float32 and allow_tf32) else "ieee"
    meta = attention_constexprs(config, head_dim, scale=scale, has_mask=mask is not None,
                                mask_rows=strides[2] != 0, causal=causal, nan_to_zero=nan_to_zero,
                                dot_precision=precision, layout=layout)
    grid = (triton.cdiv(seq_q, config.block_m), 1, z)
    q, kt, v = (t.contiguous() for t in given)  # the packed tensor: checked contiguous above, passed thrice
    attention_kernel[grid](q, kt, v, mask, out, seq_q, seq_k, heads,
                           *strides, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def reference_attention(q: "torch.Tensor", kt: "torch.Tensor", v: "torch.Tensor", *,
                        mask: "torch.Tensor | None" = None, scale: float = 1.0, causal: bool = False,
                        nan_to_zero: bool = False) -> "torch.Tensor":
    """The unfused computation in float64 (the tests' reference), returned in q's dtype."""
    import torch

    s = torch.matmul(q.double(), kt.double()) * scale
    if mask is not None:
        s = s + mask.double()
    if causal:
        seq_q, seq_k = s.shape[-2:]
        rows = torch.arange(seq_q)[:, None]
        cols = torch.arange(seq_k)[None, :]
        s = s.masked_fill(cols > rows + (seq_k - seq_q), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if nan_to_zero:
        p = torch.where(torch.isnan(p), 0.0, p)
    return torch.matmul(p, v.double()).to(q.dtype)


@dataclass(frozen=True)
class CompiledAttention:
    """One attention micro-kernel compiled ahead of time: the artifacts and launch facts (grid
    ``(cdiv(seq_q, BLOCK_M), 1, batch * heads)``, ``num_warps * 32`` threads, ``shared`` dynamic bytes)."""

    name: str
    arch: int
    cubin: bytes
    ptx: str
    params: tuple[str, ...]  # runtime parameters in order (templates.ATTENTION_PARAMS less the constexpr mask)
    num_warps: int
    shared: int
    n_regs: int | None
    n_spills: int | None
    config: AttentionConfig
    constants: tuple[tuple[str, object], ...]
    dtype: str
    triton_version: str = ""
    ptxas_version: str = ""
    ptx_isa: int = 0
    cubin_min_driver: int = 0
    ptx_min_driver: int = 0
    split_k: int = 1  # the launch facts BundleKernel.from_compiled reads
    div16: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (the kernel cache's record; the cubin as base64)."""
        data = asdict(self)
        data["cubin"] = base64.b64encode(self.cubin).decode("ascii")
        data["constants"] = [list(item) for item in self.constants]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "CompiledAttention":
        n_regs, n_spills = data["n_regs"], data["n_spills"]
        return cls(name=str(data["name"]), arch=int(data["arch"]), cubin=base64.b64decode(data["cubin"]),
                   ptx=str(data["ptx"]), params=tuple(data["params"]), num_warps=int(data["num_warps"]),
                   shared=int(data["shared"]), n_regs=None if n_regs is None else int(n_regs),
                   n_spills=None if n_spills is None else int(n_spills), config=AttentionConfig(**data["config"]),
                   constants=tuple((str(k), v) for k, v in data["constants"]), dtype=str(data["dtype"]),
                   triton_version=str(data["triton_version"]), ptxas_version=str(data["ptxas_version"]),
                   ptx_isa=int(data["ptx_isa"]), cubin_min_driver=int(data["cubin_min_driver"]),
                   ptx_min_driver=int(data["ptx_min_driver"]), split_k=int(data["split_k"]),
                   div16=tuple(data["div16"]))

    @property
    def block_m(self) -> int:
        return self.config.block_m

    @property
    def block_n(self) -> int:
        return self.config.block_n


def compile_attention(config: AttentionConfig, dtype: str, target: str, head_dim: int, *, scale: float,
                      has_mask: bool, mask_rows: bool = True, causal: bool = False, nan_to_zero: bool = False,
                      toolchain: "CompileToolchain | None" = None, allow_tf32: bool = False,
                      layout: int = 0, aligned: bool = True, cache_dir: "Path | None" = None) -> CompiledAttention:
    """Compile ``attention_kernel`` with ``config`` for ``target`` through tuner.aot's compiler (no GPU
    needed); ``allow_tf32``: a float32 kernel's two dots in TF32 (tuner.aot's precision). ``aligned``: Q, K, V
    and the output assumed 16-byte aligned (``aot.aligned_params("attention")``, the kernel's ``div16``, which
    the runtime checks per call), which lets Triton vectorize the operand loads and pipeline them (cp.async);
    without it every load is one element, in registers. A config outside the pruned space, a kernel needing scratch memory or launch features beyond a
    plain launch, and a toolchain whose artifacts the chosen driver cannot load are refused. ``cache_dir``: the
    kernel cache folder (optimize's ``--cache-dir``) to answer from and store in, as tuner.aot's GEMM kernels
    (``attention_cache_key``); None compiles every time."""
    import triton

    from tuner import aot, templates

    profile = _check(dtype, target)
    if config not in attention_space(dtype, target, head_dim):
        raise DietcodeError(f"attention {config.key()} is not in the {dtype}/{target}/d={head_dim} space "
                            f"(rules: {', '.join(ATTENTION_RULES)})")
    chain = toolchain or aot.CompileToolchain()
    chain.check()
    if allow_tf32 and dtype != "float32":
        raise DietcodeError(f"allow_tf32 applies to float32 only, not {dtype}")
    constants: dict[str, object] = attention_constexprs(config, head_dim, scale=scale, has_mask=has_mask,
                                                         mask_rows=mask_rows, causal=causal,
                                                         nan_to_zero=nan_to_zero,
                                                         dot_precision="tf32" if allow_tf32 else "ieee", layout=layout)
    if not has_mask:
        constants["mask"] = None
    pointer = "*" + {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
    fn = templates.attention_kernel
    signature = {name: "constexpr" if name in constants else pointer if name in ("q", "k", "v", "mask", "out")
                 else "i32" for name in fn.arg_names}
    div16 = aot.aligned_params("attention") if aligned else ()
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{attention_cache_key(config, dtype, target, head_dim, constants, div16, chain)}.json"
        cached = aot.read_record(path, "attention", CompiledAttention.from_dict,
                                 lambda k: k.config == config and bool(k.cubin) and bool(k.ptx))
        if cached is not None:
            return cached
    compiled, log = aot._triton_compile(fn, signature, constants, div16, profile.arch, config.num_warps,
                                        config.num_stages, toolchain=chain)
    md = compiled.metadata
    what = f"attention {config.key()} for {target}"
    if md.global_scratch_size > 0 or md.profile_scratch_size > 0:
        raise DietcodeError(f"{what} needs scratch memory; the runtime passes null scratch pointers")
    unsupported = aot.launch_features(md)
    if unsupported:
        raise DietcodeError(f"{what} needs {', '.join(unsupported)}, beyond a plain cuLaunchKernel")
    facts = aot._toolchain_facts(profile.arch, compiled.asm["ptx"], chain, what)
    n_regs, n_spills = aot._parse_ptxas(log)
    params = tuple(p for p in templates.ATTENTION_PARAMS if signature[p] != "constexpr")
    kernel = CompiledAttention(md.name, profile.arch, compiled.asm["cubin"], compiled.asm["ptx"], params,
                               md.num_warps, md.shared, n_regs, n_spills, config,
                               tuple(sorted((k, v) for k, v in constants.items() if k != "mask")), dtype,
                               triton_version=triton.__version__, div16=tuple(div16), **facts)
    if path is not None:
        aot.write_record(path, "attention", kernel.to_dict())
    return kernel


def attention_cache_key(config: AttentionConfig, dtype: str, target: str, head_dim: int,
                        constants: dict[str, object], div16: Sequence[str], toolchain: "CompileToolchain") -> str:
    """sha256 over everything that changes a compiled attention kernel (``aot.cache_key``'s counterpart): the
    record format, Triton, the templates' source, dtype, target, head dim, config, every constexpr (scale, mask
    form, causal, layout, dot precision), the aligned params and the toolchain (ptxas and the PTX ISA cap)."""
    import triton

    from dietcode_ort import toolchain as tc
    from tuner import aot

    ptxas = aot._ptxas_for(_check(dtype, target).arch, toolchain)
    payload = {"format": aot._FORMAT, "kernel": "attention", "triton": triton.__version__,
               "templates": aot.template_hash(), "dtype": dtype, "target": target, "head_dim": head_dim,
               "config": config.key(), "constants": sorted((k, repr(v)) for k, v in constants.items()),
               "div16": sorted(div16), "ptx_cap": tc.max_ptx_isa(toolchain.min_driver),
               "ptxas": [ptxas, tc.ptxas_version(ptxas)]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class AttentionCompileJob:
    """The arguments of one ``compile_attention`` call as a job an executor runs (tuner/executor.py: this
    machine's compile pool, or a Ray CPU task), beside tuner.aot's GEMM ``CompileJob``: ``aot._run_job`` calls
    ``compile()`` and records a failure as a ``CompileResult`` error."""

    config: AttentionConfig
    dtype: str
    target: str
    head_dim: int
    scale: float
    has_mask: bool
    mask_rows: bool = True
    causal: bool = False
    nan_to_zero: bool = False
    toolchain: "CompileToolchain | None" = None
    allow_tf32: bool = False
    layout: int = 0  # LAYOUT_BITS
    aligned: bool = True  # Q, K, V and the output assumed 16-byte aligned (compile_attention)
    cache_dir: "Path | None" = None  # the kernel cache (compile_attention); None: no cache

    def compile(self) -> CompiledAttention:
        return compile_attention(self.config, self.dtype, self.target, self.head_dim, scale=self.scale,
                                 has_mask=self.has_mask, mask_rows=self.mask_rows, causal=self.causal,
                                 nan_to_zero=self.nan_to_zero, toolchain=self.toolchain, allow_tf32=self.allow_tf32,
                                 layout=self.layout, aligned=self.aligned, cache_dir=self.cache_dir)


@dataclass(frozen=True)
class CompiledAttentionSpace:
    """The attention configs that compiled within the target's limits, and those dropped with the reason."""

    kept: tuple[CompiledAttention, ...]
    dropped: tuple[tuple[AttentionConfig, str], ...]  # (config, "spills ..." | "shared ..." | "compile error ...")


def compile_attention_space(dtype: str, target: str, head_dim: int, *, has_mask: bool = True,
                            mask_rows: bool = False, configs: list[AttentionConfig] | None = None,
                            toolchain: "CompileToolchain | None" = None) -> CompiledAttentionSpace:
    """Compile ``configs`` (default: the whole pruned space) with the given mask form and keep those whose
    real metadata fits the target: no register spills, shared memory within smem_per_block_optin (the
    estimate-based rules above are only a first cut: the per-row mask tile, for one, costs registers they do
    not count). The scale does not change the resources, so 1.0 stands for every scale."""
    profile = _check(dtype, target)
    kept: list[CompiledAttention] = []
    dropped: list[tuple[AttentionConfig, str]] = []
    for config in attention_space(dtype, target, head_dim) if configs is None else configs:
        try:
            kernel = compile_attention(config, dtype, target, head_dim, scale=1.0, has_mask=has_mask,
                                       mask_rows=mask_rows, toolchain=toolchain)
        except DietcodeError as exc:
            dropped.append((config, f"compile error: {exc}"))
            continue
        if kernel.n_spills:
            dropped.append((config, f"spills {kernel.n_spills} B ({kernel.n_regs} registers)"))
        elif kernel.shared > profile.smem_per_block_optin:
            dropped.append((config, f"shared {kernel.shared} B > {profile.smem_per_block_optin} B"))
        else:
            kept.append(kernel)
    return CompiledAttentionSpace(tuple(kept), tuple(dropped))
