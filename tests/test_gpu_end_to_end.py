"""On a GPU: optimize with measured tuning, then run the model on ORT's CUDA EP with the library.

Skips without a CUDA GPU visible to torch, or without a working CUDAExecutionProvider. The cheap launch check
comes first: a device call that cuts the stage short (benchmarks/device_run.sh) still gets its answer.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import dietcode_ort
import models
from tuner.optimize import OptimizeOptions, default_targets, optimize

pytestmark = pytest.mark.gpu


def _cuda_ep_works() -> bool:
    try:
        import torch
        if not torch.cuda.is_available():
            return False
    except ImportError:
        return False
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    model = models.build("mlp", "tiny")
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    except Exception:
        return False
    return sess.get_providers()[0] == "CUDAExecutionProvider"


def _op_kind(node: str, op_type: str, kernels) -> str:
    """dense MatMul | attention MatMul (its kernels take the bmm view) | fused Attention | Gemm | Conv."""
    if op_type == "Attention":
        return "fused Attention"
    if op_type.startswith("MatMul"):
        return "attention MatMul" if any(k.view == "bmm" for k in kernels) else "dense MatMul"
    return "Gemm" if op_type.startswith("Gemm") else "Conv"


@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
def test_triton_kernels_launch_for_every_op_kind(tmp_path):
    """The library's counters (dietcode_ort.node_stats) show compiled kernels launched, not ORT's kernel, for
    dense MatMuls and the fused Attention nodes (bert), Gemm and Conv (resnet50)."""
    import onnx

    from dietcode_ort.bundle import node_bundles, read_bundle

    cases = [("bert", ("batch=1:2", "seq=8:64:8"), {"batch": 2, "seq": 32}),
             ("resnet50", ("batch=1:2", "height=32:64:32", "width=32:64:32"), {"batch": 2, "height": 32, "width": 32})]
    launched: dict[str, int] = {}
    for name, dims, shape in cases:
        src, out = tmp_path / f"{name}.onnx", tmp_path / f"{name}.opt.onnx"
        models.save_model(models.build(name, "tiny", "float16"), src)
        optimize(src, out, OptimizeOptions(targets=default_targets(), measure="analytic", budget=8, dims=dims,
                                           db=tmp_path / "t.db", cache_dir=tmp_path / "k", progress=False),
                 log=lambda _: None)
        kinds = {nb.node: _op_kind(nb.node, nb.op_type, read_bundle(nb.payload).kernels)
                 for nb in node_bundles(onnx.load(str(out)))}
        stock = ort.InferenceSession(str(src), providers=["CUDAExecutionProvider"])
        tuned = dietcode_ort.InferenceSession(str(out), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        feeds = models.get(name).example_inputs("tiny", shape, "float16", seed=1)
        dietcode_ort.reset_node_stats()
        got = tuned.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, stock.run(None, feeds)[0].astype(np.float32), rtol=2e-2, atol=2e-2)
        stats = dietcode_ort.node_stats()
        for node, kind in kinds.items():
            launched[kind] = launched.get(kind, 0) + stats.get(node, {}).get("launches", 0)
    assert set(launched) == {"dense MatMul", "fused Attention", "Gemm", "Conv"}, launched
    assert all(n > 0 for n in launched.values()), launched


@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("name, dims, sweep", [
    ("mlp", ("tokens=1:256",), [{"tokens": t} for t in (1, 5, 16, 100, 256, 300, 1000)]),
    ("bert", ("batch=1,4", "seq=8:128:8"), [{"batch": b, "seq": s} for b in (1, 3, 4) for s in (1, 17, 64, 128, 200)]),
])
def test_measured_optimize_runs_on_cuda_and_matches(tmp_path, name, dims, sweep):
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    models.save_model(models.build(name, "tiny", "float16"), src)
    report = optimize(src, out, OptimizeOptions(targets=default_targets(), measure="gpu", budget=32, dims=dims,
                                                db=tmp_path / "t.db", cache_dir=tmp_path / "k", progress=False),
                      log=lambda _: None)
    assert all(r.measured for r in report.workloads)
    stock = ort.InferenceSession(str(src), providers=["CUDAExecutionProvider"])
    tuned = dietcode_ort.InferenceSession(str(out), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    for shape in sweep:
        feeds = models.get(name).example_inputs("tiny", shape, "float16", seed=1)
        want = stock.run(None, feeds)[0].astype(np.float32)
        got = tuned.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=str(shape))
