"""Triton micro-kernel templates (GEMM, batched GEMM, NCHW Conv2d, grouped too, as implicit GEMM) and a JIT launcher.

Each template computes one BLOCK_M x BLOCK_N tile of C per program and is run once per tile to cover any
shape: this is DietCode's micro-kernel. Every load past a tensor edge is masked with ``other=0`` and every
store is masked, so no shape needs padding. Accumulation is fp32; the output has the input dtype.

Kernel parameters follow the shared kernel ABI (see ``ABI_PARAMS``): pointers ``a, b, [bias], c`` then int32
scalars (the gemm and conv templates then take the ``residual`` pointer, added to the ABI later), and split-K
kernels last the fp32 ``workspace`` (``workspace_bytes`` sizes it) and the int32 ``counters``;
everything else (transposition, the scale ``ALPHA``, activation, tile sizes, conv geometry) is a
``tl.constexpr``. The epilogue is, in this order: ``out = act(ALPHA * acc + bias) + residual``, or with
``RESIDUAL_FIRST`` ``out = act(ALPHA * acc + bias + residual)`` (ResNet's Conv -> Add -> Relu), or with
``RESIDUAL_MUL`` ``out = act(ALPHA * acc + bias) * residual`` (LLaMA's SwiGLU gate: the same residual pointer,
multiplied).
The grid is ``(ceil(M/BLOCK_M) * ceil(N/BLOCK_N), SPLIT_K, batch)``, except for a PERSISTENT gemm or bmm kernel
(SPLIT_K 1): ``(min(tiles x batch, SMs x n), 1, 1)`` programs (``programs``; n per SM, from the bundle), each
looping over tiles pid, pid + num_programs, ... in the same grouped order. With SPLIT_K > 1 program
(tile, s, z) sums every SPLIT_K-th BLOCK_K slice of K from slice s (a split whose slices all lie past K sums
zeros) and the splits of a tile meet in the ``workspace`` (``_split_k_reduce``): each stores its fp32
partial tile there, and the split that arrives last adds the partials in split order 0..SPLIT_K-1 and
applies the whole epilogue, so any epilogue works and the result is the same bit for bit from run to run.

``run`` launches a template through Triton's ordinary JIT path: the tests use it under
``TRITON_INTERPRET=1`` on torch CPU tensors and the GPU tests on CUDA tensors (the GPU measurer times the
AOT cubins instead: ``tuner.gpu_timing``). ``tuner.aot`` compiles the same functions ahead of time.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from dietcode_ort.bundle import CONV_FIELDS
from dietcode_ort.errors import DietcodeError
from tuner.workload import ACTIVATIONS, ConvParams, Epilogue

if TYPE_CHECKING:  # torch is only needed by callers that launch
    import torch

    from tuner.space import MicroKernel

__all__ = ["gemm_kernel", "bmm_kernel", "conv_kernel", "attention_kernel", "KERNELS", "ABI_PARAMS", "ATTENTION_PARAMS", "kernel_for", "conv_geometry",
           "conv_out_size", "run", "check_epilogue", "workspace_bytes", "WORKSPACE_ALIGN", "programs"]


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, pid=None):
    """Map tile index ``pid`` (default program_id(0)) to a (tile row, tile col) pair, GROUP_M tile rows at a
    time (L2 reuse)."""
    if pid is None:
        pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, bias, offs_n, N, residual, offs_c, c_mask, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr,
              ACTIVATION: tl.constexpr, RESIDUAL_FIRST: tl.constexpr):
    """Scale by ALPHA, add the bias (broadcast along N), with RESIDUAL_FIRST the residual (laid out as C, at
    ``offs_c``), and apply the activation."""
    if ALPHA != 1.0:
        acc = acc * ALPHA
    if HAS_BIAS:
        bias_v = tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias_v[None, :]
    if RESIDUAL_FIRST:
        acc = acc + tl.load(residual + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    if ACTIVATION == "relu":  # NaN stays NaN, as onnxruntime's Relu on both EPs (max.NaN, not max)
        acc = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        acc = acc / (1.0 + tl.exp(-1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)))
    elif ACTIVATION == "silu":  # x sigmoid(x); exp overflows to inf for x < -88: x / inf = -0
        acc = acc / (1.0 + tl.exp(-acc))
    elif ACTIVATION == "relu6":  # Clip(0, 6): NaN stays NaN here too
        acc = tl.minimum(tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL), 6.0,
                         propagate_nan=tl.PropagateNan.ALL)
    return acc


@triton.jit
def _split_k_reduce(acc, workspace, counters, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPLIT_K: tl.constexpr):
    """Meet the other splits of this program's tile in the workspace; returns (sum, last).

    Workspace layout (fp32 elements; dc_kernel_workspace_bytes sizes it): the partial tile of (z, tile, split)
    at ((z * tiles + tile) * SPLIT_K + split) * BLOCK_M * BLOCK_N, row-major. ``counters``: one int32 per
    (z, tile) at z * tiles + tile, zero at the launch: the launcher keeps them per stream and zeroes them once
    (docs/abi.md, "The split-K counters"), since every launch leaves them at zero. Each split
    stores its partial, waits for its CTA's stores (barrier), and one thread adds 1 to the tile's counter
    (acq_rel, gpu scope: releases the CTA's partial, acquires the partials of the splits counted before).
    The split that reads SPLIT_K - 1 is the last: it sums the partials in split order, all read back from the
    workspace past L1 (which may hold stale lines), so the sum does not depend on which split came last, and
    puts the counter back to 0. ``last`` is False for every other split. Its own partial is read back too
    (from L2, just written) rather than kept in registers: the accumulator's MMA layout would be converted
    through shared memory for every split added, and both would stay live (sm_80 fp16, gelu + residual: a
    64x64 split-4 tile needs 128 registers and 11 barriers this way, 196 and 49 with its own in registers;
    16x128 split 8, 168 against 255 and 408 bytes of spills)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    split = tl.program_id(1)
    tile = tl.program_id(2).to(tl.int64) * tiles + tl.program_id(0)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = workspace + tile * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(base + split * (BLOCK_M * BLOCK_N) + offs, acc)
    tl.debug_barrier()
    counter = counters + tile
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLIT_K):
            total += tl.load(base + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
        tl.store(counter, 0)
    return total, last


@triton.jit
def _finish(acc, bias, c_ptrs, residual, offs_c, offs_n, N, c_mask, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr,
            ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr = False,
            RESIDUAL_MUL: tl.constexpr = False):
    """The epilogue on the full sum and the store of C in its dtype. The residual (a full tensor laid out as
    C) is added after the activation, or before it with RESIDUAL_FIRST, or with RESIDUAL_MUL multiplies the
    activation's result (LLaMA's SwiGLU gate: silu(x @ Wg) * up)."""
    acc = _epilogue(acc, bias, offs_n, N, residual, offs_c, c_mask, ALPHA, HAS_BIAS, ACTIVATION,
                    HAS_RESIDUAL and RESIDUAL_FIRST)
    if HAS_RESIDUAL and RESIDUAL_MUL:
        acc = acc * tl.load(residual + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    elif HAS_RESIDUAL and not RESIDUAL_FIRST:
        acc = acc + tl.load(residual + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptrs.dtype.element_ty), mask=c_mask)


@triton.jit
def _tma_descs(a_base, b_base, M, N, K, TRANS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """Tensor descriptors of A [M, K] and B ([K, N], or [N, K] when TRANS_B) made on the device
    (``tl.make_tensor_descriptor``). They live in the kernel's global scratch (128 bytes each per program,
    which the launcher passes). TMA needs both bases 16-byte aligned and every row stride (K, and N for a
    [K, N] B) a multiple of 16 bytes: the kernels are compiled with div16 on a, b, K and N, which the runtime
    checks per call."""
    a_desc = tl.make_tensor_descriptor(a_base, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if TRANS_B:
        b_desc = tl.make_tensor_descriptor(b_base, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_base, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    return a_desc, b_desc


@triton.jit
def _tma_loop(a_desc, b_desc, K, pid_m, pid_n, pid_k, TRANS_B: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K loop of one tile with A and B read through tensor descriptors (``_tma_descs``): on sm_90 each load
    is a Tensor Memory Accelerator copy into shared memory (``cp.async.bulk.tensor``, completed on an
    mbarrier), and the hardware zero-fills rows and columns past the operand's edge, so the loop has no masks;
    split s reads its slices (k0 * SPLIT_K + s) * BLOCK_K, a slice past K reading zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K * SPLIT_K)):
        k = (k0 * SPLIT_K + pid_k) * BLOCK_K
        x = a_desc.load([pid_m * BLOCK_M, k])
        if TRANS_B:
            y = b_desc.load([pid_n * BLOCK_N, k]).T
        else:
            y = b_desc.load([k, pid_n * BLOCK_N])
        acc = tl.dot(x, y, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _matmul_tile(a_base, b_base, bias, c_base, residual, workspace, counters, M, N, K, tile, pid_k, a_desc, b_desc,
                 TRANS_B: tl.constexpr, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr,
                 RESIDUAL_FIRST: tl.constexpr = False, RESIDUAL_MUL: tl.constexpr = False):
    """C tile ``tile`` (in the grouped order of ``_tile_ids``), split ``pid_k``, of A[M, K] @ B (B [K, N], or
    [N, K] when TRANS_B), contiguous row-major views. Row offsets are int64 (once per tile), so an operand may
    hold 2^31 elements or more (e.g. a 65536 x 50257 LM head). With USE_TMA the operands are read through the
    tensor descriptors ``a_desc`` and ``b_desc`` (``_tma_descs``; unused otherwise)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M, tile)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_TMA:
        acc = _tma_loop(a_desc, b_desc, K, pid_m, pid_n, pid_k, TRANS_B, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                        SPLIT_K)
    else:
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        a_ptrs = a_base + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
        if TRANS_B:
            b_ptrs = b_base + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
            b_step = BLOCK_K * SPLIT_K
        else:
            b_ptrs = b_base + offs_k[:, None].to(tl.int64) * N + offs_n[None, :]
            b_step = tl.cast(N, tl.int64) * (BLOCK_K * SPLIT_K)  # tl.cast: N may be specialized as a constexpr
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K * SPLIT_K)):
            k_left = K - k0 * BLOCK_K * SPLIT_K
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * SPLIT_K
            b_ptrs += b_step
    offs_c = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K > 1:
        acc, last = _split_k_reduce(acc, workspace, counters, M, N, BLOCK_M, BLOCK_N, SPLIT_K)
        if last:
            _finish(acc, bias, c_base + offs_c, residual, offs_c, offs_n, N, c_mask, ALPHA, HAS_BIAS, ACTIVATION,
                    HAS_RESIDUAL, RESIDUAL_FIRST, RESIDUAL_MUL)
    else:
        _finish(acc, bias, c_base + offs_c, residual, offs_c, offs_n, N, c_mask, ALPHA, HAS_BIAS, ACTIVATION,
                HAS_RESIDUAL, RESIDUAL_FIRST, RESIDUAL_MUL)


@triton.jit
def gemm_kernel(a, b, bias, c, M, N, K, residual, workspace, counters,
                TRANS_B: tl.constexpr, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr = False,
                PERSISTENT: tl.constexpr = False, RESIDUAL_FIRST: tl.constexpr = False,
                RESIDUAL_MUL: tl.constexpr = False):
    """C[M, N] = act(ALPHA * A[M, K] @ B + bias) + residual[M, N], with RESIDUAL_FIRST act(ALPHA * A[M, K] @ B
    + bias + residual[M, N]), with RESIDUAL_MUL act(ALPHA * A[M, K] @ B + bias) * residual[M, N]. PERSISTENT (SPLIT_K 1): each program
    computes tiles program_id(0), + num_programs(0), ... of the grouped order, for any grid size; a TMA
    program makes its descriptors once."""
    a_desc = a
    b_desc = b
    if USE_TMA:
        a_desc, b_desc = _tma_descs(a, b, M, N, K, TRANS_B, BLOCK_M, BLOCK_N, BLOCK_K)
    if PERSISTENT:
        tl.static_assert(SPLIT_K == 1, "persistent kernels take no split-K")
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _matmul_tile(a, b, bias, c, residual, workspace, counters, M, N, K, tile, 0, a_desc, b_desc, TRANS_B, ALPHA,
                         HAS_BIAS, ACTIVATION, HAS_RESIDUAL, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                         SPLIT_K, USE_TMA, RESIDUAL_FIRST, RESIDUAL_MUL)
    else:
        _matmul_tile(a, b, bias, c, residual, workspace, counters, M, N, K, tl.program_id(0), tl.program_id(1), a_desc,
                     b_desc, TRANS_B, ALPHA, HAS_BIAS, ACTIVATION, HAS_RESIDUAL, DOT_PRECISION, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M, SPLIT_K, USE_TMA, RESIDUAL_FIRST, RESIDUAL_MUL)


@triton.jit
def _bmm_tile(a, b, bias, c, M, N, K, stride_a_batch, stride_b_batch, workspace, counters, z, tile, pid_k,
              TRANS_B: tl.constexpr, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr):
    """Tile ``tile`` of matrix ``z`` (int64); with USE_TMA the descriptors are made from the matrices' bases."""
    a_base = a + z * stride_a_batch
    b_base = b + z * stride_b_batch
    a_desc = a_base
    b_desc = b_base
    if USE_TMA:
        a_desc, b_desc = _tma_descs(a_base, b_base, M, N, K, TRANS_B, BLOCK_M, BLOCK_N, BLOCK_K)
    _matmul_tile(a_base, b_base, bias, c + z * M * N, c, workspace, counters, M, N, K, tile, pid_k, a_desc, b_desc, TRANS_B,
                 ALPHA, HAS_BIAS, ACTIVATION, False, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K,
                 USE_TMA)


@triton.jit
def bmm_kernel(a, b, bias, c, M, N, K, batch, stride_a_batch, stride_b_batch, workspace, counters,
               TRANS_B: tl.constexpr, ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr = False,
               PERSISTENT: tl.constexpr = False):
    """C[z] = act(ALPHA * A[z] @ B[z] + bias) for z = program_id(2); a batch stride of 0 broadcasts an
    operand (attention's scores: ALPHA = 1/sqrt(head_dim)). With USE_TMA each program makes its descriptors
    from its matrices' bases (the batch strides div16 keep them 16-byte aligned). PERSISTENT (SPLIT_K 1, grid
    z 1): each program computes tiles program_id(0), + num_programs(0), ... of the BATCH x tiles sequence,
    matrix by matrix (``batch``: the batch size, the ABI param; the AOT compile of a non-persistent kernel makes
    it the constexpr 1, so that kernel takes no such parameter)."""
    if PERSISTENT:
        tl.static_assert(SPLIT_K == 1, "persistent kernels take no split-K")
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for t in range(tl.program_id(0), tiles * batch, tl.num_programs(0)):
            _bmm_tile(a, b, bias, c, M, N, K, stride_a_batch, stride_b_batch, workspace, counters, (t // tiles).to(tl.int64),
                      t % tiles, 0, TRANS_B, ALPHA, HAS_BIAS, ACTIVATION, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                      GROUP_M, SPLIT_K, USE_TMA)
    else:
        _bmm_tile(a, b, bias, c, M, N, K, stride_a_batch, stride_b_batch, workspace, counters, tl.program_id(2).to(tl.int64),
                  tl.program_id(0), tl.program_id(1), TRANS_B, ALPHA, HAS_BIAS, ACTIVATION, DOT_PRECISION, BLOCK_M,
                  BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, USE_TMA)


@triton.jit
def conv_kernel(a, b, bias, c, M, N, K, img_h, img_w, out_h, out_w, residual, workspace, counters,
                CHANNELS: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr = False,
                RESIDUAL_FIRST: tl.constexpr = False, RESIDUAL_MUL: tl.constexpr = False,
                CHANNELS_LAST: tl.constexpr = False):
    """Y = act(conv2d(X, W) + bias) + residual, with RESIDUAL_FIRST act(conv2d(X, W) + bias + residual) (ResNet's
    Conv -> Add(shortcut) -> Relu), with RESIDUAL_MUL act(conv2d(X, W) + bias) * residual, NCHW, as implicit
    GEMM: rows (n, oh, ow), cols oc, reduction (c, kh, kw). X [img_n, CHANNELS, img_h, img_w], Y and the
    residual [img_n, OC, out_h, out_w] (the residual read at Y's offsets).

    A grouped conv (ONNX ``group`` G) is G independent implicit GEMMs, one per grid z = program_id(2): the grid's
    z extent is G (the ABI's batch), N = OC / G and K = (CHANNELS / G) * KH * KW are one group's, W is
    [OC, CHANNELS / G, KH, KW] and group z reads input channels z * CHANNELS / G on, W's rows, the bias and Y's
    channels z * N on. With G = 1 (grid z 1) this is the ungrouped conv.

    CHANNELS_LAST (ungrouped only, grid z 1): X is NHWC [img_n, img_h, img_w, CHANNELS], W [OC, KH, KW,
    CHANNELS], Y and the residual NHWC [img_n, out_h, out_w, OC] (Y is then the GEMM's row-major [M, N]); the
    reduction runs (kh, kw, c), so a K slice is a run of channels of one input pixel: contiguous, and with
    CHANNELS a multiple of BLOCK_K (a whole slice in one (kh, kw)) one bounds predicate per row, so Triton loads
    it in 16-byte vectors (cp.async) where NCHW gathers element by element. The row's pixel is int64, the rest
    int32 (the launcher keeps X per image below 2^31)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    # the group: its first input channel (K / (KH * KW) channels per group), W rows and output channels (a
    # channels-last conv is ungrouped, and its pointers keep their known alignment)
    z = tl.program_id(2).to(tl.int64)
    groups = tl.num_programs(2)
    if not CHANNELS_LAST:
        a += z * (K // (KH * KW)) * img_h * img_w
        b += z * N * K
        if HAS_BIAS:
            bias += z * N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    hw_out = out_h * out_w
    img = offs_m // hw_out
    pix = offs_m % hw_out
    ih0 = (pix // out_w) * STRIDE_H - PAD_H
    iw0 = (pix % out_w) * STRIDE_W - PAD_W
    # X offset of (row, col) = row_base + col_off: per-row and per-column parts, added once per tile; channels-last,
    # the row's window origin as a pixel (maybe outside the image: only offsets inside it are loaded) times C
    if CHANNELS_LAST:
        row_base = ((img.to(tl.int64) * img_h + ih0) * img_w + iw0) * CHANNELS
    else:
        row_base = img.to(tl.int64) * (CHANNELS * img_h * img_w) + ih0 * img_w + iw0
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K * SPLIT_K)):
        k_first = (k0 * SPLIT_K + pid_k) * BLOCK_K
        offs_k = k_first + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if CHANNELS_LAST and CHANNELS % BLOCK_K == 0:
            # the slice lies in one (kh, kw): its window offset and bounds test are scalars, the load's predicate
            # the row's alone (constant along K), so Triton loads it in vectors
            kr = k_first // CHANNELS
            dh = (kr // KW) * DIL_H
            dw = (kr % KW) * DIL_W
            # k_first % CHANNELS, written so that Triton 3.6 too proves it a multiple of BLOCK_K (its alignment
            # analysis knows nothing of a remainder, and without it the slice loads one element at a time)
            cs = (k_first - kr * CHANNELS) + tl.arange(0, BLOCK_K)
            ih = (ih0 + dh).to(tl.uint32, bitcast=True)
            iw = (iw0 + dw).to(tl.uint32, bitcast=True)
            rows = tl.where(k_first < K, M, 0)  # a slice past K (split-K's last) loads nothing
            row_ok = (offs_m < rows) & (ih < img_h.to(tl.uint32)) & (iw < img_w.to(tl.uint32))
            x = tl.load(a + (row_base + (dh * img_w + dw) * CHANNELS)[:, None] + cs[None, :],
                        mask=tl.broadcast_to(row_ok[:, None], (BLOCK_M, BLOCK_K)), other=0.0)
        else:
            if CHANNELS_LAST:  # reduction (kh, kw, c): each element finds its own window offset
                kr = offs_k // CHANNELS
                dh = (kr // KW) * DIL_H
                dw = (kr % KW) * DIL_W
                col_off = (dh * img_w + dw) * CHANNELS + offs_k % CHANNELS
            else:  # reduction (c, kh, kw)
                kr = offs_k % (KH * KW)
                dh = (kr // KW) * DIL_H
                dw = (kr % KW) * DIL_W
                col_off = (offs_k // (KH * KW)) * (img_h * img_w) + dh * img_w + dw
            # 0 <= ih < img_h as one unsigned compare (a negative ih wraps to a large value).
            ih = (ih0[:, None] + dh[None, :]).to(tl.uint32, bitcast=True)
            iw = (iw0[:, None] + dw[None, :]).to(tl.uint32, bitcast=True)
            x_ok = m_ok[:, None] & k_ok[None, :] & (ih < img_h.to(tl.uint32)) & (iw < img_w.to(tl.uint32))
            x = tl.load(a + row_base[:, None] + col_off[None, :], mask=x_ok, other=0.0)
        w = tl.load(b + offs_n[None, :] * K + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    y_mask = m_ok[:, None] & n_ok[None, :]
    if CHANNELS_LAST:  # Y is the row-major [M, N]
        offs_y = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    else:
        offs_y = (img.to(tl.int64) * (N * groups) * hw_out + z * N * hw_out + pix)[:, None] + (offs_n * hw_out)[None, :]
    if SPLIT_K > 1:
        acc, last = _split_k_reduce(acc, workspace, counters, M, N, BLOCK_M, BLOCK_N, SPLIT_K)
        if last:
            _finish(acc, bias, c + offs_y, residual, offs_y, offs_n, N, y_mask, 1.0, HAS_BIAS, ACTIVATION,
                    HAS_RESIDUAL, RESIDUAL_FIRST, RESIDUAL_MUL)
    else:
        _finish(acc, bias, c + offs_y, residual, offs_y, offs_n, N, y_mask, 1.0, HAS_BIAS, ACTIVATION,
                HAS_RESIDUAL, RESIDUAL_FIRST, RESIDUAL_MUL)


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): attention_kernel keeps its scores in base 2, for exp2


@triton.jit
def attention_kernel(q, k, v, mask, out, seq_q, seq_k, heads,
                     stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SCALE: tl.constexpr,
                     HAS_MASK: tl.constexpr, MASK_ROWS: tl.constexpr, CAUSAL: tl.constexpr,
                     NAN_TO_ZERO: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     Q_BSHD: tl.constexpr, K_BSHD: tl.constexpr, V_BSHD: tl.constexpr, O_BSHD: tl.constexpr,
                     QKV_PACKED: tl.constexpr = False):
    """out[z] = softmax(Q[z] @ Kt[z] * SCALE + mask) @ V[z], flash style, for z = program_id(2) and the
    query rows of tile program_id(0). Q [z, seq_q, HEAD_DIM], Kt [z, HEAD_DIM, seq_k] (the MatMul's second
    operand as the graph has it), V [z, seq_k, HEAD_DIM], out like Q, all contiguous; z = batch * heads. The
    additive mask is read at (z // heads) * stride_mask_b + (z % heads) * stride_mask_h + row * stride_mask_q
    + col * stride_mask_k (a stride of 0 broadcasts that axis; the last two terms in int32, so the caller
    keeps seq_q * stride_mask_q + seq_k * stride_mask_k below 2^31). Without MASK_ROWS the mask is one row
    for every query (stride_mask_q must be 0), loaded as a vector over the keys. Online softmax with fp32
    statistics and accumulator (one pass over the keys, BLOCK_N at a time), in base 2: the scores are (Q Kt *
    SCALE + mask) * log2(e), one multiply-add each, and exp2 stands for exp (the same softmax); CAUSAL drops keys
    col > row + seq_k - seq_q. A row with no finite score (every key masked with -inf) is NaN, as ONNX Softmax
    gives, or 0 with NAN_TO_ZERO (torch's export: Where(IsNaN(P), 0, P)).

    Layouts (docs/abi.md "attention layouts"): Q_BSHD reads Q as [batch, seq_q, heads, HEAD_DIM] (the head
    split's Reshape output before its Transpose), K_BSHD reads K as [batch, seq_k, heads, HEAD_DIM] (the
    Reshape output before the Transpose that makes Kt; the kernel reads it transposed), V_BSHD V as [batch,
    seq_k, heads, HEAD_DIM], O_BSHD writes out as [batch, seq_q, heads, HEAD_DIM] (the merge Reshape's input);
    batch = z // heads. The head's base is int64, the offsets inside it int32 (rows of heads * HEAD_DIM: the
    caller keeps seq * heads * HEAD_DIM below 2^31, dc_kernel_fit's check). QKV_PACKED (with Q_BSHD, K_BSHD and
    V_BSHD): q, k and v each point at one packed projection [batch, seq, 3, heads, HEAD_DIM] (the q, k, v
    projections concatenated on the last axis): Q is its part 0, K part 1, V part 2, rows of 3 * heads *
    HEAD_DIM elements (seq_q == seq_k; the caller keeps seq * 3 * heads * HEAD_DIM below 2^31)."""
    pid_m = tl.program_id(0)
    z = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    d_ok = offs_d < HEAD_DIM
    row = heads * HEAD_DIM  # a head-split operand's row: heads * d elements, 3 * heads * d when packed
    if QKV_PACKED:
        row = 3 * heads * HEAD_DIM
    if Q_BSHD:  # [batch, seq_q, heads, d]: head h of batch b starts at b * seq_q * row + h * d
        q_tile = tl.load(q + ((z // heads) * seq_q * row + (z % heads) * HEAD_DIM)
                         + (offs_m[:, None] * row + offs_d[None, :]),
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        q_tile = tl.load(q + z * seq_q * HEAD_DIM + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if K_BSHD:
        k_base = k + ((z // heads) * seq_k * row + (z % heads) * HEAD_DIM)
        if QKV_PACKED:  # part 1 of the packed row
            k_base += heads * HEAD_DIM
    else:
        k_base = k + z * HEAD_DIM * seq_k
    if V_BSHD:
        v_base = v + ((z // heads) * seq_k * row + (z % heads) * HEAD_DIM)
        if QKV_PACKED:  # part 2
            v_base += 2 * heads * HEAD_DIM
    else:
        v_base = v + z * seq_k * HEAD_DIM
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    n_end = seq_k
    if CAUSAL:
        n_end = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + seq_k - seq_q)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_k
        if K_BSHD:  # Kt[d, n] = K[n, d], rows of heads * d elements (int32 offsets inside the head)
            kt = tl.load(k_base + (offs_d[:, None] + offs_n[None, :] * row),
                         mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_base + offs_d[:, None].to(tl.int64) * seq_k + offs_n[None, :],
                         mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.dot(q_tile, kt, input_precision=DOT_PRECISION)
        if HAS_MASK:
            # int64 base per (batch, head), int32 offsets inside it (the caller keeps them below 2^31)
            mask_base = mask + (z // heads) * stride_mask_b + (z % heads) * stride_mask_h
            if MASK_ROWS:
                add = tl.load(mask_base + (offs_m[:, None] * stride_mask_q + offs_n[None, :] * stride_mask_k),
                              mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
                s = s * (SCALE * LOG2E) + add * LOG2E
            else:  # one mask row for every query (BERT's [batch, 1, 1, T_k]): a vector over the keys
                add_row = tl.load(mask_base + offs_n * stride_mask_k, mask=n_ok, other=0.0).to(tl.float32)
                s = s * (SCALE * LOG2E) + (add_row * LOG2E)[None, :]
        else:
            s = s * (SCALE * LOG2E)
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + (seq_k - seq_q))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row whose keys are all masked so far keeps m = -inf; subtract 0 there (exp2(-inf) = 0, not NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_BSHD:
            vt = tl.load(v_base + (offs_n[:, None] * row + offs_d[None, :]),
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            vt = tl.load(v_base + offs_n[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    if NAN_TO_ZERO:
        acc = tl.where((l_i > 0.0)[:, None], acc, 0.0)
    if O_BSHD:
        o_ptrs = (out + ((z // heads) * seq_q * heads + z % heads) * HEAD_DIM
                  + (offs_m[:, None] * (heads * HEAD_DIM) + offs_d[None, :]))
    else:
        o_ptrs = out + z * seq_q * HEAD_DIM + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


KERNELS: dict[str, Any] = {"gemm": gemm_kernel, "bmm": bmm_kernel, "conv": conv_kernel,
                          "attention": attention_kernel}

# Runtime (non-constexpr) parameters of each template in ABI vocabulary, "bias", "residual", "workspace" and
# "counters" only when it has one (a kernel without is compiled with the pointer as a None constexpr; only
# split-K kernels take a workspace and counters); bmm's "batch" only when persistent (the others have it as the
# constexpr 1).
ABI_PARAMS: dict[str, tuple[str, ...]] = {
    "gemm": ("a", "b", "bias", "c", "M", "N", "K", "residual", "workspace", "counters"),
    "bmm": ("a", "b", "bias", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch", "workspace",
            "counters"),
    "conv": ("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual", "workspace",
             "counters"),
    "attention": ("q", "k", "v", "mask", "out", "seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h",
                  "stride_mask_q", "stride_mask_k"),
}
ATTENTION_PARAMS: tuple[str, ...] = ABI_PARAMS["attention"]  # the attention view (tuner/attention.py)


def kernel_for(op: str) -> Any:
    """The @triton.jit template for ``op`` (one of "gemm", "bmm", "conv")."""
    try:
        return KERNELS[op]
    except KeyError:
        raise DietcodeError(f"unknown op {op!r}; allowed: {', '.join(KERNELS)}") from None


def check_epilogue(op: str, epilogue: Epilogue, split_k: int) -> None:
    """Reject epilogues the templates cannot fuse (unknown activation, a residual outside the gemm and conv
    templates, residual_first without a residual and an activation, residual_mul without them or with
    residual_first, a scale on conv or one that is not a finite float). Split-K takes every epilogue: the last split of a tile applies it to the full sum."""
    if epilogue.activation not in ACTIVATIONS:
        raise DietcodeError(f"unknown activation {epilogue.activation!r}; allowed: {', '.join(ACTIVATIONS)}")
    if epilogue.residual and op not in ("gemm", "conv"):
        raise DietcodeError(f"{op}: only the gemm and conv templates add a residual (got residual=True for {op})")
    if epilogue.residual_first and (not epilogue.residual or epilogue.activation == "none"):
        raise DietcodeError(f"{op}: residual_first orders a residual before an activation: it needs both (got "
                            f"residual={epilogue.residual}, activation={epilogue.activation!r})")
    if epilogue.residual_mul and (not epilogue.residual or epilogue.activation == "none" or epilogue.residual_first):
        raise DietcodeError(f"{op}: residual_mul multiplies an activation's result by a residual: it needs both "
                            f"and no residual_first (got residual={epilogue.residual}, activation="
                            f"{epilogue.activation!r}, residual_first={epilogue.residual_first})")
    if not isinstance(epilogue.alpha, float) or not math.isfinite(epilogue.alpha) or epilogue.alpha == 0.0:
        raise DietcodeError(f"{op}: the scale alpha must be a finite, non-zero float, got {epilogue.alpha!r}")
    if epilogue.alpha != 1.0 and op == "conv":
        raise DietcodeError("conv: the conv template takes no scale (alpha must be 1.0)")
    if not isinstance(split_k, int) or split_k < 1:
        raise DietcodeError(f"{op}: split_k must be a positive int, got {split_k!r}")


WORKSPACE_ALIGN = 16  # bytes: the launcher's workspace pointer and its size are multiples of this


def programs(m: int, n: int, batch: int, block_m: int, block_n: int, split_k: int = 1, persistent: int = 0,
             sm_count: int = 0) -> int:
    """Programs the launch of one call runs: tiles x batch x split_k, or for a persistent kernel (``persistent``
    programs per SM) min(tiles x batch, ``sm_count`` x persistent), one program per tile when ``sm_count`` is 0
    (unknown: the most a persistent grid launches). The C core's grid rule (dc_kernel_grid) is the same."""
    tiles = -(-m // block_m) * -(-n // block_n) * max(1, batch)
    if persistent:
        return min(tiles, sm_count * persistent) if sm_count > 0 else tiles
    return tiles * split_k


def workspace_bytes(m: int, n: int, batch: int, block_m: int, block_n: int, split_k: int,
                    scratch_size: int = 0, scratch_align: int = 1, persistent: int = 0, sm_count: int = 0) -> int:
    """Bytes of the workspace one call needs (0 when neither part is needed): the split-K part (an fp32 partial
    tile per (batch, tile, split) and room for an int32 counter per (batch, tile), where the launcher puts the
    counters when it has none kept for the stream, rounded up to WORKSPACE_ALIGN), then
    for a kernel with ``scratch_size`` bytes of global scratch per program (TMA descriptors) room to align it
    up from the 16-byte aligned workspace (``scratch_align`` - 16) and one scratch per program of the grid
    (``programs``: a persistent kernel's grid follows ``sm_count``), the whole rounded up to WORKSPACE_ALIGN. The C core's dc_kernel_workspace_bytes computes the same
    (tests/test_abi_contract.py and tests/test_tma.py compare them); the launcher passes the scratch at the
    first ``scratch_align`` multiple past the split-K part."""
    tiles = -(-m // block_m) * -(-n // block_n) * max(1, batch)
    size = 0
    if split_k > 1:
        size = -(-(tiles * split_k * block_m * block_n * 4 + tiles * 4) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    if scratch_size:
        size += max(0, scratch_align - WORKSPACE_ALIGN) + programs(
            m, n, batch, block_m, block_n, split_k, persistent, sm_count) * scratch_size
    return -(-size // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def conv_out_size(size: int, kernel: int, stride: int, pad_lo: int, pad_hi: int, dilation: int) -> int:
    """Output extent of one spatial axis (ONNX/PyTorch formula, floor)."""
    return (size + pad_lo + pad_hi - dilation * (kernel - 1) - 1) // stride + 1


def conv_geometry(conv: ConvParams) -> dict[str, int]:
    """The conv constexprs of ``conv_kernel`` for one layer (CHANNELS: all of X's channels; the group count is
    the grid's z extent, not a constexpr, so one compiled kernel serves the layer). Only the top/left pads enter the kernel;
    bottom/right pads only change out_h/out_w (computed with all four, see ``conv_out_size``), and reads
    past the bottom/right edge are masked, so asymmetric pads are exact."""
    if conv.in_channels <= 0 or conv.out_channels <= 0 or conv.groups <= 0:
        raise DietcodeError(f"conv channels and groups must be positive, got {conv.in_channels} -> "
                            f"{conv.out_channels}, groups {conv.groups}")
    if conv.in_channels % conv.groups or conv.out_channels % conv.groups:
        raise DietcodeError(f"conv channels {conv.in_channels} -> {conv.out_channels} are not multiples of groups "
                            f"{conv.groups}")
    return dict(zip(CONV_FIELDS, conv.geometry()))


def _dot_precision(dtype: "torch.dtype", allow_tf32: bool) -> str:
    import torch

    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def _check_tma(op: str, a: "torch.Tensor", b: "torch.Tensor", trans_b: bool) -> None:
    """What a TMA config needs of its operands (the runtime's div16 checks: a, b, K, N): bases 16-byte aligned
    and row strides (K, and N for a [K, N] B) multiples of 16 bytes. On a GPU, Triton's allocator for the
    descriptors' global scratch is installed (the AOT launcher passes its own)."""
    import torch

    k = a.shape[-1]
    n = b.shape[-2] if trans_b else b.shape[-1]
    strides = (k,) if trans_b else (k, n)
    if any(s * a.element_size() % 16 for s in strides) or a.data_ptr() % 16 or b.data_ptr() % 16:
        raise DietcodeError(f"{op} (TMA): row strides {strides} x {a.element_size()} bytes must be multiples of 16 "
                            "bytes and the operands 16-byte aligned, which TMA descriptors require")
    if a.is_cuda:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=a.device))


def _batch_operand(x: "torch.Tensor", batch: tuple[int, ...]) -> tuple["torch.Tensor", int]:
    """The operand and its batch stride: 0 when its batch dims are all 1 (broadcast), rows*cols when they
    equal the output's. A partial broadcast (e.g. [3, 1] against [3, 4]) is not expressible with one
    stride, so such an operand is expanded to the full batch here (the runtime ABI has no such case)."""
    lead = tuple(x.shape[:-2])
    if math.prod(lead) == 1:
        return x, 0
    if math.prod(lead) != math.prod(batch):
        x = x.expand(*batch, *x.shape[-2:]).contiguous()
    return x, x.shape[-2] * x.shape[-1]


def run(op: str, config: "MicroKernel", a: "torch.Tensor", b: "torch.Tensor", *,
        bias: "torch.Tensor | None" = None, residual: "torch.Tensor | None" = None,
        epilogue: Epilogue = Epilogue(), trans_b: bool = False, conv: ConvParams | None = None,
        allow_tf32: bool = False, workspace: "torch.Tensor | None" = None, counters: "torch.Tensor | None" = None,
        sm_count: int | None = None) -> "torch.Tensor":
    """Launch ``op``'s template with ``config`` through Triton's JIT and return the output tensor.

    gemm: a [M, K], b [K, N] (or [N, K] with ``trans_b``). bmm: a [..., M, K], b [..., K, N] where each
    operand's batch dims are all 1 (broadcast) or equal the output's. conv: a = X [n, C, H, W],
    b = W [OC, C / groups, KH, KW], ``conv`` gives the layer (one program grid z per group); with
    ``conv.channels_last`` a = X [n, H, W, C], b = W [OC, KH, KW, C] and the output (and residual) [n, OH, OW, OC]. ``bias`` is required iff ``epilogue.bias``, ``residual``
    (the output's shape: gemm [M, N], conv [n, OC, OH, OW]) iff ``epilogue.residual``. ``workspace`` (split-K
    only): an fp32 tensor of at least ``workspace_bytes`` bytes (default: a new one); ``counters`` (split-K
    only): a contiguous int32 tensor of at least tiles x batch zeros, as the launcher keeps them per stream
    (default: the counter room in the workspace, zeroed, the launcher's fallback); the kernel leaves the
    counters at zero again. A persistent config (gemm, bmm) launches
    min(tiles x batch, ``sm_count`` x config.persistent) programs (``programs``); ``sm_count`` defaults to the
    GPU's multiprocessor count and must be given on the CPU (the interpreter).
    """
    import torch

    kernel = kernel_for(op)
    if op not in ("gemm", "bmm", "conv"):  # attention has its own launcher (tuner/attention.py)
        raise DietcodeError(f"run launches the matrix templates, not {op!r}; allowed: gemm, bmm, conv")
    check_epilogue(op, epilogue, config.split_k)
    if epilogue.bias != (bias is not None):
        raise DietcodeError(f"{op}: epilogue.bias={epilogue.bias} but bias tensor "
                            f"{'given' if bias is not None else 'missing'}")
    if epilogue.residual != (residual is not None):
        raise DietcodeError(f"{op}: epilogue.residual={epilogue.residual} but residual tensor "
                            f"{'given' if residual is not None else 'missing'}")
    a, b = a.contiguous(), b.contiguous()
    bias = bias.contiguous() if bias is not None else None
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=epilogue.activation,
                DOT_PRECISION=_dot_precision(a.dtype, allow_tf32), BLOCK_M=config.block_m,
                BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, SPLIT_K=config.split_k,
                num_warps=config.num_warps, num_stages=config.num_stages)

    given, given_counters = workspace, counters

    def split_workspace(m: int, n: int, batch: int) -> "tuple[torch.Tensor | None, torch.Tensor | None]":
        """The split-K workspace and counters (None, None without split-K); without given counters, the
        workspace's counter room, zeroed, as the launcher's fallback passes them."""
        size = workspace_bytes(m, n, batch, config.block_m, config.block_n, config.split_k)
        if not size:
            if given is not None or given_counters is not None:
                raise DietcodeError(f"{op}: the workspace must be None without split-K (split_k={config.split_k}), "
                                    "and the counters too")
            return None, None
        if given is None:
            space = torch.zeros(size // 4, dtype=torch.float32, device=a.device)
        elif given.dtype != torch.float32 or not given.is_contiguous() or given.numel() * 4 < size:
            raise DietcodeError(f"{op}: the workspace must be a contiguous float32 tensor of at least {size} bytes "
                                f"(split_k={config.split_k}), got {given.dtype} of {given.numel() * 4} bytes")
        else:
            space = given
        tiles = -(-m // config.block_m) * -(-n // config.block_n) * max(1, batch)
        if given_counters is None:
            partials = tiles * config.split_k * config.block_m * config.block_n
            room = space[partials:partials + tiles].view(torch.int32)
            room.zero_()
            return space, room
        if given_counters.dtype != torch.int32 or not given_counters.is_contiguous() or given_counters.numel() < tiles:
            raise DietcodeError(f"{op}: the counters must be a contiguous int32 tensor of at least {tiles} elements, "
                                f"got {given_counters.dtype} of {given_counters.numel()}")
        return space, given_counters

    if config.persistent:
        if op == "conv" or config.split_k != 1:
            raise DietcodeError(f"{op}: persistent kernels exist for gemm and bmm with split_k 1, got "
                                f"{config.key()}")
        if sm_count is None:
            if not a.is_cuda:
                raise DietcodeError(f"{op}: a persistent config off the GPU needs sm_count (its grid is per SM)")
            sm_count = torch.cuda.get_device_properties(a.device).multi_processor_count
        if sm_count < 1:
            raise DietcodeError(f"{op}: sm_count must be at least 1, got {sm_count}")
        meta["PERSISTENT"] = True
    if config.tma:
        if op == "conv":
            raise DietcodeError("conv: the conv template has no TMA loads (tma applies to gemm and bmm)")
        meta["USE_TMA"] = True
        _check_tma(op, a, b, trans_b)
    if op == "conv":
        if conv is None:
            raise DietcodeError("conv: ConvParams are required")
        g = conv.groups
        if conv.channels_last:
            if g != 1:
                raise DietcodeError(f"conv: the channels-last form is ungrouped only, got groups={g}")
            weight_shape = (conv.out_channels, *conv.kernel, conv.in_channels)
            if a.dim() != 4 or a.shape[3] != conv.in_channels or tuple(b.shape) != weight_shape:
                raise DietcodeError(f"conv: channels-last expects X [n, H, W, {conv.in_channels}] and W "
                                    f"{list(weight_shape)}, got {list(a.shape)} and {list(b.shape)}")
            n_img, h, w, _ = a.shape
        else:
            weight_shape = (conv.out_channels, conv.in_channels // g, *conv.kernel)
            if a.dim() != 4 or a.shape[1] != conv.in_channels or tuple(b.shape) != weight_shape:
                raise DietcodeError(f"conv: expects X [n, {conv.in_channels}, H, W] and W {list(weight_shape)}, "
                                    f"got {list(a.shape)} and {list(b.shape)}")
            n_img, _, h, w = a.shape
        oh = conv_out_size(h, conv.kernel[0], conv.strides[0], conv.pads[0], conv.pads[2], conv.dilations[0])
        ow = conv_out_size(w, conv.kernel[1], conv.strides[1], conv.pads[1], conv.pads[3], conv.dilations[1])
        if oh <= 0 or ow <= 0:
            raise DietcodeError(f"conv: input {h}x{w} is smaller than the dilated kernel (output {oh}x{ow})")
        m, n, k = n_img * oh * ow, conv.out_channels // g, conv.in_channels // g * conv.kernel[0] * conv.kernel[1]
        out_shape = (n_img, oh, ow, conv.out_channels) if conv.channels_last else (n_img, conv.out_channels, oh, ow)
        out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
        if residual is not None and tuple(residual.shape) != tuple(out.shape):
            raise DietcodeError(f"conv: the residual must have the output's shape {tuple(out.shape)}, got "
                                f"{tuple(residual.shape)}")
        residual = residual.contiguous() if residual is not None else None
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k, g)
        kernel[grid](a, b, bias, out, m, n, k, h, w, oh, ow, residual, *split_workspace(m, n, g),
                     HAS_RESIDUAL=residual is not None, RESIDUAL_FIRST=epilogue.residual_first,
                     RESIDUAL_MUL=epilogue.residual_mul, CHANNELS_LAST=conv.channels_last,
                     **conv_geometry(conv), **meta)
        return out
    m, k = a.shape[-2:]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if (b.shape[-1] if trans_b else b.shape[-2]) != k:
        raise DietcodeError(f"{op}: inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}, trans_b={trans_b}")
    if op == "gemm":
        if a.dim() != 2 or b.dim() != 2:
            raise DietcodeError(f"gemm: expects 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
        if residual is not None and tuple(residual.shape) != (m, n):
            raise DietcodeError(f"gemm: the residual must have the output's shape {(m, n)}, got "
                                f"{tuple(residual.shape)}")
        residual = residual.contiguous() if residual is not None else None
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k, 1)
        if config.persistent:
            grid = (programs(m, n, 1, config.block_m, config.block_n, 1, config.persistent, sm_count or 0), 1, 1)
        kernel[grid](a, b, bias, out, m, n, k, residual, *split_workspace(m, n, 1), TRANS_B=trans_b,
                     ALPHA=epilogue.alpha,
                     HAS_RESIDUAL=residual is not None, RESIDUAL_FIRST=epilogue.residual_first,
                     RESIDUAL_MUL=epilogue.residual_mul, **meta)
        return out
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    a, sa = _batch_operand(a, batch)
    b, sb = _batch_operand(b, batch)
    out = torch.empty((*batch, m, n), dtype=a.dtype, device=a.device)
    z = max(1, math.prod(batch))
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k, z)
    if config.persistent:
        grid = (programs(m, n, z, config.block_m, config.block_n, 1, config.persistent, sm_count or 0), 1, 1)
    kernel[grid](a, b, bias, out, m, n, k, z, sa, sb, *split_workspace(m, n, z), TRANS_B=trans_b,
                 ALPHA=epilogue.alpha, **meta)
    return out
