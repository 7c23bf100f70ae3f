"""On a GPU: optimize with measured tuning, then run the model on ORT's CUDA EP with the library.

Skips without a CUDA GPU visible to torch, or without a working CUDAExecutionProvider.
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


@pytest.mark.skipif(not _cuda_ep_works(), reason="needs a CUDA GPU and onnxruntime's CUDA EP")
@pytest.mark.parametrize("name, dims, sweep", [
    ("mlp", ("tokens=1:256",), [{"tokens": t} for t in (1, 5, 16, 100, 256, 300, 1000)]),
    ("bert", ("batch=1,4", "seq=8:128:8"), [{"batch": b, "seq": s} for b in (1, 3, 4) for s in (1, 17, 64, 128, 200)]),
])
def test_measured_optimize_runs_on_cuda_and_matches(tmp_path, name, dims, sweep):
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    models.save_model(models.build(name, "tiny", "float16"), src)
    report = optimize(src, out, OptimizeOptions(targets=default_targets(), measure="gpu", budget=64, dims=dims,
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
