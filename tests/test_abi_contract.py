"""The kernel ABI without a GPU: the custom op's launch arguments drive the Triton templates correctly.

See tests/_abi_cases.py: for ONNX node calls of each kind, the C++ runtime's view (M, N, K, batch, batch
strides, conv dims) feeds the interpreted template in the ABI's parameter order and grid rule, and the
result must match the ONNX semantics. This is what a cubin launched by custom_ops/launch.cc computes.
"""
from __future__ import annotations

from typing import Any

import pytest

from _abi_cases import ATTENTION_CASES, CASES
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


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c.name for c in ATTENTION_CASES])
def test_attention_view_drives_the_template_in_each_layout(outcomes: dict[str, Any], case) -> None:
    """dc_attention_view_layout's arguments for the node's inputs as given (Q, K, V, out as [B, S, H, d] where
    the layout says so) drive the interpreted attention kernel compiled with the layout's constexprs."""
    got = outcomes[case.name]
    assert got["view"] == "kernel", got.get("error")
    assert got["max_err"] <= 1e-4 * max(1.0, got["scale"]), got


def test_view_errors_are_clear() -> None:
    from dietcode_ort.errors import DietcodeError
    from dietcode_ort.runtime import load_core

    core = load_core()
    with pytest.raises(DietcodeError, match="inner dims differ"):
        core.abi_view("MatMul", (3, 4), (5, 6))
    with pytest.raises(DietcodeError, match="allowed: MatMul, Gemm, Conv"):
        core.abi_view("Add", (3, 4), (4, 6))
    # a grouped conv: one group's N and K, the groups along the grid's z (batch); channels that do not split
    # into the groups are no conv ONNX runs
    grouped = core.abi_view("Conv", (2, 4, 8, 8), (6, 2, 3, 3), ints=(1, 1, 1, 1, 1, 1, 1, 1, 2))
    assert grouped is not None
    assert (grouped.M, grouped.N, grouped.K, grouped.batch) == (2 * 8 * 8, 3, 18, 2)
    assert (grouped.img_n, grouped.img_h, grouped.img_w, grouped.out_h, grouped.out_w) == (2, 8, 8, 8, 8)
    for group in (2**62, 2**31 + 2, -2):  # W [5, ...] does not split into 2 groups; no product may overflow
        with pytest.raises(DietcodeError, match="Conv channels"):
            core.abi_view("Conv", (1, 4, 8, 8), (4, 2, 3, 3), ints=(1, 1, 0, 0, 0, 0, 1, 1, group))
    with pytest.raises(DietcodeError, match="Conv channels"):
        core.abi_view("Conv", (1, 4, 8, 8), (5, 2, 3, 3), ints=(1, 1, 0, 0, 0, 0, 1, 1, 2))


def test_attention_view_refuses_head_split_offsets_past_int32() -> None:
    """With a head-split layout the template's offsets inside one head (rows of heads x d elements) are int32:
    the view refuses an operand of 2^31 elements or more there (the contiguous layout computes them in int64)."""
    from dietcode_ort.runtime import load_core

    core = load_core()
    rows = 2 ** 31 // (16 * 64)  # rows * 16 heads * d 64 == 2^31
    big = [1, rows, 16, 64]
    shape: list[int] = []
    assert core.attention_view(big, [1, 16, 64, 8], [1, 16, 8, 64], head_dim=64, layout=9, out_shape=shape) is None
    assert "past int32" in core.error()
    assert shape == big  # the output's shape all the same (the CUDA node allocates it before refusing)
    core.attention_view(big, [1, 16, 64, 8], [1, 16, 8, 64], head_dim=64, layout=1, out_shape=shape)
    assert shape == [1, 16, rows, 64]
    assert core.attention_view([1, 16, 8, 64], big, big, head_dim=64, layout=6) is None  # K, V of rows keys
    assert core.attention_view([1, rows - 1, 16, 64], [1, 16, 64, 8], [1, 16, 8, 64], head_dim=64, layout=9) is not None
    contiguous = core.attention_view([1, 16, rows, 64], [1, 16, 64, 8], [1, 16, 8, 64], head_dim=64)
    assert contiguous is not None and contiguous.seq_q == rows
