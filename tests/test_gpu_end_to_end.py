"""On a GPU: optimize with measured tuning, then run the model on ORT's CUDA EP with the library.

Skips without a CUDA GPU visible to torch, or without a working CUDAExecutionProvider. The cheap launch check
comes first: a device call that cuts the stage short (benchmarks/device_run.sh) still gets its answer.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest

import dietcode_ort
import models
from _grouped_convs import grouped_conv_model
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
    if op_type == "ScaledDotProductAttention":
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


@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
def test_grouped_and_depthwise_convs_launch_and_match(tmp_path):
    """Both grouped convs run their compiled kernels (one program grid z per group) and give stock ORT's result;
    a bundle whose kernels lack the grouped flag (compiled for an ungrouped conv) is refused at session creation."""
    import onnx

    from dietcode_ort.bundle import Bundle, node_bundles, read_bundle

    src, out = tmp_path / "g.onnx", tmp_path / "g.opt.onnx"
    onnx.save(grouped_conv_model(), str(src))
    optimize(src, out, OptimizeOptions(targets=default_targets(), measure="analytic", budget=8,
                                       dims=("n=1:4", "h=8:40:16", "w=8:40:16"), db=tmp_path / "t.db",
                                       cache_dir=tmp_path / "k", progress=False), log=lambda _: None)
    stock = ort.InferenceSession(str(src), providers=["CUDAExecutionProvider"])
    tuned = dietcode_ort.InferenceSession(str(out), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    dietcode_ort.reset_node_stats()
    for shape in ((1, 16, 8, 8), (3, 16, 21, 13), (4, 16, 40, 40)):
        x = rng.standard_normal(shape).astype(np.float16)
        np.testing.assert_allclose(tuned.run(None, {"x": x})[0].astype(np.float32),
                                   stock.run(None, {"x": x})[0].astype(np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=str(shape))
    stats = dietcode_ort.node_stats()
    assert {nb.node for nb in node_bundles(onnx.load(str(out)))} == {"depthwise", "grouped"}
    assert all(stats.get(node, {}).get("launches", 0) > 0 for node in ("depthwise", "grouped")), stats

    model = onnx.load(str(out))
    for init in model.graph.initializer:
        if init.name.startswith("dietcode_bundle_"):
            bundle = read_bundle(bytes(init.raw_data))
            ungrouped = Bundle(bundle.features, tuple(replace(k, grouped=False) for k in bundle.kernels),
                               bundle.tree)
            init.raw_data = ungrouped.to_bytes()
    onnx.save(model, str(tmp_path / "ungrouped.onnx"))
    with pytest.raises(Exception, match="compiled for an ungrouped conv"):
        dietcode_ort.InferenceSession(str(tmp_path / "ungrouped.onnx"), providers=["CUDAExecutionProvider"])


@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_resnet_conv_layouts_launch_and_match(tmp_path, layout):
    """Tiny ResNet-50 (fp16) optimized channels-last (the default: every conv but the stem, two Transposes) and
    in the model's layout: every conv node launches its compiled kernels and the model gives stock ORT's result
    on shapes off the tuned grid (odd sizes: the windows' edges, tiles past the last row)."""
    import onnx

    from dietcode_ort.bundle import node_bundles

    src, out = tmp_path / "r.onnx", tmp_path / f"r.{layout}.onnx"
    models.save_model(models.build("resnet50", "tiny", "float16"), src)
    optimize(src, out, OptimizeOptions(targets=default_targets(), measure="analytic", budget=4, max_kernels=2,
                                       dims=("batch=1:2", "height=32:64:32", "width=32:64:32"), db=tmp_path / "t.db",
                                       cache_dir=tmp_path / "k", progress=False, conv_layout=layout),
             log=lambda _: None)
    model = onnx.load(str(out))
    nhwc = {n.output[0] for n in model.graph.node if any(a.name == "channels_last" and a.i for a in n.attribute)}
    assert len(nhwc) == (16 if layout == "nhwc" else 0)
    stock = ort.InferenceSession(str(src), providers=["CUDAExecutionProvider"])
    tuned = dietcode_ort.InferenceSession(str(out), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    dietcode_ort.reset_node_stats()
    for shape in ({"batch": 1, "height": 32, "width": 32}, {"batch": 3, "height": 37, "width": 51},
                  {"batch": 2, "height": 70, "width": 33}):
        feeds = models.get("resnet50").example_inputs("tiny", shape, "float16", seed=1)
        np.testing.assert_allclose(tuned.run(None, feeds)[0].astype(np.float32),
                                   stock.run(None, feeds)[0].astype(np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=str(shape))
    stats = dietcode_ort.node_stats()
    convs = [nb.node for nb in node_bundles(model) if nb.op_type.startswith("Conv")]
    assert len(convs) == 17 and all(stats.get(node, {}).get("launches", 0) > 0 for node in convs), stats
