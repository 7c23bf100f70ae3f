"""One kernel ABI: every place that names the launch parameters agrees with the C core's table.

The names live in custom_ops/bundle_impl.h (kParamNames, exported as dc_abi_param_name); the bundle
writer's PARAM_NAMES, the ctypes mirror of dc_launch_args, the templates' ABI_PARAMS and the Triton
templates' own argument lists are checked against it here, so a change in one place fails until the
others follow (docs/abi.md).
"""
from __future__ import annotations

import pytest

from dietcode_ort.bundle import PARAM_NAMES, VIEWS
from dietcode_ort.runtime import LaunchArgs, load_core

POINTERS = ("a", "b", "bias", "c")


@pytest.fixture(scope="module")
def core_names() -> tuple[str, ...]:
    lib = load_core().lib
    names = []
    while (name := lib.dc_abi_param_name(len(names))) is not None:
        names.append(name.decode())
    assert lib.dc_abi_param_name(-1) is None
    return tuple(names)


def test_bundle_param_enum_is_the_cores(core_names) -> None:
    assert PARAM_NAMES == core_names


def test_launch_args_mirror_the_core_struct(core_names) -> None:
    fields = [name for name, _ in LaunchArgs._fields_]
    # dc_launch_args: the pointers, the output's byte size, then every int param in enum order
    assert fields == list(POINTERS) + ["c_bytes"] + [p for p in core_names if p not in POINTERS]


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
