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


def test_views_of_edge_sizes() -> None:
    """K = 0 leaves M the rows of A (not its element count over K, which is 0); a dilation or pads past any input
    make the conv's output empty (an error), never a product that overflows to a size; a window larger than the
    input is an empty output, not one row rounded up from a negative numerator."""
    from dietcode_ort.errors import DietcodeError
    from dietcode_ort.runtime import load_core

    core = load_core()
    for a, rows in (((5, 0), 5), ((2, 5, 0), 10), ((0, 7, 0), 0)):
        view = core.abi_view("MatMul", a, (0, 24))
        assert view is not None and (view.M, view.N, view.K) == (rows, 24, 0)
    for dilation in (2**62, 2**61 + 1, 3):  # 5x5 window on 9x9: 2^62 * 4 wraps to 0 in int64
        with pytest.raises(DietcodeError, match="Conv output would be empty"):
            core.abi_view("Conv", (1, 1, 9, 9), (1, 1, 5, 5), ints=(1, 1, 0, 0, 0, 0, dilation, dilation, 1))
    with pytest.raises(DietcodeError, match="Conv output would be empty"):
        core.abi_view("Conv", (1, 1, 9, 9), (1, 1, 5, 5), ints=(1, 1, 2**62, 0, 2**62, 0, 1, 1, 1))
    with pytest.raises(DietcodeError, match="Conv output would be empty"):  # 4 + 0 pads < 5: floor(-1/3) + 1 = 0
        core.abi_view("Conv", (1, 1, 4, 9), (1, 1, 5, 5), ints=(3, 1, 0, 0, 0, 0, 1, 1, 1))
    view = core.abi_view("Conv", (1, 1, 9, 9), (1, 1, 5, 5), ints=(1, 1, 0, 0, 0, 0, 2, 2, 1))  # 9 - 8 = 1
    assert view is not None and (view.out_h, view.out_w) == (1, 1)


@pytest.mark.parametrize("x, w, ints", [
    ((2, 4, 8, 8), (6, 4, 3, 3), (1, 1, 1, 1, 1, 1, 1, 1, 1)),
    ((1, 3, 17, 11), (8, 3, 5, 3), (2, 1, 2, 1, 2, 1, 1, 2, 1)),
    ((3, 16, 9, 7), (32, 16, 1, 1), (2, 2, 0, 0, 0, 0, 1, 1, 1)),
])
def test_channels_last_conv_view_is_the_channels_first_view_of_the_permuted_shapes(x, w, ints) -> None:
    """dc_abi_view's 10th conv int, channels_last: X [N, H, W, C] and W [OC, KH, KW, C] give the M, N, K and image
    sizes of the NCHW call on the permuted shapes (what the CHANNELS_LAST template computes with)."""
    from dietcode_ort.runtime import load_core

    core = load_core()
    nchw = core.abi_view("Conv", x, w, ints=ints)
    x_nhwc, w_ohwi = (x[0], x[2], x[3], x[1]), (w[0], w[2], w[3], w[1])
    nhwc = core.abi_view("Conv", x_nhwc, w_ohwi, ints=(*ints, 1))
    assert nchw is not None and nhwc is not None
    fields = ("M", "N", "K", "batch", "img_n", "img_h", "img_w", "out_h", "out_w")
    assert [getattr(nhwc, f) for f in fields] == [getattr(nchw, f) for f in fields]
    assert nhwc.M == x[0] * nhwc.out_h * nhwc.out_w and nhwc.N == w[0] and nhwc.K == x[1] * w[2] * w[3]
    # the keyword form, and a 10th int of 0 is the NCHW view
    via_keyword = core.abi_view("Conv", x_nhwc, w_ohwi, ints=ints, channels_last=True)
    assert via_keyword is not None and [getattr(via_keyword, f) for f in fields] == [getattr(nchw, f) for f in fields]
    zero = core.abi_view("Conv", x, w, ints=(*ints, 0))
    assert zero is not None and [getattr(zero, f) for f in fields] == [getattr(nchw, f) for f in fields]
    # the NCHW call on the NHWC shapes is another conv (or none): the flag is what makes them the same
    try:
        other = core.abi_view("Conv", x_nhwc, w_ohwi, ints=ints)
    except Exception:
        other = None
    assert other is None or [getattr(other, f) for f in fields] != [getattr(nchw, f) for f in fields]


def test_channels_last_conv_view_refuses_bad_flags_and_groups() -> None:
    from dietcode_ort.errors import DietcodeError
    from dietcode_ort.runtime import load_core

    core = load_core()
    ints = (1, 1, 1, 1, 1, 1, 1, 1, 1)
    for bad in (2, -1, 2**40):
        with pytest.raises(DietcodeError, match=f"channels_last \\(the 10th int\\) must be 0 or 1, got {bad}"):
            core.abi_view("Conv", (1, 8, 8, 4), (6, 3, 3, 4), ints=(*ints, bad))
    with pytest.raises(DietcodeError, match=r"group\[, channels_last\]"):
        core.abi_view("Conv", (1, 8, 8, 4), (6, 3, 3, 4), ints=(*ints, 1, 0))
    with pytest.raises(DietcodeError, match="channels-last Conv must have group 1, got group 2"):
        core.abi_view("Conv", (1, 8, 8, 4), (6, 3, 3, 2), ints=(*ints[:8], 2, 1))
    with pytest.raises(DietcodeError, match="channels-last"):  # C of X [.., 4] and W [.., 3] differ
        core.abi_view("Conv", (1, 8, 8, 4), (6, 3, 3, 3), ints=(*ints, 1))
    with pytest.raises(DietcodeError, match="applies to Conv only"):
        core.abi_view("MatMul", (3, 4), (4, 5), channels_last=True)


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
