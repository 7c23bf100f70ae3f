"""Attention chains found in graphs and fused into ai.dietcode::Attention (tuner/attention_graph.py): the
project's BERT builder, hand-written variants, and the chains that must stay unfused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.bert import PRESETS, build_graph
from dietcode_ort.errors import DietcodeError
from tuner.attention_graph import OP_TYPE, find_attention, fuse_attention
from tuner.rewrite import DOMAIN


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _bert_feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    mask = np.ones((batch, seq), np.int64)
    mask[1:, seq // 2:] = 0
    return {"input_ids": rng.integers(0, 100, size=(batch, seq), dtype=np.int64), "attention_mask": mask}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tiny_bert_attention_is_fused_and_stock_ort_runs_the_fallback(dtype: str) -> None:
    model = build_graph(PRESETS["tiny"], dtype, 0)
    found = find_attention(model)
    layers = PRESETS["tiny"].layers
    assert len(found.sites) == layers and found.skipped == ()
    site = found.sites[0]
    assert site.mask == "/mask/Mul_output_0" and site.rank == 4 and site.dtype == dtype
    heads = PRESETS["tiny"].heads
    assert (site.seq_q, site.seq_k, site.batch) == ("seq", "seq", f"{heads}*batch")
    assert site.scale == pytest.approx(1 / PRESETS["tiny"].head_dim ** 0.5)
    # the head-split Transposes of Q, K, V and the head merge's Transpose of the output are absorbed
    assert [n.split("/")[-2:] for n in site.nodes] == [
        ["query", "Transpose_output_0"], ["key", "Transpose_output_0"], ["value", "Transpose_output_0"],
        ["self", "MatMul_output_0"], ["self", "Div_output_0"], ["self", "Add_output_0"],
        ["self", "Softmax_output_0"], ["self", "MatMul_1_output_0"], ["self", "Transpose_output_0"]]
    assert site.layout == 15 and site.layout_notes == ()
    assert site.q.endswith("query/Reshape_output_0") and site.kt.endswith("key/Reshape_output_0")
    assert site.v.endswith("value/Reshape_output_0") and site.output.endswith("self/Transpose_output_0")
    fused, outputs = fuse_attention(model)
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count(OP_TYPE) == layers and "Softmax" not in ops
    assert [n.op_type for n in model.graph.node].count("Transpose") == 4 * layers and "Transpose" not in ops
    assert len(ops) == len(model.graph.node) - 8 * layers
    assert outputs == tuple(s.output for s in found.sites)
    (fn,) = fused.functions
    assert (fn.domain, fn.name, list(fn.input)) == (DOMAIN, OP_TYPE, ["Q", "Kt", "V", "mask"])
    assert [n.op_type for n in fn.node] == ["Transpose"] * 3 + ["MatMul", "Constant", "Div", "Add", "Softmax",
                                                                "MatMul", "Transpose"]
    node = next(n for n in fused.graph.node if n.op_type == OP_TYPE)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["head_dim"] == 64 and attrs["layout"] == 15
    for batch, seq in ((1, 1), (3, 5), (2, 17)):
        feeds = _bert_feeds(batch, seq)
        np.testing.assert_array_equal(_run(fused, feeds), _run(model, feeds))  # the same nodes run


def _chain(*, scale_op: str | None = "Div", mask: bool = True, axis: int | None = -1, extra_output: str | None = None,
           d: int = 8, nan_to_zero: bool = False, opset: int = 17) -> onnx.ModelProto:
    """Q, Kt, V graph inputs ([z, T, d] and [z, d, T]), the chain written out, optional mask [z|1, 1, T]; the
    Softmax's ``axis`` (None: no attribute, the opset's default)."""
    nodes = [helper.make_node("MatMul", ["Q", "Kt"], ["s"])]
    x = "s"
    inits = []
    if scale_op:
        inits.append(numpy_helper.from_array(np.array(4.0 if scale_op == "Div" else 0.25, np.float32), "c"))
        nodes.append(helper.make_node(scale_op, [x, "c"], ["s1"]))
        x = "s1"
    inputs = [helper.make_tensor_value_info("Q", TensorProto.FLOAT, ["z", "T", d]),
              helper.make_tensor_value_info("Kt", TensorProto.FLOAT, ["z", d, "T"]),
              helper.make_tensor_value_info("V", TensorProto.FLOAT, ["z", "T", d])]
    if mask:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["z", 1, "T"]))
        nodes.append(helper.make_node("Add", ["mask", x], ["s2"]))
        x = "s2"
    nodes.append(helper.make_node("Softmax", [x], ["p"], **({} if axis is None else {"axis": axis})))
    if nan_to_zero:  # torch's scaled_dot_product_attention export
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
        nodes += [helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["p0"])]
        nodes.append(helper.make_node("MatMul", ["p0", "V"], ["y"]))
    else:
        nodes.append(helper.make_node("MatMul", ["p", "V"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["z", "T", d])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, ["z", "T", "T"]))
    graph = helper.make_graph(nodes, "chain", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _chain_feeds(mask: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    feeds = {"Q": rng.standard_normal((3, 5, 8), np.float32), "Kt": rng.standard_normal((3, 8, 5), np.float32),
             "V": rng.standard_normal((3, 5, 8), np.float32)}
    if mask:
        feeds["mask"] = np.where(rng.random((3, 1, 5)) < 0.3, -10000.0, 0.0).astype(np.float32)
    return feeds


@pytest.mark.parametrize("scale_op, mask, scale", [("Div", True, 0.25), ("Mul", True, 0.25), (None, False, 1.0),
                                                   ("Mul", False, 0.25)])
def test_chain_variants_fuse(scale_op: str | None, mask: bool, scale: float) -> None:
    model = _chain(scale_op=scale_op, mask=mask)
    (site,) = find_attention(model).sites
    assert site.scale == scale and (site.mask is not None) == mask and site.rank == 3
    fused, _ = fuse_attention(model)
    assert [n.op_type for n in fused.graph.node] == [OP_TYPE]
    assert not fused.graph.initializer  # the scale constant lives in the function body only
    feeds = _chain_feeds(mask)
    np.testing.assert_array_equal(_run(fused, feeds), _run(model, feeds))


@pytest.mark.parametrize("axis, opset", [(None, 17), (2, 17), (2, 11)])
def test_softmax_over_the_last_axis_in_any_spelling_fuses(axis: int | None, opset: int) -> None:
    """tf2onnx writes Keras's attention Softmax without an axis (the default, -1 from opset 13) or with the last
    axis counted from the front; at opset 11 an explicit rank - 1 is the last axis too."""
    model = _chain(axis=axis, opset=opset)
    (site,) = find_attention(model).sites
    fused, _ = fuse_attention(model)
    assert [n.op_type for n in fused.graph.node] == [OP_TYPE]
    np.testing.assert_array_equal(_run(fused, _chain_feeds()), _run(model, _chain_feeds()))


def test_distinct_bodies_get_overloads() -> None:
    a = _chain(scale_op="Div")
    b = _chain(scale_op="Mul", mask=False)
    merged = onnx.compose.merge_models(a, b, io_map=[], prefix1="a_", prefix2="b_")
    fused, outputs = fuse_attention(merged)
    assert len(outputs) == 2
    assert sorted(f.overload for f in fused.functions) == ["", "1"] and fused.ir_version >= 10
    feeds = {f"a_{k}": v for k, v in _chain_feeds().items()} | {f"b_{k}": v for k, v in _chain_feeds(False).items()}
    sess_a = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    sess_b = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    for x, y in zip(sess_a.run(None, feeds), sess_b.run(None, feeds)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("model, reason", [
    (_chain(extra_output="s1"), "graph output"),
    (_chain(extra_output="p"), "graph output"),
    (_chain(axis=1), "axis=-1"),
    (_chain(axis=None, opset=11), "axis=-1"),  # before opset 13 the default is 1: rows flattened from axis 1
    (_chain(d=0), "head dim"),
])
def test_chains_that_must_stay(model: onnx.ModelProto, reason: str) -> None:
    found = find_attention(model)
    assert found.sites == ()
    ((_, why),) = found.skipped
    assert reason in why
    fused, outputs = fuse_attention(model)
    assert outputs == () and [n.op_type for n in fused.graph.node] == [n.op_type for n in model.graph.node]


def test_scores_read_by_another_node_stay() -> None:
    model = _chain(mask=False)
    model.graph.node.append(helper.make_node("Relu", ["s"], ["r"]))
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    found = find_attention(model)
    assert found.sites == () and "read by 2 nodes" in found.skipped[0][1]


def test_non_constant_scale_stays() -> None:
    model = _chain(mask=False)
    model.graph.initializer.pop()
    model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, []))
    found = find_attention(model)
    assert found.sites == () and "one-element constant" in found.skipped[0][1]


# --- the library's CPU kernel (custom_ops/attention.cc) ----------------------------------------------------

def _library_session(model: onnx.ModelProto, profile: Path | None = None) -> ort.InferenceSession:
    from dietcode_ort.runtime import register

    opts = ort.SessionOptions()
    if profile is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(profile / "attention")
    register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _set_attribute(model: onnx.ModelProto, name: str, value: object) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == OP_TYPE:
            kept = [a for a in node.attribute if a.name != name]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute(name, value)])
    return out


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("float16", 2e-2)])
def test_library_cpu_kernel_matches_stock_ort_on_tiny_bert(dtype: str, tol: float, tmp_path: Path) -> None:
    model = build_graph(PRESETS["tiny"], dtype, 0)
    fused, _ = fuse_attention(model)
    sess = _library_session(fused, profile=tmp_path)
    import dietcode_ort

    dietcode_ort.reset_node_stats()
    for batch, seq in ((1, 1), (3, 5), (2, 17)):
        feeds = _bert_feeds(batch, seq)
        want = _run(model, feeds)
        got = sess.run(None, feeds)[0]
        assert got.dtype == want.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol)
    # the library's kernel ran (one Attention event per layer and call), not the inlined fallback function
    events = json.loads(Path(sess.end_profiling()).read_text())
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    ops = [e["args"]["op_name"] for e in kernels]
    assert ops.count(OP_TYPE) == 3 * PRESETS["tiny"].layers and "Softmax" not in ops
    # node_stats() counts them, as the CPU calls of the GEMM nodes (they were left out)
    names = [n.name for n in fused.graph.node if n.op_type == OP_TYPE]
    stats = dietcode_ort.node_stats()
    assert all(stats[n]["fallbacks"] == 3 and stats[n]["launches"] == 0 for n in names), stats


@pytest.mark.parametrize("scale_op, mask", [("Div", True), (None, False), ("Mul", False)])
def test_library_cpu_kernel_matches_stock_ort_on_chains(scale_op: str | None, mask: bool) -> None:
    model = _chain(scale_op=scale_op, mask=mask)
    fused, _ = fuse_attention(model)
    feeds = _chain_feeds(mask)
    np.testing.assert_allclose(_library_session(fused).run(None, feeds)[0], _run(model, feeds), atol=2e-6, rtol=1e-5)
    # the kernel, not the fallback function, ran: it reads the scale attribute, the function does not
    changed = _library_session(_set_attribute(fused, "scale", 3.0)).run(None, feeds)[0]
    assert not np.allclose(changed, _run(model, feeds), atol=1e-3)


def test_library_cpu_kernel_refuses_bad_calls_clearly() -> None:
    fused, _ = fuse_attention(_chain())
    feeds = _chain_feeds()
    bad_mask = dict(feeds, mask=np.zeros((2, 1, 5), np.float32))  # batch 2 against 3 heads
    with pytest.raises(Exception, match=r"Attention.*mask does not broadcast"):
        _library_session(fused).run(None, bad_mask)
    with pytest.raises(Exception, match=r"head dim 8 differs from the node's head_dim attribute 4"):
        _library_session(_set_attribute(fused, "head_dim", 4)).run(None, feeds)
    with pytest.raises(Exception, match=r"scale.*not finite"):
        _library_session(_set_attribute(fused, "scale", float("inf")))


def test_nan_to_zero_tail_fuses_and_matches_on_dead_rows() -> None:
    model = _chain(nan_to_zero=True)
    (site,) = find_attention(model).sites
    assert site.nan_to_zero and [n for n in site.nodes] == ["s", "s1", "s2", "p", "nan", "p0", "y"]
    fused, _ = fuse_attention(model)
    assert [n.op_type for n in fused.graph.node] == [OP_TYPE]
    assert [n.op_type for n in fused.functions[0].node][-4:] == ["IsNaN", "Constant", "Where", "MatMul"]
    feeds = _chain_feeds()
    feeds["mask"][0] = -np.inf  # head 0: every key masked, so its rows are NaN before the Where
    want = _run(model, feeds)
    assert (want[0] == 0).all() and np.isfinite(want).all()
    np.testing.assert_array_equal(_run(fused, feeds), want)
    np.testing.assert_allclose(_library_session(fused).run(None, feeds)[0], want, atol=2e-6, rtol=1e-5)
    # without the tail the same rows are NaN, in the library's kernel as in ONNX Softmax
    plain, _ = fuse_attention(_chain())
    assert np.isnan(_library_session(plain).run(None, feeds)[0][0]).all()
    assert np.isnan(_run(_chain(), feeds)[0]).all()


def test_nan_tail_with_another_constant_stays_outside() -> None:
    model = _chain(nan_to_zero=True)
    next(t for t in model.graph.initializer if t.name == "zero").CopyFrom(
        numpy_helper.from_array(np.array(1.0, np.float32), "zero"))
    found = find_attention(model)
    assert found.sites == () and "read by 2 nodes" in found.skipped[0][1]


def test_library_cpu_kernel_with_no_keys_gives_zeros_like_onnx() -> None:
    model = _chain()
    fused, _ = fuse_attention(model)
    feeds = {k: v[..., :0] if k in ("Kt", "mask") else v for k, v in _chain_feeds().items()}
    feeds["V"] = feeds["V"][:, :0]
    want = _run(model, feeds)
    assert want.shape == (3, 5, 8) and (want == 0).all()
    np.testing.assert_array_equal(_library_session(fused).run(None, feeds)[0], want)


def test_an_attention_node_without_a_bundle_is_refused_by_the_bundle_reader() -> None:
    """fuse_attention without bundles makes the CPU-only form Attention(Q, Kt, V[, mask]); the bundle reader
    (inspect, doctor) refuses it by name instead of skipping it (the CUDA EP runs bundles only)."""
    from dietcode_ort.bundle import node_bundles

    fused, _ = fuse_attention(build_graph(PRESETS["tiny"], "float32", 0))
    with pytest.raises(DietcodeError, match=r"MatMul_1' \(ScaledDotProductAttention\) has 4 inputs and no kernel bundle"):
        node_bundles(fused)


def test_optimize_fuse_attention_leaves_the_chains_to_attention_nodes(tmp_path: Path) -> None:
    """optimize with fuse_attention: the dense layers get tuned kernels, each attention chain one Attention
    node; the model matches stock ORT with the library (CPU kernels) and without it (fallback functions)."""
    import models
    from dietcode_ort.inspect_model import describe
    from tuner.optimize import OptimizeOptions, optimize

    src, out = tmp_path / "bert.onnx", tmp_path / "bert.opt.onnx"
    models.save_model(models.build("bert", "tiny"), src)
    logs: list[str] = []
    options = OptimizeOptions(dims=("batch=1:2", "seq=1:32:8"), budget=8, max_kernels=2, measure="analytic",
                              db=tmp_path / "t.db", cache_dir=tmp_path / "kernels", progress=False,
                              fuse_attention=True)
    report = optimize(src, out, options, log=logs.append)
    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node if n.domain == DOMAIN]
    layers = PRESETS["tiny"].layers
    assert ops.count(OP_TYPE) == layers and "Softmax" not in [n.op_type for n in model.graph.node]
    assert any(op.startswith("MatMul") for op in ops)  # the dense layers' tuned kernels
    assert all(w.workload.batch == "1" for w in report.workloads)  # no bmm workload: the chains are fused
    assert report.attention == layers
    assert any(line.startswith(f"{layers} attention chains fused into ai.dietcode::ScaledDotProductAttention")
               for line in logs)
    views = {n["view"] for n in describe(model)}
    assert views == {"attention", "gemm"}
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    opts = ort.SessionOptions()
    from dietcode_ort.runtime import register

    register(opts)
    ours = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    fallback = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 1), (2, 9), (3, 40)):
        feeds = models.get("bert").example_inputs("tiny", {"batch": batch, "seq": seq}, seed=3)
        want = stock.run(None, feeds)[0]
        np.testing.assert_allclose(ours.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(fallback.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)


def test_scale_behind_an_identity_stays() -> None:
    model = _chain(mask=False)
    model.graph.node.insert(0, helper.make_node("Identity", ["c"], ["c_id"]))
    next(n for n in model.graph.node if n.op_type == "Div").input[1] = "c_id"
    found = find_attention(model)
    assert found.sites == () and "one-element constant" in found.skipped[0][1]
    fused, outputs = fuse_attention(model)  # nothing to fuse, and no error
    assert outputs == ()


_H, _D = 2, 8


def _head_split_model(*, q_perm: tuple[int, ...] = (0, 2, 1, 3), q_also_output: bool = False,
                      merge: bool = True, scaled: bool = False) -> onnx.ModelProto:
    """x_q, x_k, x_v [B, S, H*d] -> Reshape [B, S, H, d] -> Transpose (K: 0,2,3,1) -> the chain with a mask
    [B, 1, 1, S] -> Transpose (0,2,1,3) -> Reshape [B, S, H*d] (``merge``; else the Transpose is the output).
    ``q_perm`` (0,2,3,1) makes Q from a graph input [B, d, H, S] instead (a perm that is not the head split);
    ``scaled`` multiplies Q and K after their Transposes by a constant (torch's SDPA export)."""
    split = numpy_helper.from_array(np.array([0, 0, _H, _D], np.int64), "split")
    joined = numpy_helper.from_array(np.array([0, 0, _H * _D], np.int64), "joined")
    scale = numpy_helper.from_array(np.array(_D ** 0.5, np.float32), "c")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", _H * _D]) for n in ("x_k", "x_v")]
    nodes = []
    if q_perm == (0, 2, 1, 3):
        inputs.append(helper.make_tensor_value_info("x_q", TensorProto.FLOAT, ["B", "S", _H * _D]))
        nodes.append(helper.make_node("Reshape", ["x_q", "split"], ["q4"]))
    else:
        inputs.append(helper.make_tensor_value_info("q4", TensorProto.FLOAT, ["B", _D, _H, "S"]))
    inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, 1, "S"]))
    nodes += [helper.make_node("Reshape", ["x_k", "split"], ["k4"]), helper.make_node("Reshape", ["x_v", "split"], ["v4"]),
              helper.make_node("Transpose", ["q4"], ["q0" if scaled else "q"], perm=list(q_perm)),
              helper.make_node("Transpose", ["k4"], ["kt0" if scaled else "kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "c"], ["s1"]),
              helper.make_node("Add", ["s1", "mask"], ["s2"]), helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3])]
    if scaled:  # right after the Transposes, before the chain
        at = next(i for i, n in enumerate(nodes) if n.op_type == "MatMul")
        nodes[at:at] = [helper.make_node("Mul", ["q0", "root"], ["q"]), helper.make_node("Mul", ["root", "kt0"], ["kt"])]
    outputs = [helper.make_tensor_value_info("ot", TensorProto.FLOAT, ["B", "S", _H, _D])]
    if merge:
        nodes.append(helper.make_node("Reshape", ["ot", "joined"], ["y"]))
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", _H * _D])]
    if q_also_output:
        outputs.append(helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", _H, "S", _D]))
    root = numpy_helper.from_array(np.array(0.7, np.float32), "root")
    graph = helper.make_graph(nodes, "heads", inputs, outputs, [split, joined, scale, root])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _head_feeds(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq)
    feeds = {}
    for vi in model.graph.input:
        dims = [batch if d.dim_param == "B" else seq if d.dim_param == "S" else d.dim_value
                for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    feeds["mask"][0, ..., seq // 2 + 1:] = -10000.0
    return feeds


def _library_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    from dietcode_ort.runtime import register

    opts = ort.SessionOptions()
    register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("kind", ["all", "q_other_perm", "q_read_twice", "no_merge", "scaled"])
def test_head_split_transposes_absorbed_exactly_when_they_are_the_head_split(kind: str) -> None:
    """The Transposes of the head split (Q, V perm 0,2,1,3 and K 0,2,3,1 after a Reshape splitting heads x d)
    and of the head merge are absorbed into the node's layout; a Transpose with another perm, read by another
    node too, or not followed by a merge Reshape stays, with the reason in layout_notes. The library's CPU
    kernel (reading the layouts) matches stock ORT on the original; stock ORT runs the fallback exactly."""
    model = {"all": lambda: _head_split_model(), "q_other_perm": lambda: _head_split_model(q_perm=(0, 2, 3, 1)),
             "q_read_twice": lambda: _head_split_model(q_also_output=True),
             "no_merge": lambda: _head_split_model(merge=False),
             "scaled": lambda: _head_split_model(scaled=True)}[kind]()
    (site,) = find_attention(model).sites
    layout, note = {"all": (15, None), "q_other_perm": (14, "Q's Transpose 'q' kept: has perm [0, 2, 3, 1], not "
                                                             "the head split [0, 2, 1, 3]"),
                    "q_read_twice": (14, "Q's Transpose 'q' kept: is read by other nodes too"),
                    "no_merge": (7, "the output's Transpose 'ot' kept: no Reshape merging its heads"),
                    "scaled": (15, None)}[kind]
    assert site.layout == layout
    assert (site.layout_notes == ()) if note is None else (len(site.layout_notes) == 1
                                                           and site.layout_notes[0].startswith(note))
    fused, _ = fuse_attention(model)
    onnx.checker.check_model(fused, full_check=True)
    if kind == "scaled":  # the scaling Muls are folded into the scale (0.7 * 0.7 / sqrt(d)): the node reads the
        # Reshape outputs, the Muls leave the graph for the fallback body
        assert (site.q, site.kt) == ("q4", "k4") and {"q", "kt"} <= set(site.nodes)
        assert site.scale == pytest.approx(0.7 * 0.7 / _D ** 0.5, rel=1e-6)
        assert "Mul" not in {n.op_type for n in fused.graph.node}
    transposes = [n.op_type for n in fused.graph.node].count("Transpose")
    assert transposes == 4 - bin(layout).count("1")
    for batch, seq in ((1, 1), (2, 5), (3, 17)):
        feeds = _head_feeds(model, batch, seq)
        want = _run(model, feeds)
        if kind == "scaled":  # the same values, but ORT's optimizer fuses a scale into a MatMul in one graph only
            plain = ort.SessionOptions()
            plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            unopt = [ort.InferenceSession(m.SerializeToString(), plain, providers=["CPUExecutionProvider"])
                     .run(None, feeds)[0] for m in (fused, model)]
            np.testing.assert_array_equal(*unopt)
            np.testing.assert_allclose(_run(fused, feeds), want, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(_run(fused, feeds), want)  # the fallback keeps the Transposes
        np.testing.assert_allclose(_library_run(fused, feeds)[0], want, rtol=1e-5, atol=1e-5)


def test_scan_reports_layouts_and_the_transposes_kept(tmp_path: Path) -> None:
    from tuner.scan import attention_report

    path = tmp_path / "m.onnx"
    onnx.save(_head_split_model(q_perm=(0, 2, 3, 1)), str(path))
    (fused,) = attention_report(path)["fused"]
    assert fused["layout"] == "q=BHSD,k=BSHD,v=BSHD,out=BSHD"
    assert fused["transposes_kept"] == ["Q's Transpose 'q' kept: has perm [0, 2, 3, 1], not the head split "
                                        "[0, 2, 1, 3]"]


def test_a_classifiers_softmax_is_no_attention_candidate() -> None:
    """Softmax(x @ W + b) over a constant weight (a classifier's logits) is not listed at all, while a chain's
    Softmax whose scores pass a mask Add and a scale is (here fused)."""
    w = numpy_helper.from_array(np.ones((8, 3), np.float32), "w")
    b = numpy_helper.from_array(np.zeros(3, np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["l"]), helper.make_node("Add", ["l", "b"], ["lb"]),
             helper.make_node("Softmax", ["lb"], ["p"], axis=-1)]
    graph = helper.make_graph(nodes, "clf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", 3])], [w, b])
    found = find_attention(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert found.sites == () and found.skipped == ()
    assert len(find_attention(_chain(scale_op="Div", mask=True)).sites) == 1
