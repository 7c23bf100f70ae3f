"""The vendor path on CUDA (custom_ops/vendor.h): a call no compiled kernel takes runs as cuBLAS or cuDNN on
ONNX Runtime's own handles and stream plus a PTX epilogue, never ORT's kernel through Ort::Op (whose standalone
context has no compute stream).

On the CPU: the call plans against numpy and ORT's CPU Conv, the real dc_vendor_gemm / dc_vendor_conv driven
through a host-memory stand-in for cuBLAS and cuDNN (tests/_fake_vendor_libs.c: their signatures and
semantics), the epilogue's bias indexing against numpy broadcasting, the epilogue's PTX run by a host executor
(tests/_ptx_run.py) against numpy and assembled by ptxas. On a GPU: sessions whose bundle picks the vendor
kind for every call against stock ORT.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import dietcode_ort
from _conv_reference import ort_conv
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
from dietcode_ort.errors import DietcodeError
from dietcode_ort.runtime import ConvAlgoCache, ConvPlan, load_core
from tests.test_custom_ops import SUFFIXES, custom_model, reference_model

HERE = Path(__file__).resolve().parent
STREAM = 0x5EED  # any value: the stand-in records the stream it was bound to
DTYPES = {"float32": np.float32, "float16": np.float16}


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32, as uint16 bits and values."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bits


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory) -> ctypes.CDLL:
    """The stand-in, built and made the vendor path's cuBLAS, cuBLASLt and cuDNN for this process."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("fake_vendor_libs") / "libfakevendor.so"
    lang = ["-x", "c"] if cc.endswith("g++") else []
    subprocess.run([cc, *lang, "-O1", "-shared", "-fPIC", str(HERE / "_fake_vendor_libs.c"), "-o", str(out), "-lm",
                    "-ldl"], check=True, capture_output=True)
    load_core().vendor_cublas_load(out)
    load_core().vendor_cublaslt_load(out)
    load_core().vendor_cudnn_load(out)
    return ctypes.CDLL(str(out))


# (id, op, A shape, B shape, Gemm attrs); shapes are the node's inputs as given
GEMM_CASES = [
    ("matmul2d", "MatMul", (5, 7), (7, 3), {}),
    ("matmul3d_folds_batch", "MatMul", (2, 5, 7), (7, 3), {}),
    ("matmul_attention", "MatMul", (2, 3, 5, 4), (2, 3, 4, 6), {}),
    ("matmul_shared_a", "MatMul", (5, 4), (3, 4, 6), {}),
    ("matmul_broadcast_ones", "MatMul", (1, 2, 5, 4), (2, 4, 6), {}),
    ("matmul_vector_a", "MatMul", (4,), (2, 4, 3), {}),
    ("matmul_vector_b", "MatMul", (2, 5, 4), (4,), {}),
    ("matmul_k1", "MatMul", (3, 1), (1, 4), {}),
    ("matmul_scaled_scores", "MatMul", (2, 3, 5, 4), (2, 3, 4, 6), {"alpha": 0.125}),  # a fused Div: cuBLAS alpha
    ("gemm", "Gemm", (5, 7), (7, 3), {"alpha": 0.5}),
    ("gemm_transA", "Gemm", (7, 5), (7, 3), {"trans_a": True}),
    ("gemm_transB", "Gemm", (5, 7), (3, 7), {"trans_b": True, "alpha": 2.0}),
    ("gemm_transAB", "Gemm", (7, 5), (3, 7), {"trans_a": True, "trans_b": True}),
]


def _reference(op: str, a: np.ndarray, b: np.ndarray, attrs: dict) -> np.ndarray:
    if op == "MatMul":  # alpha: the node's fused scale
        return attrs.get("alpha", 1.0) * np.matmul(a.astype(np.float64), b.astype(np.float64))
    a2 = a.T if attrs.get("trans_a") else a
    b2 = b.T if attrs.get("trans_b") else b
    return attrs.get("alpha", 1.0) * (a2.astype(np.float64) @ b2.astype(np.float64))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_vendor_gemm_through_the_c_abi_equals_numpy(fake_libs, case, dtype) -> None:
    """dc_gemm_plan_make + dc_vendor_gemm with host pointers: the column-major cuBLAS call it makes (operands,
    transposes, leading dims, batch strides, data and compute types, the stream) computes the node's product."""
    _, op, sa, sb, attrs = case
    core = load_core()
    rng = np.random.default_rng(len(sa) * 10 + len(sb))
    a32, b32 = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    if dtype == "bfloat16":
        a, b = _bf16_round(a32), _bf16_round(b32)
        a_val, b_val = _bf16_value(a), _bf16_value(b)
    else:
        a, b = a32.astype(DTYPES[dtype]), b32.astype(DTYPES[dtype])
        a_val, b_val = a.astype(np.float32), b.astype(np.float32)
    want = _reference(op, a_val, b_val, attrs)
    plan = core.gemm_plan(op, sa, sb, dtype=dtype, **attrs)
    assert plan is not None, core.error()
    out_dtype = np.uint16 if dtype == "bfloat16" else DTYPES[dtype]
    out = np.full(want.shape, 0x7FC0 if dtype == "bfloat16" else np.nan, dtype=out_dtype)  # beta = 0: never read
    calls = ctypes.c_int.in_dll(fake_libs, "fake_calls").value
    core.vendor_gemm(plan, a.ctypes.data, b.ctypes.data, out.ctypes.data, handle=1, stream=STREAM)
    assert ctypes.c_int.in_dll(fake_libs, "fake_calls").value == calls + 1
    assert ctypes.c_void_p.in_dll(fake_libs, "fake_last_stream").value == STREAM
    assert ctypes.c_int.in_dll(fake_libs, "fake_last_compute").value == (77 if dtype == "float32" else 68)
    got = _bf16_value(out) if dtype == "bfloat16" else out.astype(np.float32)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_vendor_gemm_binds_the_handle_to_the_stream_only_when_it_is_not(fake_libs) -> None:
    core = load_core()
    plan = core.gemm_plan("MatMul", (2, 3), (3, 2))
    a, b, out = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), np.zeros((2, 2), np.float32)
    ctypes.c_void_p.in_dll(fake_libs, "fake_bound_stream").value = 0x1234  # bound elsewhere
    sets = ctypes.c_int.in_dll(fake_libs, "fake_set_stream_calls")
    before = sets.value
    core.vendor_gemm(plan, a.ctypes.data, b.ctypes.data, out.ctypes.data, handle=1, stream=STREAM)
    core.vendor_gemm(plan, a.ctypes.data, b.ctypes.data, out.ctypes.data, handle=1, stream=STREAM)
    assert sets.value == before + 1  # the second call finds it bound (cublasSetStream resets the workspace)
    assert ctypes.c_void_p.in_dll(fake_libs, "fake_last_stream").value == STREAM
    np.testing.assert_array_equal(out, np.full((2, 2), 3.0))


def test_plan_batches_with_strided_calls_and_folds_a_shared_b() -> None:
    core = load_core()
    fold = core.gemm_plan("MatMul", (4, 5, 7), (7, 3))  # B shared: A's batch folds into its rows
    assert (fold.batch, fold.m, fold.n, fold.k) == (1, 3, 20, 7)
    shared_a = core.gemm_plan("MatMul", (5, 7), (4, 7, 3))
    assert (shared_a.batch, shared_a.stride_y, shared_a.stride_x, shared_a.stride_c) == (4, 0, 21, 15)
    assert core.gemm_plan("MatMul", (5, 7), (7, 3), tf32=False).compute_type == 68


def test_plan_refuses_what_one_cublas_call_cannot_express() -> None:
    core = load_core()
    assert core.gemm_plan("MatMul", (2, 1, 5, 4), (1, 3, 4, 6)) is None  # both batch shapes broadcast
    assert "broadcasts both batch shapes" in core.error()
    assert core.gemm_plan("MatMul", (1, 2**31), (2**31, 1)) is None
    assert "int32" in core.error()
    assert core.gemm_plan("MatMul", (2, 3, 4, 5), (5, 6), (2, 1, 1, 6)) is None  # bias along dims 0 and 3 only
    assert "non-adjacent" in core.error()
    with pytest.raises(DietcodeError, match="does not broadcast"):
        core.gemm_plan("MatMul", (3, 4), (4, 5), (4,))
    with pytest.raises(DietcodeError):
        core.gemm_plan("Gemm", (3, 4), (5, 6))  # K mismatch


# (op, A, B, bias shape, attrs): the epilogue indexes the bias as (r % bias_rows) * bias_rs + c * bias_cs
BIAS_CASES = [
    ("MatMul", (2, 3, 4), (4, 5), (5,), {}),
    ("MatMul", (2, 3, 4), (4, 5), (1, 1, 5), {}),
    ("MatMul", (2, 3, 4), (4, 5), (2, 3, 5), {}),
    ("MatMul", (2, 3, 4), (4, 5), (3, 5), {}),
    ("MatMul", (2, 3, 4), (4, 5), (3, 1), {}),
    ("MatMul", (2, 3, 4), (4, 5), (1,), {}),
    ("MatMul", (2, 3, 4), (4, 1), (2, 3, 1), {}),
    ("Gemm", (3, 4), (4, 5), (5,), {"beta": 0.5}),
    ("Gemm", (3, 4), (4, 5), (3, 1), {}),
    ("Gemm", (3, 4), (4, 5), (3, 5), {"beta": 2.0}),
    ("Gemm", (3, 4), (4, 5), (), {}),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=[f"{c[0]}-{c[3]}" for c in BIAS_CASES])
def test_epilogue_bias_indexing_equals_numpy_broadcasting(case) -> None:
    op, sa, sb, sbias, attrs = case
    gemm = load_core().gemm_plan(op, sa, sb, sbias, **attrs)
    assert gemm is not None and gemm.epilogue.has_bias == 1
    plan = gemm.epilogue
    out_shape = np.matmul(np.zeros(sa), np.zeros(sb)).shape
    bias = np.arange(1, int(np.prod(sbias)) + 1, dtype=np.float64).reshape(sbias)
    want = attrs.get("beta", 1.0) * np.broadcast_to(bias, out_shape).reshape(-1)
    i = np.arange(int(np.prod(out_shape)))
    r, c = i // plan.cols, i % plan.cols
    got = plan.bias_scale * bias.reshape(-1)[(r % plan.bias_rows) * plan.bias_rs + c * plan.bias_cs]
    assert plan.rows * plan.cols == len(i)
    np.testing.assert_array_equal(got, want)


def test_gemm_beta_zero_adds_no_bias() -> None:
    assert load_core().gemm_plan("Gemm", (3, 4), (4, 5), (5,), beta=0.0).epilogue.has_bias == 0


# --- cuBLASLt: the GEMM and its epilogue as one call ----------------------------------------------------------

RESIDUALS = {"": {}, "after": {"has_residual": 1}, "first": {"has_residual": 1, "residual_first": 1},
             "mul": {"has_residual": 1, "residual_mul": 1}}


def _with_residual(plan, residual: str):
    """The plan with its epilogue's residual flags set, as ort_ops.cc sets them from the op type."""
    for name, value in RESIDUALS[residual].items():
        setattr(plan.epilogue, name, value)
    return plan


# (bias, activation, residual) -> the cublasLtEpilogue_t of the one fused call, or None: cuBLAS + the PTX epilogue
LT_EPILOGUES = {
    (True, "none", ""): 4, (True, "relu", ""): 6, (True, "gelu_tanh", ""): 36,
    (False, "relu", ""): 2, (False, "gelu_tanh", ""): 32,
    (True, "none", "after"): 4, (False, "none", "after"): 1,
    (True, "relu", "first"): 6, (True, "gelu_tanh", "first"): 36, (False, "relu", "first"): 2,
    (False, "gelu_tanh", "first"): 32,
}
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "relu6")


@pytest.mark.parametrize("residual", list(RESIDUALS))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_lt_plan_fuses_exactly_the_epilogues_cublaslt_computes(bias, activation, residual) -> None:
    """cuBLASLt computes act(alpha A B + beta C + bias) with relu or the tanh GELU: a bias vector along the
    output's last dim, those activations, and the residual as C where it comes before the activation (or there
    is none) fuse; the erf GELU, silu, relu6, the residual after an activation or multiplying it do not."""
    core = load_core()
    plan = _with_residual(core.gemm_plan("MatMul", (2, 3, 4), (4, 5), (5,) if bias else None,
                                         activation=activation), residual)
    lt = core.gemm_lt_plan(plan)
    want = LT_EPILOGUES.get((bias, activation, residual))
    if residual == "first" and activation == "none":
        want = LT_EPILOGUES[(bias, "none", "after")]  # the residual's place does not matter without an activation
    if not bias and activation == "none" and not residual:
        assert lt is None and "no epilogue" in core.error()
        return
    if want is None:
        assert lt is None, (lt.epilogue, bias, activation, residual)
        why = core.error()
        assert any(w in why for w in ("erf GELU", "silu", "relu6", "after the activation", "multiplies")), why
        return
    assert lt is not None, core.error()
    assert (lt.epilogue, lt.has_bias, lt.residual_c, lt.beta) == (want, int(bias), int(bool(residual)),
                                                                  1.0 if residual else 0.0)


def test_lt_plan_keeps_batches_broadcast_and_scaled_biases_unfused() -> None:
    core = load_core()
    batched = core.gemm_plan("MatMul", (2, 3, 4), (2, 4, 5), (5,))
    assert core.gemm_lt_plan(batched) is None and "batch of 2" in core.error()
    for bias in ((3, 5), (3, 1), (1,)):  # per row, per row and column, a scalar
        assert core.gemm_lt_plan(core.gemm_plan("MatMul", (3, 4), (4, 5), bias)) is None, bias
        assert "one vector along the output's last dim" in core.error()
    assert core.gemm_lt_plan(core.gemm_plan("Gemm", (3, 4), (4, 5), (5,), beta=0.5)) is None
    assert "scaled by Gemm's beta" in core.error()
    assert core.gemm_lt_plan(core.gemm_plan("Gemm", (3, 4), (4, 5), (5,), alpha=0.5, beta=1.0)) is not None
    assert core.gemm_lt_plan(core.gemm_plan("MatMul", (3, 0), (0, 5), (5,))) is None and "empty" in core.error()
    assert core.gemm_lt_plan(core.gemm_plan("MatMul", (1, 2, 3, 4), (4, 5), (1, 5))) is not None  # folds to one


def _lt_counts(fake) -> tuple[int, int]:
    return ctypes.c_int.in_dll(fake, "fake_lt_matmuls").value, ctypes.c_int.in_dll(fake, "fake_calls").value


def _alignment(address: int) -> int:
    return 256 if address == 0 else min(256, address & -address)


def _values(dtype: str, shape, rng, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Random data in ``dtype`` (bfloat16 as uint16 bits) and its exact float64 values."""
    x = _to_dtype_bits((rng.standard_normal(shape) * scale).astype(np.float32), dtype)
    return x, _from_dtype_bits(x, dtype).astype(np.float64)


LT_CALLS = [  # (id, op, A, B, bias, attrs)
    ("matmul3d", "MatMul", (2, 3, 6), (6, 5), (5,), {}),
    ("matmul_scaled", "MatMul", (4, 6), (6, 5), (1, 5), {"alpha": 0.25}),
    ("gemm_transA", "Gemm", (6, 4), (6, 5), (5,), {"trans_a": True, "alpha": 0.5}),
    ("gemm_transB", "Gemm", (4, 6), (5, 6), (5,), {"trans_b": True}),
    ("gemm_transA_transB", "Gemm", (6, 4), (5, 6), (5,), {"trans_a": True, "trans_b": True, "alpha": 2.0}),
]
LT_TAKEN = [(b, a, r) for (b, a, r) in LT_EPILOGUES] + [(True, "none", "first")]
_LT_HANDLES = itertools.count(0x1000)  # stand-in cuBLASLt handles: the choice is kept per handle


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("epilogue", LT_TAKEN, ids=lambda e: f"{'bias' if e[0] else 'nobias'}-{e[1]}-{e[2] or 'nores'}")
@pytest.mark.parametrize("case", LT_CALLS, ids=[c[0] for c in LT_CALLS])
def test_lt_fused_call_equals_numpy(fake_libs, case, epilogue, dtype) -> None:
    """dc_vendor_gemm_call with the fused form: one cublasLtMatmul (the stand-in computes D = epilogue(alpha
    op(A) op(B) + beta C + bias) as cuBLASLt does), no cublasGemmEx; the operands, transposes, epilogue, bias
    pointer, the residual as C with beta 1, the pointers' alignments, compute type and stream it passes make
    the node's act(alpha A B + bias + residual)."""
    _, op, sa, sb, sbias, attrs = case
    has_bias, activation, residual = epilogue
    core, fake = load_core(), fake_libs
    rng = np.random.default_rng(len(sa) + len(sb) + 7)
    a, a64 = _values(dtype, sa, rng)
    b, b64 = _values(dtype, sb, rng)
    bias, bias64 = _values(dtype, sbias, rng) if has_bias else (None, 0.0)
    plan = _with_residual(core.gemm_plan(op, sa, sb, sbias if has_bias else None, dtype=dtype,
                                         activation=activation, **attrs), residual)
    lt = core.gemm_lt_plan(plan)
    assert lt is not None, core.error()
    y64 = attrs.get("alpha", 1.0) * _reference(op, a64, b64, {k: v for k, v in attrs.items() if k != "alpha"})
    res, res64 = _values(dtype, y64.shape, rng, 2.0) if residual else (None, 0.0)
    h = y64 + bias64 + res64
    if activation == "relu":
        h = np.maximum(h, 0.0)
    elif activation == "gelu_tanh":
        h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    out = np.zeros(y64.shape, dtype=np.uint16 if dtype == "bfloat16" else DTYPES[dtype])
    lt_before, gemm_before = _lt_counts(fake)
    fused, why = core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data,
                                       bias=bias.ctypes.data if has_bias else 0,
                                       residual=res.ctypes.data if residual else 0, handle=1,
                                       lt_handle=next(_LT_HANDLES), stream=STREAM)  # a handle of its own: a query
    assert (fused, why) == (True, "")
    assert _lt_counts(fake) == (lt_before + 1, gemm_before)  # the fused call only
    assert ctypes.c_uint.in_dll(fake, "fake_lt_last_epilogue").value == lt.epilogue
    assert ctypes.c_int.in_dll(fake, "fake_lt_last_compute").value == (77 if dtype == "float32" else 68)
    assert ctypes.c_void_p.in_dll(fake, "fake_lt_last_stream").value == STREAM
    assert ctypes.c_int.in_dll(fake, "fake_lt_last_in_place").value == (0 if residual else 1)
    c_ptr = res.ctypes.data if residual else out.ctypes.data  # cuBLASLt's A is the node's B, its B the node's A
    want_align = [_alignment(p) for p in (b.ctypes.data, a.ctypes.data, c_ptr, out.ctypes.data)]
    assert list((ctypes.c_uint32 * 4).in_dll(fake, "fake_lt_last_align")) == want_align
    _assert_rounded_close(out, h, dtype, {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype])


UNFUSED = [  # (id, op, A, B, bias, activation, residual, attrs)
    ("erf_gelu", "MatMul", (3, 6), (6, 5), (5,), "gelu", "", {}),
    ("silu_mul", "MatMul", (3, 6), (6, 5), (5,), "silu", "mul", {}),
    ("relu_then_residual", "MatMul", (3, 6), (6, 5), (5,), "relu", "after", {}),
    ("relu6", "MatMul", (3, 6), (6, 5), None, "relu6", "", {}),
    ("batched", "MatMul", (2, 3, 6), (2, 6, 5), (5,), "none", "", {}),
    ("bias_per_row", "MatMul", (3, 6), (6, 5), (3, 1), "relu", "", {}),
    ("gemm_beta", "Gemm", (3, 6), (6, 5), (5,), "none", "", {"beta": 0.5}),
]


@pytest.mark.parametrize("case", UNFUSED, ids=[c[0] for c in UNFUSED])
def test_unfused_calls_run_cublas_and_the_ptx_epilogue(fake_libs, case) -> None:
    """The calls cuBLASLt cannot fuse exactly: no fused form, so the call runs cublasGemmEx (or the batched
    call) and no cublasLtMatmul, and cuBLAS's output with the PTX epilogue run on it (tests/_ptx_run.py) is the
    node's result."""
    from tests import _ptx_run

    _, op, sa, sb, sbias, activation, residual, attrs = case
    core, fake = load_core(), fake_libs
    rng = np.random.default_rng(5)
    a, a64 = _values("float32", sa, rng)
    b, b64 = _values("float32", sb, rng)
    plan = _with_residual(core.gemm_plan(op, sa, sb, sbias, activation=activation, **attrs), residual)
    assert core.gemm_lt_plan(plan) is None
    y = np.zeros(np.matmul(a64, b64).shape, np.float32)
    lt_before, gemm_before = _lt_counts(fake)
    assert core.vendor_gemm_call(plan, None, a.ctypes.data, b.ctypes.data, y.ctypes.data, handle=1, lt_handle=1,
                                 stream=STREAM) == (False, "")
    assert _lt_counts(fake) == (lt_before, gemm_before + 1)
    h = np.matmul(a64, b64)
    memory = _ptx_run.Memory()
    y_addr, bias_addr, res_addr = memory.place(y), 0, 0
    if sbias is not None:
        bias, bias64 = _values("float32", sbias, rng)
        bias_addr = memory.place(bias)
        h = h + attrs.get("beta", 1.0) * np.broadcast_to(bias64, h.shape)
    act = {"none": lambda x: x, "relu": lambda x: np.maximum(x, 0.0), "relu6": lambda x: np.clip(x, 0.0, 6.0),
           "gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
           "silu": lambda x: x / (1.0 + np.exp(-x))}[activation]
    h = act(h)
    if residual:
        r, r64 = _values("float32", h.shape, rng)
        res_addr = memory.place(r)
        h = h * r64 if residual == "mul" else h + r64
    _run_epilogue(core, "float32", plan.epilogue, memory, y_addr, bias_addr, res_addr, 2 if residual == "mul" else 0,
                  row_threads=2)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)


def _lt_case(core, handle_m: int = 4):
    """A float32 MatMulBiasRelu call [m, 6] x [6, 5] and its buffers."""
    rng = np.random.default_rng(handle_m)
    a, b = rng.standard_normal((handle_m, 6)).astype(np.float32), rng.standard_normal((6, 5)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    plan = core.gemm_plan("MatMul", a.shape, b.shape, bias.shape, activation="relu")
    want = np.maximum(a.astype(np.float64) @ b + bias, 0.0)
    return plan, core.gemm_lt_plan(plan), a, b, bias, want


@pytest.fixture
def fresh_lt(fake_libs):
    """The stand-in's cuBLASLt answering and succeeding, restored after the test."""
    names = ("fake_lt_heuristic_status", "fake_lt_matmul_status")
    yield fake_libs
    for name in names:
        ctypes.c_int.in_dll(fake_libs, name).value = 0
    ctypes.c_size_t.in_dll(fake_libs, "fake_lt_workspace").value = 0


def test_lt_descriptors_are_made_once_per_plan_and_take_each_calls_bias(fresh_lt) -> None:
    """A thread keeps its cuBLASLt descriptors per plan: after a plan's first call its calls create and destroy
    none (the stand-in counts the live ones), each still adds its own bias (the pointer is set per call, on the
    kept operation descriptor), and another M makes one more set: the operation and the A, B and D layouts."""
    core, fake = load_core(), fresh_lt
    live = ctypes.c_int.in_dll(fake, "fake_lt_live_descriptors")
    plan, lt, a, b, bias, want = _lt_case(core, 23)
    out = np.zeros_like(want, dtype=np.float32)
    assert core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=bias.ctypes.data,
                                 handle=1, lt_handle=101, stream=STREAM) == (True, "")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    made = live.value
    for shift in (1.0, -2.0, 3.5):  # other bias buffers on the same plan
        other = (bias + shift).astype(np.float32)
        out[:] = 0.0
        assert core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=other.ctypes.data,
                                     handle=1, lt_handle=101, stream=STREAM) == (True, "")
        np.testing.assert_allclose(out, np.maximum(a.astype(np.float64) @ b + other, 0.0), rtol=1e-5, atol=1e-5)
    assert live.value == made
    plan29, lt29, a29, b29, bias29, want29 = _lt_case(core, 29)
    out29 = np.zeros_like(want29, dtype=np.float32)
    assert core.vendor_gemm_call(plan29, lt29, a29.ctypes.data, b29.ctypes.data, out29.ctypes.data,
                                 bias=bias29.ctypes.data, handle=1, lt_handle=101, stream=STREAM) == (True, "")
    np.testing.assert_allclose(out29, want29, rtol=1e-5, atol=1e-5)
    assert live.value == made + 4


def test_lt_heuristic_runs_once_per_key(fresh_lt) -> None:
    """cublasLtMatmulAlgoGetHeuristic once per (handle, sizes, types, epilogue, alignments, workspace), the choice
    kept for the process: repeated calls query nothing; another M, handle or alignment queries once more, with
    the pointers' alignment as the MIN_ALIGNMENT preferences."""
    core, fake = load_core(), fresh_lt
    heuristic = ctypes.c_int.in_dll(fake, "fake_lt_heuristic_calls")
    plan, lt, a, b, bias, want = _lt_case(core, 7)
    out = np.zeros_like(want, dtype=np.float32)
    calls0, queries0 = core.vendor_lt_stats()
    before = heuristic.value
    for _ in range(3):
        assert core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=bias.ctypes.data,
                                     handle=1, lt_handle=101, stream=STREAM) == (True, "")
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert heuristic.value == before + 1 and core.vendor_lt_stats() == (calls0 + 3, queries0 + 1)
    core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=bias.ctypes.data, handle=1,
                          lt_handle=102, stream=STREAM)  # another handle (device)
    plan9, lt9, a9, b9, bias9, want9 = _lt_case(core, 9)  # another M
    out9 = np.zeros_like(want9, dtype=np.float32)
    core.vendor_gemm_call(plan9, lt9, a9.ctypes.data, b9.ctypes.data, out9.ctypes.data, bias=bias9.ctypes.data,
                          handle=1, lt_handle=101, stream=STREAM)
    np.testing.assert_allclose(out9, want9, rtol=1e-5, atol=1e-5)
    assert heuristic.value == before + 3
    buffer = np.zeros(out.size + 1, np.float32)  # an output at a 4-byte offset: alignment 4 (or more) apart
    shifted = buffer[1:].reshape(out.shape)
    core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, shifted.ctypes.data, bias=bias.ctypes.data,
                          handle=1, lt_handle=101, stream=STREAM)
    assert heuristic.value == before + 4
    align = list((ctypes.c_uint32 * 4).in_dll(fake, "fake_lt_last_align"))
    assert align[3] == _alignment(shifted.ctypes.data) and align[2] == align[3]  # C is D without a residual
    np.testing.assert_allclose(shifted, want, rtol=1e-5, atol=1e-5)


def test_lt_failures_fall_back_to_cublas_with_the_reason_once_per_key(fresh_lt) -> None:
    """A failing heuristic query or cublasLtMatmul: the call runs cuBLAS (the caller adds the PTX epilogue) and
    says why; the failure is kept for the key, so later calls neither query nor try again."""
    core, fake = load_core(), fresh_lt
    heuristic = ctypes.c_int.in_dll(fake, "fake_lt_heuristic_calls")
    plan, lt, a, b, bias, _ = _lt_case(core, 11)
    out = np.zeros((11, 5), np.float32)
    product = a.astype(np.float64) @ b
    ctypes.c_int.in_dll(fake, "fake_lt_heuristic_status").value = 15  # CUBLAS_STATUS_NOT_SUPPORTED
    before = heuristic.value
    for _ in range(2):
        lt_before, gemm_before = _lt_counts(fake)
        fused, why = core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data,
                                           bias=bias.ctypes.data, handle=1, lt_handle=201, stream=STREAM)
        assert not fused and "cublasLtMatmulAlgoGetHeuristic" in why and "status 15" in why, why
        assert _lt_counts(fake) == (lt_before, gemm_before + 1)
        np.testing.assert_allclose(out, product, rtol=1e-5, atol=1e-5)  # cuBLAS's product, the epilogue to come
    assert heuristic.value == before + 1

    ctypes.c_int.in_dll(fake, "fake_lt_heuristic_status").value = 0
    ctypes.c_int.in_dll(fake, "fake_lt_matmul_status").value = 15
    for _ in range(2):
        fused, why = core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data,
                                           bias=bias.ctypes.data, handle=1, lt_handle=202, stream=STREAM)
        assert not fused and "cublasLtMatmul (" in why and "status 15 CUBLAS_STATUS_NOT_SUPPORTED" in why, why
    ctypes.c_int.in_dll(fake, "fake_lt_matmul_status").value = 0
    assert core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=bias.ctypes.data,
                                 handle=1, lt_handle=202, stream=STREAM)[0] is False  # kept for the key
    assert core.vendor_gemm_call(plan, None, a.ctypes.data, b.ctypes.data, out.ctypes.data, handle=1,
                                 lt_handle=202, stream=STREAM) == (False, "")  # no fused form: nothing to say
    _, why = core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=bias.ctypes.data,
                                   handle=1, stream=STREAM)
    assert why == "no cuBLASLt handle"
    with pytest.raises(DietcodeError, match="adds a bias but none was given"):
        core.vendor_gemm_lt(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, handle=203, stream=STREAM)


def test_lt_takes_an_algorithm_within_the_workspace_it_is_given(fresh_lt) -> None:
    """The heuristic is asked for algorithms needing at most the workspace the call gives: none within 0 bytes
    (the call falls back, saying so); within 1 MiB it runs, with that buffer."""
    core, fake = load_core(), fresh_lt
    ctypes.c_size_t.in_dll(fake, "fake_lt_workspace").value = 4096
    plan, lt, a, b, bias, want = _lt_case(core, 13)
    out = np.zeros_like(want, dtype=np.float32)
    fused, why = core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data,
                                       bias=bias.ctypes.data, handle=1, lt_handle=301, stream=STREAM)
    assert not fused and "found no algorithm within a 0-byte workspace" in why
    workspace = np.zeros(1 << 20, np.uint8)
    assert core.vendor_gemm_call(plan, lt, a.ctypes.data, b.ctypes.data, out.ctypes.data, bias=bias.ctypes.data,
                                 handle=1, lt_handle=301, stream=STREAM, workspace=workspace.ctypes.data,
                                 workspace_bytes=workspace.size) == (True, "")
    assert ctypes.c_uint64.in_dll(fake, "fake_lt_last_max_ws").value == workspace.size
    assert ctypes.c_void_p.in_dll(fake, "fake_lt_last_ws").value == workspace.ctypes.data
    assert (workspace == 0xA5).all()  # cuBLASLt wrote the workspace it was given
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# (id, X shape, W shape, attrs as ONNX takes them)
CONV_CASES = [
    ("plain", (2, 3, 7, 6), (4, 3, 3, 3), {}),
    ("stride_pad_dilation", (1, 3, 9, 10), (4, 3, 3, 3), {"strides": [2, 1], "pads": [1, 2, 1, 2], "dilations": [1, 2]}),
    ("groups", (2, 4, 6, 6), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ("depthwise", (1, 3, 5, 5), (3, 1, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),
    ("same_upper_symmetric", (1, 2, 7, 7), (3, 2, 3, 3), {"auto_pad": "SAME_UPPER"}),
    ("valid_1x1", (2, 5, 4, 3), (7, 5, 1, 1), {"auto_pad": "VALID"}),
]


def _plan_kwargs(attrs: dict) -> dict:
    return {"strides": attrs.get("strides", (1, 1)), "pads": attrs.get("pads", (0, 0, 0, 0)),
            "dilations": attrs.get("dilations", (1, 1)), "group": attrs.get("group", 1),
            "auto_pad": attrs.get("auto_pad", "NOTSET")}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_vendor_conv_through_the_c_abi_equals_onnxruntime(fake_libs, case, dtype) -> None:
    """dc_conv_plan_make + dc_vendor_conv with host pointers: the cuDNN descriptors and call it makes (NCHW,
    cross-correlation, pads, strides, dilations, groups, IMPLICIT_GEMM without workspace, math type, stream)
    compute ONNX's Conv."""
    _, sx, sw, attrs = case
    core = load_core()
    rng = np.random.default_rng(sum(sx) + sum(sw))
    x, w = rng.standard_normal(sx).astype(DTYPES[dtype]), rng.standard_normal(sw).astype(DTYPES[dtype])
    want = ort_conv(x.astype(np.float32), w.astype(np.float32), attrs)
    plan = core.conv_plan(sx, sw, dtype=dtype, **_plan_kwargs(attrs))
    assert plan is not None, core.error()
    assert (plan.out_h, plan.out_w) == want.shape[2:]
    out = np.full(want.shape, np.nan, dtype=DTYPES[dtype])
    ctypes.c_void_p.in_dll(fake_libs, "fake_dnn_bound_stream").value = 0
    core.vendor_conv(plan, x.ctypes.data, w.ctypes.data, out.ctypes.data, handle=1, stream=STREAM)
    assert ctypes.c_void_p.in_dll(fake_libs, "fake_dnn_last_stream").value == STREAM
    assert ctypes.c_int.in_dll(fake_libs, "fake_dnn_last_algo").value == 0
    assert ctypes.c_int.in_dll(fake_libs, "fake_dnn_last_math").value == 1  # TENSOR_OP: 16-bit, or float32 in TF32
    assert ctypes.c_int.in_dll(fake_libs, "fake_dnn_live_descriptors").value == 0  # all destroyed
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", [c for c in CONV_CASES if "group" not in c[3]], ids=[c[0] for c in CONV_CASES
                                                                                     if "group" not in c[3]])
def test_vendor_conv_nhwc_through_the_c_abi_equals_onnxruntime(fake_libs, case, dtype) -> None:
    """channels_last: dc_conv_plan_make takes X [N, H, W, C] and W [OC, KH, KW, C], and dc_vendor_conv gives cuDNN
    NHWC X and Y descriptors and an NHWC (KRSC) filter with the NCHW dims; the output, [N, OH, OW, OC], is ONNX's
    Conv of the permuted tensors, and the epilogue indexes B by column."""
    _, sx, sw, attrs = case
    core = load_core()
    rng = np.random.default_rng(sum(sx) + sum(sw) + 1)
    x, w = rng.standard_normal(sx).astype(DTYPES[dtype]), rng.standard_normal(sw).astype(DTYPES[dtype])
    want = ort_conv(x.astype(np.float32), w.astype(np.float32), attrs).transpose(0, 2, 3, 1)
    x_nhwc, w_ohwi = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), np.ascontiguousarray(w.transpose(0, 2, 3, 1))
    plan = core.conv_plan(x_nhwc.shape, w_ohwi.shape, (sw[0],), dtype=dtype, channels_last=True,
                          **_plan_kwargs(attrs))
    assert plan is not None, core.error()
    nchw = core.conv_plan(sx, sw, (sw[0],), dtype=dtype, **_plan_kwargs(attrs))
    assert nchw is not None and plan.channels_last == 1 and nchw.channels_last == 0
    fields = ("n", "c", "h", "w", "k", "kc", "kh", "kw", "group", "pad_h", "pad_w", "stride_h", "stride_w", "out_h",
              "out_w")
    assert [getattr(plan, f) for f in fields] == [getattr(nchw, f) for f in fields]  # the NCHW dims either way
    out = np.full(want.shape, np.nan, dtype=DTYPES[dtype])
    for name in ("fake_dnn_last_x_format", "fake_dnn_last_w_format", "fake_dnn_last_y_format"):
        _dnn(fake_libs, name).value = -1
    core.vendor_conv(plan, x_nhwc.ctypes.data, w_ohwi.ctypes.data, out.ctypes.data, handle=1, stream=STREAM)
    assert [_dnn(fake_libs, f"fake_dnn_last_{t}_format").value for t in "xwy"] == [1, 1, 1]  # CUDNN_TENSOR_NHWC
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=tol, atol=tol)
    core.vendor_conv(nchw, x.ctypes.data, w.ctypes.data, np.empty(want.shape[:1] + want.shape[3:] + want.shape[1:3],
                                                                  DTYPES[dtype]).ctypes.data, handle=1, stream=STREAM)
    assert [_dnn(fake_libs, f"fake_dnn_last_{t}_format").value for t in "xwy"] == [0, 0, 0]
    # the epilogue: rows N*OH*OW, cols OC, B per column (a GEMM's bias along N)
    e = plan.epilogue
    assert (e.rows, e.cols, e.has_bias, e.bias_rows, e.bias_cs) == (want.shape[0] * want.shape[1] * want.shape[2],
                                                                    sw[0], 1, 1, 1)
    bias = np.arange(1.0, sw[0] + 1.0)
    i = np.arange(out.size)
    got = bias[(i // e.cols % e.bias_rows) * e.bias_rs + (i % e.cols) * e.bias_cs]
    np.testing.assert_array_equal(got, np.broadcast_to(bias, want.shape).reshape(-1))


def test_conv_plan_channels_last_refuses_groups_and_bad_flags() -> None:
    core = load_core()
    with pytest.raises(DietcodeError, match="channels-last Conv must have group 1"):
        core.conv_plan((1, 6, 6, 4), (4, 3, 3, 2), group=2, channels_last=True)
    i64 = ctypes.c_int64
    assert core.lib.dc_conv_plan_make((i64 * 4)(1, 6, 6, 4), 4, (i64 * 4)(4, 3, 3, 4), 4, None, 0, (i64 * 2)(1, 1),
                                      (i64 * 4)(), (i64 * 2)(1, 1), 1, 0, 0, 0, 1, 2, ctypes.byref(ConvPlan())) == -1
    assert "channels_last 2 (0 or 1)" in core.error()
    with pytest.raises(DietcodeError, match="channels-last"):  # X's C (last) 4, W's C (last) 3
        core.conv_plan((1, 6, 6, 4), (4, 3, 3, 3), channels_last=True)


def test_conv_algo_cache_keys_the_layout(fresh_heuristic) -> None:
    """One node's algorithm cache: an NHWC call of the same dims as an NCHW one asks the heuristic again."""
    core = load_core()
    cache = ConvAlgoCache(core)
    nchw = core.conv_plan((1, 4, 8, 8), (8, 4, 3, 3))
    nhwc = core.conv_plan((1, 8, 8, 4), (8, 3, 3, 4), channels_last=True)
    assert nchw is not None and nhwc is not None
    core.vendor_conv_algo(nchw, handle=1, cache=cache)
    core.vendor_conv_algo(nchw, handle=1, cache=cache)
    assert cache.queries == 1
    core.vendor_conv_algo(nhwc, handle=1, cache=cache)
    assert cache.queries == 2


def _dnn(fake_libs, name: str, kind=ctypes.c_int):
    return kind.in_dll(fake_libs, name)


@pytest.fixture
def fresh_heuristic(fake_libs):
    """The stand-in's heuristic answering, its counters at zero (restored after the test)."""
    _dnn(fake_libs, "fake_dnn_heuristic_calls").value = 0
    _dnn(fake_libs, "fake_dnn_heuristic_status").value = 0
    yield fake_libs
    _dnn(fake_libs, "fake_dnn_heuristic_status").value = 0


def _run_conv(core, fake_libs, sx, sw, attrs, dtype, cache, cap=None):
    """Plan, choose the algorithm (through ``cache``), allocate its workspace (host memory) and run the conv;
    returns the output, the algorithm, the fallback reason and the workspace buffer."""
    rng = np.random.default_rng(sum(sx) + sum(sw))
    x, w = rng.standard_normal(sx).astype(DTYPES[dtype]), rng.standard_normal(sw).astype(DTYPES[dtype])
    want = ort_conv(x.astype(np.float32), w.astype(np.float32), attrs)
    plan = core.conv_plan(sx, sw, dtype=dtype, **_plan_kwargs(attrs))
    kw = {} if cap is None else {"cap": cap}
    algo, why = core.vendor_conv_algo(plan, handle=1, cache=cache, **kw)
    workspace = np.zeros(max(1, algo.workspace_bytes), np.uint8)
    out = np.full(want.shape, np.nan, dtype=DTYPES[dtype])
    core.vendor_conv(plan, x.ctypes.data, w.ctypes.data, out.ctypes.data, handle=1, stream=STREAM, algo=algo,
                     workspace=workspace.ctypes.data if algo.workspace_bytes else 0)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=tol, atol=tol)
    return algo, why, workspace


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_vendor_conv_takes_the_heuristics_first_algorithm_that_fits_with_its_workspace(fresh_heuristic, dtype):
    """cudnnGetConvolutionForwardAlgorithm_v7 once per shape (the node's cache): the first result with status
    SUCCESS whose workspace fits the cap (the stand-in ranks FFT_TILING, unsupported, then GEMM, needing
    1 TiB, then IMPLICIT_PRECOMP_GEMM), run with exactly that workspace, computing ORT's Conv."""
    fake, core = fresh_heuristic, load_core()
    from dietcode_ort.runtime import ConvAlgoCache

    cache = ConvAlgoCache(core)
    sx, sw, attrs = (2, 3, 7, 6), (4, 3, 3, 3), {"pads": (1, 1, 1, 1)}
    for _ in range(3):
        algo, why, workspace = _run_conv(core, fake, sx, sw, attrs, dtype, cache)
        assert (algo.algo, algo.from_heuristic, why) == (1, 1, "")
        assert algo.workspace_bytes == 2 * 3 * 7 * 6 * 4 + 256  # the stand-in's size for this shape
        assert _dnn(fake, "fake_dnn_last_ws", ctypes.c_void_p).value == workspace.ctypes.data
        assert _dnn(fake, "fake_dnn_last_ws_size", ctypes.c_size_t).value == algo.workspace_bytes
        assert _dnn(fake, "fake_dnn_last_algo").value == 1 and _dnn(fake, "fake_dnn_last_math").value == 1
        assert (workspace[:algo.workspace_bytes] == 0xA5).all()  # cuDNN wrote the workspace it was given
    assert _dnn(fake, "fake_dnn_heuristic_calls").value == 1 and cache.queries == 1
    _run_conv(core, fake, (1, 3, 9, 9), sw, attrs, dtype, cache)  # another image size: one more query
    _run_conv(core, fake, sx, sw, attrs, dtype, cache)
    assert _dnn(fake, "fake_dnn_heuristic_calls").value == 2 and cache.queries == 2
    assert _dnn(fake, "fake_dnn_live_descriptors").value == 0


def test_vendor_conv_falls_back_to_implicit_gemm_when_the_query_fails(fresh_heuristic):
    """A failing heuristic query: IMPLICIT_GEMM without workspace, with the reason; the failure is cached per
    shape too (queried once), and the result still equals ORT's Conv."""
    fake, core = fresh_heuristic, load_core()
    from dietcode_ort.runtime import ConvAlgoCache

    cache = ConvAlgoCache(core)
    _dnn(fake, "fake_dnn_heuristic_status").value = 9  # CUDNN_STATUS_NOT_SUPPORTED
    for _ in range(2):
        algo, why, _ = _run_conv(core, fake, (1, 2, 5, 5), (3, 2, 3, 3), {}, "float32", cache)
        assert (algo.algo, algo.from_heuristic, algo.workspace_bytes) == (0, 0, 0)
        assert "IMPLICIT_GEMM without workspace" in why and "cudnnGetConvolutionForwardAlgorithm_v7" in why
        assert "status 9" in why
        assert _dnn(fake, "fake_dnn_last_algo").value == 0 and _dnn(fake, "fake_dnn_last_ws_size", ctypes.c_size_t).value == 0
    assert _dnn(fake, "fake_dnn_heuristic_calls").value == 1


def test_vendor_conv_skips_algorithms_past_the_cap_and_falls_back_when_none_fits(fresh_heuristic):
    fake, core = fresh_heuristic, load_core()
    algo, why, _ = _run_conv(core, fake, (1, 2, 5, 5), (3, 2, 3, 3), {}, "float32", None, cap=64)
    assert (algo.algo, algo.from_heuristic, algo.workspace_bytes, why) == (0, 1, 0, "")  # the heuristic's 4th
    _dnn(fake, "fake_dnn_heuristic_results").value = 3  # FFT_TILING, GEMM, IMPLICIT_PRECOMP_GEMM only
    try:
        algo, why, _ = _run_conv(core, fake, (1, 2, 5, 5), (3, 2, 3, 3), {}, "float32", None, cap=64)
    finally:
        _dnn(fake, "fake_dnn_heuristic_results").value = 4
    assert (algo.algo, algo.from_heuristic) == (0, 0)
    assert "returned 3 algorithms and none runs within the 64-byte workspace cap: 2 (" in why and ", 1 (" in why


def test_vendor_conv_refuses_a_missing_workspace(fresh_heuristic):
    core = load_core()
    plan = core.conv_plan((1, 2, 5, 5), (3, 2, 3, 3))
    algo, _ = core.vendor_conv_algo(plan, handle=1)
    assert algo.workspace_bytes > 0
    x, w, y = np.zeros((1, 2, 5, 5), np.float32), np.zeros((3, 2, 3, 3), np.float32), np.zeros((1, 3, 3, 3), np.float32)
    with pytest.raises(DietcodeError, match="workspace, none given"):
        core.vendor_conv(plan, x.ctypes.data, w.ctypes.data, y.ctypes.data, handle=1, stream=STREAM, algo=algo)


def test_conv_plan_math_type_follows_tf32() -> None:
    core = load_core()
    assert core.conv_plan((1, 1, 3, 3), (1, 1, 1, 1), tf32=False).math_type == 3  # FMA: no TF32
    assert core.conv_plan((1, 1, 3, 3), (1, 1, 1, 1)).math_type == 1  # TENSOR_OP: TF32 allowed
    assert core.conv_plan((1, 1, 3, 3), (1, 1, 1, 1), dtype="float16").math_type == 1


def test_conv_plan_refuses_pads_that_stay_asymmetric() -> None:
    core = load_core()
    assert core.conv_plan((1, 2, 8, 8), (3, 2, 3, 3), pads=(0, 1, 1, 1)) is None
    assert "asymmetric" in core.error()
    assert core.conv_plan((1, 2, 8, 8), (3, 2, 3, 3), strides=(2, 2), auto_pad="SAME_UPPER") is None  # pads 0/1
    assert core.conv_plan((1, 2, 2, 3, 3), (3, 2, 1, 1, 1)) is None and "2-D" in core.error()
    with pytest.raises(DietcodeError, match="channels"):
        core.conv_plan((1, 2, 8, 8), (3, 4, 3, 3))
    with pytest.raises(DietcodeError, match="one value per output channel"):
        core.conv_plan((1, 2, 8, 8), (3, 2, 3, 3), (2,))


def test_conv_epilogue_indexes_b_per_output_channel() -> None:
    e = load_core().conv_plan((2, 3, 5, 4), (6, 3, 3, 3), (6,), pads=(1, 1, 1, 1), activation="relu").epilogue
    out_shape, bias = (2, 6, 5, 4), np.arange(1.0, 7.0)
    i = np.arange(int(np.prod(out_shape)))
    got = bias[(i // e.cols % e.bias_rows) * e.bias_rs + (i % e.cols) * e.bias_cs]
    np.testing.assert_array_equal(got, np.broadcast_to(bias[:, None, None], out_shape).reshape(-1))
    assert (e.has_bias, e.activation, e.rows * e.cols) == (1, 1, len(i))


def _to_dtype_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return _bf16_round(x)
    return x.astype(DTYPES[dtype])


def _from_dtype_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    return _bf16_value(x) if dtype == "bfloat16" else x.astype(np.float32)


def _run_epilogue(core, dtype: str, e, memory, y_addr: int, bias_addr: int, res_addr: int, first: int,
                  row_threads: int) -> None:
    """The epilogue kernel's PTX run on the host with the arguments dc_vendor_epilogue passes, over blocks of 4
    column threads (some past the last column) and ``row_threads`` row threads in all: each thread walks its
    column over several rows, and a bias row (r % bias_rows) wraps as it steps."""
    from tests import _ptx_run

    params = {"p_y": y_addr, "p_bias": bias_addr, "p_rows": e.rows, "p_cols": e.cols,
              "p_brows": max(e.bias_rows, 1), "p_brs": e.bias_rs, "p_bcs": e.bias_cs, "p_scale": e.bias_scale,
              "p_act": e.activation, "p_res": res_addr, "p_first": first}
    _ptx_run.run(core.vendor_epilogue_ptx(dtype), params, memory, grid=(-(-e.cols // 4), row_threads), block=(4, 1))


def _assert_rounded_close(out: np.ndarray, ref: np.ndarray, dtype: str, tol: float) -> None:
    """``out`` (the dtype's bits) against ``ref`` rounded once to the dtype at the end."""
    want = ref.astype(np.float32)
    if dtype != "float32":
        want = _from_dtype_bits(_to_dtype_bits(want, dtype), dtype)
    np.testing.assert_allclose(_from_dtype_bits(out, dtype), want, rtol=tol, atol=tol)


EPILOGUE_CASES = [  # (id, plan maker, output shape, bias shape, bias scale)
    ("matmul_bias_n", lambda c, act, dt: c.gemm_plan("MatMul", (2, 3, 4), (4, 5), (5,), activation=act, dtype=dt),
     (2, 3, 5), (5,), 1.0),
    ("gemm_c_column", lambda c, act, dt: c.gemm_plan("Gemm", (3, 4), (4, 5), (3, 1), beta=0.5, activation=act,
                                                     dtype=dt), (3, 5), (3, 1), 0.5),
    ("conv_b", lambda c, act, dt: c.conv_plan((2, 3, 4, 3), (4, 3, 1, 1), (4,), activation=act, dtype=dt),
     (2, 4, 4, 3), (4, 1, 1), 1.0),
    ("no_bias", lambda c, act, dt: c.gemm_plan("MatMul", (3, 4), (4, 6), activation=act, dtype=dt), (3, 6), None, 1.0),
]


@pytest.mark.parametrize("residual", ["", "after", "first", "mul"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu", "relu6"])
@pytest.mark.parametrize("case", EPILOGUE_CASES, ids=[c[0] for c in EPILOGUE_CASES])
def test_epilogue_ptx_executed_on_the_host_equals_numpy(case, activation, dtype, residual) -> None:
    """The epilogue kernel's PTX itself, run by a host executor of its instructions (tests/_ptx_run.py) with
    the arguments dc_vendor_epilogue passes: bias broadcast, scale, activation, the residual added last
    (act(y + bias) + residual) or, p_first 1, before the activation (act(y + bias + residual)) or, p_first 2,
    multiplied after it (act(y + bias) * residual: LLaMA's SwiGLU gate), and the dtype's loads, stores and
    rounding. Two elements are NaN, and stay NaN through every activation (relu and relu6 as onnxruntime's Relu
    and Clip give it, not as max.f32's 0)."""
    from tests import _ptx_run

    _, make, out_shape, bias_shape, scale = case
    core = load_core()
    e = make(core, activation, dtype).epilogue
    assert e.has_residual == 0  # the plan never adds one: the node's op type says (ort_ops.cc sets it)
    rng = np.random.default_rng(3)
    y32 = (rng.standard_normal(out_shape) * 2).astype(np.float32)
    y32.reshape(-1)[[1, -2]] = np.nan
    y = _to_dtype_bits(y32, dtype)
    y_in = _from_dtype_bits(y, dtype).astype(np.float64)
    ref = y_in.copy()
    memory = _ptx_run.Memory()
    bias_addr = 0
    if bias_shape is not None:
        bias = _to_dtype_bits(rng.standard_normal(bias_shape).astype(np.float32), dtype)
        bias_addr = memory.place(bias)
        ref = ref + scale * np.broadcast_to(_from_dtype_bits(bias, dtype).astype(np.float64), out_shape)
    res_addr, res64 = 0, 0.0
    if residual:
        res = _to_dtype_bits((rng.standard_normal(out_shape) * 3).astype(np.float32), dtype)
        res_addr = memory.place(res)
        res64 = _from_dtype_bits(res, dtype).astype(np.float64)
    if residual == "first":
        ref = ref + res64
    if activation == "relu":
        ref = np.maximum(ref, 0.0)
    elif activation == "gelu":
        ref = 0.5 * ref * (1.0 + np.vectorize(math.erf)(ref / math.sqrt(2.0)))
    elif activation == "gelu_tanh":
        ref = 0.5 * ref * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (ref + 0.044715 * ref ** 3)))
    elif activation == "silu":
        ref = ref / (1.0 + np.exp(-ref))
    elif activation == "relu6":
        ref = np.clip(ref, 0.0, 6.0)
    if residual == "after":
        ref = ref + res64
    elif residual == "mul":
        ref = ref * res64
    # 3 row threads: the conv's bias row (r % 4) wraps as a thread steps
    _run_epilogue(core, dtype, e, memory, memory.place(y), bias_addr, res_addr, {"first": 1, "mul": 2}.get(residual, 0),
                  row_threads=3)
    _assert_rounded_close(y, ref, dtype, {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype])


def _ptxas() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() else None


@pytest.mark.ptx
@pytest.mark.skipif(_ptxas() is None, reason="needs ptxas (the triton wheel ships one)")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_epilogue_ptx_assembles_for_ampere_and_hopper(tmp_path, dtype) -> None:
    ptx = tmp_path / "epilogue.ptx"
    ptx.write_text(load_core().vendor_epilogue_ptx(dtype))
    for arch in ("sm_80", "sm_90"):
        res = subprocess.run([str(_ptxas()), f"-arch={arch}", str(ptx), "-o", str(tmp_path / f"{arch}.cubin")],
                             capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("loader, soname, says", [
    ("dc_vendor_cublas_load", "libcublas.so", "-1 no cuBLAS in this process (libcublas.so.13"),
    ("dc_vendor_cublaslt_load", "libcublasLt.so", "-1 no cuBLASLt in this process (libcublasLt.so.13"),
])
def test_without_a_loaded_cublas_the_vendor_path_says_so(loader: str, soname: str, says: str) -> None:
    """In a fresh process that has not loaded cuBLAS or cuBLASLt (no CUDA EP ran), the path names what is
    missing instead of loading a second copy."""
    code = ("import sys; from dietcode_ort.runtime import load_core\n"
            f"if {soname!r} in open('/proc/self/maps').read(): sys.exit(3)\n"
            f"c = load_core(); r = c.lib.{loader}(None)\n"
            "print(r, c.error())\n"
            f"sys.exit(4 if {soname!r} in open('/proc/self/maps').read() else 0)")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=HERE.parent, env=env)
    if res.returncode == 3:
        pytest.skip(f"this process image already maps a {soname}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith(says)


# --- on a GPU: every call through the vendor path against stock ONNX Runtime --------------------------------

def _vendor_only_bundle() -> bytes:
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(),), DispatchTree.single(0)).to_bytes()


def _cuda_ep_works() -> bool:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    try:
        probe = load_core().cuda_probe(0)
    except DietcodeError:
        return False
    return bool(probe)


GPU_CASES = [
    ("MatMul", [(2, 5, 8), (8, 6)], {}, 6),
    ("MatMul", [(2, 3, 5, 8), (2, 3, 8, 5)], {}, 5),
    ("Gemm", [(5, 8), (6, 8)], {"transB": 1, "alpha": 0.5, "beta": 2.0}, 6),
    ("Gemm", [(8, 5), (8, 6)], {"transA": 1}, 6),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}{len(c[1][0])}d" if isinstance(c, tuple) else "")
def test_vendor_leaf_on_cuda_matches_stock_onnxruntime(case, suffix, dtype) -> None:
    base, shapes, attrs, n_bias = case
    rng = np.random.default_rng(7)
    feeds = {"A": rng.standard_normal(shapes[0]).astype(dtype), "B": rng.standard_normal(shapes[1]).astype(dtype)}
    if "Bias" in suffix:
        feeds["bias"] = rng.standard_normal(n_bias).astype(dtype)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = custom_model(base + suffix, len(feeds), attrs, elem, _vendor_only_bundle())
    dietcode_ort.reset_node_stats()
    sess = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    for _ in range(3):  # repeated calls reuse ORT's stream and handle
        (got,) = sess.run(None, feeds)
    stats = dietcode_ort.node_stats()["n0"]
    assert stats["fallbacks"] == 3 and stats["launches"] == 0
    ref = ort.InferenceSession(reference_model(base, suffix, attrs).SerializeToString(),
                               providers=["CUDAExecutionProvider"])
    (want,) = ref.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})
    tol = 2e-2  # float16 rounding; for float32, TF32 on both sides (differently blocked sums)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_vendor_leaf_with_scale_and_residual_on_cuda(dtype) -> None:
    """MatMulBiasGeluResidual with scale 0.25 through the vendor path: cuBLAS's alpha is the scale, the PTX
    epilogue adds bias, Gelu, then the residual; a residual of another shape fails naming both shapes."""
    from onnx import helper

    from tests.test_custom_ops import _model, bundle_initializer

    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((2, 5, 8)).astype(dtype), rng.standard_normal((8, 6)).astype(dtype)
    c, r = rng.standard_normal(6).astype(dtype), rng.standard_normal((2, 5, 6)).astype(dtype)
    node = helper.make_node("MatMulBiasGeluResidual", ["A", "B", "bias", "R", "bundle"], ["Y"],
                            domain="ai.dietcode", name="n0", scale=0.25)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = _model([node], ["A", "B", "bias", "R"], elem, initializers=[bundle_initializer(_vendor_only_bundle())])
    sess = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    feeds = {"A": a, "B": b, "bias": c, "R": r}
    (got,) = sess.run(None, feeds)
    h = 0.25 * (a.astype(np.float64) @ b.astype(np.float64)) + c
    want = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0))) + r
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)  # TF32 / float16
    with pytest.raises(Exception, match=r"residual input has shape \[5, 6\], not the output's"):
        sess.run(None, feeds | {"R": r[0]})


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_vendor_leaf_gemm_residual_in_row_order_on_cuda(dtype) -> None:
    """GemmBiasResidual (GPT-2's Conv1D output projection) through the vendor path: cuBLAS with Gemm's C, then
    the epilogue adds a residual of the shape the Reshape after the product gives ([2, 5, 6] for [10, 6])."""
    from onnx import helper

    from tests.test_custom_ops import _model, bundle_initializer

    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((10, 8)).astype(dtype), rng.standard_normal((6, 8)).astype(dtype)
    c, r = rng.standard_normal(6).astype(dtype), rng.standard_normal((2, 5, 6)).astype(dtype)
    node = helper.make_node("GemmBiasResidual", ["A", "B", "bias", "R", "bundle"], ["Y"], domain="ai.dietcode",
                            name="n0", transB=1)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = _model([node], ["A", "B", "bias", "R"], elem, initializers=[bundle_initializer(_vendor_only_bundle())])
    sess = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    (got,) = sess.run(None, {"A": a, "B": b, "bias": c, "R": r})
    want = a.astype(np.float64) @ b.T.astype(np.float64) + c + r.reshape(10, 6)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)  # TF32 / float16


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_vendor_leaf_swiglu_gate_on_cuda(dtype) -> None:
    """MatMulBiasSiluMul (LLaMA's SwiGLU gate) through the vendor path: cuBLAS, then the PTX epilogue adds the
    bias, applies SiLU and multiplies by the residual (the up-projection's output)."""
    from onnx import helper

    from tests.test_custom_ops import _model, bundle_initializer

    rng = np.random.default_rng(17)
    a, b = rng.standard_normal((2, 5, 8)).astype(dtype), rng.standard_normal((8, 6)).astype(dtype)
    c, r = rng.standard_normal(6).astype(dtype), rng.standard_normal((2, 5, 6)).astype(dtype)
    node = helper.make_node("MatMulBiasSiluMul", ["A", "B", "bias", "R", "bundle"], ["Y"], domain="ai.dietcode",
                            name="gate")
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = _model([node], ["A", "B", "bias", "R"], elem, initializers=[bundle_initializer(_vendor_only_bundle())])
    sess = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    (got,) = sess.run(None, {"A": a, "B": b, "bias": c, "R": r})
    h = a.astype(np.float64) @ b.astype(np.float64) + c
    want = h / (1.0 + np.exp(-h)) * r
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)  # TF32 / float16


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op_type", ["ConvBiasResidualRelu", "ConvBiasReluResidual"])
def test_conv_vendor_leaf_with_the_residual_on_cuda(op_type, dtype) -> None:
    """ResNet's block end through the vendor path: cuDNN's conv, then the PTX epilogue adds B and the residual
    before the Relu (ConvBiasResidualRelu) or after it; a residual of another shape fails naming both shapes."""
    from onnx import helper

    from tests.test_custom_ops import _conv3x3_f64, _model, bundle_initializer

    rng = np.random.default_rng(13)
    x, w = rng.standard_normal((2, 3, 6, 5)).astype(dtype), rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    b, r = rng.standard_normal(4).astype(dtype), rng.standard_normal((2, 4, 6, 5)).astype(dtype)
    node = helper.make_node(op_type, ["X", "W", "B", "R", "bundle"], ["Y"], domain="ai.dietcode", name="n0",
                            pads=[1, 1, 1, 1])
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = _model([node], ["X", "W", "B", "R"], elem, initializers=[bundle_initializer(_vendor_only_bundle())])
    sess = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    feeds = {"X": x, "W": w, "B": b, "R": r}
    (got,) = sess.run(None, feeds)
    y = _conv3x3_f64(x, w, b)
    want = np.maximum(y + r, 0.0) if op_type == "ConvBiasResidualRelu" else np.maximum(y, 0.0) + r
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)  # TF32 / float16
    with pytest.raises(Exception, match=r"residual input has shape \[2, 4, 6, 4\], not the output's"):
        sess.run(None, feeds | {"R": r[:, :, :, :4]})


# (op type, attributes, whether dc_gemm_lt_plan fuses it into one cuBLASLt call)
LT_GPU_CASES = [
    ("MatMulBias", {}, True), ("MatMulBiasRelu", {}, True), ("MatMulBiasGeluTanh", {"scale": 0.5}, True),
    ("MatMulRelu", {}, True), ("MatMulGeluTanh", {}, True), ("MatMulBiasResidual", {}, True),
    ("MatMulResidual", {"scale": 0.25}, True), ("MatMulBiasResidualRelu", {}, True),
    ("MatMulBiasResidualGeluTanh", {}, True), ("GemmBiasRelu", {"transB": 1, "alpha": 0.5}, True),
    ("GemmBiasGeluTanh", {"transA": 1}, True),
    ("MatMulBiasGelu", {}, False), ("MatMulBiasReluResidual", {}, False), ("MatMulBiasSiluMul", {}, False),
    ("GemmBias", {"transB": 1, "beta": 2.0}, False),
]


def _torch_reference(op_type: str, attrs: dict, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The node's result in float64, by torch on the GPU (numpy where torch has no CUDA)."""
    try:
        import torch

        on_cuda = torch.cuda.is_available()
    except ImportError:
        on_cuda = False

    def t(x):
        x = x.astype(np.float64)
        return torch.from_numpy(x).cuda() if on_cuda else x

    a, b = t(feeds["A"]), t(feeds["B"])
    if op_type.startswith("Gemm"):
        a = a.T if attrs.get("transA") else a
        b = b.T if attrs.get("transB") else b
        y = attrs.get("alpha", 1.0) * (a @ b)
    else:
        y = attrs.get("scale", 1.0) * (a @ b)
    if "bias" in feeds:
        y = y + attrs.get("beta", 1.0) * t(feeds["bias"])
    r = t(feeds["R"]) if "R" in feeds else None
    rest = op_type.removeprefix("Gemm").removeprefix("MatMul").removeprefix("Bias")
    if rest.startswith("Residual") and rest != "Residual":  # the residual before the activation
        y, rest = y + r, rest.removeprefix("Residual")
    act = rest.removesuffix("Residual").removesuffix("Mul")
    if on_cuda:
        fn = torch.nn.functional
        acts = {"": lambda x: x, "Relu": torch.relu, "Gelu": fn.gelu, "Silu": fn.silu,
                "GeluTanh": lambda x: fn.gelu(x, approximate="tanh")}
    else:
        acts = {"": lambda x: x, "Relu": lambda x: np.maximum(x, 0.0), "Silu": lambda x: x / (1.0 + np.exp(-x)),
                "Gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
                "GeluTanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))}
    y = acts[act](y)
    if rest.endswith("Mul"):
        y = y * r
    elif rest.endswith("Residual"):
        y = y + r
    return y.cpu().numpy() if on_cuda else y


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("size", ["odd", "aligned", "one_row"])
@pytest.mark.parametrize("case", LT_GPU_CASES, ids=[c[0] + ("-beta" if "beta" in c[1] else "") for c in LT_GPU_CASES])
def test_vendor_leaf_fuses_the_epilogue_into_one_cublaslt_call_on_cuda(case, size, dtype) -> None:
    """Through ORT's CUDA EP with a vendor-only bundle: the op types dc_gemm_lt_plan fuses run one cuBLASLt call
    per node call (dc_vendor_lt_stats counts them; cuBLASLt found in ORT's process, a handle for its context, a
    workspace from ORT's allocator), the others none (cuBLAS + the PTX epilogue); both equal torch's result."""
    from onnx import helper

    from tests.test_custom_ops import _model, bundle_initializer

    op_type, attrs, fused = case
    lead, m, k, n = {"odd": (2, 5, 8, 6), "aligned": (2, 40, 64, 48), "one_row": (1, 1, 64, 48)}[size]
    rng = np.random.default_rng(23)
    if op_type.startswith("Gemm"):
        sa = (k, lead * m) if attrs.get("transA") else (lead * m, k)
        sb = (n, k) if attrs.get("transB") else (k, n)
        out_shape = (lead * m, n)
    else:
        sa, sb, out_shape = (lead, m, k), (k, n), (lead, m, n)
    feeds = {"A": rng.standard_normal(sa).astype(dtype), "B": rng.standard_normal(sb).astype(dtype)}
    if "Bias" in op_type:
        feeds["bias"] = rng.standard_normal(n).astype(dtype)
    if "Residual" in op_type or op_type.endswith("Mul"):
        feeds["R"] = rng.standard_normal(out_shape).astype(dtype)
    node = helper.make_node(op_type, [*feeds, "bundle"], ["Y"], domain="ai.dietcode", name="lt0", **attrs)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = _model([node], list(feeds), elem, initializers=[bundle_initializer(_vendor_only_bundle())])
    sess = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    core = load_core()
    calls = core.vendor_lt_stats()[0]
    for _ in range(3):
        (got,) = sess.run(None, feeds)
    assert core.vendor_lt_stats()[0] - calls == (3 if fused else 0)
    want = _torch_reference(op_type, attrs, feeds)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)  # TF32 / float16


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("op_type", ["MatMulBiasRelu", "MatMulRelu", "MatMulBiasResidualRelu", "MatMulBiasGelu"])
def test_vendor_leaf_relu_keeps_nan_as_onnxruntime_does_on_cuda(op_type) -> None:
    """A NaN row of A stays a NaN row through the vendor path's relu, cuBLASLt's RELU epilogue included (its NaN
    handling is not documented), as onnxruntime's CUDA Relu (_Max propagates NaN) gives it."""
    from onnx import helper

    from tests.test_custom_ops import _model, bundle_initializer

    rng = np.random.default_rng(29)
    feeds = {"A": rng.standard_normal((2, 40, 64)).astype(np.float16),
             "B": rng.standard_normal((64, 48)).astype(np.float16)}
    feeds["A"][0, [0, 9]] = np.nan
    if "Bias" in op_type:
        feeds["bias"] = rng.standard_normal(48).astype(np.float16)
    if "Residual" in op_type:
        feeds["R"] = rng.standard_normal((2, 40, 48)).astype(np.float16)
    node = helper.make_node(op_type, [*feeds, "bundle"], ["Y"], domain="ai.dietcode", name="lt0")
    model = _model([node], list(feeds), TensorProto.FLOAT16, initializers=[bundle_initializer(_vendor_only_bundle())])
    (got,) = dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"]).run(None, feeds)
    want = _torch_reference(op_type, {}, feeds)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got.astype(np.float64)), np.nan_to_num(want), rtol=2e-2, atol=2e-2)


GPU_CONV_CASES = [
    ("Conv", [(2, 3, 9, 10), (4, 3, 3, 3)], {"strides": [2, 1], "pads": [1, 1, 1, 1], "dilations": [1, 2]}, 4),
    ("Conv", [(1, 4, 7, 7), (6, 2, 3, 3)], {"group": 2, "auto_pad": "SAME_UPPER"}, 6),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("case", GPU_CONV_CASES, ids=["stride_dilation", "groups_same"])
def test_conv_vendor_leaf_on_cuda_matches_stock_onnxruntime(case, suffix, dtype) -> None:
    test_vendor_leaf_on_cuda_matches_stock_onnxruntime(case, suffix, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
def test_conv_vendor_leaf_with_asymmetric_pads_fails_at_session_creation_naming_the_node() -> None:
    model = custom_model("Conv", 2, {"pads": [0, 1, 1, 1]}, TensorProto.FLOAT, _vendor_only_bundle())
    with pytest.raises(Exception, match=r"node 'n0'.*symmetric pads only"):
        dietcode_ort.InferenceSession(model, providers=["CUDAExecutionProvider"])


# --- the tuner: conv trees get no vendor leaf (the CUDA path has no vendor conv) ----------------------------

def test_optimize_gives_conv_trees_no_vendor_leaf_even_when_the_vendor_is_faster(monkeypatch) -> None:
    import models
    from tuner import optimize as opt
    from tuner.measure import AnalyticMeasurer, MeasureResult
    from tuner.scan import attach_instances, scan_model

    class VendorAlwaysFaster(AnalyticMeasurer):
        def measure_vendor(self, family, problems):
            return [MeasureResult(1e-12) for _ in problems]

    options = opt.OptimizeOptions(measure="analytic", budget=8, max_kernels=2, progress=False)
    from tuner.hardware import get_profile

    monkeypatch.setattr(opt, "make_measurer", lambda o, w, executor=None: (
        VendorAlwaysFaster(get_profile(o.targets[0]), w.dtype), "analytic"))
    scanned = attach_instances(scan_model(models.build("resnet50", "tiny")), ("batch=1,2", "height=32,64",
                                                                             "width=32"))
    by_op = {}
    for w in scanned.workloads:
        by_op.setdefault(w.op, w)
    assert {"conv", "gemm"} <= set(by_op), set(by_op)
    for op, w in by_op.items():
        chosen = opt._tune(w, opt.merge_problems(w), options, lambda _: None)
        if op == "conv":
            assert "vendor" not in chosen.kernels and chosen.report.geomean_vs_vendor is not None
        else:  # the control: a GEMM workload does dispatch to the faster vendor
            assert chosen.kernels == ("vendor",)


# --- measured tuning: a workload that loses to the vendor library is left to ORT ------------------------------

def _vendor_timed(monkeypatch, vendor_seconds):
    """``optimize`` with the analytic roofline's times for the kernels, counted as measured ones (a replay), and
    ``vendor_seconds(problem)`` as the vendor library's."""
    from tuner import optimize as opt
    from tuner.hardware import get_profile
    from tuner.measure import AnalyticMeasurer, MeasureResult

    class Timed(AnalyticMeasurer):
        def measure_vendor(self, family, problems):
            return [MeasureResult(vendor_seconds(p)) for p in problems]

    monkeypatch.setattr(opt, "make_measurer", lambda o, w, executor=None: (
        Timed(get_profile(o.targets[0]), w.dtype), "replay:stand-in"))


def test_a_measured_workload_that_loses_to_the_vendor_is_left_to_ort(monkeypatch, tmp_path) -> None:
    """The depthwise conv's GEMM kernel (one output column wide) against a cuDNN that is far faster: its node
    stays a Conv, with the figure as the reason; the grouped conv, faster than its vendor time, is rewritten.
    With --min-speedup 0 both are; where every workload loses, nothing is written and the error says why."""
    from _grouped_convs import grouped_conv_model
    from tuner.optimize import OptimizeOptions, optimize

    src = tmp_path / "g.onnx"
    onnx.save(grouped_conv_model(), str(src))
    dims = ("n=1,2", "h=8,16", "w=8")

    def run(out: str, **kw):
        options = OptimizeOptions(dims=dims, budget=4, max_kernels=1, progress=False, db=tmp_path / "t.db",
                                  cache_dir=tmp_path / "k", **kw)
        lines: list[str] = []
        return optimize(src, tmp_path / out, options, log=lines.append), lines

    _vendor_timed(monkeypatch, lambda p: 1e-12 if p.batch == 16 else 1.0)  # depthwise: 16 groups
    report, lines = run("one.onnx")
    assert report.rewritten == ("y",)
    (why,) = [r for n, r in report.skipped if n == "dw"]
    assert re.search(r"measured [0-9.e+-]+x cuDNN's speed .* below --min-speedup 1:", why), why
    assert any(line.startswith("left as it is: dw (Conv)") for line in lines)
    nodes = onnx.load(str(tmp_path / "one.onnx")).graph.node
    assert [(n.domain, n.op_type) for n in nodes][:2] == [("", "Conv"), ("", "Relu")]  # as they were
    assert [n.output[0] for n in nodes if n.domain == "ai.dietcode"] == ["y"]
    assert run("all.onnx", min_speedup=0.0)[0].rewritten == ("dw", "y")

    _vendor_timed(monkeypatch, lambda p: 1e-12)
    with pytest.raises(DietcodeError, match="every tuned workload lost to cuDNN"):
        run("none.onnx")
    assert not (tmp_path / "none.onnx").exists()
    with pytest.raises(DietcodeError, match="--min-speedup must be a number >= 0"):
        run("bad.onnx", min_speedup=float("nan"))


def test_only_a_measured_conv_tree_is_left_to_ort() -> None:
    """A GEMM tree takes cuBLAS per shape (its vendor leaf), even on every shape: it stays, with its fused
    epilogue. A conv tree below --min-speedup is left out only with measured figures."""
    from tuner.optimize import WorkloadReport, _loses
    from tuner.workload import ConvParams, Epilogue, Workload

    gemm = Workload(op="gemm", onnx_op="MatMul", nodes=("y",), m="m", n="64", k="64", dtype="float16",
                    symbols=("m",), epilogue=Epilogue())
    report = WorkloadReport(gemm, "replay:t", 8, 1.0, ("vendor",), 4, 0.9, 1.0, measured=True)
    assert _loses(report, 1.0) == ""
    conv = replace(gemm, op="conv", onnx_op="Conv", conv=ConvParams(8, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)))
    slow = replace(report, workload=conv, kernels=("c1",), geomean_vs_vendor=0.5)
    assert "measured 0.5x cuDNN's speed" in _loses(slow, 1.0)
    assert _loses(slow, 0.4) == _loses(slow, 0.0) == _loses(replace(slow, measured=False), 1.0) == ""
    assert _loses(replace(slow, geomean_vs_vendor=None), 1.0) == ""  # no vendor timing: nothing to compare
