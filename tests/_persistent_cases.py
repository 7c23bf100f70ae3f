"""Persistent gemm and bmm configs (``MicroKernel.persistent``: min(tiles x batch, SMs x n) programs, each looping
over tiles in the grouped order) against a float64 reference and against the same config launched one program
per tile, run under TRITON_INTERPRET=1 in a child process (see test_persistent.py); prints one JSON object
{case: result}. The interpreter has no SMs: each case gives a small ``sm_count`` so that the tiles are fewer
than, as many as, or more than the programs. Importing it imports neither triton nor torch. Run by hand:
``TRITON_INTERPRET=1 python tests/_persistent_cases.py``.
"""
from __future__ import annotations

import sys
from typing import Any

# name: (op, batch (a_batch, b_batch) or None, M, N, K, trans_b, dtype, bias, activation, alpha, residual,
# config fields (block_m, block_n, block_k, warps, stages, group_m, split_k, tma, persistent), sm_count).
# The programs launched are min(tiles x batch, sm_count x persistent); "tiles" in the comment is tiles x batch.
CASES: dict[str, tuple[Any, ...]] = {
    # 3 x 2 = 6 tiles on 4 SMs x 2 = 8 programs: tiles < programs (2 programs idle)
    "gemm_tiles_below_programs_bias_gelu": ("gemm", None, 40, 30, 24, False, "float32", True, "gelu", 1.0, False,
                                            (16, 16, 16, 2, 2, 8, 1, 0, 2), 4),
    # 4 x 2 = 8 tiles on 8 programs: one tile each
    "gemm_tiles_equal_programs_transb_residual": ("gemm", None, 64, 20, 33, True, "float32", False, "none", 0.5,
                                                  True, (16, 16, 16, 2, 2, 8, 1, 0, 1), 8),
    # 5 x 6 = 30 tiles on 3 programs: each takes 10 tiles, across GROUP_M groups (group_m 2)
    "gemm_tiles_above_programs_bias_gelu_residual_transb_fp16": (
        "gemm", None, 70, 90, 40, True, "float16", True, "gelu", 1.0, True, (16, 16, 16, 2, 2, 2, 1, 0, 1), 3),
    # TMA: descriptors made once per program, reused for its tiles (9 tiles on 2 programs)
    "gemm_tma_tiles_above_programs_bias_relu_residual_fp16": (
        "gemm", None, 37, 48, 56, False, "float16", True, "relu", 1.0, True, (16, 16, 16, 4, 2, 8, 1, 1, 1), 2),
    "gemm_tma_transb_bias_gelu_bf16": ("gemm", None, 33, 32, 40, True, "bfloat16", True, "gelu", 1.0, False,
                                       (16, 16, 32, 4, 2, 8, 1, 1, 2), 2),
    # bmm: batch 3 x 4 tiles = 12 on 5 programs (a program crosses matrices), broadcast B
    "bmm_broadcast_b_tiles_above_programs": ("bmm", (3, 1), 20, 30, 24, False, "float32", True, "none", 0.125,
                                             False, (16, 16, 16, 2, 2, 8, 1, 0, 1), 5),
    # bmm with TMA: descriptors made per tile from its matrix's bases (2 x 9 = 18 tiles, 4 programs)
    "bmm_tma_transb_fp16": ("bmm", (2, 2), 33, 40, 32, True, "float16", False, "gelu", 1.0, False,
                            (16, 16, 16, 4, 2, 8, 1, 1, 2), 2),
    # bmm: 2 x 1 tiles on 16 programs: fewer tiles than programs
    "bmm_tiles_below_programs": ("bmm", (2, 2), 9, 12, 20, False, "float32", False, "relu", 1.0, False,
                                 (16, 16, 16, 2, 2, 8, 1, 0, 4), 4),
}
TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (2e-2, 2e-2)}


def _run(op: str, batch: tuple[int, int] | None, m: int, n: int, k: int, trans_b: bool, dtype_name: str,
         bias_on: bool, activation: str, alpha: float, residual_on: bool, fields: tuple[int, ...],
         sm_count: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from tuner.space import MicroKernel
    from tuner.templates import programs, run
    from tuner.workload import Epilogue

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    a_lead, b_lead = ((batch[0],), (batch[1],)) if batch else ((), ())
    a = torch.randn(*a_lead, m, k, generator=gen).to(dtype)
    b = torch.randn(*b_lead, *((n, k) if trans_b else (k, n)), generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if bias_on else None
    residual = torch.randn(m, n, generator=gen).to(dtype) if residual_on else None
    *base, tma, persistent = fields
    config = MicroKernel(*base, tma=tma, persistent=persistent)
    epilogue = Epilogue(bias_on, activation, alpha, residual_on)
    y = run(op, config, a, b, bias=bias, residual=residual, trans_b=trans_b, epilogue=epilogue, sm_count=sm_count)
    twin = run(op, MicroKernel(*base, tma=tma), a, b, bias=bias, residual=residual, trans_b=trans_b,
               epilogue=epilogue)
    bd = b.double().transpose(-1, -2) if trans_b else b.double()
    ref = alpha * (a.double() @ bd)
    if bias is not None:
        ref = ref + bias.double()
    ref = {"none": ref, "relu": torch.relu(ref), "gelu": F.gelu(ref)}[activation]
    if residual is not None:
        ref = ref + residual.double()
    rtol, atol = TOLERANCE[dtype_name]
    err = (y.double() - ref).abs()
    z = max(batch) if batch else 1
    tiles = -(-m // base[0]) * -(-n // base[1]) * z
    return {"ok": True, "shape_ok": tuple(y.shape) == tuple(ref.shape), "dtype_ok": y.dtype == dtype,
            "excess": (err - (atol + rtol * ref.abs())).max().item(), "max_err": err.max().item(),
            "equals_twin": bool(torch.equal(y, twin)), "tiles": tiles,
            "programs": programs(m, n, z, base[0], base[1], 1, persistent, sm_count), "sm_count": sm_count,
            "persistent": persistent}


def _refusals() -> dict[str, Any]:
    """What ``run`` refuses of a persistent config: split-K, conv, and no SM count off the GPU."""
    import torch

    from dietcode_ort.errors import DietcodeError
    from tuner.space import MicroKernel
    from tuner.templates import run

    a, b = torch.zeros(8, 16), torch.zeros(16, 16)
    out = {}
    for name, call in (("split_k", lambda: run("gemm", MicroKernel(16, 16, 16, 2, 2, 8, 2, persistent=1), a, b,
                                               sm_count=2)),
                       ("no_sm_count", lambda: run("gemm", MicroKernel(16, 16, 16, 2, 2, persistent=1), a, b))):
        try:
            call()
            out[name] = "no refusal"
        except DietcodeError as exc:
            out[name] = str(exc)
    return out


def main() -> int:
    from _interpreter import case_main

    return case_main(CASES, _run, {"refusals": _refusals})


if __name__ == "__main__":
    sys.exit(main())
