"""float32 GEMMs through the template with TF32 and ieee dots under TRITON_INTERPRET=1 (see test_tf32.py).

Prints one JSON object: per case the worst excess over a TF32 tolerance against float64, and what the
interpreter computes for a product TF32 cannot represent (1 + 2**-12 needs 12 mantissa bits, TF32 has 10).
Run by hand: ``TRITON_INTERPRET=1 python tests/_tf32_cases.py``.
"""
from __future__ import annotations

import json


def main() -> None:
    import torch

    from tuner import templates
    from tuner.space import MicroKernel
    from tuner.workload import Epilogue

    out: dict[str, object] = {}
    gen = torch.Generator().manual_seed(0)
    # TF32 keeps 10 mantissa bits: each operand rounds with a relative error up to 2**-11, so each product is
    # off by up to ~2**-10 of its size; the float32 accumulation adds far less. Bound: 2**-10 of sum |a||b|.
    for name, (m, k, n), config, bias in (
            ("ragged", (37, 70, 29), MicroKernel(32, 16, 32, 2, 2), False),
            ("bias_split_k", (16, 96, 24), MicroKernel(16, 16, 16, 2, 2, 1, 2), True)):
        a = torch.randn(m, k, generator=gen)
        b = torch.randn(k, n, generator=gen)
        bias_t = torch.randn(n, generator=gen) if bias else None
        ref = a.double() @ b.double() + (bias_t.double() if bias_t is not None else 0)
        y = templates.run("gemm", config, a, b, bias=bias_t, epilogue=Epilogue(bias=bias), allow_tf32=True)
        bound = 2 ** -10 * (a.double().abs() @ b.double().abs()) + 1e-6
        out[name] = ((y.double() - ref).abs() / bound).max().item()  # <= 1: within TF32's error
    k = 32
    a = torch.full((16, k), 1 + 2 ** -12)
    b = torch.ones(k, 16)
    for precision, tf32 in (("tf32", True), ("ieee", False)):
        y = templates.run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, allow_tf32=tf32)
        out[f"probe_{precision}"] = y[0, 0].item()
    out["probe_exact"] = k * (1 + 2 ** -12)
    out["probe_tf32_rounded"] = float(k)  # what TF32 tensor cores give: 1 + 2**-12 rounds to 1
    print(json.dumps(out))


if __name__ == "__main__":
    main()
