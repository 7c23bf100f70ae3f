"""The fused attention template (tuner/attention.py, templates.attention_kernel): interpreted against a
float64 reference, its space and its mask broadcasting."""
from __future__ import annotations

import ctypes
from typing import Any

import pytest

from _attention_cases import CASES
from _interpreter import run_interpreted
from dietcode_ort.errors import DietcodeError
from tuner.attention import (AttentionConfig, attention_prune_report, attention_space, block_d,
                             mask_strides)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_interpreted("_attention_cases.py")


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_template_matches_reference(interpreted: dict[str, Any], name: str) -> None:
    errors = interpreted[name]
    case = next(c for c in CASES if c.name == name)
    assert len(errors) == len(case.configs)
    assert max(errors) <= 1.0, f"{name}: error {max(errors)} x tolerance"


def test_cases_cover_the_brief() -> None:
    assert {c.seq_q for c in CASES} >= {1, 5, 17}
    assert {c.head_dim for c in CASES} >= {16, 32}
    assert any(c.mask == (2, 1, 1, 17) for c in CASES)  # BERT's extended attention mask
    assert any(c.mask is None for c in CASES) and any(c.causal for c in CASES)
    assert {c.dtype for c in CASES} >= {"float32", "float16"}
    # keys spanning several BLOCK_N steps, so the online rescaling runs
    assert any(c.seq_k > min(cfg[1] for cfg in c.configs) for c in CASES)
    # each operand's head-split layout alone and all together, with masks and ragged sequences
    layouts = {c.layout for c in CASES}
    assert {1, 2, 15} <= layouts and any(c.layout & 4 and c.layout & 8 for c in CASES)
    assert any(c.layout == 15 and c.mask is not None and c.seq_k % 16 for c in CASES)


def test_mask_strides_follow_onnx_broadcasting() -> None:
    assert mask_strides((2, 1, 1, 17), 2, 12, 17, 17) == (17, 0, 0, 1)
    assert mask_strides((2, 12, 17, 17), 2, 12, 17, 17) == (12 * 17 * 17, 17 * 17, 17, 1)
    assert mask_strides((17, 17), 2, 12, 17, 17) == (0, 0, 17, 1)
    assert mask_strides((1, 1, 17, 1), 2, 12, 17, 17) == (0, 0, 1, 0)
    assert mask_strides((1,), 1, 1, 1, 1) == (0, 0, 0, 0)
    with pytest.raises(DietcodeError, match="does not broadcast"):
        mask_strides((3, 1, 1, 17), 2, 12, 17, 17)
    with pytest.raises(DietcodeError, match="more than 4"):
        mask_strides((1, 1, 1, 1, 17), 2, 12, 17, 17)


def test_space_is_pruned_by_the_gpu_limits() -> None:
    for target in ("sm_80", "sm_90"):
        report = attention_prune_report("float16", target, 64)
        space = attention_space("float16", target, 64)
        assert report["kept"] == len(space) > 0
        assert report["total"] == sum(v for k, v in report.items() if k not in ("total", "kept")) + len(space)
        assert report["warp_rows"] > 0
        assert space == sorted(set(space))
    # a wider head needs more shared memory and registers per config: never a larger space
    assert len(attention_space("float32", "sm_80", 256)) < len(attention_space("float32", "sm_80", 32))
    assert AttentionConfig(16, 16, 8, 1) not in attention_space("float16", "sm_90", 64)  # 16 rows, 8 warps


def test_head_dim_padding_and_limits() -> None:
    assert [block_d(d) for d in (1, 16, 24, 64, 80, 128)] == [16, 16, 32, 64, 128, 128]
    with pytest.raises(DietcodeError, match="head dim"):
        block_d(0)
    with pytest.raises(DietcodeError, match="head dim"):
        block_d(257)


def test_template_arguments_are_the_attention_params() -> None:
    from tuner import templates

    fn = templates.attention_kernel
    runtime_args = [a for a, p in zip(fn.arg_names, fn.params) if not p.is_constexpr]
    assert runtime_args == list(templates.ATTENTION_PARAMS)


@pytest.mark.ptx
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_aot_compiles_bert_configs_within_limits(target: str) -> None:
    from tuner.attention import compile_attention
    from tuner.hardware import get_profile

    profile = get_profile(target)
    for config in (AttentionConfig(64, 64, 4, 2), AttentionConfig(128, 64, 8, 2)):
        kernel = compile_attention(config, "float16", target, 64, scale=0.125, has_mask=True, mask_rows=False)
        assert kernel.arch == profile.arch and kernel.cubin and ".entry attention_kernel" in kernel.ptx
        assert kernel.params == ("q", "k", "v", "mask", "out", "seq_q", "seq_k", "heads", "stride_mask_b",
                                 "stride_mask_h", "stride_mask_q", "stride_mask_k")
        assert 0 < kernel.shared <= profile.smem_per_block_optin and kernel.num_warps == config.num_warps
        assert kernel.n_spills == 0, f"{config.key()} spills {kernel.n_spills} B on {target}"
        assert ("wgmma" if target == "sm_90" else "mma.sync") in kernel.ptx
        assert dict(kernel.constants)["SCALE"] == 0.125 and dict(kernel.constants)["MASK_ROWS"] is False
    unmasked = compile_attention(AttentionConfig(32, 32, 4, 1), "float32", target, 32, scale=1.0, has_mask=False)
    assert "mask" not in unmasked.params and unmasked.n_spills == 0


def _code(ptx: str) -> list[str]:
    """The PTX's instructions: debug line records and sections dropped (they carry template line numbers)."""
    import re

    out, debug = [], False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section"):
            debug = ".debug" in line
        if debug or re.match(r"\s*(\.loc|\.file|\$L__)", line):
            continue
        out.append(line)
    return out


@pytest.mark.ptx
def test_aot_layouts_compile_and_are_recorded_in_the_bundle_kernel() -> None:
    """The head-split layouts compile ahead of time within the same limits, to other code than the contiguous
    layout (which stays the default and takes no new params), and the bundle kernel records them."""
    from dietcode_ort import bundle as fmt
    from tuner.attention import compile_attention

    config = AttentionConfig(64, 64, 4, 2)
    default = compile_attention(config, "float16", "sm_80", 64, scale=0.125, has_mask=True, mask_rows=False)
    explicit = compile_attention(config, "float16", "sm_80", 64, scale=0.125, has_mask=True, mask_rows=False,
                                 layout=0)
    strided = compile_attention(config, "float16", "sm_80", 64, scale=0.125, has_mask=True, mask_rows=False,
                                layout=15)
    assert _code(default.ptx) == _code(explicit.ptx) != _code(strided.ptx)
    assert strided.params == default.params and strided.n_spills == 0
    assert fmt.BundleKernel.from_compiled([default]).layout == 0
    assert fmt.BundleKernel.from_compiled([strided]).layout == 15
    with pytest.raises(DietcodeError, match="layout 32 is not a bit set"):
        compile_attention(config, "float16", "sm_80", 64, scale=0.125, has_mask=True, layout=32)
    with pytest.raises(DietcodeError, match="layout 16 is packed without q, k and v"):
        compile_attention(config, "float16", "sm_80", 64, scale=0.125, has_mask=True, layout=16)


def test_aot_refuses_configs_outside_the_space() -> None:
    from tuner.attention import compile_attention

    with pytest.raises(DietcodeError, match="not in the float16/sm_90/d=64 space"):
        compile_attention(AttentionConfig(16, 16, 8, 1), "float16", "sm_90", 64, scale=1.0, has_mask=False)


def test_bundle_carries_an_attention_kernel_in_the_attention_view(tmp_path) -> None:
    """An AOT attention kernel in a bundle: the C core parses it, names its view and checks calls."""
    from dietcode_ort import bundle as fmt
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.attention import compile_attention

    compiled = [compile_attention(AttentionConfig(64, 64, 4, 2), "float16", t, 64, scale=0.125, has_mask=True,
                                  mask_rows=False) for t in ("sm_80", "sm_90")]
    kernel = fmt.BundleKernel.from_compiled(compiled)
    assert kernel.view == "attention" and kernel.dtype == "float16" and kernel.block_m == 64
    payload = fmt.Bundle(features=(fmt.Feature("seq", ((0, -2),)),), kernels=(kernel,),
                         tree=fmt.DispatchTree.single(0)).to_bytes()
    core = load_core()
    parsed = core.parse(payload)
    assert core.lib.dc_bundle_kernel_view(parsed.handle, 0) == fmt.VIEWS.index("attention") == 3
    args = core.attention_view([2, 12, 17, 64], [2, 12, 64, 17], [2, 12, 17, 64], [2, 1, 1, 17], head_dim=64)
    assert args is not None
    assert (args.seq_q, args.seq_k, args.heads, args.batch) == (17, 17, 12, 24)
    assert (args.stride_mask_b, args.stride_mask_h, args.stride_mask_q, args.stride_mask_k) == (17, 0, 0, 1)
    fit = core.lib.dc_kernel_fit
    assert fit(parsed.handle, 0, ctypes.byref(args)) == 0
    for change, reason in (({"seq_q": 0}, "empty output"), ({"seq_k": 0}, "K is 0"), ({"batch": 12 * 5462}, "batch above grid z"),
                           ({"heads": 5}, "negative size"), ({"stride_mask_k": -1}, "negative size")):
        bad = LaunchArgs.from_buffer_copy(args)
        for name, value in change.items():
            setattr(bad, name, value)
        code = fit(parsed.handle, 0, ctypes.byref(bad))
        assert code > 0 and reason in core.lib.dc_fit_name(code).decode(), (change, code)
    assert "mask" in kernel.params and fmt.read_bundle(payload).kernels[0].view == "attention"


def test_attention_view_of_shapes() -> None:
    from dietcode_ort.runtime import load_core

    core = load_core()
    three = core.attention_view([6, 5, 32], [6, 32, 9], [6, 9, 32], [6, 1, 9])
    assert three is not None and (three.batch, three.heads, three.seq_q, three.seq_k) == (6, 1, 5, 9)
    assert (three.stride_mask_b, three.stride_mask_h, three.stride_mask_q, three.stride_mask_k) == (9, 0, 0, 1)
    no_mask = core.attention_view([1, 2, 1, 16], [1, 2, 16, 40], [1, 2, 40, 16])
    assert no_mask is not None and (no_mask.batch, no_mask.heads, no_mask.seq_k) == (2, 2, 40)
    assert core.attention_view([1, 1, 2, 3, 8], [1, 1, 2, 8, 3], [1, 1, 2, 3, 8]) is None  # rank 5
    with pytest.raises(DietcodeError, match="equal leading dims"):
        core.attention_view([2, 5, 8], [3, 8, 5], [2, 5, 8])
    with pytest.raises(DietcodeError, match="does not broadcast"):
        core.attention_view([2, 12, 5, 8], [2, 12, 8, 5], [2, 12, 5, 8], [3, 1, 1, 5])
    with pytest.raises(DietcodeError, match="head_dim attribute 64"):
        core.attention_view([2, 5, 8], [2, 8, 5], [2, 5, 8], head_dim=64)


def test_compile_filter_drops_spilling_configs() -> None:
    from tuner.attention import compile_attention_space

    small, large = AttentionConfig(64, 32, 4, 2), AttentionConfig(32, 128, 2, 1)  # large spills 2 warps
    space = compile_attention_space("float16", "sm_90", 64, has_mask=True, mask_rows=False, configs=[small, large])
    assert [k.config for k in space.kept] == [small]
    ((config, why),) = space.dropped
    assert config == large and why.startswith("spills ")


def test_attention_view_of_a_packed_projection() -> None:
    """The packed layout: Q, K and V each the one [B, T, 3 * H * d] projection; H from its last dim and the
    head_dim attribute; every size checked before use."""
    from dietcode_ort.runtime import load_core

    core = load_core()
    packed = [2, 17, 3 * 4 * 16]
    out_shape: list[int] = []
    args = core.attention_view(packed, packed, packed, [2, 1, 1, 17], head_dim=16, layout=31, out_shape=out_shape)
    assert args is not None and (args.seq_q, args.seq_k, args.heads, args.batch) == (17, 17, 4, 8)
    assert (args.stride_mask_b, args.stride_mask_h, args.stride_mask_q, args.stride_mask_k) == (17, 0, 0, 1)
    assert out_shape == [2, 17, 4, 16]  # the out bit: [B, T, H, d]
    core.attention_view(packed, packed, packed, head_dim=16, layout=23, out_shape=out_shape)
    assert out_shape == [2, 4, 17, 16]  # [B, H, T, d]
    refusals = (
        (([2, 17, 3 * 4 * 16 + 16],) * 3, 16, 31, "not a positive multiple of 3 \\* head_dim \\(head_dim 16\\)"),
        (([2, 17, 0],) * 3, 16, 31, "not a positive multiple"),
        (([2, 17, 192], [2, 16, 192], [2, 17, 192]), 16, 31, "one \\[batch, seq, 3 \\* heads \\* head_dim\\]"),
        (([2, 17, 192], [2, 17, 192], [2, 17, 96]), 16, 31, "one \\[batch, seq, 3 \\* heads \\* head_dim\\]"),
        (([2, 17, 4, 48],) * 3, 16, 31, "one \\[batch, seq"),
        (([2, 17, 192],) * 3, 0, 31, "needs the node's head_dim attribute"),
        (([2, 17, 192],) * 3, 16, 16, "layout 16 not a valid bit set"),
        (([2, 17, 192],) * 3, 16, 32, "layout 32 not a valid bit set"),
    )
    for shapes, head_dim, layout, message in refusals:
        with pytest.raises(DietcodeError, match=message):
            core.attention_view(*shapes, head_dim=head_dim, layout=layout)
    # offsets inside one head are int32: a packed row is 3 * heads * d elements
    big = [1, 1 << 20, 3 * 16 * 64]  # 2^20 rows of 3 * 1024 elements: past 2^31 packed, within it unpacked
    assert core.attention_view(big, big, big, head_dim=64, layout=23) is None
    assert "offsets past int32" in core.error()
    split = [1, 1 << 20, 16, 64]
    assert core.attention_view(split, split, split, head_dim=64, layout=7) is not None


@pytest.mark.ptx
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_aot_packed_layout_compiles_without_more_spills_than_the_head_split_layout(target: str) -> None:
    """The packed layout (Q, K, V read from one [B, S, 3*H*d] projection) compiles ahead of time to its own
    code, recorded in the bundle kernel (flags bit 7), spilling no more than the head-split layout (none)."""
    from dietcode_ort import bundle as fmt
    from tuner.attention import compile_attention

    config = AttentionConfig(64, 64, 4, 2)
    split = compile_attention(config, "float16", target, 64, scale=0.125, has_mask=True, mask_rows=False, layout=15)
    packed = compile_attention(config, "float16", target, 64, scale=0.125, has_mask=True, mask_rows=False, layout=31)
    assert _code(packed.ptx) != _code(split.ptx) and packed.params == split.params
    assert packed.n_spills == split.n_spills == 0
    assert fmt.BundleKernel.from_compiled([packed]).layout == 31
