"""Shape expressions: any dim name an exporter writes works, and no text from a model is evaluated."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import sympy
from onnx import TensorProto, helper, numpy_helper

from tuner import shape_expr
from tuner.scan import scan, scan_model

ROOT = Path(__file__).resolve().parents[1]

# Names exporters write (Hugging Face: batch/sequence; TorchScript: input_ids_dynamic_axes_1; dynamo: s0;
# ORT: unk__123) and names that are sympy objects or Python keywords when sympified.
NAMES = ["sequence", "N", "E", "S", "I", "Q", "O", "beta", "lambda", "unk__123", "s0", "batch_size",
         "input_ids_dynamic_axes_1", "input.1", "seq-len", "batch size", "gamma", "pi", "oo", "zoo", "nan"]
HOSTILE = "__import__('os').system('touch pwned')"


def _dense_model(d0: str, d1: str, path: Path) -> Path:
    """x[d0, d1, 16] -> Reshape[-1, 16] -> MatMul[16, 32] -> Add(bias): M is d0*d1 only after inference."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([-1, 16], np.int64), "shape")]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["x2"], name="reshape"),
             helper.make_node("MatMul", ["x2", "w"], ["mm"], name="matmul"),
             helper.make_node("Add", ["mm", "b"], ["y"], name="bias")]
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [d0, d1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("name", NAMES)
def test_any_dim_name_scans_and_evaluates(tmp_path: Path, name: str) -> None:
    result = scan(_dense_model("batch", name, tmp_path / "m.onnx"), ["batch=1,2", f"{name}=3,5"])
    assert result.symbols == tuple(sorted(["batch", name]))
    (w,) = result.workloads
    assert set(w.symbols) == {"batch", name}
    assert shape_expr.free_names(w.m) == {"batch", name}
    assert sorted(p.m for p, _ in w.problems()) == [3, 5, 6, 10]


def test_names_round_trip_through_text() -> None:
    for name in NAMES + [HOSTILE]:
        expr = 2 * shape_expr.symbol(name) * shape_expr.symbol("batch") + 1
        text = shape_expr.to_text(expr)
        assert shape_expr.parse(text) == expr, text
        assert shape_expr.evaluate(text, {name: 3, "batch": 4}) == 25


@pytest.mark.parametrize("text, values, expected", [
    ("floor((height - 1)/2) + 1", {"height": 224}, 112),
    ("floor((height + 2*1 - 3)/2) + 1", {"height": 7}, 4),
    ("ceiling(seq/64)*64", {"seq": 65}, 128),
    ("ceil(seq/64)", {"seq": 64}, 1),
    ("seq // 3 + seq % 3", {"seq": 10}, 4),
    ("Mod(seq, 4) + mod(seq, 3)", {"seq": 10}, 3),
    ("Max(1, seq - 5) * min(seq, 2)", {"seq": 3}, 2),
    ("-seq + 3*seq", {"seq": 7}, 14),
    ("seq**2", {"seq": 9}, 81),
    ("`input-ids.1`*2", {"input-ids.1": 21}, 42),
])
def test_evaluate_is_exact(text: str, values: dict, expected: int) -> None:
    assert shape_expr.evaluate(text, values) == expected
    # The same value through sympy's algebra, so the canonical text means what the original did.
    canonical = shape_expr.to_text(shape_expr.parse(text))
    assert shape_expr.evaluate(canonical, values) == expected


@pytest.mark.parametrize("text", [
    HOSTILE, "x.y", "lambda: 1", "x if y else z", "f(x)", "open('x')", "1e5", "1.5", "x**100", "x**y",
    "9" * 40, "(" * 100 + "x" + ")" * 100, "+".join(["x"] * 500), "", "x +", "floor(x, y)", "mod(x)", "`a",
    "x; y", "__class__", "x[0]", "'x'",
])
def test_text_outside_the_grammar_is_refused(text: str) -> None:
    if text == "__class__":  # a plain name: read as a symbol, never as an attribute
        assert shape_expr.free_names(text) == {"__class__"}
        return
    with pytest.raises(shape_expr.ShapeExprError):
        shape_expr.parse(text)


def test_non_integer_and_missing_values_are_errors() -> None:
    with pytest.raises(shape_expr.ShapeExprError, match="not an integer"):
        shape_expr.evaluate("seq/2", {"seq": 3})
    with pytest.raises(shape_expr.ShapeExprError, match="needs a value for 'seq'"):
        shape_expr.evaluate("seq*batch", {"batch": 3})
    with pytest.raises(shape_expr.ShapeExprError, match="division by zero"):
        shape_expr.evaluate("batch // (seq - 3)", {"batch": 1, "seq": 3})


def test_scan_never_sympifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No text reaches sympy's parser: scanning a model with every kind of name works with it disabled."""
    module = sys.modules["sympy.core.sympify"]
    real = module.sympify

    def guarded(a, *args, **kwargs):
        if isinstance(a, str):
            raise AssertionError(f"sympify called on text {a!r}")
        return real(a, *args, **kwargs)

    monkeypatch.setattr(sympy, "sympify", guarded)
    monkeypatch.setattr(module, "sympify", guarded)
    from models import bert

    model = bert.build_graph(bert.PRESETS["tiny"], "float32", seed=0)
    result = scan_model(model)
    assert len(result.workloads) >= 4
    assert scan(_dense_model("sequence", "lambda", tmp_path / "m.onnx")).workloads


def test_crafted_dim_name_is_never_executed(tmp_path: Path) -> None:
    """The dim_param is a Python call: scan, optimize and inspect read it as a name and run nothing."""
    model = _dense_model("batch", HOSTILE, tmp_path / "hostile.onnx")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "dietcode_ort"]
    scanned = subprocess.run(run + ["scan", str(model), "--json"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
    assert scanned.returncode == 0, scanned.stderr
    assert json.loads(scanned.stdout)["symbols"] == sorted(["batch", HOSTILE])
    out = tmp_path / "hostile.dietcode.onnx"
    optimized = subprocess.run(run + ["optimize", str(model), "-o", str(out), "--dim", "batch=1,2",
                                      "--dim", f"{HOSTILE}=3", "--measure", "analytic", "--budget", "8",
                                      "--db", str(tmp_path / "db.sqlite"), "--quiet"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert optimized.returncode == 0, optimized.stderr
    inspected = subprocess.run(run + ["inspect", str(out)], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=300)
    assert inspected.returncode == 0, inspected.stderr
    assert not (tmp_path / "pwned").exists()


def test_dim_outside_the_grammar_leaves_the_node_with_the_reason(tmp_path: Path) -> None:
    result = scan(_dense_model("batch", "a`b", tmp_path / "m.onnx"))
    assert not result.workloads
    (skipped,) = result.skipped
    assert skipped.op == "MatMul" and "grammar" in skipped.reason and "a`b" in skipped.reason


def test_hugging_face_names_through_optimize(tmp_path: Path) -> None:
    """`batch` and `sequence` (what transformers' exporters write) through the whole tuner."""
    from tuner.optimize import OptimizeOptions, optimize

    model = _dense_model("batch", "sequence", tmp_path / "hf.onnx")
    out = tmp_path / "hf.dietcode.onnx"
    optimize(model, out, OptimizeOptions(dims=("batch=1,2", "sequence=3:9:3"), measure="analytic", budget=8,
                                         db=tmp_path / "db.sqlite", progress=False), log=lambda _: None)
    import onnxruntime as ort

    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert math.isclose(float(np.abs(got - want).max()), 0.0, abs_tol=1e-4)
