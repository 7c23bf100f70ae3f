"""Packed QKV (tuner/attention_pack.py, the packed layout of tuner/attention_graph.py, custom_ops/attention.cc):
BERT's three projections merged into one MatMul, a GPT-2-style packed projection split by a Split or three
Slices read in place by the fused node; outputs against stock ORT on the original models."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.bert import PRESETS, build_graph
from tuner.attention import LAYOUT_BITS
from tuner.attention_graph import OP_TYPE, find_attention, fuse_attention
from tuner.attention_pack import pack_projections

_H, _D = 2, 16
_E = _H * _D


def _stock(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _library(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    from dietcode_ort.runtime import register

    opts = ort.SessionOptions()
    register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _gpt2(split: str = "split13", *, sizes: tuple[int, int, int] = (_E, _E, _E), extra_read: bool = False,
          opset: int = 17, shape_reads: bool = False) -> onnx.ModelProto:
    """GPT-2's attention as its exports write it: x [B, S, E] -> c_attn MatMul [E, 3E] + bias -> split into
    q, k, v (``split``: "split13" a Split with a sizes input, "split18" num_outputs, "attr" the opset-11 split
    attribute, "slices" three Slices) -> Reshape [B, S, H, d] -> Transpose -> the chain (scale Div, mask Add)
    -> Transpose -> Reshape [B, S, E]. ``extra_read``: q's third is a graph output too; ``shape_reads``: each
    Reshape's shape comes from Shape(third) -> Gather(0, 1) -> Concat (the exporters' dynamic shapes)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((_E, 3 * _E)).astype(np.float32) * 0.2, "w"),
             numpy_helper.from_array(rng.standard_normal(3 * _E).astype(np.float32) * 0.1, "b"),
             numpy_helper.from_array(np.array([0, 0, _H, _D], np.int64), "heads"),
             numpy_helper.from_array(np.array([_H, _D], np.int64), "hd"),
             numpy_helper.from_array(np.array([0, 0, _E], np.int64), "joined"),
             numpy_helper.from_array(np.array(_D ** 0.5, np.float32), "c"),
             numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(1, np.int64), "i1"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0"),
             numpy_helper.from_array(np.array([2], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["qkv"])]
    parts = ["q3", "k3", "v3"]
    if split == "slices":
        bounds = [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
        for i, part in enumerate(parts):
            inits += [numpy_helper.from_array(np.array([bounds[i]], np.int64), f"start{i}"),
                      numpy_helper.from_array(np.array([bounds[i + 1]], np.int64), f"end{i}")]
            nodes.append(helper.make_node("Slice", ["qkv", f"start{i}", f"end{i}", "axes"], [part]))
    elif split == "split18":
        nodes.append(helper.make_node("Split", ["qkv"], parts, axis=2, num_outputs=3))
    elif split == "attr":
        nodes.append(helper.make_node("Split", ["qkv"], parts, axis=-1, split=list(sizes)))
    else:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        nodes.append(helper.make_node("Split", ["qkv", "sizes"], parts, axis=-1))
    for part, name, perm in zip(parts, "qkv", ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])):
        shape = "heads"
        if shape_reads:
            nodes += [helper.make_node("Shape", [part], [f"{name}_shape"]),
                      helper.make_node("Gather", [f"{name}_shape", "i0"], [f"{name}_b0"], axis=0),
                      helper.make_node("Gather", [f"{name}_shape", "i1"], [f"{name}_s0"], axis=0),
                      helper.make_node("Unsqueeze", [f"{name}_b0", "ax0"], [f"{name}_b"]),
                      helper.make_node("Unsqueeze", [f"{name}_s0", "ax0"], [f"{name}_s"]),
                      helper.make_node("Concat", [f"{name}_b", f"{name}_s", "hd"], [f"{name}_dims"], axis=0)]
            shape = f"{name}_dims"
        nodes += [helper.make_node("Reshape", [part, shape], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}t"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["qt", "kt"], ["s"]), helper.make_node("Div", ["s", "c"], ["s1"]),
              helper.make_node("Add", ["s1", "mask"], ["s2"]), helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vt"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "joined"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", _E]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, 1, "S"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", _E])]
    if extra_read:
        outputs.append(helper.make_tensor_value_info("q3", TensorProto.FLOAT, ["B", "S", sizes[0]]))
    graph = helper.make_graph(nodes, "gpt2_attention", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq)
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[0, ..., seq // 2 + 1:] = -10000.0
    return {"x": rng.standard_normal((batch, seq, _E)).astype(np.float32), "mask": mask}


@pytest.mark.parametrize("split, opset, shape_reads", [("split13", 17, False), ("split18", 18, True),
                                                       ("attr", 11, False), ("slices", 17, False)])
def test_gpt2_packed_projection_is_read_in_place(split: str, opset: int, shape_reads: bool) -> None:
    model = _gpt2(split, opset=opset, shape_reads=shape_reads)
    (site,) = find_attention(model).sites
    assert site.layout == 31 and site.layout & LAYOUT_BITS["packed"] and site.pack_notes == ()
    assert site.q == site.kt == site.v == "qkv" and site.packed_heads == _H
    fused, _ = fuse_attention(model)
    onnx.checker.check_model(fused, full_check=True)
    ops = Counter(n.op_type for n in fused.graph.node)
    before = Counter(n.op_type for n in model.graph.node)
    assert before["Transpose"] == 4 and before["Split"] + before["Slice"] in (1, 3)
    # the split, the head splits' Reshapes and Transposes (and their Shape computations) leave the graph
    assert ops == Counter({"MatMul": 1, "Add": 1, OP_TYPE: 1, "Reshape": 1}), ops
    node = next(n for n in fused.graph.node if n.op_type == OP_TYPE)
    assert list(node.input) == ["qkv", "qkv", "qkv", "mask"]
    for batch, seq in ((1, 1), (3, 5), (2, 17)):
        feeds = _feeds(batch, seq)
        want = _stock(model, feeds)
        np.testing.assert_allclose(_stock(fused, feeds), want, atol=1e-6)  # the fallback function
        np.testing.assert_allclose(_library(fused, feeds), want, atol=2e-6, rtol=1e-5)  # the CPU kernel


@pytest.mark.parametrize("kind, note", [
    ("unequal", "the Split's sizes \\[40, 24, 32\\] are not three equal thirds of 96"),
    ("unequal_slices", "takes \\[\\[0\\], \\[40\\]\\), not third 0"),
    ("extra_read", "the third 'q3' is read by other nodes too"),
])
def test_gpt2_split_that_is_not_provably_packed_stays(kind: str, note: str) -> None:
    if kind == "unequal":
        model = _gpt2("split13", sizes=(40, 24, 32))
    elif kind == "unequal_slices":
        model = _gpt2("slices", sizes=(40, 24, 32))
    else:
        model = _gpt2("split13", extra_read=True)
    found = find_attention(model)
    (site,) = found.sites
    assert not site.packed and not site.layout & LAYOUT_BITS["packed"]
    assert any(__import__("re").search(note, n) for n in site.pack_notes), site.pack_notes
    if kind != "extra_read":  # unequal parts: the head-split Reshapes do not fit them (ORT refuses to run it)
        return
    fused, _ = fuse_attention(model)
    feeds = _feeds(2, 5)
    np.testing.assert_allclose(_library(fused, feeds), _stock(model, feeds), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("float16", 2e-2)])
def test_tiny_bert_projections_merge_into_one_matmul_read_packed(dtype: str, tol: float) -> None:
    model = build_graph(PRESETS["tiny"], dtype, 0)
    layers = PRESETS["tiny"].layers
    packed, result = pack_projections(model)
    assert len(result.packed) == layers and result.notes == ()
    before, merged = Counter(n.op_type for n in model.graph.node), Counter(n.op_type for n in packed.graph.node)
    assert merged["MatMul"] == before["MatMul"] - 2 * layers and merged["Split"] == layers
    sites = find_attention(packed).sites
    assert all(s.layout == 31 and s.packed for s in sites)
    fused, _ = fuse_attention(packed)
    onnx.checker.check_model(fused, full_check=True)
    ops = Counter(n.op_type for n in fused.graph.node)
    assert ops["Split"] == ops["Transpose"] == 0 and ops[OP_TYPE] == layers
    assert ops["MatMul"] == before["MatMul"] - 4 * layers  # 3 projections -> 1, the 2 chain MatMuls -> the node
    assert ops["Reshape"] == layers  # the head merges only
    rng = np.random.default_rng(1)
    for batch, seq in ((1, 1), (3, 5), (2, 17)):
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq // 2:] = 0
        feeds = {"input_ids": rng.integers(0, 100, size=(batch, seq), dtype=np.int64), "attention_mask": mask}
        want = _stock(model, feeds)
        np.testing.assert_allclose(_stock(fused, feeds), want, atol=tol, rtol=tol)
        np.testing.assert_allclose(_library(fused, feeds), want, atol=tol, rtol=tol)


def _bert_variant(change: str) -> onnx.ModelProto:
    model = build_graph(PRESETS["tiny"], "float32", 0)
    nodes = {n.name: n for n in model.graph.node}
    key_mm = nodes["/encoder/layer.0/attention/self/key/MatMul"]
    if change == "weight_input":  # the key weight a graph input: not a constant
        w = next(t for t in model.graph.initializer if t.name == key_mm.input[1])
        model.graph.input.append(helper.make_tensor_value_info(w.name, w.data_type, list(w.dims)))
        model.graph.initializer.remove(w)
    elif change == "other_input":  # K projected from another value than Q and V
        key_mm.input[0] = "/embeddings/Add_output_0"
    elif change == "no_bias":  # V without its bias Add
        add = nodes["/encoder/layer.0/attention/self/value/Add"]
        for n in model.graph.node:
            for i, x in enumerate(n.input):
                if x == add.output[0]:
                    n.input[i] = nodes["/encoder/layer.0/attention/self/value/MatMul"].output[0]
        model.graph.node.remove(add)
    return model


@pytest.mark.parametrize("change, note", [
    ("weight_input", "weight .* is not a constant initializer"),
    ("other_input", "projections of different inputs"),
])
def test_bert_projections_that_do_not_merge_exactly_stay_three(change: str, note: str) -> None:
    model = _bert_variant(change)
    packed, result = pack_projections(model)
    layer0 = "/encoder/layer.0/attention/self/Transpose_output_0"
    assert layer0 not in result.packed and len(result.packed) == 1  # layer 1 still packs
    import re

    assert re.search(note, dict(result.notes)[layer0])
    site = next(s for s in find_attention(packed).sites if s.output == layer0)
    assert not site.packed and site.layout == 15


def test_a_projection_without_bias_packs_with_zeros_in_the_merged_bias() -> None:
    """V without its bias Add (Whisper's K has none) merges with Q and K all the same: its third of the merged
    bias is zeros, so the packed model computes the original's values."""
    model = _bert_variant("no_bias")
    packed, result = pack_projections(model)
    assert len(result.packed) == PRESETS["tiny"].layers and result.notes == ()
    bias = next(t for t in packed.graph.initializer if t.name.startswith("encoder.layer.0.attention.self.query.bias")
                and t.name.endswith("_qkv"))
    values = numpy_helper.to_array(bias)
    assert values.shape == (3 * 128,) and not values[256:].any() and values[:256].any()
    fused, _ = fuse_attention(packed)
    rng = np.random.default_rng(2)
    feeds = {"input_ids": rng.integers(0, 100, size=(2, 7), dtype=np.int64), "attention_mask": np.ones((2, 7), np.int64)}
    want = _stock(model, feeds)
    np.testing.assert_allclose(_stock(packed, feeds), want, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(_library(fused, feeds), want, atol=2e-5, rtol=2e-5)


def test_scan_reports_packing_and_why_not(tmp_path) -> None:
    from tuner.scan import attention_report

    onnx.save(_bert_variant("other_input"), tmp_path / "bert.onnx")
    report = attention_report(tmp_path / "bert.onnx")
    by_output = {f["output"]: f for f in report["fused"]}
    layer0, layer1 = (by_output[f"/encoder/layer.{i}/attention/self/Transpose_output_0"] for i in (0, 1))
    assert layer1["packed_qkv"] and layer1["merged_projections"] and layer1["layout"].endswith(",packed")
    assert not layer0["packed_qkv"] and "projections of different inputs" in layer0["pack_notes"][0]


def _packed_node(a_dims: list, b_dims: list, head_dim: int, layout: int = 23) -> onnx.ModelProto:
    """One CPU-form Attention node taking ``a`` as Q and V and ``b`` as K in the packed layout."""
    from tuner.rewrite import DOMAIN, DOMAIN_VERSION

    node = helper.make_node(OP_TYPE, ["a", "b", "a"], ["y"], domain=DOMAIN, scale=1.0, head_dim=head_dim,
                            nan_to_zero=0, layout=layout)
    graph = helper.make_graph([node], "packed", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims),
                                                 helper.make_tensor_value_info("b", TensorProto.FLOAT, b_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(DOMAIN, DOMAIN_VERSION)], ir_version=8)


@pytest.mark.parametrize("a, b, head_dim, layout, message", [
    ((2, 5, 96), (2, 5, 96), 12, 23, "last dim that is not a positive multiple of 3 \\* head_dim \\(head_dim 12\\)"),
    ((2, 5, 90), (2, 5, 90), 16, 23, "not a positive multiple of 3 \\* head_dim \\(head_dim 16\\)"),
    ((2, 5, 96), (2, 4, 96), 16, 23, "takes one \\[batch, seq, 3 \\* heads \\* head_dim\\] projection"),
    ((2, 5, 96), (2, 5, 48), 16, 23, "takes one \\[batch, seq, 3 \\* heads \\* head_dim\\] projection"),
    ((2, 5, 96), (2, 5, 96), 0, 23, "packed layout needs the head_dim attribute"),
    # a hand-edited head_dim whose 3 * head_dim overflows int64 (2^62: the text of the product overran a buffer)
    ((2, 5, 96), (2, 5, 96), 2**62, 23, "not a positive multiple of 3 \\* head_dim \\(head_dim 4611686018427387904\\)"),
    ((2, 5, 96), (2, 5, 96), 2**63 // 3 + 1, 23, "not a positive multiple of 3 \\* head_dim \\(head_dim 3074457345618258603\\)"),
    ((2, 5, 96), (2, 5, 96), 16, 16, "layout attribute 16 is not a bit set"),
])
def test_cpu_kernel_refuses_bad_packed_calls_clearly(a: tuple, b: tuple, head_dim: int, layout: int,
                                                     message: str) -> None:
    model = _packed_node(["A", "S", "C"], ["A2", "S2", "C2"], head_dim, layout)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal(a).astype(np.float32), "b": rng.standard_normal(b).astype(np.float32)}
    with pytest.raises(Exception, match=message):
        _library(model, feeds)



@pytest.mark.parametrize("layout, dims", [(15, [2**40, 0, _H, _D]), (23, [2**40, 0, 3 * _E])])
def test_cpu_kernel_answers_empty_inputs_with_a_huge_batch_at_once(tmp_path, layout: int, dims: list) -> None:
    """Q, K and V with no element but a batch of 2^40 (a shape ORT accepts): the empty output comes back at once,
    without permuting 2^40 empty rows (the head-split layouts' permutation looped over them, for hours)."""
    import subprocess
    import sys

    path = tmp_path / "empty.onnx"
    names = [f"d{i}" for i in range(len(dims))]
    onnx.save(_packed_node(names, names, _D, layout), str(path))
    code = f"""
import numpy as np, onnxruntime as ort
from dietcode_ort.runtime import register
opts = ort.SessionOptions()
register(opts)
sess = ort.InferenceSession({str(path)!r}, opts, providers=["CPUExecutionProvider"])
x = ort.OrtValue.ortvalue_from_shape_and_type({dims!r}, np.float32)
print(sess.run_with_ort_values(None, {{"a": x, "b": x}})[0].shape())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shape = [int(d) for d in proc.stdout.strip().strip("[]").split(",")]
    assert shape[0] == 2**40 and 0 in shape  # layout 23 writes [B, H, S, d], 15 [B, S, H, d]


def test_cpu_kernel_reads_part_i_of_input_i() -> None:
    """The packed node reads Q from part 0 of input 0, K from part 1 of input 1, V from part 2 of input 2 (the
    fallback body's semantics): with Q, V from one tensor and K from another, the result is that attention."""
    from tuner.attention import reference_attention

    import torch

    model = _packed_node(["A", "S", "C"], ["A", "S", "C"], _D)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 5, 3 * _E)).astype(np.float32)
    b = rng.standard_normal((2, 5, 3 * _E)).astype(np.float32)
    got = _library(model, {"a": a, "b": b})

    def part(x: np.ndarray, i: int) -> torch.Tensor:
        return torch.from_numpy(x.reshape(2, 5, 3, _H, _D)[:, :, i]).transpose(1, 2)

    want = reference_attention(part(a, 0), part(b, 1).transpose(-1, -2), part(a, 2))
    np.testing.assert_allclose(got, want.numpy(), atol=2e-6, rtol=1e-5)
