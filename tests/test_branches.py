"""If branches tuned as models of their own and put back (tuner/branches.py): a merged decoder (optimum's
``decoder_model_merged.onnx`` layout: one If over the decoder without and with its past, the weights in the main
graph) has every MatMul inside a branch, where only the main graph's were tuned before."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import dietcode_ort
from dietcode_ort.errors import DietcodeError
from dietcode_ort.bench import model_info
from dietcode_ort.bundle import dietcode_nodes, node_bundles
from dietcode_ort.inspect_model import describe
from tuner.branches import branch_models, splice
from tuner.optimize import OptimizeOptions, optimize
from tuner.scan import attention_report, scan

D, H = 64, 128


def _mlp(p: str, x: str) -> list[onnx.NodeProto]:
    return [helper.make_node("MatMul", [x, "w1"], [p + "h"], name=p + "fc1"),
            helper.make_node("Add", [p + "h", "b1"], [p + "hb"]),
            helper.make_node("Relu", [p + "hb"], [p + "r"]),
            helper.make_node("MatMul", [p + "r", "w2"], [p + "o"], name=p + "fc2"),
            helper.make_node("Add", [p + "o", x], [p + "y"])]


def _merged(then_reads: str = "x", outputs: tuple[str, str] = ("t_y", "e_y")) -> onnx.ModelProto:
    """One If over use_cache: then the MLP of Concat(past, x) (the decoder with its past), else the MLP of x; the
    weights are the main graph's, read by both branches. ``then_reads``: what the then branch concatenates x to
    (``cat``: a value the main graph computes, of dim ``past_seq + seq``); ``outputs``: the branches' output names."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((D, H)) * 0.1).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((H, D)) * 0.1).astype(np.float32), "w2")]
    main: list[onnx.NodeProto] = []
    if then_reads == "cat":
        main.append(helper.make_node("Concat", ["past", "x"], ["cat"], axis=1))
        then_nodes = _mlp("t_", "cat")
    else:
        then_nodes = [helper.make_node("Concat", ["past", "x"], ["t_cat"], axis=1)] + _mlp("t_", "t_cat")
    else_nodes = _mlp("e_", "x")
    then_nodes[-1].output[0], else_nodes[-1].output[0] = outputs
    then = helper.make_graph(then_nodes, "with_past", [], [helper.make_tensor_value_info(outputs[0], T.FLOAT, None)])
    els = helper.make_graph(else_nodes, "no_past", [], [helper.make_tensor_value_info(outputs[1], T.FLOAT, None)])
    main.append(helper.make_node("If", ["use_cache"], ["y"], then_branch=then, else_branch=els, name="merged"))
    graph = helper.make_graph(main, "merged", [helper.make_tensor_value_info("use_cache", T.BOOL, [1]),
                                               helper.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", D]),
                                               helper.make_tensor_value_info("past", T.FLOAT, ["batch", "past_seq", D])],
                              [helper.make_tensor_value_info("y", T.FLOAT, ["batch", "out_seq", D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _options(work: Path, *dims: str) -> OptimizeOptions:
    return OptimizeOptions(dims=dims, budget=32, db=work / "tuning.db", cache_dir=work / "kernels", progress=False,
                           measure="analytic")


def _sessions(src: Path, out: Path) -> list[tuple[str, ort.InferenceSession]]:
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    return [("stock", ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])),
            ("library", ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])),
            ("fallback", ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]))]


def test_scan_lists_the_workloads_of_both_branches_with_where_they_are(tmp_path: Path) -> None:
    onnx.save(_merged(), str(tmp_path / "m.onnx"))
    result = scan(tmp_path / "m.onnx")
    nodes = sorted(n for w in result.workloads for n in w.nodes)
    assert nodes == ["the else_branch of If 'merged': e_h", "the else_branch of If 'merged': e_o",
                     "the then_branch of If 'merged': t_h", "the then_branch of If 'merged': t_o"]
    assert {w.m for w in result.workloads} == {"batch*seq", "batch*(past_seq + seq)"}
    assert result.skipped == ()
    assert result.symbols == ("batch", "past_seq", "seq")


def test_optimize_rewrites_both_branches_and_computes_what_stock_does(tmp_path: Path) -> None:
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(_merged(), str(src))
    report = optimize(src, out, _options(tmp_path, "batch=1:2", "seq=1:16", "past_seq=0:16:4"), log=lambda _: None)
    assert len(report.rewritten) == 4 and all(n.startswith("the ") for n in report.rewritten)
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    branches = {a.name: a.g for a in model.graph.node[0].attribute}
    for g in branches.values():  # the branches read the weights and bundles from the main graph
        assert not g.initializer
        assert [n.op_type for n in g.node if n.domain == "ai.dietcode"] == ["MatMulBiasRelu", "MatMulResidual"]
    assert len(dietcode_nodes(model)) == 4 and len(node_bundles(model, str(tmp_path))) == 4
    assert sorted(n["graph"] for n in describe(model, tmp_path)) == ["the else_branch of If 'merged'"] * 2 + \
        ["the then_branch of If 'merged'"] * 2  # inspect names where each node is
    assert {t.name for t in model.graph.initializer} >= {"w1", "b1", "w2"}
    rng = np.random.default_rng(1)
    sessions = _sessions(src, out)
    for use_cache in (True, False):
        for b, s, p in ((1, 1, 0), (2, 7, 5), (3, 33, 17)):
            feed = {"use_cache": np.array([use_cache]), "x": rng.standard_normal((b, s, D)).astype(np.float32),
                    "past": rng.standard_normal((b, p, D)).astype(np.float32)}
            want = sessions[0][1].run(None, feed)[0]
            assert want.shape == (b, s + p if use_cache else s, D)
            for name, session in sessions[1:]:
                np.testing.assert_allclose(session.run(None, feed)[0], want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_branches_named_as_the_if_outputs_infer(tmp_path: Path) -> None:
    """optimum names the If's outputs as its branches' (``logits``, ``present.0.key``). onnxruntime's symbolic shape
    inference handed each branch the If's untyped outputs as outer values, and failed on the Add making one."""
    onnx.save(_merged(outputs=("y", "y")), str(tmp_path / "m.onnx"))
    result = scan(tmp_path / "m.onnx")
    assert len(result.workloads) == 4 and result.skipped == ()


def test_a_branch_reading_a_value_of_a_computed_dim_is_left_with_the_reason(tmp_path: Path) -> None:
    """The then branch reads Concat(past, x) from the main graph: its dim past_seq + seq is no input dim, so
    --dim cannot give it values; that branch stays as it is, the other is tuned."""
    model = _merged(then_reads="cat")
    branches, refused = branch_models(model)
    assert [b.attribute for b in branches] == ["else_branch"]
    assert sorted(s.node for s in refused) == ["t_fc1", "t_fc2"]
    assert all("inside the then_branch of If 'merged'" in s.reason and "'cat'" in s.reason
               and "past_seq + seq" in s.reason for s in refused)
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(model, str(src))
    report = optimize(src, out, _options(tmp_path, "batch=1:2", "seq=1:16", "past_seq=0:16:4"), log=lambda _: None)
    assert sorted(report.rewritten) == ["the else_branch of If 'merged': e_h", "the else_branch of If 'merged': e_o"]
    assert {n for n, _ in report.skipped} == {"t_fc1", "t_fc2"}


def _done(branch_model: onnx.ModelProto, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto],
          functions: list[onnx.FunctionProto] = ()) -> onnx.ModelProto:
    """``branch_model`` as a rewrite would leave it: ``nodes``, its initializers plus ``inits``, ``functions``."""
    done = onnx.ModelProto()
    done.CopyFrom(branch_model)
    del done.graph.node[:]
    done.graph.node.extend(nodes)
    done.graph.initializer.extend(inits)
    done.functions.extend(functions)
    return done


def test_splice_renames_what_would_shadow_an_outer_value_and_keeps_function_bodies_apart() -> None:
    """A value the pipeline made in a branch under a name the main graph uses is renamed (ONNX forbids
    shadowing); a new initializer goes to the main graph (shared when equal, renamed when not); a fallback body
    that differs from the one the model has under that op type and overload gets the next overload."""
    model = _merged()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "taken"))
    branches, _ = branch_models(model)
    then = next(b for b in branches if b.attribute == "then_branch")
    body = helper.make_function("ai.dietcode", "Op", ["a", "b"], ["y"], [helper.make_node("MatMul", ["a", "b"], ["y"])],
                                [helper.make_opsetid("", 17)])
    model.functions.append(body)  # the model has Op "" with a MatMul body; the branch brings another body
    other = helper.make_function("ai.dietcode", "Op", ["a", "b"], ["y"], [helper.make_node("Mul", ["a", "b"], ["y"])],
                                 [helper.make_opsetid("", 17)])
    new = numpy_helper.from_array(np.ones(3, np.float32), "taken")  # same name as the main graph's, other values
    nodes = [helper.make_node("Concat", ["past", "x"], ["y"], axis=1),  # "y": the If's own output, outside
             helper.make_node("Op", ["y", "w1"], ["t_h"], domain="ai.dietcode"),
             helper.make_node("Add", ["t_h", "taken"], ["t_y"])]
    splice(model, then, _done(then.model, nodes, [new], [other]))
    graph = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    made = [o for n in graph.node for o in n.output]
    assert "y" not in made and made[0].startswith("y") and graph.node[1].input[0] == made[0]
    moved = graph.node[2].input[1]
    assert moved != "taken" and moved in {t.name for t in model.graph.initializer}
    assert graph.node[1].overload == "1"
    assert {(f.name, f.overload, f.node[0].op_type) for f in model.functions} == {("Op", "", "MatMul"),
                                                                                ("Op", "1", "Mul")}
    assert model.ir_version >= 10 and not graph.initializer


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-torchscript", "bert-torchscript", "llama-dynamo"])
def test_exports_merged_as_optimum_merges_decoders(tmp_path: Path, name: str) -> None:
    """A TorchScript export merged with itself the way optimum merges a decoder and its with-past twin: the
    weights in the main graph, both branches with the same value names (sibling scopes may repeat names). Both
    branches get tuned nodes and fused attention; what the pipeline made for both (kernel bundles, BERT's packed
    Q/K/V weights) is one initializer, never two equal ones, and the weights no branch reads any more (BERT's
    separate Q, K and V) are gone; outputs agree with stock ORT on both branches."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests._corpus import CASES_BY_NAME, build_case, feeds
    from tuner.scan import node_reads

    case = CASES_BY_NAME[name]
    built = build_case(case, tmp_path)
    decoder = onnx.load(str(built.path))
    # as optimum's merge_decoders: scalars and 1-D int32/int64 initializers stay in each branch, the rest go up
    local = [t for t in decoder.graph.initializer if not t.dims or (len(t.dims) == 1 and t.data_type in (6, 7))]
    shared = [t for t in decoder.graph.initializer if t not in local]
    branch = helper.make_graph(list(decoder.graph.node), "no_past", [], list(decoder.graph.output), local)
    twin = helper.make_graph(list(decoder.graph.node), "with_past", [], list(decoder.graph.output), local)
    merged = helper.make_graph(
        [helper.make_node("If", ["use_cache_branch"], [o.name for o in decoder.graph.output], then_branch=twin,
                          else_branch=branch, name="optimum::if")],
        "merged", list(decoder.graph.input) + [helper.make_tensor_value_info("use_cache_branch", T.BOOL, [1])],
        list(decoder.graph.output), shared)
    model = helper.make_model(merged, opset_imports=list(decoder.opset_import))
    model.ir_version = decoder.ir_version
    src, out = tmp_path / "decoder_model_merged.onnx", tmp_path / "merged.opt.onnx"
    onnx.save(model, str(src))
    assert model_info(model).vocab == (("input_ids", 100),)  # bench's ids index the embedding inside the branches
    dims = [f"{sym}={spec}" for role, spec in case.tuned.items() for sym in built.symbols[role]]
    report = optimize(src, out, _options(tmp_path, *dims), log=lambda _: None)
    sides = {n.split("': ")[0] + "'" for n in report.rewritten}
    assert sides == {"the then_branch of If 'optimum::if'", "the else_branch of If 'optimum::if'"}
    optimized = onnx.load(str(out))
    assert sum(n.op_type == "ScaledDotProductAttention" for n, _, _, _ in dietcode_nodes(optimized)) == 4  # two layers, two branches
    read = set().union(*(node_reads(n) for n in optimized.graph.node))
    assert [t.name for t in optimized.graph.initializer if t.name not in read] == []
    big = [t for t in optimized.graph.initializer if len(t.raw_data) > 1024]
    digests = [hashlib.sha256(t.raw_data).hexdigest() for t in big]
    assert len(set(digests)) == len(digests), "an initializer the pipeline made is held twice"
    for a in optimized.graph.node[0].attribute:
        assert not a.g.initializer or all(len(t.raw_data) <= 1024 for t in a.g.initializer)
    sessions = _sessions(src, out)
    for shape in case.probes[:3]:
        for use_cache in (True, False):
            feed = feeds(built.path, built, shape) | {"use_cache_branch": np.array([use_cache])}
            want = sessions[0][1].run(None, feed)[0]
            for name, session in sessions[1:]:
                np.testing.assert_allclose(session.run(None, feed)[0], want, rtol=case.rtol, atol=case.atol,
                                           err_msg=f"{name} {shape}")


def test_splice_keeps_in_the_branch_a_constant_it_returns() -> None:
    """A branch output the pipeline made a constant (a folded Constant node) stays the branch's own initializer:
    ORT refuses a branch that returns an outer value directly."""
    model = _merged()
    branches, _ = branch_models(model)
    els = next(b for b in branches if b.attribute == "else_branch")
    folded = numpy_helper.from_array(np.ones((1, 1, D), np.float32), "e_y")
    splice(model, els, _done(els.model, [], [folded]))
    graph = next(a.g for a in model.graph.node[0].attribute if a.name == "else_branch")
    assert [t.name for t in graph.initializer] == ["e_y"]
    assert "e_y" not in {t.name for t in model.graph.initializer}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"use_cache": np.array([False]), "x": np.zeros((1, 2, D), np.float32), "past": np.zeros((1, 0, D), np.float32)}
    np.testing.assert_array_equal(session.run(None, feed)[0], np.ones((1, 1, D), np.float32))


def _decoder_layer(d: int = 32, heads: int = 2):
    """A pre-LayerNorm decoder layer whose K and V are its past's concatenated with the new ones when it is given a
    past (the layout of a decoder with past): returns (hidden, present K, present V)."""
    import torch

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
            self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)

        def split(self, x):
            return x.view(x.shape[0], x.shape[1], heads, d // heads).transpose(1, 2)

        def forward(self, x, past_k=None, past_v=None):
            h = self.ln1(x)
            q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
            if past_k is not None:
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / (d // heads) ** 0.5, dim=-1)
            x = x + self.o(torch.matmul(p, v).transpose(1, 2).reshape(x.shape))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x)))), k, v

    torch.manual_seed(0)
    return Layer().eval()


@pytest.mark.slow
def test_a_decoder_and_its_with_past_twin_merged(tmp_path: Path) -> None:
    """Two TorchScript exports of one decoder layer, without and with its past K/V (inputs ``past.key`` /
    ``past.value`` concatenated before attention), merged into one If with the weights deduplicated by content in
    the main graph: each branch's attention is fused (the with-past one over Tk = past_seq + seq), and outputs
    agree with stock ORT through both branches, a past of length 0 included."""
    torch = pytest.importorskip("torch")
    layer = _decoder_layer()
    outs = ["hidden", "present.key", "present.value"]
    x, past = torch.randn(2, 5, 32), torch.randn(2, 2, 3, 16)
    seq = {0: "batch", 1: "seq"}
    torch.onnx.export(layer, (x,), str(tmp_path / "a.onnx"), dynamo=False, input_names=["x"], output_names=outs,
                      opset_version=17, dynamic_axes={"x": seq, "hidden": seq, "present.key": {0: "batch", 2: "seq"},
                                                      "present.value": {0: "batch", 2: "seq"}})
    total = {0: "batch", 2: "total"}
    torch.onnx.export(layer, (x, past, past), str(tmp_path / "b.onnx"), dynamo=False,
                      input_names=["x", "past.key", "past.value"], output_names=outs, opset_version=17,
                      dynamic_axes={"x": seq, "hidden": seq, "past.key": {0: "batch", 2: "past_seq"},
                                    "past.value": {0: "batch", 2: "past_seq"}, "present.key": total,
                                    "present.value": total})
    shared: dict[bytes, onnx.TensorProto] = {}
    branches = []
    for tag, name in (("no_past", "a.onnx"), ("with_past", "b.onnx")):
        export = onnx.load(str(tmp_path / name))
        rename = {}
        for t in export.graph.initializer:  # the exports number their constants apart: deduplicate by content
            key = bytes([t.data_type]) + str(list(t.dims)).encode() + numpy_helper.to_array(t).tobytes()
            if key not in shared:
                shared[key] = numpy_helper.from_array(numpy_helper.to_array(t), f"{t.name}_{tag}")
            rename[t.name] = shared[key].name
        for n in export.graph.node:
            n.input[:] = [rename.get(i, i) for i in n.input]
        branches.append(helper.make_graph(list(export.graph.node), tag, [], list(export.graph.output)))
    graph = helper.make_graph(
        [helper.make_node("If", ["use_cache_branch"], outs, then_branch=branches[1], else_branch=branches[0],
                          name="optimum::if")], "merged",
        list(export.graph.input) + [helper.make_tensor_value_info("use_cache_branch", T.BOOL, [1])],
        list(export.graph.output), list(shared.values()))
    model = helper.make_model(graph, opset_imports=list(export.opset_import))
    model.ir_version = export.ir_version
    src, out = tmp_path / "merged.onnx", tmp_path / "merged.opt.onnx"
    onnx.save(model, str(src))
    fused = [f["output"].split("': ")[0] + "'" for f in attention_report(src)["fused"]]  # scan's attention table
    assert sorted(fused) == ["the else_branch of If 'optimum::if'", "the then_branch of If 'optimum::if'"]
    lines: list[str] = []
    optimize(src, out, _options(tmp_path, "batch=1,2", "seq=1:16:4", "past_seq=0:32:8"), log=lines.append)
    assert any("Tk=past_seq + seq" in line for line in lines)
    nodes = [n for n, _, _, _ in dietcode_nodes(onnx.load(str(out)))]
    assert sum(n.op_type == "ScaledDotProductAttention" for n in nodes) == 2 and len(nodes) == 14  # and 6 GEMMs a branch
    rng = np.random.default_rng(0)
    sessions = _sessions(src, out)
    for use_cache in (True, False):
        for b, s, p in ((1, 1, 0), (1, 1, 31), (3, 20, 40)):
            feed = {"use_cache_branch": np.array([use_cache]), "x": rng.standard_normal((b, s, 32)).astype(np.float32),
                    "past.key": rng.standard_normal((b, 2, p, 16)).astype(np.float32),
                    "past.value": rng.standard_normal((b, 2, p, 16)).astype(np.float32)}
            want = sessions[0][1].run(None, feed)
            for name, session in sessions[1:]:
                for got, expected in zip(session.run(None, feed), want):
                    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=f"{name} {b, s, p}")


def test_optimize_refuses_to_overwrite_a_data_file_only_a_branch_reads(tmp_path: Path) -> None:
    """A branch's own initializer stored as external data: an output whose data file is that file is refused before
    anything is written (it was checked against the main graph's tensors only)."""
    model = _merged()
    then = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    then.initializer.append(numpy_helper.from_array(np.zeros(D, np.float32), "t_zero"))
    then.node.append(helper.make_node("Add", ["t_y", "t_zero"], ["t_y2"]))
    then.output[0].name = "t_y2"
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=0)
    (tmp_path / "t_zero").rename(tmp_path / "m.opt.onnx.data")  # where the output's own data file would go
    then_saved = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    graph = next(a.g for a in then_saved.graph.node[0].attribute if a.name == "then_branch")
    entry = next(e for e in graph.initializer[0].external_data if e.key == "location")
    entry.value = "m.opt.onnx.data"
    onnx.save(then_saved, str(tmp_path / "m.onnx"))
    with pytest.raises(DietcodeError, match="would overwrite"):
        optimize(tmp_path / "m.onnx", tmp_path / "m.opt.onnx", _options(tmp_path, "batch=1:2", "seq=1:16",
                                                                         "past_seq=0:16:4"), log=lambda _: None)
    assert not (tmp_path / "m.opt.onnx").exists() and (tmp_path / "m.opt.onnx.data").stat().st_size == 4 * D
