"""Tuned attention: workloads from the chains, the analytic cost, the bundle on the Attention node, the C core's
choice and launch view for attention shapes, and the nodes' refusals of bundles and attributes that do not fit."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from dietcode_ort.bundle import node_bundles, read_bundle
from dietcode_ort.errors import DietcodeError
from models.bert import PRESETS
from tuner.attention import AttentionConfig
from tuner.attention_tune import (AttentionProblem, AttentionWorkload, attention_features, attention_instances,
                                  attention_time, tune_attention)
from tuner.hardware import get_profile
from tuner.workload import Instance

LAYERS = PRESETS["tiny"].layers


def _workload(**kw) -> AttentionWorkload:
    base = dict(dtype="float16", head_dim=64, has_mask=True, mask_rows=False, causal=False, nan_to_zero=False,
                scale=0.125, rank=4, seq_q="seq", seq_k="seq", batch="2*batch")
    base.update(kw)
    return AttentionWorkload(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """Tiny BERT optimized with the defaults (attention fused) and analytic tuning."""
    import models
    from tuner.optimize import OptimizeOptions, optimize

    tmp = tmp_path_factory.mktemp("att")
    src, out = tmp / "bert.onnx", tmp / "bert.opt.onnx"
    models.save_model(models.build("bert", "tiny"), src)
    logs: list[str] = []
    optimize(src, out, OptimizeOptions(dims=("batch=1:4", "seq=1:512:64"), budget=8, max_kernels=3,
                                       measure="analytic", db=tmp / "t.db", cache_dir=tmp / "k", progress=False),
             log=logs.append)
    return src, out, logs


def test_padding_to_the_tiles_costs_time() -> None:
    """Tq = 65 with BLOCK_M = 64 pays for two query blocks: it costs more than Tq = 64 and, with enough heads
    to fill the GPU, about as much as Tq = 128."""
    profile = get_profile("sm_90")
    w, c = _workload(), AttentionConfig(64, 64, 4, 2)
    t64, t65, t128 = (attention_time(c, w, AttentionProblem(q, 512, 4096), profile) for q in (64, 65, 128))
    assert t64 < t65 and t65 == pytest.approx(t128, rel=0.1)
    assert attention_time(c, w, AttentionProblem(0, 8, 8), profile) < t64  # empty call: the launch only


def test_causal_kernels_cost_about_half_for_long_sequences() -> None:
    """The causal template stops each query block at its diagonal: the analytic cost counts half the key
    steps on long sequences, and the same for one query block."""
    profile = get_profile("sm_90")
    c = AttentionConfig(64, 64, 4, 2)
    plain, causal = _workload(has_mask=False), _workload(has_mask=False, causal=True)
    long = AttentionProblem(4096, 4096, 256)
    ratio = attention_time(c, causal, long, profile) / attention_time(c, plain, long, profile)
    assert 0.45 < ratio < 0.6
    short = AttentionProblem(64, 64, 256)
    assert attention_time(c, causal, short, profile) == attention_time(c, plain, short, profile)


def test_tuning_dispatches_shapes_to_different_kernels() -> None:
    """Short and long sequences want different tiles: the tree over the dynamic sizes splits them."""
    w = _workload()
    problems = [(AttentionProblem(s, s, z), 1.0) for s in (1, 8, 512, 2048) for z in (2, 64)]
    tuned = tune_attention(w, problems, ["sm_90"], max_kernels=4)
    assert len(tuned.kernels) >= 2 and tuned.dispatch.report.geomean < 1.05
    names = w.dynamic()
    short = tuned.dispatch.select(dict(zip(names, (8, 8, 2))))
    long = tuned.dispatch.select(dict(zip(names, (2048, 2048, 64))))
    assert isinstance(short, AttentionConfig) and isinstance(long, AttentionConfig)
    assert short.block_m < long.block_m


def test_instances_come_from_the_chain_expressions() -> None:
    w = _workload(seq_k="seq + 1")
    got = attention_instances(w, [Instance.of({"batch": 2, "seq": 5}, 1.0), Instance.of({"batch": 2, "seq": 5}, 2.0),
                                  Instance.of({"batch": 1, "seq": 3}, 1.0)])
    assert got == [(AttentionProblem(3, 4, 2), 1.0), (AttentionProblem(5, 6, 4), 3.0)]
    assert [f.name for f in attention_features(w)] == ["seq_q", "seq_k", "batch"]
    assert attention_features(w)[2].terms == ((0, 0), (0, 1))  # z = Q.dim0 * Q.dim1
    with pytest.raises(DietcodeError, match="needs a value for 'seq'"):
        attention_instances(w, [Instance.of({"batch": 2})])


def test_attention_nodes_carry_a_shared_bundle_of_attention_kernels(optimized) -> None:
    _, out, logs = optimized
    model = onnx.load(str(out))
    nodes = [n for n in model.graph.node if n.op_type == "ScaledDotProductAttention"]
    assert len(nodes) == LAYERS and all(len(n.input) == 5 and n.input[3] for n in nodes)
    found = [b for b in node_bundles(model) if b.op_type == "ScaledDotProductAttention"]
    assert len(found) == LAYERS and len({b.initializer for b in found}) == 1  # both layers: one workload
    bundle = read_bundle(found[0].payload)
    assert [f.name for f in bundle.features] == ["seq_q", "seq_k", "batch"]
    assert bundle.kernels and all(k.kind == "triton" and k.view == "attention" for k in bundle.kernels)
    assert all(k.dtype == "float32" for k in bundle.kernels)
    assert any(line.startswith("attention workload 0 d=64 float32") for line in logs)


def test_inspect_shows_attention_kernels_and_tree(optimized, capsys: pytest.CaptureFixture[str]) -> None:
    from dietcode_ort.inspect_model import describe, inspect_command

    _, out, _ = optimized
    nodes = [n for n in describe(onnx.load(str(out))) if n["op"] == "ScaledDotProductAttention"]
    assert len(nodes) == LAYERS
    n = nodes[0]
    assert n["view"] == "attention" and n["bundle"]["bytes"] > 0
    assert n["attention"] == {"inputs": ["Q", "Kt", "V", "mask"], "scale": 0.125, "head_dim": 64,
                              "nan_to_zero": False, "mask_rows": False, "kernel_scale": [0.125],
                              "causal": False, "layout": 31}  # Q, K, V packed
    assert all(k["alpha"] == 0.125 for k in n["kernels"])
    assert all(c.startswith("am") for c in n["configs"]) and len(n["configs"]) == len(n["kernels"])
    # packed Q, K, V: the batch feature is B (the projection [B, S, 3 * H * d] has no heads dim)
    assert n["ranges"] == {"seq_q": [1, 449], "seq_k": [1, 449], "batch": [1, 4]}
    assert "->" in n["tree"]["if_chain"]
    assert inspect_command(str(out), as_json=False) == 0
    text = capsys.readouterr().out
    assert "attention(Q, Kt," in text and "head_dim=64" in text and n["configs"][0] in text


def test_attention_kernels_record_their_scale_and_a_node_with_another_is_refused(optimized) -> None:
    """The bundle optimize writes records each attention kernel's baked-in SCALE as its alpha; a node whose
    scale attribute differs (hand-edited here) is refused at session creation on the CPU EP, and by the C
    core's check the CUDA EP runs, naming the node, both values and what to do."""
    import re

    from dietcode_ort import library_path
    from dietcode_ort.runtime import Core

    _, out, _ = optimized
    model = onnx.load(str(out))
    payload = next(b.payload for b in node_bundles(model) if b.op_type == "ScaledDotProductAttention")
    assert {k.alpha for k in read_bundle(payload).kernels} == {0.125}
    parsed = Core(library_path()).parse(payload)
    parsed.check_scale(0.125)
    with pytest.raises(DietcodeError, match=r"compiled with alpha 0\.125, the node's scale is 0\.25; "
                                            "optimize the model again"):
        parsed.check_scale(0.25)

    names: list[str] = []

    def rescale(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        names.append(node.name)
        next(a for a in node.attribute if a.name == "scale").f = 0.25

    edited = _with_node(model, "ScaledDotProductAttention", rescale)
    with pytest.raises(Exception, match=re.escape(f"node '{names[0]}' (ai.dietcode:Attention)") +
                       r".*alpha 0\.125, the node's scale is 0\.25; optimize the model again"):
        _session(edited)
    # stock ORT (no library) still runs the edited model through the fallback function
    ort.InferenceSession(edited.SerializeToString(), providers=["CPUExecutionProvider"])


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    from dietcode_ort.runtime import register

    opts = ort.SessionOptions()
    register(opts)
    data = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def test_optimized_bert_runs_on_the_cpu_ep_like_stock_ort(optimized) -> None:
    import models

    src, out, _ = optimized
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    ours, fallback = _session(out), ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 1), (3, 70)):
        feeds = models.get("bert").example_inputs("tiny", {"batch": batch, "seq": seq}, seed=5)
        want = stock.run(None, feeds)[0]
        np.testing.assert_allclose(ours.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(fallback.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.ptx
def test_the_core_picks_attention_kernels_and_builds_their_launch_args(optimized) -> None:
    """Through ctypes: the tree over (seq_q, seq_k, batch x heads) read from Q and Kt picks what the tuner's
    dispatch picks, and dc_attention_view gives the launch scalars and the mask's broadcast strides."""
    from dietcode_ort.runtime import Core
    from dietcode_ort import library_path

    _, out, _ = optimized
    model = onnx.load(str(out))
    node = next(n for n in model.graph.node if n.op_type == "ScaledDotProductAttention")
    info = json.loads(next(a.s for a in node.attribute if a.name == "info"))
    payload = next(b.payload for b in node_bundles(model) if b.op_type == "ScaledDotProductAttention")
    core = Core(library_path())
    bundle = core.parse(payload)
    decoded = read_bundle(payload)
    heads = 2
    # the node takes Q, K, V packed in the merged projection [B, S, 3 * H * d] (layout 31: the Split, the head
    # split's Reshapes and Transposes absorbed)
    assert {k.layout for k in decoded.kernels} == {31}
    assert node.input[0] == node.input[1] == node.input[2]
    for batch, seq in ((1, 1), (4, 449), (2, 100)):
        q = k_ = v = [batch, seq, 3 * heads * 64]
        mask = [batch, 1, 1, seq]
        features = bundle.features([q, k_, v, mask])
        assert features == [seq, seq, batch]
        k = bundle.select(features)
        assert k == decoded.tree.evaluate(features)
        assert info["kernels"][k].startswith("am")
        args = core.attention_view(q, k_, v, mask, head_dim=64, layout=31)
        assert args is not None
        assert (args.seq_q, args.seq_k, args.heads, args.batch) == (seq, seq, heads, batch * heads)
        assert (args.stride_mask_b, args.stride_mask_h, args.stride_mask_q, args.stride_mask_k) == \
            (seq if batch > 1 else 0, 0, 0, 1 if seq > 1 else 0)
        assert bundle.fit(k, args)[0] == "fits"
        # the tree's kernels assume Q, K, V and the output 16-byte aligned (what was timed): a call whose Q is
        # not is refused by the pick and taken by the bundle's last kernel, the first one compiled without the
        # assumption, outside the tree (the CUDA path runs the first kernel that takes the call)
        args.q += 2
        assert bundle.fit(k, args)[0] == "div16 assumption"
        assert bundle.fit(len(decoded.kernels) - 1, args)[0] == "fits"
    *tree_kernels, unaligned = decoded.kernels
    assert all(kernel.div16 == ("q", "k", "v", "out") for kernel in tree_kernels) and unaligned.div16 == ()
    assert (unaligned.block_m, unaligned.block_n, unaligned.num_warps) == \
        (tree_kernels[0].block_m, tree_kernels[0].block_n, tree_kernels[0].num_warps)
    # aligned, Triton pipelines 16-byte copies (cp.async of 0x10 bytes); without, at most one float per copy
    copies = [set(re.findall(r"cp\.async\.c[ag]\.shared\.global\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)", kernel.ptx))
              for kernel in (tree_kernels[0], unaligned)]
    assert "0x10" in copies[0] and "0x10" not in copies[1]
    assert max(decoded.tree.leaf) < len(tree_kernels) and info["kernels"][-1].endswith(" unaligned")
    with pytest.raises(DietcodeError, match="head dim 32 differs"):
        core.attention_view([1, 2, 3, 32], [1, 2, 32, 3], [1, 2, 3, 32], None, head_dim=64)
    # the same shapes in the contiguous layout disagree (Kt's d is not Q's): the view reads the layouts
    with pytest.raises(DietcodeError, match="expected Q"):
        core.attention_view([2, 5, 2, 64], [2, 5, 2, 64], [2, 5, 2, 64], None, head_dim=64)
    with pytest.raises(DietcodeError, match="needs Q, K and V of rank 4"):
        core.attention_view([4, 5, 64], [4, 5, 64], [4, 5, 64], None, head_dim=64, layout=2)


def _with_node(model: onnx.ModelProto, op_type: str, edit) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = next(n for n in out.graph.node if n.op_type == op_type)
    edit(out, node)
    return out


def test_bad_attention_bundles_and_attributes_are_refused(optimized) -> None:
    _, out, _ = optimized
    model = onnx.load(str(out))
    gemm_bundle = next(n.input[-1] for n in model.graph.node if n.op_type.startswith("MatMul"))
    att_bundle = next(n.input[4] for n in model.graph.node if n.op_type == "ScaledDotProductAttention")

    def swap(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        node.input[4] = gemm_bundle

    with pytest.raises(Exception, match="is not a kernel for this op type"):
        _session(_with_node(model, "ScaledDotProductAttention", swap))

    # the core's node check (what a CUDA node runs at creation): attention kernels fit Attention only, and a
    # MatMul node given them is refused rather than launched with the wrong view
    from dietcode_ort import library_path
    from dietcode_ort.runtime import Core

    core = Core(library_path())
    payloads = {b.initializer: b.payload for b in node_bundles(model)}
    attention, gemm = core.parse(payloads[att_bundle]), core.parse(payloads[gemm_bundle])
    attention.check_node("float32", "Attention")
    with pytest.raises(DietcodeError, match="is not a kernel for this op type"):
        attention.check_node("float32", "MatMul")
    with pytest.raises(DietcodeError, match="is not a kernel for this op type"):
        gemm.check_node("float32", "Attention", activation=gemm.decode().kernels[0].activation)
    with pytest.raises(DietcodeError, match="another element type"):
        attention.check_node("float16", "Attention")
    # the kernels were compiled for the node's layouts (Q, K, V and out as [B, S, H, d]); any other is refused
    attrs = {a.name: onnx.helper.get_attribute_value(a)
             for a in next(n for n in model.graph.node if n.op_type == "ScaledDotProductAttention").attribute}
    head_dim, mask_rows, nan_to_zero = attrs["head_dim"], bool(attrs.get("mask_rows", 1)), bool(attrs.get("nan_to_zero", 0))
    attention.check_attention(31, head_dim, mask_rows, nan_to_zero)
    assert {(k.head_dim, k.mask_rows, k.nan_to_zero) for k in attention.decode().kernels} == {(head_dim, mask_rows,
                                                                                              nan_to_zero)}
    with pytest.raises(DietcodeError, match=r"compiled for operand layout q=BSHD,k=BSHD,v=BSHD,out=BSHD,packed, "
                                            r"the node has q=BSHD,k=BSHD,v=BSHD,out=BSHD; optimize the model again"):
        attention.check_attention(15, head_dim, mask_rows, nan_to_zero)

    # a node whose head_dim, mask_rows or nan_to_zero attribute is not what its kernels were compiled with is
    # refused at session creation (the kernels would index its operands and mask as compiled)
    def set_attr(name: str, value: int):
        def edit(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
            keep = [a for a in node.attribute if a.name != name]
            del node.attribute[:]
            node.attribute.extend(keep + [onnx.helper.make_attribute(name, value)])
        return edit

    for name, value, message in (
            ("head_dim", head_dim + 1, f"compiled for head_dim {head_dim}, the node's head_dim attribute is "
                                       f"{head_dim + 1}"),
            ("mask_rows", int(not mask_rows), f"compiled with mask_rows={int(mask_rows)}, the node has "
                                              f"mask_rows={int(not mask_rows)}"),
            ("nan_to_zero", int(not nan_to_zero), f"compiled with nan_to_zero={int(nan_to_zero)}, the node has "
                                                  f"nan_to_zero={int(not nan_to_zero)}")):
        with pytest.raises(Exception, match=r"bundle kernel \d+ \('attention_kernel[^']*'\) was " + message):
            _session(_with_node(model, "ScaledDotProductAttention", set_attr(name, value)))

    def relayout(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        next(a for a in node.attribute if a.name == "layout").i = 0

    with pytest.raises(Exception, match=r"compiled for operand layout q=BSHD,k=BSHD,v=BSHD,out=BSHD,packed, the "
                                        r"node has q=BHSD,k=BHDS,v=BHSD,out=BHSD"):
        _session(_with_node(model, "ScaledDotProductAttention", relayout))

    def bad_layout(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        next(a for a in node.attribute if a.name == "layout").i = 16

    with pytest.raises(Exception, match="layout attribute 16 is not a bit set"):
        _session(_with_node(model, "ScaledDotProductAttention", bad_layout))

    def drop_mask(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        node.input[3] = ""

    with pytest.raises(Exception, match="takes a mask but the node has none"):
        _session(_with_node(model, "ScaledDotProductAttention", drop_mask))

    def drop_scale(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        keep = [a for a in node.attribute if a.name != "scale"]
        del node.attribute[:]
        node.attribute.extend(keep)

    with pytest.raises(Exception, match="'scale' attribute is missing"):
        _session(_with_node(model, "ScaledDotProductAttention", drop_scale))

    def garbage(m: onnx.ModelProto, node: onnx.NodeProto) -> None:
        m.graph.initializer.append(numpy_helper.from_array(np.arange(40, dtype=np.uint8), "junk"))
        node.input[4] = "junk"

    with pytest.raises(Exception, match="bundle input 'junk'"):
        _session(_with_node(model, "ScaledDotProductAttention", garbage))

    def float_bundle(m: onnx.ModelProto, node: onnx.NodeProto) -> None:
        m.graph.initializer.append(helper.make_tensor("fb", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]))
        node.input[4] = "fb"

    with pytest.raises(Exception):
        _session(_with_node(model, "ScaledDotProductAttention", float_bundle))
    with pytest.raises(DietcodeError, match="not a non-empty 1-D uint8|must be a non-empty 1-D uint8"):
        node_bundles(_with_node(model, "ScaledDotProductAttention", float_bundle))



@pytest.mark.parametrize("name, value, kind", [("causal", [1, 1], "an INT"), ("head_dim", 64.0, "an INT"),
                                               ("layout", "31", "an INT"), ("scale", 1, "a FLOAT")])
def test_attention_attributes_of_another_type_are_refused(optimized, name, value, kind) -> None:
    """An attribute of the wrong type is refused naming it, not read as absent (a causal=[1, 1] would run a
    non-causal node, a FLOAT head_dim would be reported missing)."""
    _, out, _ = optimized

    def retype(_: onnx.ModelProto, node: onnx.NodeProto) -> None:
        keep = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(keep + [helper.make_attribute(name, value)])

    with pytest.raises(Exception, match=rf"ai.dietcode:Attention.*the '{name}' attribute is not {kind}"):
        _session(_with_node(onnx.load(str(out)), "ScaledDotProductAttention", retype))


def test_gpu_measure_times_shipped_attention_kernels_through_the_timing_child(tmp_path: Path, monkeypatch) -> None:
    """measure="gpu": the configs the analytic cost ranks best are compiled as they ship and sent to the timing
    child as attention node calls, whose launch view is dc_attention_view's (the fake backend plays the GPU:
    1 us per query row, so every config ties and the tree is one leaf)."""
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("DIETCODE_FAKE_TIMING", json.dumps({"log": str(log)}))
    w = _workload(dtype="float32", mask_rows=True)
    problems = [(AttentionProblem(16, 16, 2), 1.0), (AttentionProblem(40, 24, 4), 1.0)]
    tuned = tune_attention(w, problems, ["sm_90"], max_kernels=2, measure="gpu", budget=2,
                           backend="_fake_timing:FakeBackend")
    assert tuned.measurer.startswith("gpu") and tuned.candidates == 2 and len(tuned.kernels) == 1
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 4 and len({r["config"] for r in records}) == 2  # 2 configs x 2 shapes
    assert tuned.kernels[0].key() in {r["config"] for r in records}
    assert "seq_q" in records[0]["params"] and "mask" in records[0]["params"]
    # [z, Tq, Tk] mask: strides (batch Tq*Tk, query Tk, key 1)
    assert sorted(r["view"] for r in records)[0] == [16, 16, 1, 2, 256, 16, 1]
    assert sorted(r["view"] for r in records)[-1] == [40, 24, 1, 4, 960, 24, 1]


def test_chains_that_cannot_get_kernels_are_left_unfused() -> None:
    """A chain whose sizes are all static has nothing to dispatch on; one whose head dim no config fits (here
    past the template's 256) has no kernel: optimize leaves both unfused instead of failing."""
    from dataclasses import replace

    from tuner.attention_graph import AttentionSite
    from tuner.attention_tune import unfit_reason

    site = AttentionSite(("s",), "q", "kt", "v", None, "y", 0.125, 64, "float32", 3, seq_q="seq", seq_k="seq",
                         batch="4")
    assert unfit_reason(site, ["sm_90"]) is None
    assert "all static" in str(unfit_reason(replace(site, seq_q="8", seq_k="8"), ["sm_90"]))
    assert "head dim 300 is outside" in str(unfit_reason(replace(site, head_dim=300), ["sm_90"]))


def test_fused_attention_is_the_cli_default_and_can_be_switched_off() -> None:
    from dietcode_ort.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["optimize", "m.onnx", "-o", "o.onnx"]).fuse_attention is True
    assert parser.parse_args(["optimize", "m.onnx", "-o", "o.onnx", "--no-fuse-attention"]).fuse_attention is False
    from tuner.optimize import OptimizeOptions

    assert OptimizeOptions().fuse_attention is True


def test_gpu_measure_without_a_local_gpu_tunes_attention_analytically(monkeypatch) -> None:
    """Attention kernels are timed on this machine's GPU; without one (GEMMs timed on a Ray cluster) the
    attention workloads fall back to the analytic cost, saying so, instead of failing the run."""
    from tuner import attention_tune
    from tuner.attention_graph import AttentionSite
    from tuner.executor import LocalExecutor

    monkeypatch.setattr(LocalExecutor, "gpu_available", lambda self: False)
    calls: list[str] = []
    monkeypatch.setattr(attention_tune, "compile_tuned", lambda *a, **k: b"bundle")
    real = attention_tune.tune_attention

    def spy(*args, **kw):
        calls.append(kw["measure"])
        return real(*args, **kw)

    monkeypatch.setattr(attention_tune, "tune_attention", spy)
    site = AttentionSite(("s",), "q", "kt", "v", None, "y", 0.125, 64, "float32", 3, seq_q="seq", seq_k="seq",
                         batch="4")
    logs: list[str] = []
    out = attention_tune.tune_sites([((site,), ("seq",), ("seq=1:64:16",), None, {})], ["sm_90"], max_kernels=2,
                                    seed=0, min_driver=13000, ptxas=None, measure="gpu", log=logs.append)
    assert calls == ["analytic"] and out[0]["y"][0] == b"bundle"
    assert any("analytic attention cost" in line for line in logs)


def test_zeroing_an_empty_key_call_output_checks_its_arguments() -> None:
    """dc_zero_async (an Attention call with no keys gets zeros, as ONNX defines) refuses a null pointer and
    says what is missing without a driver; nothing to zero is no error."""
    import ctypes

    from dietcode_ort import library_path
    from dietcode_ort.runtime import Core

    core = Core(library_path())
    core.lib.dc_zero_async.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
    assert core.lib.dc_zero_async(0, 0, None) == 0
    assert core.lib.dc_zero_async(0, 16, None) == -1 and "null pointer" in core.error()
    # no driver here; on a GPU, no context is current on this thread and no stream is given: an error either way
    assert core.lib.dc_zero_async(1 << 20, 16, None) == -1 and core.error()


def test_a_chain_without_mask_gets_an_empty_mask_slot_and_runs_everywhere() -> None:
    """A mask-free chain: Attention(Q, Kt, V, "", bundle), its kernels take no mask; stock ORT (the fallback
    function, its mask formal unbound) and the library's CPU kernel give the chain's outputs."""
    from test_attention_graph import _chain, _chain_feeds

    from tuner.attention_graph import find_attention, fuse_attention
    from tuner.attention_tune import tune_sites

    model = _chain(mask=False)
    sites = find_attention(model).sites
    assert len(sites) == 1 and sites[0].mask is None
    (bundles,) = tune_sites([(sites, ("T", "z"), ("z=1:3", "T=1:9:4"), None, {})], ["sm_90"], max_kernels=2,
                            seed=0, min_driver=13000, ptxas=None, log=lambda _: None)
    fused, _ = fuse_attention(model, sites, bundles=bundles)
    node = next(n for n in fused.graph.node if n.op_type == "ScaledDotProductAttention")
    assert len(node.input) == 5 and node.input[3] == "" and node.input[4].startswith("dietcode_bundle_")
    kernels = read_bundle(node_bundles(fused)[0].payload).kernels
    assert kernels and all("mask" not in k.params for k in kernels)
    feeds = _chain_feeds(mask=False)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    stock = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(stock, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_session(fused).run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)


def _timed(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _new_children(monkeypatch, plan: dict) -> None:
    """The next timing child reads ``plan`` (the fake backend reads it when the child starts)."""
    from tuner import gpu_timing

    for timer in list(gpu_timing._SHARED.values()):
        timer.close()
    monkeypatch.setenv("DIETCODE_FAKE_TIMING", json.dumps(plan))


def test_attention_gpu_timings_are_stored_in_the_database_and_reused(tmp_path: Path, monkeypatch) -> None:
    """optimize --db: a second run with the same database times no attention kernel again (its log line says
    how many timings came from the database); a changed timing setting or template hash times them again."""
    from tuner import aot, attention_tune
    from tuner.attention_graph import AttentionSite
    from tuner.executor import LocalExecutor
    from tuner.gpu_timing import TimingSettings

    log, db = tmp_path / "timed.jsonl", tmp_path / "tuning.db"
    _new_children(monkeypatch, {"log": str(log)})
    monkeypatch.setattr(LocalExecutor, "gpu_available", lambda self: True)
    monkeypatch.setattr(attention_tune, "compile_tuned", lambda *a, **k: b"bundle")
    site = AttentionSite(("s",), "q", "kt", "v", None, "y", 0.125, 64, "float32", 3, seq_q="seq", seq_k="seq",
                         batch="4")

    def run() -> list[str]:
        logs: list[str] = []
        attention_tune.tune_sites([((site,), ("seq",), ("seq=16:32:16",), None, {})], ["sm_90"], max_kernels=2,
                                  seed=0, min_driver=13000, ptxas=None, measure="gpu", budget=2, log=logs.append,
                                  db=db, backend="_fake_timing:FakeBackend")
        return logs

    first = run()
    assert len(_timed(log)) == 4  # 2 configs x 2 shapes
    assert any("0 of 4 timings from the database" in line for line in first)
    second = run()
    assert len(_timed(log)) == 4  # nothing timed again
    assert any("4 of 4 timings from the database" in line for line in second)

    w = _workload(dtype="float32", has_mask=False, seq_q="seq", seq_k="seq", batch="4")
    problems = [(AttentionProblem(16, 16, 4), 1.0), (AttentionProblem(32, 32, 4), 1.0)]
    from tuner.database import Database

    def tune(**kw) -> tuple[int, int] | None:
        kw.setdefault("allow_tf32", True)  # as tune_sites compiles float32 under --fp32-precision tf32 (default)
        with Database(db) as store:
            return tune_attention(w, problems, ["sm_90"], max_kernels=2, measure="gpu", budget=2,
                                  backend="_fake_timing:FakeBackend", db=store,
                                  toolchain=aot.CompileToolchain(13000, None), **kw).from_db

    assert tune() == (4, 4) and len(_timed(log)) == 4  # the same workload through tune_attention
    assert tune(settings=TimingSettings(repeats=5)) == (0, 4) and len(_timed(log)) == 8
    monkeypatch.setattr(aot, "template_hash", lambda: "f" * 64)
    assert tune() == (0, 4) and len(_timed(log)) == 12
    assert tune() == (4, 4) and len(_timed(log)) == 12
    assert tune(allow_tf32=False) == (0, 4) and len(_timed(log)) == 16  # ieee kernels: other rows


def test_attention_gpu_failures_in_the_database(tmp_path: Path, monkeypatch) -> None:
    """A transient failure (a lost context) is not stored and is timed again next run; a deterministic one
    (the config refused by the GPU, a compile error) is stored and neither timed nor compiled again."""
    from tuner import attention_tune
    from tuner.database import Database

    log, db = tmp_path / "timed.jsonl", tmp_path / "tuning.db"
    w = _workload(dtype="float32", has_mask=False, seq_q="seq", seq_k="seq", batch="4")
    problems = [(AttentionProblem(16, 16, 4), 1.0), (AttentionProblem(32, 32, 4), 1.0)]

    def tune(store: Database | None = None) -> set[str]:
        tuned = tune_attention(w, problems, ["sm_90"], max_kernels=2, measure="gpu", budget=4,
                               backend="_fake_timing:FakeBackend", db=store)
        return {k.key() for k in tuned.kernels}

    _new_children(monkeypatch, {"log": str(log)})
    tune()
    lost, refused, broken, good = sorted({r["config"] for r in _timed(log)})
    log.unlink()
    _new_children(monkeypatch, {"log": str(log), lost: "lost", refused: "refuse"})
    real = attention_tune.one_kernel_bundle
    compiled: list[str] = []

    def compile_one(config, *args):
        compiled.append(config.key())
        return "compile error: fake" if config.key() == broken else real(config, *args)

    monkeypatch.setattr(attention_tune, "one_kernel_bundle", compile_one)
    with Database(db) as store:
        assert tune(store) == {good}
        assert {r["config"] for r in _timed(log)} == {good}  # lost and refused items are not logged
        assert broken in compiled
        rows = store.rows(*_device_family(w, store))
    assert {k[0] for k in rows} == {refused, broken, good}  # the lost config is not stored
    assert all("compile error: fake" in (r.error or "") for k, r in rows.items() if k[0] == broken)
    log.unlink()
    compiled.clear()
    _new_children(monkeypatch, {"log": str(log)})
    with Database(db) as store:
        tune(store)
    assert [r["config"] for r in _timed(log)] == [lost, lost]  # only the transient failure is timed again
    assert compiled == [lost]


def _device_family(w: AttentionWorkload, store) -> tuple:
    from tuner import aot
    from tuner.attention_tune import timing_context, timing_family
    from tuner.gpu_timing import TimingSettings

    family, text = timing_family(w, "sm_90")
    context = f"{text};{timing_context(aot.CompileToolchain(), TimingSettings())}"
    return ("model=fake;arch=sm_90;driver=0;triton=0", family, context)


def test_optimize_hands_its_database_to_attention_tuning(tmp_path: Path, monkeypatch) -> None:
    """optimize --db applies to attention as to GEMMs: tune_sites gets the database file."""
    assert _what_optimize_hands_attention(tmp_path, monkeypatch, "db") == tmp_path / "t.db"


def test_attention_kernels_are_compiled_by_the_executor_optimize_uses(tmp_path: Path, monkeypatch) -> None:
    """The chosen attention configs are compile jobs of the executor (a Ray cluster's CPU tasks under --ray,
    as the GEMM kernels'): every config x target goes through it, and optimize hands tune_sites its own."""
    from tuner import attention_tune
    from tuner.attention import AttentionCompileJob
    from tuner.attention_graph import AttentionSite
    from tuner.executor import LocalExecutor

    class Recording(LocalExecutor):
        jobs: list = []

        def compile_many(self, jobs):
            self.jobs.extend(jobs)
            return super().compile_many(jobs)

    site = AttentionSite(("s",), "q", "kt", "v", None, "y", 0.125, 64, "float32", 3, seq_q="seq", seq_k="seq",
                         batch="4")
    executor = Recording(1)
    (bundles,) = attention_tune.tune_sites([((site,), ("seq",), ("seq=16:64:16",), None, {})], ["sm_80", "sm_90"],
                                           max_kernels=2, seed=0, min_driver=13000, ptxas=None, log=lambda _: None,
                                           executor=executor)
    kernels = read_bundle(bundles["y"][0]).kernels
    assert executor.jobs and all(isinstance(j, AttentionCompileJob) for j in executor.jobs)
    assert len(executor.jobs) == 2 * len(kernels)
    assert {j.target for j in executor.jobs} == {"sm_80", "sm_90"}
    assert all(sorted(a for a, _ in k.images) == ["sm_80", "sm_90a"] for k in kernels)
    assert isinstance(_what_optimize_hands_attention(tmp_path, monkeypatch, "executor"), LocalExecutor)


def test_attention_kernels_are_kept_in_the_kernel_cache(tmp_path: Path, monkeypatch) -> None:
    """The chosen attention kernels' compiles are stored in the kernel cache (--cache-dir) as the GEMM kernels'
    are: a rerun compiles nothing and writes the same bundle; another scale is another kernel (compiled); a
    damaged entry is compiled again. optimize hands tune_sites its cache folder."""
    from tuner import aot, attention_tune
    from tuner.attention_graph import AttentionSite
    from tuner.executor import LocalExecutor

    cache = tmp_path / "k"

    def bundle(scale: float) -> bytes:
        site = AttentionSite(("s",), "q", "kt", "v", None, "y", scale, 64, "float32", 3, seq_q="seq", seq_k="seq",
                             batch="4")
        (bundles,) = attention_tune.tune_sites([((site,), ("seq",), ("seq=16:64:16",), None, {})], ["sm_90"],
                                               max_kernels=2, seed=0, min_driver=13000, ptxas=None,
                                               log=lambda _: None, executor=LocalExecutor(1), cache_dir=cache)
        return bundles["y"][0]

    first = bundle(0.125)
    entries = sorted(cache.glob("*.json"))
    assert len(entries) == len(read_bundle(first).kernels)
    real = aot._triton_compile

    def refuse(*args, **kwargs):
        raise AssertionError("recompiled")

    monkeypatch.setattr(aot, "_triton_compile", refuse)
    assert bundle(0.125) == first
    with pytest.raises(DietcodeError, match="recompiled"):
        bundle(0.25)
    entries[0].write_text(entries[0].read_text()[:-40])
    monkeypatch.setattr(aot, "_triton_compile", real)
    assert bundle(0.125) == first and len(list(cache.glob("*.json"))) == len(entries)
    monkeypatch.setattr(aot, "_triton_compile", refuse)
    assert bundle(0.125) == first
    monkeypatch.setattr(aot, "_triton_compile", real)
    assert _what_optimize_hands_attention(tmp_path, monkeypatch, "cache_dir") == tmp_path / "k"


def test_kernel_layouts_round_trip_through_the_c_reader_and_are_refused_off_attention() -> None:
    """Each attention kernel's operand layouts (flags bits 3..6) survive the C core's parser; the Python writer
    and the C reader refuse them on kernels that are not attention kernels, and unknown flag bits."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import load_core
    from tuner import templates

    core = load_core()
    ptx = ".version 8.0\n.target sm_80\n"
    for layout in (0, 1, 6, 15, 23, 31):
        kernel = BundleKernel(name="k", ptx=ptx, params=templates.ATTENTION_PARAMS, block_m=16, block_n=16,
                              layout=layout, head_dim=64)
        payload = Bundle((), (kernel,), DispatchTree.single(0)).to_bytes()
        parsed = core.parse(payload)
        assert parsed.decode().kernels[0].layout == layout
        parsed.check_attention(layout, mask_rows=False)
        with pytest.raises(DietcodeError, match="compiled for operand layout"):
            parsed.check_attention(layout ^ 8, mask_rows=False)
    gemm = BundleKernel(name="g", ptx=ptx, params=templates.ABI_PARAMS["gemm"][:7], block_m=16, block_n=16, layout=2)
    with pytest.raises(DietcodeError, match="operand layouts apply to attention kernels only"):
        Bundle((), (gemm,), DispatchTree.single(0)).validate()
    with pytest.raises(DietcodeError, match="layout 32 is not a bit set"):
        BundleKernel(name="k", ptx=ptx, params=templates.ATTENTION_PARAMS, layout=32, head_dim=64).validate(0)
    with pytest.raises(DietcodeError, match="layout 16 is packed without Q, K and V"):
        BundleKernel(name="k", ptx=ptx, params=templates.ATTENTION_PARAMS, layout=16, head_dim=64).validate(0)
    # the same kernels written past the Python checks: the C reader refuses them too
    with pytest.raises(DietcodeError, match="operand layouts apply to attention kernels only"):
        core.parse(Bundle((), (gemm,), DispatchTree.single(0)).to_bytes(validate=False))
    bad = BundleKernel(name="k", ptx=ptx, params=templates.ATTENTION_PARAMS, block_m=16, block_n=16, layout=16,
                       head_dim=64)
    with pytest.raises(DietcodeError, match="layout 16 is packed without Q, K and V"):  # flags bit 7 without 3..5
        core.parse(Bundle((), (bad,), DispatchTree.single(0)).to_bytes(validate=False))


def _what_optimize_hands_attention(tmp_path: Path, monkeypatch, keyword: str) -> object:
    """Optimize tiny BERT (analytic, --db in tmp_path) and return the ``keyword`` argument optimize passes to
    attention tuning (tune_sites is stopped there)."""
    import models
    from tuner import attention_tune
    from tuner.optimize import OptimizeOptions, optimize

    class Seen(Exception):
        pass

    def spy(*args, **kw):
        raise Seen(kw.get(keyword))

    monkeypatch.setattr(attention_tune, "tune_sites", spy)
    src = tmp_path / "bert.onnx"
    models.save_model(models.build("bert", "tiny"), src)
    with pytest.raises(Seen) as seen:
        optimize(src, tmp_path / "out.onnx", OptimizeOptions(dims=("batch=1:2", "seq=16:32:16"), budget=2,
                                                              max_kernels=1, measure="analytic", db=tmp_path / "t.db",
                                                              cache_dir=tmp_path / "k", progress=False),
                 log=lambda line: None)
    return seen.value.args[0]
