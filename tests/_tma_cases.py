"""The TMA study kernel (tuner/tma.py) against a float64 reference, run under TRITON_INTERPRET=1 in a child
process (see test_hopper.py); prints one JSON object {case: result}. Importing it imports neither triton nor
torch. Run by hand: ``TRITON_INTERPRET=1 python tests/_tma_cases.py``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

# name: (M, N, K, trans_b, dtype, bias, activation, alpha, config fields). Ragged M and N (TMA zero-fills the
# rows and columns past the edge), K not a multiple of BLOCK_K, rows a multiple of 16 bytes as TMA requires.
CASES: dict[str, tuple[Any, ...]] = {
    "ragged_bias_gelu_alpha_fp16": (37, 56, 72, False, "float16", True, "gelu", 0.5, (32, 32, 32, 4, 3)),
    "transb_fp16": (70, 20, 40, True, "float16", False, "none", 1.0, (64, 16, 32, 4, 2)),
    "m1_relu_fp32": (1, 12, 28, False, "float32", True, "relu", 1.0, (16, 16, 16, 2, 2)),
}


def _run(m: int, n: int, k: int, trans_b: bool, dtype_name: str, bias_on: bool, activation: str, alpha: float,
         fields: tuple[int, ...]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from tuner.space import MicroKernel
    from tuner.tma import run_tma
    from tuner.workload import Epilogue

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn((n, k) if trans_b else (k, n), generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if bias_on else None
    y = run_tma(MicroKernel(*fields), a, b, bias=bias, epilogue=Epilogue(bias_on, activation, alpha), trans_b=trans_b)
    ref = alpha * (a.double() @ (b.double().T if trans_b else b.double()))
    if bias is not None:
        ref = ref + bias.double()
    ref = {"none": ref, "relu": torch.relu(ref), "gelu": F.gelu(ref)}[activation]
    rtol, atol = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2)}[dtype_name]
    err = (y.double() - ref).abs()
    return {"ok": True, "shape_ok": tuple(y.shape) == (m, n), "dtype_ok": y.dtype == dtype,
            "excess": (err - (atol + rtol * ref.abs())).max().item(), "max_err": err.max().item()}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            out[name] = _run(*case)
        except Exception as exc:  # noqa: BLE001 - reported per case to the parent test
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
