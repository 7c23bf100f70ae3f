"""The graph pre-pass before attention matching (tuner/attention_prepare.py) and the folding of the Muls that scale
Q and Kt (tuner/attention_graph.py), on BERT-style layers written the way torch.onnx's two exporters write them:
TorchScript (Reshape targets from Shape of the transposed Q, V and output, a no-op Reshape of the output before
its Transpose) and dynamo (Kt as Reshape -> Transpose (0, 2, 1) -> Reshape from Shape(K) slices, opset 18 Shape
start/end), both with scaled_dot_product_attention's Mul of Q and of Kt by the root of the scale. Outputs
against stock ORT on the original."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.attention_graph import OP_TYPE, find_attention, fuse_attention
from tuner.attention_pack import pack_projections
from tuner.attention_prepare import prepare_attention

_H, _D = 2, 8
_E = _H * _D
_ROOT = 0.7  # each of Q and Kt is multiplied by it: the chain's scale is its square


def _i64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _exported(style: str, *, q_mul: str = "scalar", projection_scale: bool = False) -> onnx.ModelProto:
    """One attention layer of three projections of x [B, S, E] with biases, as ``style`` ("torchscript" or
    "dynamo") writes it. ``q_mul``: "scalar" (SDPA's), "vector" (a [d] constant: no scale to fold) or
    "read_twice" (Q's Mul output is a graph output too). ``projection_scale``: Q's projection is multiplied by
    a constant before its head split (Whisper's and BART's attention), and K's projection has no bias (Whisper's)."""
    rng = np.random.default_rng(0)
    inits = [_i64("i0", 0), _i64("i1", 1), _i64("i2", 2), _i64("i3", 3), _i64("ax0", [0]), _i64("hd", [_H, _D]),
             _i64("e", [_E]), _i64("minus1", [-1]),
             numpy_helper.from_array(np.array(_ROOT, np.float32), "root"),
             numpy_helper.from_array(np.full(_D, _ROOT, np.float32), "root_d"),
             numpy_helper.from_array(np.array([0.3], np.float32), "proj_c")]
    nodes = []
    for p in "qkv":
        inits += [numpy_helper.from_array(rng.standard_normal((_E, _E)).astype(np.float32) * 0.3, f"w{p}"),
                  numpy_helper.from_array(rng.standard_normal(_E).astype(np.float32) * 0.1, f"b{p}")]
        if projection_scale and p == "k":
            nodes.append(helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}3"]))
            continue
        nodes += [helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}m"]),
                  helper.make_node("Add", [f"{p}m", f"b{p}"], [f"{p}3" if p != "q" or not projection_scale else "qb"])]
        if projection_scale and p == "q":
            nodes.append(helper.make_node("Mul", ["qb", "proj_c"], ["q3"]))

    def unsq(src: str, dst: str) -> onnx.NodeProto:
        return helper.make_node("Unsqueeze", [src, "ax0"], [dst])

    if style == "torchscript":
        nodes += [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["b0"]),
                  helper.make_node("Gather", ["xs", "i1"], ["s0"]), unsq("b0", "b1"), unsq("s0", "s1"),
                  helper.make_node("Concat", ["b1", "s1", "hd"], ["heads"], axis=0)]
    else:
        nodes += [helper.make_node("Shape", ["x"], ["b1"], start=0, end=1),
                  helper.make_node("Shape", ["x"], ["s1"], start=1, end=2),
                  helper.make_node("Concat", ["b1", "s1", "hd"], ["heads"], axis=0)]
    for p in "qkv":
        nodes.append(helper.make_node("Reshape", [f"{p}3", "heads"], [f"{p}4"]))
    nodes += [helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3])]
    if style == "torchscript":
        nodes.append(helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    else:  # K [B, H, S, d] -> [B*H, S, d] -> [B*H, d, S] -> [B, H, d, S], the targets from Shape(K)
        nodes += [helper.make_node("Transpose", ["k4"], ["k0"], perm=[0, 2, 1, 3]),
                  helper.make_node("Shape", ["k0"], ["ks"], start=0),
                  helper.make_node("Slice", ["ks", "ax0", "i2_1"], ["kbh"]),
                  helper.make_node("Slice", ["ks", "i2_1", "i3_1"], ["kseq"]),
                  helper.make_node("Slice", ["ks", "i3_1", "i4_1"], ["kd"]),
                  helper.make_node("Concat", ["minus1", "kseq", "kd"], ["k3shape"], axis=0),
                  helper.make_node("Reshape", ["k0", "k3shape"], ["kbhsd"]),
                  helper.make_node("Transpose", ["kbhsd"], ["k3t"], perm=[0, 2, 1]),
                  helper.make_node("Concat", ["kbh", "kd", "kseq"], ["ktshape"], axis=0),
                  helper.make_node("Reshape", ["k3t", "ktshape"], ["kt"])]
        inits += [_i64("i2_1", [2]), _i64("i3_1", [3]), _i64("i4_1", [4])]
    nodes += [helper.make_node("Mul", ["qt", "root_d" if q_mul == "vector" else "root"], ["qs"]),
              helper.make_node("Mul", ["kt", "root"], ["ks_"]),
              helper.make_node("MatMul", ["qs", "ks_"], ["s"]), helper.make_node("Add", ["s", "mask"], ["s2"]),
              helper.make_node("Softmax", ["s2"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "vt"], ["o"])]
    if style == "torchscript":  # SDPA's no-op Reshape [B, -1, S_q, E_v] from Shapes of o, Q and V; the merge
        # Reshape's [B, S] from Shape of the output's Transpose
        nodes += [helper.make_node("Shape", ["o"], ["os"]), helper.make_node("Gather", ["os", "i0"], ["ob"]),
                  helper.make_node("Shape", ["qt"], ["qts"]), helper.make_node("Gather", ["qts", "i2"], ["oq"]),
                  helper.make_node("Shape", ["vt"], ["vts"]), helper.make_node("Gather", ["vts", "i3"], ["oe"]),
                  unsq("ob", "ob1"), unsq("oq", "oq1"), unsq("oe", "oe1"),
                  helper.make_node("Concat", ["ob1", "minus1", "oq1", "oe1"], ["o4shape"], axis=0),
                  helper.make_node("Reshape", ["o", "o4shape"], ["o4"]),
                  helper.make_node("Transpose", ["o4"], ["ot"], perm=[0, 2, 1, 3]),
                  helper.make_node("Shape", ["ot"], ["ots"]), helper.make_node("Gather", ["ots", "i0"], ["yb"]),
                  helper.make_node("Gather", ["ots", "i1"], ["ys"]), unsq("yb", "yb1"), unsq("ys", "ys1"),
                  helper.make_node("Concat", ["yb1", "ys1", "e"], ["yshape"], axis=0)]
    else:
        nodes += [helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
                  helper.make_node("Concat", ["b1", "s1", "e"], ["yshape"], axis=0)]
    nodes.append(helper.make_node("Reshape", ["ot", "yshape"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", _E]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, 1, "S"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", _E])]
    if q_mul == "read_twice":
        outputs.append(helper.make_tensor_value_info("qs", TensorProto.FLOAT, ["B", _H, "S", _D]))
    graph = helper.make_graph(nodes, f"{style}_attention", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq)
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[0, ..., seq // 2 + 1:] = -10000.0
    return {"x": rng.standard_normal((batch, seq, _E)).astype(np.float32), "mask": mask}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], library: bool = False,
         plain: bool = False) -> list[np.ndarray]:
    """ORT's outputs; ``plain``: with its graph optimizations off (they fuse a scaling Mul into a MatMul in one
    graph and not in another, which moves the last bit)."""
    opts = ort.SessionOptions()
    if plain:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if library:
        from dietcode_ort.runtime import register

        register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def _transposes(model: onnx.ModelProto) -> int:
    return [n.op_type for n in model.graph.node].count("Transpose")


@pytest.mark.parametrize("style", ["torchscript", "dynamo"])
def test_exported_layers_fuse_absorb_every_transpose_and_pack(style: str) -> None:
    """Without the pre-pass the exports keep head-split Transposes (TorchScript: Q's and V's read by Shapes,
    the output's behind a Reshape; dynamo: Kt's Reshape -> Transpose -> Reshape); with it every Transpose is
    absorbed, the SDPA Muls fold into the scale, the projections merge and the node reads them packed. The
    fused model matches stock ORT on the original, through the library's CPU kernel and the fallback."""
    model = _exported(style)
    (raw,) = find_attention(model).sites
    assert raw.layout == {"torchscript": 2, "dynamo": 13}[style]  # Kt made by a Reshape: no Transpose to keep
    assert raw.scale == pytest.approx(_ROOT * _ROOT, rel=1e-6)  # the Muls folded even so
    prepared, done = prepare_attention(model)
    onnx.checker.check_model(prepared, full_check=True)
    assert (done.shapes, done.kt_transposes, done.merged_transposes, done.reshapes) == \
        {"torchscript": (3, 0, 0, 1), "dynamo": (1, 1, 1, 0)}[style]
    assert not any(n.op_type == "Shape" and n.input[0] in {"qt", "vt", "ot", "k0"} for n in prepared.graph.node)
    (site,) = find_attention(prepared).sites
    assert site.layout == 15 and site.layout_notes == ()
    assert site.scale == pytest.approx(_ROOT * _ROOT, rel=1e-6) and {"qs", "ks_"} <= set(site.nodes)
    packed, result = pack_projections(prepared)
    assert result.packed == (site.output,) and result.notes == ()
    (site,) = find_attention(packed).sites
    assert site.layout == 31 and site.pack_notes == ()
    fused, _ = fuse_attention(packed)
    onnx.checker.check_model(fused, full_check=True)
    ops = Counter(n.op_type for n in fused.graph.node)
    assert ops["Transpose"] == 0 and ops[OP_TYPE] == 1 and ops["MatMul"] == 1 and ops["Mul"] == 0, ops
    assert _transposes(model) == 4 if style == "torchscript" else 5
    for batch, seq in ((1, 1), (2, 5), (3, 17)):
        feeds = _feeds(batch, seq)
        (want,) = _run(model, feeds)
        np.testing.assert_allclose(_run(prepared, feeds)[0], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(_run(fused, feeds)[0], want, rtol=1e-5, atol=1e-6)  # the fallback function
        np.testing.assert_allclose(_run(fused, feeds, library=True)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["torchscript", "dynamo"])
def test_a_scaled_projection_moves_after_its_head_split_and_packs(style: str) -> None:
    """Q's projection times a constant before its head split: the Mul moves after the Transpose (the same
    values), folds into the scale with SDPA's, and Q packs with K (no bias: zeros in the merged bias) and V."""
    model = _exported(style, projection_scale=True)
    prepared, done = prepare_attention(model)
    assert done.scales == 1
    packed, result = pack_projections(prepared)
    (site,) = find_attention(packed).sites
    assert site.layout == 31 and result.notes == ()
    assert site.scale == pytest.approx(0.3 * _ROOT * _ROOT, rel=1e-6)
    fused, _ = fuse_attention(packed)
    onnx.checker.check_model(fused, full_check=True)
    assert {n.op_type for n in fused.graph.node} == {"MatMul", "Add", OP_TYPE, "Reshape"} | (
        {"Shape", "Gather", "Unsqueeze", "Concat"} if style == "torchscript" else {"Shape", "Concat"})
    for batch, seq in ((1, 1), (2, 9)):
        feeds = _feeds(batch, seq)
        (want,) = _run(model, feeds)
        np.testing.assert_array_equal(_run(prepared, feeds, plain=True)[0], _run(model, feeds, plain=True)[0])
        np.testing.assert_allclose(_run(fused, feeds, library=True)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["torchscript", "dynamo"])
def test_prepare_is_idempotent(style: str) -> None:
    once, _ = prepare_attention(_exported(style))
    twice, done = prepare_attention(once)
    assert (done.shapes, done.kt_transposes, done.merged_transposes, done.reshapes) == (0, 0, 0, 0)
    assert twice.graph.SerializeToString(deterministic=True) == once.graph.SerializeToString(deterministic=True)


@pytest.mark.parametrize("restored", [True, False])
def test_kt_reshapes_are_one_transpose_only_when_they_restore_the_leading_dims(restored: bool) -> None:
    """Reshape [a, b, c, d] -> [a*b, c, d], Transpose (0, 2, 1), Reshape -> [a, b, d, c] is Transpose (0, 1, 3,
    2) and is rewritten so; a second Reshape to [b, a, d, c] is not (the same elements, another order): it stays.
    Either way the values are the original's."""
    a, b, c, d = 2, 3, 4, 5
    out_dims = [a, b, d, c] if restored else [b, a, d, c]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [a, b, c, d])
    nodes = [helper.make_node("Reshape", ["x", "merged"], ["r1"]),
             helper.make_node("Transpose", ["r1"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["t", "split"], ["y0"]), helper.make_node("Softmax", ["y0"], ["y"])]
    graph = helper.make_graph(nodes, "kt", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)],
                              [_i64("merged", [a * b, c, d]), _i64("split", out_dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    prepared, done = prepare_attention(model)
    assert done.kt_transposes == int(restored)
    ops = [n.op_type for n in prepared.graph.node]
    assert ops == (["Transpose", "Softmax"] if restored else ["Reshape", "Transpose", "Reshape", "Softmax"])
    if restored:
        assert [list(at.ints) for at in prepared.graph.node[0].attribute] == [[0, 1, 3, 2]]
    feeds = {"x": np.random.default_rng(0).standard_normal((a, b, c, d)).astype(np.float32)}
    np.testing.assert_array_equal(_run(prepared, feeds)[0], _run(model, feeds)[0])


@pytest.mark.parametrize("q_mul", ["vector", "read_twice"])
def test_muls_that_are_not_a_scalar_scale_of_q_alone_stay(q_mul: str) -> None:
    """Q's Mul by a [d] constant, or one whose output is read elsewhere too, is not folded: it stays in the
    graph, K's is folded. Q's Transpose moves past the [d] Mul (the constant permuted alike, [1, 1, 1, d]) and
    the node absorbs it; past the Mul whose output is a graph output it does not (the node reads the Mul's
    output, Q's Transpose stays, with the reason)."""
    model, result = prepare_attention(_exported("torchscript", q_mul=q_mul))
    found = find_attention(model)
    (site,) = found.sites
    assert "ks_" in site.nodes and site.scale == pytest.approx(_ROOT, rel=1e-6)
    if q_mul == "vector":
        assert result.moved == 1 and result.notes == ()
        assert site.layout == 15 and site.layout_notes == () and _transposes(model) == 4
        mul = next(n for n in model.graph.node if n.output[0] == site.q)
        assert mul.op_type == "Mul" and mul.input[0] == "q4"
        assert numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == mul.input[1])).shape == \
            (1, 1, 1, _D)
    else:
        assert result.moved == 0 and result.notes == (("qt", "the head-split Transpose stays: 'qs' is a graph "
                                                             "output"),)
        assert site.q == "qs" and "qs" not in site.nodes and site.layout == 14
        assert site.layout_notes == ("Q's Transpose 'qt' kept: the Mul between it and the chain is not one by a "
                                     "one-element constant read by the chain alone",)
    fused, _ = fuse_attention(model, found.sites)
    assert any(n.op_type == "Mul" and n.output[0] == site.q for n in fused.graph.node)
    feeds = _feeds(2, 6)
    want = _run(_exported("torchscript", q_mul=q_mul), feeds)
    got = _run(fused, feeds, library=True)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_shape_of_a_transpose_with_start_and_end() -> None:
    """Shape(Transpose(x, perm), start, end) is Gather(Shape(x), perm[start:end]): the same values for every
    start/end (negative ones included), and a constant Gather of it reads Shape(x) at the composed index, or
    becomes the constant when the dim is a known integer."""
    perm = [2, 0, 3, 1]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["A", 3, "C", 5])
    ranges = [(None, None), (1, None), (-3, -1), (0, 2), (2, 100), (-100, 1)]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm), helper.make_node("Softmax", ["t"], ["sm"])]
    outputs = [helper.make_tensor_value_info("sm", TensorProto.FLOAT, None)]
    for i, (start, end) in enumerate(ranges):
        attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
        nodes.append(helper.make_node("Shape", ["t"], [f"shape{i}"], **attrs))
        outputs.append(helper.make_tensor_value_info(f"shape{i}", TensorProto.INT64, None))
    nodes += [helper.make_node("Shape", ["t"], ["whole"]), helper.make_node("Gather", ["whole", "i0"], ["g0"]),
              helper.make_node("Gather", ["whole", "i3"], ["g3"])]  # t's dim 0 is x's "C", dim 3 x's 3
    outputs += [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("g0", "g3")]
    graph = helper.make_graph(nodes, "shapes", [x], outputs, [_i64("i0", 0), _i64("i3", 3)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    prepared, done = prepare_attention(model)
    assert done.shapes == len(ranges) + 1
    assert not any(n.op_type == "Shape" and n.input[0] == "t" for n in prepared.graph.node)
    assert "g3" in {t.name for t in prepared.graph.initializer}  # x's dim 1 is 3
    feeds = {"x": np.zeros((2, 3, 4, 5), np.float32)}
    for want, got in zip(_run(model, feeds), _run(prepared, feeds)):
        np.testing.assert_array_equal(got, want)


# --- LLaMA-style attention: rotary embedding on Q and K, grouped-query K/V repeated over the heads -------------

_KV = 2  # K/V heads: each repeated _H4 // _KV times
_H4 = 4
_E4 = _H4 * _D


def _llama(variant: str = "") -> onnx.ModelProto:
    """One LLaMA layer's attention as the Hugging Face model writes it and torch.onnx exports it: Q [B, S, H, d] and
    K [B, S, KV, d] head-split and transposed, then the rotary embedding (x * cos + rotate_half(x) * sin, cos and
    sin [1, S, d] unsqueezed to [1, 1, S, d]), K and V repeated to H heads (Unsqueeze at 2 -> Expand [B, KV, H/KV,
    S, d] -> Reshape [B, H, S, d]), SDPA's Mul of Q and Kt by the root of the scale. ``variant``: "cos_input" (cos
    and sin [1, 1, S, d] graph inputs: no Unsqueeze to re-place), "tile" (the repeat's new axis before the KV
    heads: head h is KV head h % KV, which the moved layout cannot merge), "present" (K after its rotary
    embedding is a graph output too, as a KV cache's present key is), "reduce" (V's head split is also read by a
    ReduceMean)."""
    rng = np.random.default_rng(1)
    half = _D // 2
    inits = [numpy_helper.from_array(rng.standard_normal((_E4, _E4)).astype(np.float32) * 0.3, "wq"),
             numpy_helper.from_array(rng.standard_normal((_E4, _KV * _D)).astype(np.float32) * 0.3, "wk"),
             numpy_helper.from_array(rng.standard_normal((_E4, _KV * _D)).astype(np.float32) * 0.3, "wv"),
             numpy_helper.from_array((1.0 / 10000 ** (np.arange(half) / half)).astype(np.float32), "inv_freq"),
             numpy_helper.from_array(np.array(_ROOT, np.float32), "root"),
             _i64("q_shape", [0, 0, _H4, _D]), _i64("kv_shape", [0, 0, _KV, _D]), _i64("ax0", [0]),
             _i64("ax1", [1]), _i64("ax2", [2]), _i64("ax02", [0, 2]), _i64("last", [3]), _i64("minus1", [-1]),
             _i64("zero", [0]), _i64("half", [half]), _i64("big", [2 ** 62]), _i64("kv", [_KV]),
             _i64("rep", [_H4 // _KV]), _i64("heads", [_H4]), _i64("d", [_D]), _i64("e", [_E4])]
    nodes = [helper.make_node("Shape", ["x"], ["b1"], start=0, end=1),
             helper.make_node("Shape", ["x"], ["s1"], start=1, end=2),
             helper.make_node("MatMul", ["x", "wq"], ["q3"]), helper.make_node("MatMul", ["x", "wk"], ["k3"]),
             helper.make_node("MatMul", ["x", "wv"], ["v3"]),
             helper.make_node("Reshape", ["q3", "q_shape"], ["q4"]),
             helper.make_node("Reshape", ["k3", "kv_shape"], ["k4"]),
             helper.make_node("Reshape", ["v3", "kv_shape"], ["v4"])]
    nodes += [helper.make_node("Transpose", [f"{p}4"], [f"{p}t"], perm=[0, 2, 1, 3]) for p in "qkv"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", _E4]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, 1, "S"])]
    if variant == "cos_input":
        inputs += [helper.make_tensor_value_info(f, TensorProto.FLOAT, [1, 1, "S", _D]) for f in ("cos4", "sin4")]
    else:
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.FLOAT, ["S"]))
        nodes += [helper.make_node("Unsqueeze", ["pos", "ax02"], ["pos3"]),
                  helper.make_node("Mul", ["pos3", "inv_freq"], ["freqs"]),
                  helper.make_node("Concat", ["freqs", "freqs"], ["angles"], axis=-1),
                  helper.make_node("Cos", ["angles"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"]),
                  helper.make_node("Unsqueeze", ["cos", "ax1"], ["cos4"]),
                  helper.make_node("Unsqueeze", ["sin", "ax1"], ["sin4"])]
    for p in "qk":  # x * cos + cat(-x2, x1) * sin, the halves sliced along axis 3 and -1
        nodes += [helper.make_node("Mul", [f"{p}t", "cos4"], [f"{p}c"]),
                  helper.make_node("Slice", [f"{p}t", "zero", "half", "last"], [f"{p}1"]),
                  helper.make_node("Slice", [f"{p}t", "half", "big", "minus1"], [f"{p}2"]),
                  helper.make_node("Neg", [f"{p}2"], [f"{p}n"]),
                  helper.make_node("Concat", [f"{p}n", f"{p}1"], [f"{p}rot"], axis=-1),
                  helper.make_node("Mul", [f"{p}rot", "sin4"], [f"{p}sn"]),
                  helper.make_node("Add", [f"{p}c", f"{p}sn"], [f"{p}r"])]
    repeat = ["b1", "rep", "kv", "s1", "d"] if variant == "tile" else ["b1", "kv", "rep", "s1", "d"]
    nodes += [helper.make_node("Concat", repeat, ["rep_shape"], axis=0),
              helper.make_node("Concat", ["b1", "heads", "s1", "d"], ["bhsd"], axis=0)]
    for p, src in (("k", "kr"), ("v", "vt")):
        nodes += [helper.make_node("Unsqueeze", [src, "ax1" if variant == "tile" else "ax2"], [f"{p}u"]),
                  helper.make_node("Expand", [f"{p}u", "rep_shape"], [f"{p}e"]),
                  helper.make_node("Reshape", [f"{p}e", "bhsd"], [f"{p}h"], allowzero=1)]
    nodes += [helper.make_node("Transpose", ["kh"], ["kht"], perm=[0, 1, 3, 2]),
              helper.make_node("Mul", ["qr", "root"], ["qs"]), helper.make_node("Mul", ["kht", "root"], ["ks"]),
              helper.make_node("MatMul", ["qs", "ks"], ["s"]), helper.make_node("Add", ["s", "mask"], ["s2"]),
              helper.make_node("Softmax", ["s2"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "vh"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Concat", ["b1", "s1", "e"], ["yshape"], axis=0),
              helper.make_node("Reshape", ["ot", "yshape"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", _E4])]
    if variant == "present":
        outputs.append(helper.make_tensor_value_info("kr", TensorProto.FLOAT, ["B", _KV, "S", _D]))
    if variant == "reduce":  # V's head split read by an op with no form on the moved layout as well
        nodes.append(helper.make_node("ReduceMean", ["vt", "last"], ["vmean"]))
        outputs.append(helper.make_tensor_value_info("vmean", TensorProto.FLOAT, ["B", _KV, "S", 1]))
    graph = helper.make_graph(nodes, f"llama_{variant or 'attention'}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _llama_feeds(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, np.ndarray]:
    feeds = _feeds(batch, seq)
    feeds["x"] = np.random.default_rng(seq + 1).standard_normal((batch, seq, _E4)).astype(np.float32)
    angles = np.arange(seq, dtype=np.float32)[:, None] / 10000 ** (np.arange(_D) % (_D // 2) / (_D // 2))
    names = {i.name for i in model.graph.input}
    if "pos" in names:
        feeds["pos"] = np.arange(seq, dtype=np.float32)
    else:
        feeds["cos4"] = np.cos(angles).astype(np.float32)[None, None]
        feeds["sin4"] = np.sin(angles).astype(np.float32)[None, None]
    return feeds


def test_llama_transposes_move_past_the_rotary_embedding_and_the_kv_repeat() -> None:
    """Q's, K's and V's head-split Transposes move down to the chain: the rotary embedding runs on [B, S, H, d]
    (cos and sin unsqueezed at axis 2, the Slices and the Concat along axis 3), K and V are repeated there
    (Unsqueeze at 3, the Expand's shape gathered [B, S, KV, rep, d], a Reshape [0, 0, H, d]); K's moved Transpose
    and its Kt Transpose are one (0, 2, 3, 1). The node absorbs all four: no Transpose is left. The prepared
    model computes bit for bit what the original does; Q/K/V are not packed (the rotary embedding and the
    repeat sit between the projections and the head splits, whose widths differ: GQA)."""
    model = _llama()
    prepared, result = prepare_attention(model)
    assert result.moved == 3 and result.notes == () and result.merged_transposes == 1
    assert _transposes(prepared) == 4
    ops = Counter(n.op_type for n in prepared.graph.node)
    assert ops["Unsqueeze"] == Counter(n.op_type for n in model.graph.node)["Unsqueeze"]  # cos/sin re-placed
    unsqueezes = {tuple(numpy_helper.to_array(t).tolist()) for n in prepared.graph.node if n.op_type == "Unsqueeze"
                  for t in prepared.graph.initializer if t.name == n.input[1]}
    assert {(2,), (3,)} <= unsqueezes and (1,) not in unsqueezes
    again, twice = prepare_attention(prepared)
    assert twice.moved == 0 and [n.op_type for n in again.graph.node] == [n.op_type for n in prepared.graph.node]
    found = find_attention(prepared)
    (site,) = found.sites
    assert site.layout == 15 and site.layout_notes == () and site.scale == pytest.approx(_ROOT ** 2, rel=1e-6)
    assert next(n for n in prepared.graph.node if n.output[0] == site.kt).op_type == "Reshape"
    _, packs = pack_projections(prepared)
    assert packs.packed == () and "rotary embedding or a K/V head repeat" in packs.notes[0][1]
    fused, _ = fuse_attention(prepared, found.sites)
    assert _transposes(fused) == 0
    for batch, seq in ((2, 7), (1, 1), (3, 4)):
        feeds = _llama_feeds(model, batch, seq)
        want = _run(model, feeds)
        for got, tol in ((_run(prepared, feeds), 0.0), (_run(fused, feeds, library=True), 1e-5),
                         (_run(fused, feeds), 0.0)):
            np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("variant, stays, note", [
    ("cos_input", "qt", "the operand 'cos4' is neither a constant nor made by an Unsqueeze"),
    ("tile", "kt", "merges axes apart in the moved layout"),
    ("present", "kt", "'kr' is a graph output"),
    ("reduce", "vt", "the ReduceMean 'vmean' after it: it has no form in the moved layout"),
])
def test_llama_near_misses_keep_their_transposes(variant: str, stays: str, note: str) -> None:
    """What has no exact form on the moved layout stays as it is, with the reason: cos and sin given as
    [1, 1, S, d] inputs (Q's and K's Transposes stay), the repeat's axis inserted before the KV heads (K's and V's
    stay, Q's moves), K's rotary output read as a graph output too (K's stays), V's head split read by a
    ReduceMean too (V's stays). The model computes what the original does."""
    model = _llama(variant)
    prepared, result = prepare_attention(model)
    notes = dict(result.notes)
    assert stays in notes and note in notes[stays], notes
    kept = {"cos_input": {"qt", "kt"}, "tile": {"kt", "vt"}, "present": {"kt"}, "reduce": {"vt"}}[variant]
    assert set(notes) == kept and result.moved == 3 - len(kept)
    assert {n.output[0] for n in prepared.graph.node if n.op_type == "Transpose"} >= kept
    found = find_attention(prepared)
    (site,) = found.sites
    fused, _ = fuse_attention(prepared, found.sites)
    feeds = _llama_feeds(model, 2, 5)
    want = _run(model, feeds)
    np.testing.assert_allclose(_run(prepared, feeds)[0], want[0], rtol=0, atol=0)
    np.testing.assert_allclose(_run(fused, feeds, library=True)[0], want[0], rtol=1e-5, atol=1e-5)


def test_scan_reports_the_transposes_not_moved(tmp_path) -> None:
    from tuner.scan import attention_report

    path = tmp_path / "llama.onnx"
    onnx.save(_llama("present"), str(path))
    report = attention_report(path)
    assert report["transposes_not_moved"] == [{"transpose": "kt", "reason": "the head-split Transpose stays: 'kr' is "
                                                                           "a graph output"}]
    (fused,) = report["fused"]
    assert fused["layout"] == "q=BSHD,k=BHDS,v=BSHD,out=BSHD"
