"""The corpus of real exports (tests/_corpus.py): for every model other projects' exporters wrote, scan
covers every MatMul/Gemm/Conv node (rewritten, or left alone for an expected reason), optimize succeeds
(analytic tuning, small budget, sm_90 kernels), and the optimized model gives the original's outputs on the
CPU EP with and without the custom-op library, at shapes inside and outside the tuned ranges.

Each model is exported once per test session; optimize runs once per case and all cases share one tuning
database and one kernel compile cache.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import dietcode_ort
from _corpus import CASES, Built, Case, build_case, feeds, gemm_view_nodes, node_test_tuned
from dietcode_ort.errors import DietcodeError
from tuner.attention_graph import find_attention, without_attention
from tuner.conv1d import convs_as_2d
from tuner.attention_prepare import prepare_attention
from tuner.optimize import OptimizeOptions, _pack_projections, optimize
from tuner.scan import prepare_graph, scan_model

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs only: any hub access fails loudly


def _param(case: Case, stage: str):
    marks = []
    if case.unsupported:
        reason = f"{case.exporter} cannot export {case.model}: {case.unsupported}"
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(case, marks=marks, id=case.name)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Built models (each exported once), optimized models (each optimized once), and the shared folders."""
    folder = tmp_path_factory.mktemp("corpus")
    return {"folder": folder, "built": {}, "optimized": {}}


def _built(corpus, case: Case) -> Built:
    if case.name not in corpus["built"]:
        corpus["built"][case.name] = build_case(case, corpus["folder"])
    return corpus["built"][case.name]


def _tuned(case: Case, built: Built):
    if case.exporter == "onnx node test":
        return node_test_tuned(built)
    return case.tuned, case.probes


def _dims(built: Built, tuned: dict[str, str]) -> tuple[str, ...]:
    return tuple(f"{sym}={spec}" for role, spec in tuned.items() for sym in built.symbols[role])


def _optimized(corpus, case: Case) -> tuple[Path, object]:
    if case.name not in corpus["optimized"]:
        built = _built(corpus, case)
        tuned, _ = _tuned(case, built)
        out = corpus["folder"] / f"{case.name}.dietcode.onnx"
        options = OptimizeOptions(dims=_dims(built, tuned), measure="analytic", budget=16, max_kernels=2,
                                  targets=("sm_90",), db=corpus["folder"] / "tuning.db",
                                  cache_dir=corpus["folder"] / "kernels", progress=False)
        corpus["optimized"][case.name] = (out, optimize(built.path, out, options, log=lambda _: None))
    return corpus["optimized"][case.name]


@pytest.mark.parametrize("case", [_param(c, "scan") for c in CASES])
def test_scan_covers_every_node_and_leaves_alone_only_for_expected_reasons(corpus, case):
    built = _built(corpus, case)
    model = prepare_graph(onnx.load(str(built.path)), built.path.parent)[0]  # as scan and optimize see it
    result = scan_model(model)
    nodes = gemm_view_nodes(model)
    covered = [n for w in result.workloads for n in w.nodes]
    left = {nodes[s.node]: s.reason for s in result.skipped}
    assert sorted(covered + list(left)) == sorted(nodes.values())
    assert not set(covered) & set(left)
    for node, reason in left.items():
        assert any(want in reason for want in case.left_alone), f"{node}: unexpected refusal: {reason}"
    for want in case.left_alone:
        assert any(want in reason for reason in left.values()), f"no node was left alone for {want!r}"
    if not case.left_alone or case.exporter != "onnx node test":
        assert covered, "no node to tune"


@pytest.mark.parametrize("case", [_param(c, "optimize") for c in CASES])
def test_optimized_model_gives_the_original_outputs(corpus, case):
    built = _built(corpus, case)
    if case.exporter == "onnx node test" and case.left_alone:  # its only node is refused: nothing to do
        out = corpus["folder"] / f"{case.name}.dietcode.onnx"
        with pytest.raises(DietcodeError, match=re.escape(case.left_alone[0])):
            optimize(built.path, out, OptimizeOptions(dims=_dims(built, _tuned(case, built)[0]),
                                                      measure="analytic", budget=4, progress=False,
                                                      db=corpus["folder"] / "tuning.db",
                                                      cache_dir=corpus["folder"] / "kernels"),
                     log=lambda _: None)
        assert not out.exists()
        return
    out, report = _optimized(corpus, case)
    # the model as optimize scans it: the attention pre-pass run, the Q/K/V projections merged where exact
    model = prepare_attention(prepare_graph(onnx.load(str(built.path)), built.path.parent)[0],
                              built.path.parent)[0]
    model = _pack_projections(built.path, model, ("sm_90",))
    scanned = scan_model(model, built.path.parent)
    sites = find_attention(model, built.path.parent).sites  # fused by default
    assert sorted(report.rewritten) == sorted(n for w in without_attention(scanned.workloads, sites) for n in w.nodes)
    optimized = onnx.load(str(out))
    assert sum(n.domain == "ai.dietcode" for n in optimized.graph.node) == len(report.rewritten) + len(sites)

    stock = ort.InferenceSession(str(built.path), providers=["CPUExecutionProvider"])
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    with_lib = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    fallback = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    _, probes = _tuned(case, built)
    for i, shape in enumerate(probes):
        feed = feeds(built.path, built, shape, seed=i)
        want = stock.run(None, feed)
        for session in (with_lib, fallback):
            for got, ref in zip(session.run(None, feed), want):
                assert got.dtype == ref.dtype and got.shape == ref.shape
                np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=case.rtol,
                                           atol=case.atol, err_msg=f"{case.name} at {shape}")
    if built.shipped is not None:  # the node test's own data: the optimized model reproduces its outputs
        shipped_feeds, shipped_outputs = built.shipped
        for session in (with_lib, fallback):
            for got, ref in zip(session.run(None, shipped_feeds), shipped_outputs):
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [_param(c, "conv1d") for c in CASES if c.model == "whisper-encoder"])
def test_whisper_conv1d_front_end_is_tuned_with_its_gelu(corpus, case):
    """Whisper's two Conv1d (then Gelu) over [batch, mel bins, frames] were left alone (only 2-D convs): written
    as 2-D convs of height 1 between an Unsqueeze and a Squeeze (tuner/conv1d.py), both are tuned with their
    bias and Gelu fused, the second at stride 2."""
    model, result = convs_as_2d(onnx.load(str(_built(corpus, case).path)))
    assert len(result.converted) == 2 and result.notes == ()
    convs = [w for w in scan_model(model).workloads if w.op == "conv"]
    assert sorted(w.conv.strides for w in convs) == [(1, 1), (1, 2)]
    assert all(w.conv.kernel == (1, 3) and w.conv.pads == (0, 1, 0, 1) for w in convs)
    assert all(w.epilogue.bias and w.epilogue.activation == "gelu" for w in convs)


# the activation nodes each model's exports must have fused into its products (by the model, any exporter and
# dtype): GPT-2's tanh Gelu behind its Conv1D's Reshape, LLaMA's SiLU on the MLP gate, MobileNetV2's ReLU6
# after every conv, its depthwise (grouped) ones too
FUSED_ACTIVATIONS = {"gpt2": ("Tanh", "gelu_tanh", "Gemm"), "llama": ("Sigmoid", "silu", "MatMul"),
                     "mobilenet-v2": ("Clip", "relu6", "Conv"), "bert": ("Erf", "gelu", "MatMul"),
                     "bart-decoder": ("Erf", "gelu", "MatMul"), "t5-decoder": ("Relu", "relu", "MatMul")}


@pytest.mark.parametrize("case", [_param(c, "fused") for c in CASES if c.model in FUSED_ACTIVATIONS
                                  and c.exporter in ("torchscript", "dynamo")])
def test_real_exports_fuse_their_activations(corpus, case):
    op, activation, base = FUSED_ACTIVATIONS[case.model]
    model = onnx.load(str(_built(corpus, case).path))
    result = scan_model(model)
    fused = {o for w in result.workloads for f in w.fused_nodes for o in f}
    acts = [n for n in model.graph.node if n.op_type == op]
    if op == "Erf" and not acts:  # opset 20: the Gelu op
        acts = [n for n in model.graph.node if n.op_type == "Gelu"]
    want = [n.output[0] for n in acts]  # MobileNetV2's ReLU6 after its depthwise (grouped) convs too
    assert want and all(o in fused for o in want), sorted(set(want) - fused)
    takers = [w for w in result.workloads if w.epilogue.activation == activation]
    assert takers and {w.onnx_op for w in takers} == {base}
    assert sum(len(w.nodes) for w in takers) == len(want)
    if case.model == "llama":  # the SwiGLU product by the up-projection's output goes in with the SiLU
        assert all(w.epilogue.residual_mul and w.epilogue.residual for w in takers)
        readers = {i: n for n in model.graph.node for i in n.input}
        silu = [readers[o] for o in want]  # Sigmoid -> its Mul by the gate (the SiLU)
        products = [readers[m.output[0]] for m in silu]
        assert all(p.op_type == "Mul" and p.output[0] in fused for p in products)


@pytest.mark.parametrize("case", [_param(c, "layer-scale") for c in CASES if c.model == "dinov2"])
def test_dinov2_layer_scale_is_folded_and_its_residuals_fused(corpus, case):
    """DINOv2's LayerScale, ``(x @ W + b) * lambda`` then the residual Add, after each block's attention output
    projection and second MLP layer: the scanner alone fuses the bias and stops at the Mul; with the Mul folded
    into W and b (tuner/affine.py) the residual is fused too, and no LayerScale Mul is left."""
    model = onnx.load(str(_built(corpus, case).path))
    lambdas = {t.name for t in model.graph.initializer if t.name.endswith("lambda1")}
    scales = [n for n in model.graph.node if n.op_type == "Mul" and set(n.input) & lambdas]
    assert len(scales) == 4  # two blocks, two LayerScales each
    assert not any(w.epilogue.residual for w in scan_model(model).workloads)
    prepared = prepare_graph(model, None).model
    assert not any(n.op_type == "Mul" and set(n.input) & lambdas for n in prepared.graph.node)
    residual = [n for w in scan_model(prepared).workloads if w.epilogue.residual and w.epilogue.bias
                for n in w.nodes]
    assert len(residual) == 4



@pytest.mark.parametrize("case", [_param(c, "residual") for c in CASES if c.exporter in ("torchscript", "dynamo")
                                  and c.model in ("bert", "distilbert", "gpt2", "vit", "dinov2", "bart-decoder")])
def test_real_exports_fuse_the_residual_before_each_layer_norm(corpus, case):
    """Each skip connection the transformers write before a LayerNorm (post-LN BERT, pre-LN GPT-2 and ViT) is a
    residual Add fused into the product before it: a MatMul's, or GPT-2's Conv1D Gemm's behind its Reshape back to
    [batch, seq, n] (the Reshape moves after the fused node; the residual is read in the product's row order)."""
    model = prepare_graph(onnx.load(str(_built(corpus, case).path)), None).model
    fused = {o for w in scan_model(model).workloads if w.epilogue.residual for f in w.fused_nodes for o in f}
    adds = {o for n in model.graph.node if n.op_type == "Add" for o in n.output}
    norms = [n.input[0] for n in model.graph.node if n.op_type == "LayerNormalization"]
    # the first LayerNorm reads the embeddings' sum (token and position embeddings; ViT's patches and positions)
    skips = {x for x in norms[1:] if x in adds} - {norms[0]}
    assert len(skips) >= 4 and skips <= fused, sorted(skips - fused)  # two layers, two skips each
