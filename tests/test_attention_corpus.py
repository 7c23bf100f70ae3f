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
CHAINS = {"bart-decoder": 2 * LAYERS, "t5-decoder": 2 * LAYERS}  # a decoder's self- and cross-attention; else one
# case -> the reason its chains stay unfused, "" when each layer's chain fuses
EXPECTED = {
    "bert-torchscript": "", "bert-dynamo": "", "distilbert-torchscript": "", "distilbert-dynamo": "",
    "gpt2-torchscript": "", "gpt2-dynamo": "", "llama-torchscript": "", "llama-dynamo": "",
    "t5-encoder-torchscript": "", "vit-torchscript": "", "vit-dynamo": "", "vit-fp16-torchscript": "",
    "whisper-encoder-torchscript": "", "bert-opset17-torchscript": "", "bert-inits-as-inputs-torchscript": "",
    "llama-fp16-dynamo": "", "bart-decoder-torchscript": "", "bart-decoder-dynamo": "",
    "t5-decoder-torchscript": "", "t5-decoder-dynamo": "",
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
    assert len(found.sites) == CHAINS.get(CASES_BY_NAME[name].model, LAYERS) and found.skipped == ()
    fused, _ = fuse_attention(model, found.sites)
    assert "Softmax" not in {n.op_type for n in fused.graph.node}
    inputs = feeds(built.path, built, {"batch": 2, "sequence": 7, "source": 13, "height": 32, "width": 32})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    opts = ort.SessionOptions()
    register(opts)
    got = ort.InferenceSession(fused.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    tol = 2e-2 if want.dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol)


# case -> (Transpose nodes in the export, after fusing the export as it is, without the pre-pass of
# tuner/attention_prepare.py): the head-split Transposes the Attention nodes absorb (tuner/attention_graph.py; Q's
# and K's through the Mul that scales them, folded into the scale). Kept (site.layout_notes): in the TorchScript
# exports Q's and V's Transposes are read by a Shape too and the output goes through a Reshape before its
# Transpose; the dynamo exports make Kt through a rank-3 Transpose (0, 2, 1); LLaMA applies the rotary embedding
# after Q's and K's Transposes and repeats K and V (Expand) after them. PREPARED below: with the pre-pass.
TRANSPOSES = {
    "bert-torchscript": (8, 6), "gpt2-torchscript": (8, 6), "llama-torchscript": (10, 10),
    "bert-dynamo": (10, 4), "gpt2-dynamo": (10, 4), "llama-dynamo": (10, 8),
}


def g_op(model: onnx.ModelProto, value: str) -> str:
    return next(n.op_type for n in model.graph.node if value in n.output)


@pytest.mark.parametrize("name", sorted(TRANSPOSES))
def test_corpus_head_split_transposes_are_absorbed(name: str, tmp_path) -> None:
    """The fused graph has the Transposes counted above, each node's layout says which it absorbed, and the
    library's CPU kernel reading those layouts matches stock ORT on the original."""
    from tuner.attention import LAYOUT_BITS

    built = build_case(CASES_BY_NAME[name], tmp_path)
    model = onnx.load(str(built.path))
    found = find_attention(model, base_dir=built.path.parent)
    fused, _ = fuse_attention(model, found.sites)
    count = lambda m: [n.op_type for n in m.graph.node].count("Transpose")  # noqa: E731
    before, after = TRANSPOSES[name]
    assert (count(model), count(fused)) == (before, after)
    absorbed = sum(bin(s.layout).count("1") for s in found.sites)
    assert before - after == absorbed
    for site in found.sites:
        layout = next(a.i for n in fused.graph.node if n.output[0] == site.output for a in n.attribute
                      if a.name == "layout")
        assert layout == site.layout
        # what each absorbed operand now is: the Reshape output (K: the keys) and the merge Reshape's input
        if site.layout & LAYOUT_BITS["q"]:
            assert g_op(model, site.q) in ("Reshape", "Mul")
        if site.layout & LAYOUT_BITS["out"]:
            assert any(n.op_type == "Reshape" and n.input[0] == site.output for n in fused.graph.node)
    inputs = feeds(built.path, built, {"batch": 2, "sequence": 7, "source": 13, "height": 32, "width": 32})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    opts = ort.SessionOptions()
    register(opts)
    got = ort.InferenceSession(fused.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=1e-5, rtol=1e-5)
    # stock ORT without the library runs the fallback functions, which keep the absorbed Transposes: the same
    # values (with its graph optimizations off: they fuse a scaling Mul into a MatMul in one graph only)
    off = ort.SessionOptions()
    off.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = [ort.InferenceSession(m.SerializeToString(), off, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
             for m in (fused, model)]
    np.testing.assert_array_equal(*plain)


# case -> (chains read packed, Transposes left after fusing) as optimize sees the export: the pre-pass
# (tuner/attention_prepare.py: Shape(Transpose) -> Gather(Shape), dynamo's Kt Reshape -> Transpose -> Reshape ->
# one Transpose, SDPA's no-op output Reshape dropped, Whisper's scale of the Q projection moved after its head
# split, LLaMA's head-split Transposes moved past the rotary embedding and the K/V repeat), the Muls of Q and Kt
# folded into the scale, the Q/K/V projections merged (Whisper's K, which has no bias, with zeros). Kept: ViT's
# patch-embedding, T5's position-bias and Whisper's conv-output Transposes (no attention's). LLaMA: every
# Transpose absorbed, not packed (the rotary embedding and the K/V repeat sit between the projections and the
# chain, and K's and V's projections are narrower than Q's: grouped-query attention).
PREPARED = {
    "bert-torchscript": (2, 0), "bert-dynamo": (2, 0), "distilbert-torchscript": (2, 0),
    "distilbert-dynamo": (2, 0), "gpt2-torchscript": (2, 0), "gpt2-dynamo": (2, 0), "vit-torchscript": (2, 1),
    "vit-dynamo": (2, 1), "t5-encoder-torchscript": (2, 1), "whisper-encoder-torchscript": (2, 1),
    "whisper-encoder-dynamo": (2, 1), "llama-torchscript": (0, 0), "llama-dynamo": (0, 0),
    "llama-fp16-dynamo": (0, 0),
}


@pytest.mark.parametrize("name", sorted(PREPARED))
def test_corpus_exports_pack_after_the_pre_pass(name: str, tmp_path) -> None:
    from tuner.attention_pack import pack_projections
    from tuner.attention_prepare import prepare_attention

    built = build_case(CASES_BY_NAME[name], tmp_path)
    model = onnx.load(str(built.path))
    prepared, _ = prepare_attention(model, built.path.parent)
    packed, _ = pack_projections(prepared, built.path.parent)
    found = find_attention(packed, built.path.parent)
    fused, _ = fuse_attention(packed, found.sites)
    onnx.checker.check_model(fused)
    assert len(found.sites) == CHAINS.get(CASES_BY_NAME[name].model, LAYERS) and found.skipped == ()
    kept = [n.op_type for n in fused.graph.node].count("Transpose")
    assert (sum(bool(s.packed) for s in found.sites), kept) == PREPARED[name]
    for batch, seq in ((2, 7), (1, 1)):
        inputs = feeds(built.path, built, {"batch": batch, "sequence": seq, "height": 32, "width": 32})
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
        opts = ort.SessionOptions()
        register(opts)
        for m, o in ((fused, opts), (fused, ort.SessionOptions()), (prepared, ort.SessionOptions())):
            got = ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
            # the library's kernel rounds float16 probabilities once, where the chain rounds its steps
            tol = 2e-2 if want.dtype == np.float16 and o is opts else 1e-5
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol)
