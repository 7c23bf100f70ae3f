"""The gemm and bmm templates with TMA configs (``MicroKernel.tma``: A and B read through tensor descriptors)
against a float64 reference, run under TRITON_INTERPRET=1 in a child process (see test_tma.py); prints one JSON
object {case: result}. Importing it imports neither triton nor torch. Run by hand:
``TRITON_INTERPRET=1 python tests/_tma_cases.py``.

The interpreter enforces what the hardware needs of a descriptor (16-byte aligned base, row strides multiples of
16 bytes) and zero-fills reads past the tensor's edge, as the Tensor Memory Accelerator does. Its bfloat16
``tl.dot`` multiplies the uint16 storage: ``_splitk_cases._exact_bf16_dot`` widens the operands first.
"""
from __future__ import annotations

import sys
from typing import Any

# name: (op, batch (a_batch, b_batch), M, N, K, trans_b, dtype, bias, activation, alpha, residual, config fields
# (block_m, block_n, block_k, warps, stages, group_m, split_k)). Ragged M and N, K not a multiple of BLOCK_K,
# rows multiples of 16 bytes as TMA requires.
CASES: dict[str, tuple[Any, ...]] = {
    "gemm_ragged_bias_gelu_alpha_residual_fp16": ("gemm", None, 37, 56, 72, False, "float16", True, "gelu", 0.5,
                                                  True, (32, 32, 32, 4, 3, 8, 1)),
    "gemm_transb_bf16": ("gemm", None, 70, 24, 40, True, "bfloat16", False, "none", 1.0, False,
                         (64, 16, 32, 4, 2, 8, 1)),
    "gemm_split_k4_bias_relu_residual_fp16": ("gemm", None, 19, 40, 200, False, "float16", True, "relu", 1.0, True,
                                              (16, 32, 32, 4, 2, 8, 4)),
    "gemm_split_k8_past_k_bf16": ("gemm", None, 5, 16, 48, True, "bfloat16", True, "gelu", 2.0, False,
                                  (16, 16, 16, 4, 2, 8, 8)),  # 3 slices of K for 8 splits: 5 read only zeros
    "bmm_broadcast_b_alpha_fp16": ("bmm", (3, 1), 21, 40, 24, False, "float16", False, "none", 0.125, False,
                                   (16, 32, 16, 4, 2, 8, 1)),
    "bmm_transb_split_k2_bf16": ("bmm", (2, 2), 33, 17 + 7, 64, True, "bfloat16", True, "none", 1.0, False,
                                 (32, 16, 32, 4, 2, 8, 2)),
}
TOLERANCE = {"float16": (1e-2, 1e-2), "bfloat16": (2e-2, 2e-2)}


def _run(op: str, batch: tuple[int, int] | None, m: int, n: int, k: int, trans_b: bool, dtype_name: str,
         bias_on: bool, activation: str, alpha: float, residual_on: bool, fields: tuple[int, ...]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from tuner.space import MicroKernel
    from tuner.templates import run
    from tuner.workload import Epilogue

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    a_lead, b_lead = ((batch[0],), (batch[1],)) if batch else ((), ())
    a = torch.randn(*a_lead, m, k, generator=gen).to(dtype)
    b = torch.randn(*b_lead, *((n, k) if trans_b else (k, n)), generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if bias_on else None
    residual = torch.randn(m, n, generator=gen).to(dtype) if residual_on else None
    config = MicroKernel(*fields, tma=1)
    y = run(op, config, a, b, bias=bias, residual=residual, trans_b=trans_b,
            epilogue=Epilogue(bias_on, activation, alpha, residual_on))
    bd = b.double().transpose(-1, -2) if trans_b else b.double()
    ref = alpha * (a.double() @ bd)
    if bias is not None:
        ref = ref + bias.double()
    ref = {"none": ref, "relu": torch.relu(ref), "gelu": F.gelu(ref)}[activation]
    if residual is not None:
        ref = ref + residual.double()
    rtol, atol = TOLERANCE[dtype_name]
    err = (y.double() - ref).abs()
    return {"ok": True, "shape_ok": tuple(y.shape) == tuple(ref.shape), "dtype_ok": y.dtype == dtype,
            "excess": (err - (atol + rtol * ref.abs())).max().item(), "max_err": err.max().item()}


def _refusal() -> dict[str, Any]:
    """A TMA config given rows that are not multiples of 16 bytes is refused, naming the rule."""
    import torch

    from dietcode_ort.errors import DietcodeError
    from tuner.space import MicroKernel
    from tuner.templates import run

    a, b = torch.zeros(8, 20, dtype=torch.float16), torch.zeros(20, 16, dtype=torch.float16)  # K rows: 40 bytes
    try:
        run("gemm", MicroKernel(16, 16, 32, 4, 2, tma=1), a, b)
    except DietcodeError as exc:
        return {"ok": True, "error": str(exc)}
    return {"ok": False, "error": "no refusal"}


def main() -> int:
    from _interpreter import case_main

    return case_main(CASES, _run, {"refusal": _refusal})


if __name__ == "__main__":
    sys.exit(main())
