"""One kernel ABI: every place that names the launch parameters agrees with the C core's table.

The names live in custom_ops/bundle_impl.h (kParamNames, exported as dc_abi_param_name); the bundle
writer's PARAM_NAMES, the ctypes mirror of dc_launch_args, the templates' ABI_PARAMS and the Triton
templates' own argument lists are checked against it here, so a change in one place fails until the
others follow (docs/abi.md).
"""
from __future__ import annotations

import pytest

from dietcode_ort.bundle import PARAM_NAMES, POINTER_PARAMS, VIEWS
from dietcode_ort.runtime import LaunchArgs, load_core

POINTERS = ("a", "b", "bias", "c", "residual", "q", "k", "v", "mask", "out", "workspace", "counters")


@pytest.fixture(scope="module")
def core_names() -> tuple[str, ...]:
    lib = load_core().lib
    names = []
    while (name := lib.dc_abi_param_name(len(names))) is not None:
        names.append(name.decode())
    assert lib.dc_abi_param_name(-1) is None
    return tuple(names)


def test_bundle_param_enum_is_the_cores(core_names) -> None:
    from tuner import templates

    assert PARAM_NAMES == core_names
    # residual (15) and then attention's params came after out_w, so the indices bundles written before them
    # store keep their meaning
    assert core_names[:4] == ("a", "b", "bias", "c") and core_names.index("out_w") == 14
    assert core_names[15] == "residual"
    assert core_names[16:28] == templates.ATTENTION_PARAMS
    # the split-K workspace came after the attention params (28)
    assert core_names[28:] == ("workspace", "counters")
    assert POINTER_PARAMS == POINTERS


def test_the_div16_mask_counts_attention_params_from_q() -> None:
    """The bundle's div16 mask is 16 bits and every attention param sits at index 16 or later: since format 10
    an attention kernel's bits count from q, so its pointers carry their alignment, while a GEMM kernel's mask
    still ends at param 15 (the workspace, 28, is refused with the reason)."""
    from dietcode_ort.bundle import BundleKernel
    from dietcode_ort.errors import DietcodeError
    from tuner import aot, templates

    assert min(PARAM_NAMES.index(p) for p in templates.ATTENTION_PARAMS) >= 16
    # format 10: an attention kernel's div16 bits count from q, so its pointers can carry the alignment
    kernel = BundleKernel(name="k", ptx=".version 8.0\n.target sm_80\n", params=templates.ATTENTION_PARAMS,
                          div16=aot.aligned_params("attention"), head_dim=64)
    kernel.validate(0)
    assert all(PARAM_NAMES.index(p) - 16 < 16 for p in templates.ATTENTION_PARAMS)
    with pytest.raises(DietcodeError, match="16 bits"):  # a GEMM kernel's mask still ends at param 15
        BundleKernel(name="k", ptx=".version 8.0\n.target sm_80\n", params=("a", "b", "c", "workspace", "counters"),
                     div16=("workspace",), split_k=2).validate(0)


def test_the_core_reads_the_residual_pointer_as_a_pointer() -> None:
    """A kernel assuming ``residual`` 16-byte aligned is refused a call whose residual pointer is not: the core
    checks it as a pointer (an int check would read LaunchArgs' zero int slot and pass)."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree

    kernel = BundleKernel(name="k", ptx=".version 8.0\n.target sm_80\n", params=("a", "b", "c", "M", "N", "K",
                          "residual"), div16=("residual",))
    core = load_core()
    bundle = core.parse(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes())
    args = LaunchArgs(a=256, b=512, c=768, residual=1024, M=16, N=16, K=16, batch=1)
    assert bundle.fit(0, args)[0] == "fits"
    args.residual = 1032
    fit, message = bundle.fit(0, args)
    assert fit != "fits" and "residual" in message


def test_launch_args_mirror_the_core_struct(core_names) -> None:
    import ctypes

    fields = [name for name, _ in LaunchArgs._fields_]
    # dc_launch_args: the pointers before the attention view's, the output's byte size, the int params in enum
    # order; then the attention view's pointers and ints, each in enum order; then the split-K workspace and
    # its size in bytes, the SM count and the attention call's head dim (the split-K counters, param 29, are the
    # launcher's own: no field)
    first, attention, last = core_names[:16], core_names[16:28], core_names[28:29]
    assert fields == ([p for p in first if p in POINTERS] + ["c_bytes"] + [p for p in first if p not in POINTERS]
                      + [p for p in attention if p in POINTERS] + [p for p in attention if p not in POINTERS]
                      + list(last) + ["workspace_bytes", "sm_count", "head_dim"])
    for name, ctype in LaunchArgs._fields_:
        assert ctype is (ctypes.c_uint64 if name in POINTERS or name in ("c_bytes", "workspace_bytes")
                         else ctypes.c_int32), name
    # 4 added the residual pointer, 5 the attention fields: each grew the struct, so the ABI version says so
    # (6 added the kernel alpha accessor and check Python binds; 7 the split-K workspace and the kernel causal
    # accessor; 8 the device's SM count for persistent grids, last, and the packed QKV attention layout; 9 the
    # residual before the activation: dc_bundle_kernel_residual_first and dc_epilogue.residual_first; 10 the
    # activations 3 gelu_tanh, 4 silu, 5 relu6 in dc_epilogue, the vendor plans and dc_bundle_check_node, and the
    # residual multiplied after the activation: dc_bundle_kernel_residual_mul and dc_epilogue.residual_mul, and an
    # attention call's head dim, last, checked against the kernel's HEAD_DIM; 11 grouped conv kernels:
    # dc_bundle_kernel_grouped, and the conv view of group > 1 as batch = group; 12 the vendor GEMM's cuBLASLt
    # path: dc_gemm_lt_plan, dc_vendor_gemm_lt, dc_vendor_gemm_call; 13 channels-last conv kernels:
    # dc_bundle_kernel_channels_last, dc_bundle_check_node's channels_last, dc_abi_view's 10th conv int and
    # dc_conv_plan_make's channels_last, which grew dc_conv_plan; 14 the split-K counters, param 29, which the
    # launcher keeps per stream)
    assert load_core().lib.dc_abi_version() == 14


def test_template_params_are_abi_names_in_enum_order(core_names) -> None:
    from tuner import templates

    for op, params in templates.ABI_PARAMS.items():
        assert [p for p in core_names if p in params] == list(params), op
        # the Triton template takes exactly these runtime arguments, in this order (constexprs aside)
        fn = templates.kernel_for(op)
        runtime_args = [a for a, p in zip(fn.arg_names, fn.params) if not p.is_constexpr]
        assert runtime_args == list(params), op


def test_views_follow_the_templates() -> None:
    from dietcode_ort.bundle import BundleKernel
    from tuner import templates

    assert VIEWS == ("gemm", "bmm", "conv", "attention")
    for op, params in templates.ABI_PARAMS.items():
        assert BundleKernel(name="k", params=params).view == op
