"""The kernel ABI without a GPU: the custom op's launch arguments drive the Triton templates correctly.

See tests/_abi_cases.py: for ONNX node calls of each kind, the C++ runtime's view (M, N, K, batch, batch
strides, conv dims) feeds the interpreted template in the ABI's parameter order and grid rule, and the
result must match the ONNX semantics. This is what a cubin launched by custom_ops/launch.cc computes.
"""
from __future__ import annotations

from typing import Any

import pytest

from _abi_cases import CASES
from _interpreter import run_interpreted

@pytest.fixture(scope="module")
def outcomes() -> dict[str, Any]:
    return run_interpreted("_abi_cases.py")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_runtime_view_drives_the_template(outcomes: dict[str, Any], case) -> None:
    got = outcomes[case.name]
    assert got["view"] != "error", got.get("error")
    assert got["view"] == ("kernel" if case.expect_kernel else "vendor")
    if case.tma and not case.expect_kernel:  # the ABI expresses it, the TMA kernel's div16 check refuses it
        assert got["fit"] == "div16 assumption" and "K a multiple of 16" in got["why"], got
    if case.expect_kernel:
        tolerance = (2e-2 if case.dtype == "float16" else 1e-4) * max(1.0, got["scale"])
        assert got["max_err"] <= tolerance, got
        split_k = (list(case.config[5:]) + [8, 1])[1]
        # the C core sizes a workspace for split-K and TMA calls only (Python's rule agrees), and the kernel leaves
        # every counter at 0
        assert (got["workspace_bytes"] > 0) == (split_k > 1 or case.tma), got
        assert got["workspace_bytes"] == got["python_workspace_bytes"], got
        if split_k > 1:
            assert got["counters"] and set(got["counters"]) == {0}, got


def test_view_errors_are_clear() -> None:
    from dietcode_ort.errors import DietcodeError
    from dietcode_ort.runtime import load_core

    core = load_core()
    with pytest.raises(DietcodeError, match="inner dims differ"):
        core.abi_view("MatMul", (3, 4), (5, 6))
    with pytest.raises(DietcodeError, match="allowed: MatMul, Gemm, Conv"):
        core.abi_view("Add", (3, 4), (4, 6))
    assert core.abi_view("Conv", (1, 4, 8, 8), (4, 2, 3, 3), ints=(1, 1, 0, 0, 0, 0, 1, 1, 2)) is None  # grouped
