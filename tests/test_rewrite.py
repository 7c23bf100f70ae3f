"""Graph rewrite: custom nodes with fused epilogues, and model-local functions that stock ORT can run."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import models
from tuner.rewrite import DOMAIN, op_type, rewrite_model, save_model
from tuner.scan import scan_model

PAYLOAD = b"\x00not-a-real-bundle\xff"  # stock ORT runs the function body and never reads it

SHAPES = {
    "bert": [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 7}, {"batch": 3, "seq": 20}],
    "resnet50": [{"batch": 1, "height": 32, "width": 32}, {"batch": 2, "height": 45, "width": 38}],
    "mlp": [{"tokens": 1}, {"tokens": 77}],
}


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_function_fallback_matches_original(name, dtype):
    model = models.build(name, "tiny", dtype)
    scanned = scan_model(model)
    bundles = {n: PAYLOAD for w in scanned.workloads for n in w.nodes}
    result = rewrite_model(model, list(scanned.workloads), bundles)
    onnx.checker.check_model(result.model, full_check=True)
    assert len(result.rewritten) == len(bundles)
    custom = [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert len(custom) == len(bundles)
    assert {f.name for f in result.model.functions} == set(result.op_types)
    assert [o.name for o in result.model.graph.output] == [o.name for o in model.graph.output]
    for dims in SHAPES[name]:
        feeds = models.get(name).example_inputs("tiny", dims, dtype, seed=1)
        for want, got in zip(_run(model, feeds), _run(result.model, feeds)):
            np.testing.assert_array_equal(want, got)


def test_fused_nodes_are_removed_and_op_types_name_the_epilogue():
    model = models.build("bert", "tiny")
    scanned = scan_model(model)
    ffn = next(w for w in scanned.workloads if w.epilogue.activation == "gelu")
    assert op_type(ffn) == "MatMulBiasGelu"
    result = rewrite_model(model, [ffn], {n: PAYLOAD for n in ffn.nodes})
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Erf") == 0 and ops.count("MatMulBiasGelu") == 2
    node = next(n for n in result.model.graph.node if n.op_type == "MatMulBiasGelu")
    bundle = next(t for t in result.model.graph.initializer if t.name == node.input[-1])
    assert bytes(onnx.numpy_helper.to_array(bundle)) == PAYLOAD
    assert len(node.input) == 4  # A, weight, bias, bundle
    assert len(model.graph.node) - len(result.model.graph.node) == 2 * 6  # bias Add + 5 Gelu nodes each


def test_nodes_without_a_bundle_stay_and_save_roundtrips(tmp_path):
    model = models.build("mlp", "tiny")
    scanned = scan_model(model)
    first = scanned.workloads[0].nodes[0]
    result = rewrite_model(model, list(scanned.workloads), {first: PAYLOAD})
    assert result.rewritten == (first,)
    assert sum(n.domain == DOMAIN for n in result.model.graph.node) == 1
    path = tmp_path / "out" / "m.onnx"
    save_model(result.model, path)
    assert onnx.load(str(path)).graph.node[0].domain in (DOMAIN, "")
    assert not list(path.parent.glob(".*tmp*"))


def test_unnamed_nodes_get_their_outputs_names():
    """Exporters that name no node (some write none): each custom node takes its output's name, so node_stats()
    and inspect tell them apart (all were "" before); named nodes keep their names."""
    model = models.build("bert", "tiny")
    for i, node in enumerate(model.graph.node):
        if node.op_type == "MatMul" and i % 2:
            node.name = ""
    scanned = scan_model(model)
    bundles = {n: PAYLOAD for w in scanned.workloads for n in w.nodes}
    result = rewrite_model(model, list(scanned.workloads), bundles)
    custom = [n for n in result.model.graph.node if n.domain == DOMAIN]
    names = [n.name for n in custom]
    assert all(names) and len(set(names)) == len(names)
    assert any(n.name == n.output[0] for n in custom) and any(n.name != n.output[0] for n in custom)
