"""A study, not wired in: the gemm tile loop reading its operands through TMA tensor descriptors.

``gemm_tma_kernel`` is ``templates.gemm_kernel``'s loop (same tile order, epilogue and output store) with
A and B read by ``tl.make_tensor_descriptor(...).load``: on sm_90 Triton 3.9 lowers those loads to the Tensor
Memory Accelerator (``cp.async.bulk.tensor`` into shared memory, completion on an mbarrier), out-of-bounds
rows and columns zero-filled by the hardware, so the loop needs no masks. It lives in its own module so that
the shipped templates, their hash (which keys the kernel cache and the GPU timings) and their compiled
output are untouched.

It is in no space, bundle or launcher: its kernel needs a launch the runtime does not do (docs/abi.md,
"TMA: not built yet"). Descriptors built on the device are written to global scratch memory, 128 bytes
per descriptor per program (``global_scratch_size`` 256, ``global_scratch_align`` 128 for A and B), which
the launcher must allocate (grid size x 256 bytes) and pass as the kernel's second-to-last parameter,
where today it passes null and ``tuner.aot`` refuses such kernels. TMA also needs every row stride
(K, and N for B) to be a multiple of 16 bytes and 16-byte aligned bases, which the runtime would check per
call as it checks ``div16``.

``run_tma`` launches it through Triton's JIT (the tests run it under ``TRITON_INTERPRET=1`` on CPU
tensors); ``compile_tma`` compiles it ahead of time for a target and returns the facts a launcher would
need, without caching or shipping anything.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from dietcode_ort.errors import DietcodeError
from tuner.templates import _epilogue, _tile_ids, check_epilogue
from tuner.workload import Epilogue

if TYPE_CHECKING:
    import torch

    from tuner.space import Family, MicroKernel

__all__ = ["gemm_tma_kernel", "run_tma", "compile_tma", "TmaCompiled", "TMA_PARAMS", "DESCRIPTOR_BYTES"]

TMA_PARAMS = ("a", "b", "bias", "c", "M", "N", "K")  # the gemm ABI without the residual
DESCRIPTOR_BYTES = 128  # a CUtensorMap (cuda.h: CU_TENSOR_MAP_NUM_QWORDS = 16)


@triton.jit
def gemm_tma_kernel(a, b, bias, c, M, N, K,
                    TRANS_B: tl.constexpr, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[M, N] = act(ALPHA * A[M, K] @ B + bias), A and B read through TMA descriptors made on the device
    (B [K, N], or [N, K] with TRANS_B; row-major, rows 16-byte aligned)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    a_desc = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if TRANS_B:
        b_desc = tl.make_tensor_descriptor(b, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        x = a_desc.load([pid_m * BLOCK_M, k0 * BLOCK_K])
        if TRANS_B:
            y = b_desc.load([pid_n * BLOCK_N, k0 * BLOCK_K]).T
        else:
            y = b_desc.load([k0 * BLOCK_K, pid_n * BLOCK_N])
        acc = tl.dot(x, y, acc, input_precision=DOT_PRECISION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _epilogue(acc, bias, offs_n, N, ALPHA, HAS_BIAS, ACTIVATION)
    offs_c = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(c + offs_c, acc.to(c.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _check(config: "MicroKernel", epilogue: Epilogue) -> None:
    check_epilogue("gemm", epilogue, config.split_k)
    if config.split_k != 1 or epilogue.residual:
        raise DietcodeError("the TMA study kernel has no split-K and no residual (split_k must be 1, "
                            "residual False)")


def _constants(config: "MicroKernel", epilogue: Epilogue, trans_b: bool, tf32: bool) -> dict[str, Any]:
    return dict(TRANS_B=trans_b, ALPHA=float(epilogue.alpha), HAS_BIAS=epilogue.bias,
                ACTIVATION=epilogue.activation, DOT_PRECISION="tf32" if tf32 else "ieee",
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m)


def run_tma(config: "MicroKernel", a: "torch.Tensor", b: "torch.Tensor", *, bias: "torch.Tensor | None" = None,
            epilogue: Epilogue = Epilogue(), trans_b: bool = False) -> "torch.Tensor":
    """Launch ``gemm_tma_kernel`` through Triton's JIT: a [M, K], b [K, N] (or [N, K] with ``trans_b``), contiguous,
    with K (and N when B is [K, N]) a multiple of 16 bytes of elements. On a GPU it installs a torch allocator
    for the descriptors' global scratch."""
    import torch

    _check(config, epilogue)
    if epilogue.bias != (bias is not None):
        raise DietcodeError(f"gemm (TMA): epilogue.bias={epilogue.bias} but bias tensor "
                            f"{'given' if bias is not None else 'missing'}")
    if a.dim() != 2 or b.dim() != 2:
        raise DietcodeError(f"gemm (TMA): expects 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    if (b.shape[1] if trans_b else b.shape[0]) != k:
        raise DietcodeError(f"gemm (TMA): inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    strides = (k,) if trans_b else (k, n)
    if any(s * a.element_size() % 16 for s in strides):
        raise DietcodeError(f"gemm (TMA): row strides {strides} x {a.element_size()} bytes are not multiples of "
                            "16 bytes, which TMA descriptors require")
    if a.is_cuda:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=a.device))
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), 1, 1)
    gemm_tma_kernel[grid](a, b, bias, out, m, n, k, **_constants(config, epilogue, trans_b, False),
                          num_warps=config.num_warps, num_stages=config.num_stages)
    return out


@dataclass(frozen=True)
class TmaCompiled:
    """What compiling the TMA study kernel gave: its PTX and the launch facts a launcher would need."""

    ptx: str
    shared: int
    num_warps: int
    global_scratch_size: int  # bytes per program
    global_scratch_align: int
    params: tuple[str, ...]  # ABI names before the two scratch pointers
    n_regs: int | None
    n_spills: int | None

    @property
    def mma(self) -> str:
        from dietcode_ort.toolchain import ptx_mma

        return ptx_mma(self.ptx)

    def scratch_bytes(self, grid: tuple[int, int, int]) -> int:
        """Global scratch a launch of ``grid`` needs (Triton's launcher: size x programs)."""
        return self.global_scratch_size * math.prod(grid)


def compile_tma(family: "Family", config: "MicroKernel", *, epilogue: Epilogue = Epilogue(),
                trans_b: bool = False, div16: tuple[str, ...] = ("a", "b", "c", "N", "K")) -> TmaCompiled:
    """Compile ``gemm_tma_kernel`` ahead of time for ``family.target`` (not cached, not shipped)."""
    from tuner.aot import _parse_ptxas, _triton_compile
    from tuner.space import check_family

    _check(config, epilogue)
    profile = check_family(family)
    if family.op != "gemm":
        raise DietcodeError(f"the TMA study kernel is a gemm, not {family.op}")
    pointer = "*" + {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[family.dtype]
    constants = _constants(config, epilogue, trans_b, False)
    if not epilogue.bias:
        constants["bias"] = None
    signature = {name: "constexpr" if name in constants else (pointer if name in ("a", "b", "bias", "c") else "i32")
                 for name in gemm_tma_kernel.arg_names}
    fn = gemm_tma_kernel
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16 if name in signature
             and signature[name] != "constexpr"}
    with tempfile.TemporaryDirectory(prefix="dietcode-tma-") as scratch:  # Triton's working files
        compiled, log = _triton_compile(fn, signature, constants, attrs, profile.arch, config.num_warps,
                                        config.num_stages, scratch=Path(scratch))
    md = compiled.metadata
    n_regs, n_spills = _parse_ptxas(log)
    return TmaCompiled(ptx=compiled.asm["ptx"], shared=md.shared, num_warps=md.num_warps,
                       global_scratch_size=md.global_scratch_size, global_scratch_align=md.global_scratch_align,
                       params=tuple(p for p in TMA_PARAMS if signature[p] != "constexpr"), n_regs=n_regs,
                       n_spills=n_spills)
