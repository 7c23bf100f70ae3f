"""Split-K through the fp32 workspace (tuner/templates.py), interpreted on the CPU (tests/_splitk_cases.py).

fp16, bf16 and fp32, gemm, bmm (batch and broadcast strides) and conv, with alpha, bias, gelu / relu and the
residual, on ragged shapes and with splits that have no K to sum, against a float64 reference; the result
must not depend on which split of a tile arrives last (bit for bit, the splits run in both orders) and the
kernel must leave every counter at 0.
"""
from __future__ import annotations

from typing import Any

import pytest

from _interpreter import run_interpreted
from _splitk_cases import CASES


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_interpreted("_splitk_cases.py")


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_split_k_matches_float64_and_is_order_independent(interpreted: dict[str, Any], name: str) -> None:
    got = interpreted[name]
    assert "error" not in got, got.get("error")
    assert got["shape_ok"] and got["dtype_ok"] and got["finite"], got
    assert got["max_err"] <= got["tolerance"], got
    assert got["same_bits"] == [True, True], got  # a second run, and the splits arriving in reverse
    assert got["counters"] == [0] and got["n_counters"] == got["tiles"] > 0, got
    assert got["workspace_bytes"] % 16 == 0 and got["workspace_bytes"] > 0


def test_the_order_reversal_reverses_the_arrival(interpreted: dict[str, Any]) -> None:
    """The determinism check above means something only if the reversal changes which split comes last."""
    assert interpreted["arrival_order"] == {"plain": [0, 1, 2, 3], "reversed": [3, 2, 1, 0]}


def test_cases_cover_the_brief() -> None:
    assert {c.dtype for c in CASES} == {"float16", "bfloat16", "float32"}
    assert {c.op for c in CASES} == {"gemm", "bmm", "conv"}
    assert any(c.activation == "gelu" and c.residual and c.bias and c.alpha != 1.0 for c in CASES)
    assert any(c.op == "bmm" and len(c.a) > 2 and c.a[:-2] != c.b[:-2] for c in CASES)  # broadcast batch


def test_cases_have_empty_splits_and_ragged_k(interpreted: dict[str, Any]) -> None:
    cases = {c.name: c for c in CASES}
    assert any(interpreted[name]["empty_splits"] for name in cases)
    assert any(interpreted[name]["k_below_splits"] for name in cases)
    ragged = [c for c in CASES if (c.b[-1] if c.trans_b else c.b[-2]) % (c.config[2] * c.config[6]) and c.op != "conv"]
    assert ragged


def test_workspace_is_checked() -> None:
    torch = pytest.importorskip("torch")
    from dietcode_ort.errors import DietcodeError
    from tuner.space import MicroKernel
    from tuner.templates import run, workspace_bytes

    assert workspace_bytes(37, 29, 1, 16, 16, 1) == 0
    # 3 x 2 tiles, 4 splits of 16x16 fp32 partials, one int32 counter per tile, rounded up to 16 bytes
    assert workspace_bytes(37, 29, 1, 16, 16, 4) == -(-(6 * 4 * 256 * 4 + 6 * 4) // 16) * 16
    a, b = torch.zeros(37, 64), torch.zeros(64, 29)
    with pytest.raises(DietcodeError, match="at least 24608 bytes"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2, 8, 4), a, b, workspace=torch.zeros(10))
    with pytest.raises(DietcodeError, match="workspace must be"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, workspace=torch.zeros(10))
