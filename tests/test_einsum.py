"""tuner/einsum.py: two-operand Einsums that are matrix products become MatMuls (with Transposes and Unsqueezes
where needed) that compute the same values, and the scanner then tunes them; the others stay, with the reason."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.einsum import einsums_as_matmuls, matmul_form
from tuner.scan import prepare_graph, scan, scan_model

# (equation, A's dims, B's dims): letters name dims; upper-case ones are symbolic in the model
CASES = [
    ("bhqd,bhkd->bhqk", "BHQd", "BHKd"),  # attention scores: B transposed
    ("bhqk,bhkd->bhqd", "BHQK", "BHKd"),  # attention output: a plain batched MatMul
    ("bsd,hd->bsh", "BSd", "hd"),  # a linear layer with its weight [out, in]
    ("bsd,dh->bsh", "BSd", "dh"),  # ... and [in, out]: no node but the MatMul
    ("bhwc,wkc->bhwk", "BHwc", "wkc"),  # SAM's relative positions: a batch letter in the middle
    ("bqc,bchw->bqhw", "BQc", "BcHW"),  # Mask2Former's masks: two letters of B alone
    ("blhd,bshd->blhs", "BLhd", "BShd"),  # Longformer's global attention: heads after the sequence
    ("...pd,...qd->...pq", "XYPd", "XYQd"),  # OWL-ViT's class logits: an ellipsis
    ("...d,de->...e", "XYd", "de"),  # an ellipsis on one side: MatMul broadcasts it
    ("ij,jk", "Ij", "jk"),  # implicit output (the letters used once, sorted)
    (" bij , bjk -> bik ", "BIj", "Bjk"),  # spaces
]
SIZES = [{"B": 2, "H": 3, "Q": 5, "K": 6, "S": 4, "W": 5, "L": 3, "X": 2, "Y": 3, "P": 4, "I": 3},
         {"B": 1, "H": 2, "Q": 1, "K": 9, "S": 7, "W": 2, "L": 5, "X": 1, "Y": 1, "P": 2, "I": 1}]
FIXED = {"d": 4, "c": 5, "h": 3, "w": 4, "k": 6, "j": 4, "e": 7}


def _dims(spec: str) -> list[int | str]:
    return [c.lower() + "_dim" if c.isupper() else FIXED[c] for c in spec]


def _model(equation: str, a: str, b: str, const_b: bool, opset: int = 17) -> tuple[onnx.ModelProto, np.ndarray]:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal([FIXED[c] for c in b]).astype(np.float32) if const_b else np.zeros(0)
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, _dims(a))]
    inits = [numpy_helper.from_array(weight, "b")] if const_b else []
    if not const_b:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, _dims(b)))
    node = helper.make_node("Einsum", ["a", "b"], ["y"], name="einsum", equation=equation)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), weight


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("const_b", [False, True], ids=["two-inputs", "constant-b"])
@pytest.mark.parametrize("equation, a, b", CASES, ids=[c[0].strip() for c in CASES])
def test_a_matrix_product_einsum_becomes_a_matmul_of_the_same_values(equation, a, b, const_b):
    if const_b and any(c.isupper() for c in b):
        pytest.skip("a constant has no symbolic dim")
    model, weight = _model(equation, a, b, const_b)
    out, result = einsums_as_matmuls(model)
    assert result.converted == ("y",) and result.notes == ()
    ops = [n.op_type for n in out.graph.node]
    assert "Einsum" not in ops and ops.count("MatMul") == 1
    assert set(ops) <= {"MatMul", "Transpose", "Unsqueeze"}
    if const_b:  # the weight transposed and reshaped here, once: the MatMul reads a constant
        matmul = next(n for n in out.graph.node if n.op_type == "MatMul")
        assert matmul.input[1] in {t.name for t in out.graph.initializer}
    rng = np.random.default_rng(1)
    for sizes in SIZES:
        feeds = {"a": rng.standard_normal([sizes[c] if c.isupper() else FIXED[c] for c in a]).astype(np.float32)}
        if not const_b:
            feeds["b"] = rng.standard_normal([sizes[c] if c.isupper() else FIXED[c] for c in b]).astype(np.float32)
        np.testing.assert_allclose(_run(out, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)
    again, second = einsums_as_matmuls(out)  # nothing more to do
    assert second.converted == () and again.SerializeToString() == out.SerializeToString()


def test_a_linear_einsum_is_a_gemm_workload_with_its_weight_transposed_once():
    model, weight = _model("bsd,hd->bsh", "BSd", "hd", const_b=True)
    out, _ = einsums_as_matmuls(model)
    (init,) = out.graph.initializer  # the [out, in] weight is gone, its transpose [in, out] in its place
    np.testing.assert_array_equal(numpy_helper.to_array(init), weight.T)
    (w,) = scan_model(out).workloads
    assert (w.op, w.m, w.n, w.k, w.const_operands) == ("gemm", "b_dim*s_dim", "3", "4", (1,))


def test_opset_12_unsqueezes_by_attribute():
    model, _ = _model("bqc,bchw->bqhw", "BQc", "BcHW", const_b=False, opset=12)
    out, result = einsums_as_matmuls(model)
    (unsqueeze,) = [n for n in out.graph.node if n.op_type == "Unsqueeze"]
    assert len(unsqueeze.input) == 1 and [a.name for a in unsqueeze.attribute] == ["axes"]
    rng = np.random.default_rng(2)
    feeds = {"a": rng.standard_normal((2, 3, 5)).astype(np.float32),
             "b": rng.standard_normal((2, 5, 4, 6)).astype(np.float32)}
    np.testing.assert_allclose(_run(out, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)


def test_a_weight_in_an_external_file_gets_a_transpose_node(tmp_path: Path):
    """Weights whose values stay in their file (optimize loads none) are not read here: a Transpose does it."""
    model, weight = _model("bsd,hd->bsh", "BSd", "hd", const_b=True)
    weight = np.random.default_rng(3).standard_normal((300, 4)).astype(np.float32)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "b"))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    lazy = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    out, result = einsums_as_matmuls(lazy)
    assert result.converted == ("y",)
    assert [n.op_type for n in out.graph.node] == ["Transpose", "MatMul"]
    onnx.save(out, str(tmp_path / "out.onnx"))
    x = np.random.default_rng(4).standard_normal((2, 3, 4)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"a": x})[0]
    np.testing.assert_allclose(got, x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, why", [
    ("ii->i", "1 operands"),
    ("ij,jk,kl->il", "3 operands"),
    ("ii,ij->ij", "a letter repeated within a term"),
    ("ij,ij->", "2 contracted letters"),
    ("ijk,jk->i", "2 contracted letters"),
    ("ij,jk->i", "letter 'k' summed out of one operand alone"),
    ("i,ij->j", "no letter of A alone (a matrix-vector or dot product)"),
    ("ij,j->i", "no letter of B alone (a matrix-vector or dot product)"),
    ("bsh,bsh->bs", "no letter of A alone (a matrix-vector or dot product)"),
    ("i...j,jk->i...k", "an ellipsis not at the start of a term"),
    ("...ij,...jk->ik", "the ellipsis dims summed out"),
])
def test_other_einsums_stay_with_the_reason(equation, why):
    assert isinstance(matmul_form(equation), str) and why in str(matmul_form(equation))
    if equation.count(",") != 1:
        return
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    out, result = einsums_as_matmuls(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert [n.op_type for n in out.graph.node] == ["Einsum"] and result.converted == ()
    assert result.notes == (("y", f"Einsum {equation!r}: {matmul_form(equation)}"),)
    assert prepare_graph(out, None)[1][0].op == "Einsum"


def test_an_integer_einsum_stays():
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.INT64, ["n", 3]) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    out, result = einsums_as_matmuls(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert [n.op_type for n in out.graph.node] == ["Einsum"]
    assert result.notes == (("y", "Einsum 'ij,jk->ik' on INT64: only float products are tuned"),)


def test_an_einsum_attention_export_is_fused_and_matches(tmp_path: Path):
    """torch.einsum attention (projections ``bsd,ed->bse``, scores ``bqhd,bkhd->bhqk``, output ``bhqk,bkhd->bqhd``)
    through the TorchScript exporter: the projections become one packed GEMM, the chain one fused Attention, and
    the optimized model gives the original outputs."""
    torch = pytest.importorskip("torch")
    from tuner.optimize import OptimizeOptions, optimize

    class Attention(torch.nn.Module):
        def __init__(self, d: int = 32, heads: int = 4) -> None:
            super().__init__()
            self.h, self.dh = heads, d // heads
            gen = torch.Generator().manual_seed(0)
            self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(d, d, generator=gen) * 0.1) for _ in range(3))
            self.wo = torch.nn.Linear(d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = (torch.einsum("bsd,ed->bse", x, w).view(b, s, self.h, self.dh) for w in (self.wq, self.wk, self.wv))
            p = (torch.einsum("bqhd,bkhd->bhqk", q, k) / self.dh ** 0.5).softmax(-1)
            return self.wo(torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d))

    src, dst = tmp_path / "einsum.onnx", tmp_path / "einsum.opt.onnx"
    torch.onnx.export(Attention().eval(), (torch.randn(2, 7, 32),), str(src), input_names=["x"], output_names=["y"],
                      dynamo=False, dynamic_axes={"x": {0: "batch", 1: "seq"}})
    assert sum(n.op_type == "Einsum" for n in onnx.load(str(src)).graph.node) == 5
    scanned = scan(src)
    assert not [s for s in scanned.skipped if s.op in ("Einsum", "MatMul")]
    optimize(src, dst, OptimizeOptions(dims=("batch=1,4", "seq=8:64:8"), measure="analytic", budget=4, progress=False,
                                       db=tmp_path / "t.db", cache_dir=tmp_path / "k"), log=lambda _: None)
    ops = sorted(n.op_type for n in onnx.load(str(dst)).graph.node if n.domain == "ai.dietcode")
    assert ops == ["MatMulBias", "MatMulPlain", "ScaledDotProductAttention"]  # Q/K/V in one projection, the chain, the output one
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    import dietcode_ort

    tuned = dietcode_ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for shape in ((1, 1, 32), (3, 20, 32), (2, 100, 32)):
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(tuned.run(None, {"x": x})[0], stock.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
