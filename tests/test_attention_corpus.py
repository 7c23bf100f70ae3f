"""Attention fusion on the corpus's exports (tests/_corpus.py): which chains fuse, and the fused model on the
library's CPU kernel against stock ORT on the original."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from _corpus import CASES_BY_NAME, build_case, feeds
from dietcode_ort.runtime import register
from tuner.attention_graph import find_attention, fuse_attention

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYERS = 2  # every text/vision model of the corpus has two layers
# case -> the reason its chains stay unfused, "" when each layer's chain fuses
EXPECTED = {
    "bert-torchscript": "", "bert-dynamo": "", "distilbert-torchscript": "", "distilbert-dynamo": "",
    "gpt2-torchscript": "", "gpt2-dynamo": "", "llama-torchscript": "", "llama-dynamo": "",
    "t5-encoder-torchscript": "", "vit-torchscript": "", "vit-dynamo": "", "vit-fp16-torchscript": "",
    "whisper-encoder-torchscript": "", "bert-opset17-torchscript": "", "bert-inits-as-inputs-torchscript": "",
    "llama-fp16-dynamo": "",
    # float16 LLaMA through TorchScript computes the softmax in float32 and keeps the probabilities there: V is
    # Cast up to float32 for the AV product, whose float32 output feeds the output projection
    "llama-fp16-torchscript": "the probabilities multiply V of float32 while Q is float16 (the AV product and the "
                              "output are float32): the fused kernel rounds the probabilities to float16 and "
                              "writes float16",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_attention_fuses_and_matches_stock_ort(name: str, tmp_path) -> None:
    built = build_case(CASES_BY_NAME[name], tmp_path)
    model = onnx.load(str(built.path))
    found = find_attention(model, base_dir=built.path.parent)
    if EXPECTED[name]:
        assert found.sites == () and {why for _, why in found.skipped} == {EXPECTED[name]}
        return
    assert len(found.sites) == LAYERS and found.skipped == ()
    fused, _ = fuse_attention(model, found.sites)
    assert "Softmax" not in {n.op_type for n in fused.graph.node}
    inputs = feeds(built.path, built, {"batch": 2, "sequence": 7, "height": 32, "width": 32})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    opts = ort.SessionOptions()
    register(opts)
    got = ort.InferenceSession(fused.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    tol = 2e-2 if want.dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol)
