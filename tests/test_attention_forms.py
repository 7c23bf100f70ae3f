"""Attention chains as float16 exporters and hand-written decoders write them (tuner/attention_graph.py): Cast
nodes around the scores, the mask and the probabilities, and masks built by hand. Each fused chain is checked
against the original in ONNX Runtime (CPU EP: stock ORT through the fallback function, and the library's
Attention kernel); each refused one by its reason."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.attention_graph import OP_TYPE, find_attention, fuse_attention

F32, F16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE
Z, T, D = 3, 6, 8
FP32_MIN = float(np.finfo(np.float32).min)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], library: bool = False) -> np.ndarray:
    opts = ort.SessionOptions()
    if library:
        from dietcode_ort.runtime import register

        register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _const(name: str, value: float, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype), name)


class _Graph:
    """A chain written node by node: Q [z, T, d], Kt [z, d, T], V [z, T, d] graph inputs of ``qdtype``."""

    def __init__(self, qdtype: int = F16) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs = [helper.make_tensor_value_info(n, qdtype, s)
                       for n, s in (("Q", ["z", "T", D]), ("Kt", ["z", D, "T"]), ("V", ["z", "T", D]))]
        self.count = 0

    def add(self, op: str, inputs: list[str], **attrs) -> str:
        self.count += 1
        out = f"{op.lower()}{self.count}"
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def init(self, name: str, value: float, dtype=np.float32) -> str:
        self.inits.append(_const(name, value, dtype))
        return name

    def input(self, name: str, dtype: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def model(self, y: str, ydtype: int = F16) -> onnx.ModelProto:
        self.nodes.append(helper.make_node("Identity", [y], ["y"]))
        graph = helper.make_graph(self.nodes, "chain", self.inputs,
                                  [helper.make_tensor_value_info("y", ydtype, ["z", "T", D])], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(model: onnx.ModelProto, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        t = vi.type.tensor_type
        shape = [{"z": Z, "T": T}.get(d.dim_param, d.dim_value) for d in t.shape.dim]
        if t.elem_type == TensorProto.BOOL:
            out[vi.name] = rng.random(shape) < 0.7
            out[vi.name][..., 0] = True  # every row keeps a key
        elif vi.name.startswith("mask"):
            out[vi.name] = np.where(rng.random(shape) < 0.3, -10000.0, 0.0).astype(
                onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
        else:
            out[vi.name] = rng.standard_normal(shape).astype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    return out


def llama_fp16(masked_value: float = float("-inf"), nan_to_zero: bool = True) -> onnx.ModelProto:
    """Scores in float16, Cast to float32, scaled, a float32 additive mask Where(keep, 0, -inf) added, the
    softmax in float32 (torch's NaN guard after it), the probabilities Cast back to float16 for the AV product."""
    g = _Graph()
    keep = g.input("keep", TensorProto.BOOL, ["z", "T", "T"])
    mask = g.add("Where", [keep, g.init("zero_m", 0.0), g.init("masked", masked_value)])
    s = g.add("Cast", [g.add("MatMul", ["Q", "Kt"])], to=F32)
    s = g.add("Add", [g.add("Mul", [s, g.init("scale", 0.25)]), mask])
    p = g.add("Softmax", [s], axis=-1)
    if nan_to_zero:
        p = g.add("Where", [g.add("IsNaN", [p]), g.init("zero", 0.0), p])
    return g.model(g.add("MatMul", [g.add("Cast", [p], to=F16), "V"]))


def mask_add_in_float32() -> onnx.ModelProto:
    """Scores and scale in float16, Cast to float32 around the mask Add (a float16 mask Cast up), back to
    float16 for the softmax."""
    g = _Graph()
    m = g.add("Cast", [g.input("mask16", F16, ["z", 1, "T"])], to=F32)
    s = g.add("Div", [g.add("MatMul", ["Q", "Kt"]), g.init("c", 4.0, np.float16)])
    s = g.add("Cast", [g.add("Add", [g.add("Cast", [s], to=F32), m])], to=F16)
    return g.model(g.add("MatMul", [g.add("Softmax", [s], axis=-1), "V"]))


def float64_softmax() -> onnx.ModelProto:
    g = _Graph()
    s = g.add("Cast", [g.add("MatMul", ["Q", "Kt"])], to=F64)
    return g.model(g.add("MatMul", [g.add("Cast", [g.add("Softmax", [s], axis=-1)], to=F16), "V"]))


def float32_mask_input() -> onnx.ModelProto:
    g = _Graph()
    s = g.add("Add", [g.add("Cast", [g.add("MatMul", ["Q", "Kt"])], to=F32), g.input("mask32", F32, ["z", 1, "T"])])
    return g.model(g.add("MatMul", [g.add("Cast", [g.add("Softmax", [s], axis=-1)], to=F16), "V"]))


def float32_av_product() -> onnx.ModelProto:
    """The LLaMA float16 TorchScript export's form: the probabilities stay float32 and V is Cast up to them."""
    g = _Graph()
    s = g.add("Cast", [g.add("MatMul", ["Q", "Kt"])], to=F32)
    return g.model(g.add("MatMul", [g.add("Softmax", [s], axis=-1), g.add("Cast", ["V"], to=F32)]), F32)


@pytest.mark.parametrize("build, scale, mask_dtype, nan_to_zero", [
    (llama_fp16, 0.25, "float32", True), (mask_add_in_float32, 0.25, "float32", False)])
def test_float16_chains_with_casts_fuse_and_match_the_original(build, scale, mask_dtype, nan_to_zero) -> None:
    model = build()
    found = find_attention(model)
    assert found.skipped == ()
    (site,) = found.sites
    assert (site.dtype, site.scale, site.mask_dtype, site.nan_to_zero) == ("float16", scale, mask_dtype, nan_to_zero)
    assert site.mask is not None
    fused, _ = fuse_attention(model)
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in fused.graph.node]
    assert "Softmax" not in ops and ops.count(OP_TYPE) == 1
    node = next(n for n in fused.graph.node if n.op_type == OP_TYPE)
    if mask_dtype:  # the node takes the float32 mask cast to float16 (exact), the fallback casts it back
        cast = next(n for n in fused.graph.node if n.op_type == "Cast" and n.output[0] == node.input[3])
        assert cast.input[0] == site.mask and cast.attribute[0].i == F16
        assert fused.functions[0].node[0].op_type == "Cast"
    feeds = _feeds(model)
    want = _run(model, feeds)
    np.testing.assert_array_equal(_run(fused, feeds), want)  # stock ORT: the fallback computes the original
    np.testing.assert_allclose(_run(fused, feeds, library=True).astype(np.float32), want.astype(np.float32),
                               rtol=1e-2, atol=2e-3)


def test_a_float16_chain_with_casts_runs_with_its_bundle_on_the_cpu_ep() -> None:
    """Tuned and compiled like any chain: Attention(Q, Kt, V, mask cast to float16, bundle), kernels taking a
    float16 mask, and the library's CPU kernel matches the original."""
    from dietcode_ort.bundle import node_bundles, read_bundle
    from tuner.attention_tune import tune_sites

    model = llama_fp16()
    sites = find_attention(model).sites
    (bundles,) = tune_sites([(sites, ("T", "z"), ("z=1:3", "T=1:9:4"), None, {})], ["sm_90"], max_kernels=1,
                            seed=0, min_driver=13000, ptxas=None, log=lambda _: None)
    fused, _ = fuse_attention(model, sites, bundles=bundles)
    node = next(n for n in fused.graph.node if n.op_type == OP_TYPE)
    assert node.input[3] != sites[0].mask and node.input[4].startswith("dietcode_bundle_")
    kernels = read_bundle(node_bundles(fused)[0].payload).kernels
    assert kernels and all(k.dtype == "float16" and "mask" in k.params and k.alpha == 0.25 for k in kernels)
    feeds = _feeds(model)
    want = _run(model, feeds).astype(np.float32)
    np.testing.assert_allclose(_run(fused, feeds, library=True).astype(np.float32), want, rtol=1e-2, atol=2e-3)
    np.testing.assert_array_equal(_run(fused, feeds), _run(model, feeds))


@pytest.mark.parametrize("build, reason", [
    (float64_softmax, "a Cast to float64 inside the chain: the fused kernel keeps the scores and the softmax in "
                      "float32 and rounds the probabilities to float16"),
    (float32_mask_input, "the float32 mask is not provably exact in float16"),
    (lambda: llama_fp16(FP32_MIN), "the float32 mask is not provably exact in float16"),
    (float32_av_product, "the probabilities multiply V of float32 while Q is float16 (the AV product and the "
                         "output are float32)"),
])
def test_casts_outside_the_kernels_arithmetic_are_refused_with_the_reason(build, reason: str) -> None:
    found = find_attention(build())
    assert found.sites == () and len(found.skipped) == 1
    assert found.skipped[0][1].startswith(reason)


# --- hand-written causal masks -------------------------------------------------------------------------------

P = 16  # the length of the constant buffers the masks are sliced from


def _causal_chain(mask_of, dtype: int = F32) -> onnx.ModelProto:
    """A float32 chain whose additive mask ``mask_of(g)`` builds (g: the _Graph; "T" from Q's shape)."""
    g = _Graph(dtype)
    s = g.add("Div", [g.add("MatMul", ["Q", "Kt"]), g.init("c", 2.0)])
    s = g.add("Add", [s, mask_of(g)])
    return g.model(g.add("MatMul", [g.add("Softmax", [s], axis=-1), "V"]), dtype)


def _seq(g: _Graph) -> str:
    """[T, T] as a 1-D int64 value, from Q's shape."""
    t = g.add("Gather", [g.add("Shape", ["Q"]), g.init("one", 1, np.int64)], axis=0)
    t = g.add("Unsqueeze", [t, g.init("axis0", [0], np.int64)])
    return g.add("Concat", [t, t], axis=0)


def _sliced(g: _Graph, buffer: np.ndarray, start: int = 0) -> str:
    """buffer[:, start:start+T, start:start+T] (GPT-2 / Whisper keep such a buffer and cut it to the sequence
    length)."""
    g.inits.append(numpy_helper.from_array(buffer, "buffer"))
    ends = _seq(g)
    if start:
        ends = g.add("Add", [ends, g.init("shift", [start, start], np.int64)])
    starts = g.init("starts", [start, start], np.int64)
    return g.add("Slice", ["buffer", starts, ends, g.init("axes", [1, 2], np.int64)])


def _triu(fill: float) -> np.ndarray:
    return np.triu(np.full((1, P, P), fill, np.float32), 1)


def sliced_additive_buffer(fill: float = float("-inf")):
    return lambda g: _sliced(g, _triu(fill))


def where_on_sliced_bool_buffer(g: _Graph) -> str:
    keep = _sliced(g, np.tril(np.ones((1, P, P), bool)))
    return g.add("Where", [keep, g.init("zero", 0.0), g.init("lowest", FP32_MIN)])


def trilu_of_a_filled_square(g: _Graph) -> str:  # torch.triu(torch.full((T, T), -inf), diagonal=1)
    full = g.add("ConstantOfShape", [_seq(g)], value=numpy_helper.from_array(np.array([-np.inf], np.float32)))
    return g.add("Trilu", [full, g.init("k", 1, np.int64)], upper=1)


def where_on_trilu_of_ones(g: _Graph) -> str:  # torch.tril(torch.ones(T, T, dtype=bool))
    ones = g.add("ConstantOfShape", [_seq(g)], value=numpy_helper.from_array(np.array([True])))
    return g.add("Where", [g.add("Trilu", [ones], upper=0), g.init("zero", 0.0), g.init("ninf", -np.inf)])


def trilu_on_the_diagonal(g: _Graph) -> str:  # k = 0: the diagonal is masked too, not the causal mask
    full = g.add("ConstantOfShape", [_seq(g)], value=numpy_helper.from_array(np.array([-np.inf], np.float32)))
    return g.add("Trilu", [full], upper=1)


@pytest.mark.parametrize("mask_of, causal", [
    (sliced_additive_buffer(), True), (where_on_sliced_bool_buffer, True), (trilu_of_a_filled_square, True),
    (where_on_trilu_of_ones, True), (sliced_additive_buffer(FP32_MIN), True),
    # not provably causal: kept as a general additive mask
    (sliced_additive_buffer(-10000.0), False), (lambda g: _sliced(g, _triu(-np.inf), start=1), False),
    (trilu_on_the_diagonal, False), (lambda g: _sliced(g, np.triu(np.full((1, P, P), -np.inf, np.float32), 2)), False),
])
def test_hand_written_causal_masks(mask_of, causal: bool) -> None:
    model = _causal_chain(mask_of)
    found = find_attention(model)
    assert found.skipped == ()
    (site,) = found.sites
    assert site.causal is causal and site.mask is not None and site.scale == 0.5
    fused, _ = fuse_attention(model)
    assert [n.op_type for n in fused.graph.node].count(OP_TYPE) == 1
    rng = np.random.default_rng(4)
    for t in (1, 5, 9) if causal else (5,):
        feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
                 (("Q", (Z, t, D)), ("Kt", (Z, D, t)), ("V", (Z, t, D)))}
        want = _run(model, feeds)
        np.testing.assert_array_equal(_run(fused, feeds), want)
        np.testing.assert_allclose(_run(fused, feeds, library=True), want, rtol=1e-5, atol=1e-6)


def test_a_causal_chain_gets_causal_kernels_that_take_no_mask(tmp_path) -> None:
    """Tuned and compiled in causal mode: the bundle's kernels carry the causal flag and take no mask, the node
    (causal=1) still takes the mask for the CPU kernel, which matches the original; a node whose causal
    attribute disagrees with its kernels is refused at session creation."""
    from dietcode_ort.bundle import node_bundles, read_bundle
    from tuner.attention_tune import tune_sites

    model = _causal_chain(trilu_of_a_filled_square)
    sites = find_attention(model).sites
    (bundles,) = tune_sites([(sites, ("T", "z"), ("z=1:3", "T=1:9:4"), None, {})], ["sm_90"], max_kernels=1,
                            seed=0, min_driver=13000, ptxas=None, log=lambda _: None)
    fused, _ = fuse_attention(model, sites, bundles=bundles)
    node = next(n for n in fused.graph.node if n.op_type == OP_TYPE)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["causal"] == 1 and node.input[3] == sites[0].mask
    kernels = read_bundle(node_bundles(fused)[0].payload).kernels
    assert kernels and all(k.causal and "mask" not in k.params for k in kernels)
    feeds = {n: np.random.default_rng(5).standard_normal(s).astype(np.float32)
             for n, s in (("Q", (Z, T, D)), ("Kt", (Z, D, T)), ("V", (Z, T, D)))}
    np.testing.assert_allclose(_run(fused, feeds, library=True), _run(model, feeds), rtol=1e-5, atol=1e-6)
    next(a for a in node.attribute if a.name == "causal").i = 0
    with pytest.raises(Exception, match="bundle kernel 0 takes no mask but the node has one|is causal but the node"):
        _run(fused, feeds, library=True)


def gpt2_eager_where() -> onnx.ModelProto:
    """GPT-2's eager attention before transformers 4.5x: scores replaced by Where(bias[:, :T, :T], S, lowest)."""
    g = _Graph(F32)
    s = g.add("Div", [g.add("MatMul", ["Q", "Kt"]), g.init("c", 2.0)])
    keep = _sliced(g, np.tril(np.ones((1, P, P), bool)))
    s = g.add("Where", [keep, s, g.init("lowest", FP32_MIN)])
    return g.model(g.add("MatMul", [g.add("Softmax", [s], axis=-1), "V"]), F32)


def test_scan_lists_fused_and_refused_attention_chains(tmp_path, capsys) -> None:
    """`dietcode-ort scan` reports each attention chain: fused with its mask kind (causal here), or left
    unfused with the reason (GPT-2's eager Where on the scores)."""
    import json

    from tuner.scan import scan_command

    merged = onnx.compose.merge_models(_causal_chain(trilu_of_a_filled_square), gpt2_eager_where(), io_map=[],
                                       prefix1="a_", prefix2="b_")
    path = tmp_path / "m.onnx"
    onnx.save(merged, str(path))
    assert scan_command(str(path), ["z=1,2", "T=4"], None, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)["attention"]
    assert [(f["output"][:2], f["mask"]) for f in report["fused"]] == [("a_", "causal")]
    (unfused,) = report["unfused"]
    assert unfused["reason"].startswith("the scores pass through a Where (a mask applied by replacing scores, as "
                                        "GPT-2's eager attention writes its causal mask): only an added mask fuses")
    assert scan_command(str(path), ["z=1,2", "T=4"], None, as_json=False) == 0
    text = capsys.readouterr().out
    assert "1 attention chains fused" in text and "1 attention chains left unfused" in text and "causal" in text
