"""Split-K cases run under TRITON_INTERPRET=1 in a child process (see tests/test_split_k.py).

Each case runs a split-K config of a template (tuner.templates.run) against a float64 reference of the
whole epilogue, act(alpha * A @ B + bias) + residual, on ragged shapes: M and N not multiples of the tile,
K not a multiple of BLOCK_K * SPLIT_K, and K below SPLIT_K * BLOCK_K (splits with no K to sum). The
workspace starts with NaN partials (a split that did not store its partial, zeros included, would poison the
sum) and zeroed counters, as dc_launch_fit leaves it. Each case runs three times: as the interpreter orders
the programs (split 0 first, so the last split to arrive is SPLIT_K - 1), again the same way, and with the
splits arriving in reverse (split 0 last); the three outputs must be the same bits, and the counters must
be back at 0 after each run.

The Triton 3.9 interpreter multiplies bfloat16 ``tl.dot`` operands as their uint16 storage (its create_dot
passes the raw arrays to numpy); ``_exact_bf16_dot`` widens them to float32 first, which is exact, as the
GPU's MMA is. Prints one JSON object {case: result}.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SplitCase", "CASES", "main"]


@dataclass(frozen=True)
class SplitCase:
    name: str
    op: str  # gemm | bmm | conv
    a: tuple[int, ...]
    b: tuple[int, ...]
    config: tuple[int, ...]  # bm, bn, bk, warps, stages, group_m, split_k
    dtype: str
    alpha: float = 1.0
    bias: bool = True
    activation: str = "gelu"
    residual: bool = False
    trans_b: bool = False
    conv: dict[str, Any] = field(default_factory=dict)


CASES: tuple[SplitCase, ...] = (
    # K = 70 is not a multiple of 16 x 4; M = 37, N = 29 are ragged
    SplitCase("gemm_fp16_alpha_bias_gelu_residual", "gemm", (37, 70), (70, 29), (16, 16, 16, 2, 2, 8, 4), "float16",
              alpha=0.5, residual=True),
    # K = 40 < 8 x 16: splits 3..7 have no K to sum
    SplitCase("gemm_bf16_empty_splits", "gemm", (19, 40), (40, 45), (16, 32, 16, 2, 2, 8, 8), "bfloat16",
              alpha=-1.5, residual=True),
    SplitCase("gemm_fp32_trans_b_gelu_residual", "gemm", (21, 100), (45, 100), (16, 16, 32, 2, 2, 8, 2), "float32",
              alpha=1.25, residual=True, trans_b=True),
    # fp32 output keeps the fp32 sum's last bits: a sum in arrival order would show here
    SplitCase("gemm_fp32_split8_order", "gemm", (9, 300), (300, 20), (16, 16, 16, 2, 2, 8, 8), "float32",
              bias=False, activation="none"),
    SplitCase("gemm_fp16_m1_relu", "gemm", (1, 200), (200, 70), (16, 64, 16, 2, 2, 8, 8), "float16",
              activation="relu"),
    # bmm: batch (2, 3) with A broadcast (batch stride 0) and with B broadcast
    SplitCase("bmm_fp16_a_broadcast_gelu", "bmm", (1, 1, 17, 50), (2, 3, 50, 20), (16, 16, 16, 2, 2, 8, 4), "float16",
              alpha=0.125),
    SplitCase("bmm_bf16_b_broadcast_trans_b", "bmm", (2, 3, 9, 33), (1, 19, 33), (16, 16, 16, 2, 2, 8, 2), "bfloat16",
              trans_b=True, bias=False),
    SplitCase("conv_fp16_bias_gelu", "conv", (2, 3, 7, 6), (8, 3, 3, 3), (16, 16, 16, 2, 2, 8, 4), "float16",
              conv={"pads": (1, 1, 1, 1)}),
)


def _exact_bf16_dot() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle: Any) -> Any:
        if handle.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return handle

    def create_dot(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
        return original(self, widen(a), widen(b), d, *rest)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _splits_in_reverse(on: bool) -> None:
    """Make the interpreter hand program (x, y, z) the split id SPLIT_K - 1 - y, so the splits of each tile
    arrive last-first (the launch loops over y in increasing order)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    cls = type(builder)
    if not hasattr(cls, "_plain_set_grid_idx"):
        cls._plain_set_grid_idx = cls.set_grid_idx
    plain = cls._plain_set_grid_idx

    def reversed_idx(self: Any, x: int, y: int, z: int) -> None:
        plain(self, x, self.grid_dim[1] - 1 - y, z)

    cls.set_grid_idx = reversed_idx if on else plain


def arrival_order(reverse: bool, splits: int = 4) -> list[int]:
    """The split ids of one tile in the order the interpreter runs them, with or without the reversal (each
    program takes a ticket with an atomic add and writes its split id at that slot)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def probe(ticket, order):
        slot = tl.atomic_add(ticket, 1)
        tl.store(order + slot, tl.program_id(1))

    ticket, order = torch.zeros(1, dtype=torch.int32), torch.full((splits,), -1, dtype=torch.int32)
    _splits_in_reverse(reverse)
    try:
        probe[(1, splits, 1)](ticket, order)
    finally:
        _splits_in_reverse(False)
    return order.tolist()


def _reference(torch: Any, case: SplitCase, a: Any, b: Any, bias: Any, residual: Any) -> Any:
    a64, b64 = a.double(), b.double()
    if case.op == "conv":
        top, left, bottom, right = case.conv.get("pads", (0, 0, 0, 0))
        y = torch.nn.functional.conv2d(torch.nn.functional.pad(a64, (left, right, top, bottom)), b64)
        if bias is not None:
            y = y + bias.double()[None, :, None, None]
    else:
        y = case.alpha * torch.matmul(a64, b64.mT if case.trans_b else b64)
        if bias is not None:
            y = y + bias.double()
    if case.activation == "relu":
        y = torch.relu(y)
    elif case.activation == "gelu":
        y = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    if residual is not None:
        y = y + residual.double()
    return y


def run_case(case: SplitCase) -> dict[str, Any]:
    import torch

    from tuner.space import MicroKernel
    from tuner.templates import run, workspace_bytes
    from tuner.workload import ConvParams, Epilogue

    torch.manual_seed(0)
    dtype = getattr(torch, case.dtype)
    a, b = torch.randn(case.a, dtype=dtype), torch.randn(case.b, dtype=dtype)
    config = MicroKernel(*case.config)
    conv = None
    if case.op == "conv":
        oc, c, kh, kw = case.b
        conv = ConvParams(c, oc, (kh, kw), pads=tuple(case.conv.get("pads", (0, 0, 0, 0))))
        n_out = oc
        out_h, out_w = case.a[2] + sum(conv.pads[::2]) - kh + 1, case.a[3] + sum(conv.pads[1::2]) - kw + 1
        m, batch, k = case.a[0] * out_h * out_w, 1, c * kh * kw
    else:
        n_out = case.b[-2] if case.trans_b else case.b[-1]
        m, k = case.a[-2], case.a[-1]
        batch = math.prod(torch.broadcast_shapes(case.a[:-2], case.b[:-2]))
    bias = torch.randn(n_out, dtype=dtype) if case.bias else None
    want_shape = _reference(torch, case, a, b, bias, None).shape
    residual = torch.randn(want_shape, dtype=dtype) if case.residual else None
    want = _reference(torch, case, a, b, bias, residual)
    size = workspace_bytes(m, n_out, batch, config.block_m, config.block_n, config.split_k)
    tiles = -(-m // config.block_m) * -(-n_out // config.block_n) * batch
    partials = tiles * config.split_k * config.block_m * config.block_n
    epilogue = Epilogue(bias=case.bias, activation=case.activation, alpha=case.alpha, residual=case.residual)
    outs, counters = [], []
    for reverse in (False, False, True):
        workspace = torch.full((size // 4,), float("nan"), dtype=torch.float32)
        workspace.view(torch.int32)[partials:] = 0  # what dc_launch_fit zeroes
        _splits_in_reverse(reverse)
        try:
            outs.append(run(case.op, config, a, b, bias=bias, residual=residual, epilogue=epilogue,
                            trans_b=case.trans_b, conv=conv, workspace=workspace))
        finally:
            _splits_in_reverse(False)
        counters.append(workspace.view(torch.int32)[partials:partials + tiles].tolist())
    y = outs[0]
    scale = float(want.abs().max())
    eps = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -22}[case.dtype]
    return {"max_err": float((y.double() - want).abs().max()), "tolerance": 2 * eps * max(1.0, scale),
            "shape_ok": tuple(y.shape) == tuple(want.shape), "dtype_ok": y.dtype == dtype,
            "finite": bool(torch.isfinite(y).all()),
            "same_bits": [bool(torch.equal(o.view(torch.int16 if o.element_size() == 2 else torch.int32),
                                           y.view(torch.int16 if y.element_size() == 2 else torch.int32)))
                          for o in outs[1:]],
            "counters": sorted(set(v for run_counters in counters for v in run_counters)),
            "n_counters": len(counters[0]), "tiles": tiles, "workspace_bytes": size,
            "k_below_splits": k < config.split_k * config.block_k,
            "empty_splits": -(-k // config.block_k) < config.split_k}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _exact_bf16_dot()
    out: dict[str, Any] = {"arrival_order": {"plain": arrival_order(False), "reversed": arrival_order(True)}}
    for case in CASES:
        try:
            out[case.name] = run_case(case)
        except Exception as exc:  # reported per case
            out[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
