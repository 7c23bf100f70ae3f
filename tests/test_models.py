"""The benchmark model builders: they run in onnxruntime at many symbol values, in float32 and float16,
are deterministic under a seed, keep the exporter patterns the scanner relies on, and the CLI writes
files that load back. Only the tiny presets run; the big presets are checked for structure only.
"""
from __future__ import annotations

import functools
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import models
from models.__main__ import main as cli_main
from models.graph import save_model

ROOT = Path(__file__).resolve().parents[1]

TINY_DIMS: dict[str, list[dict[str, int]]] = {
    "bert": [{"batch": 1, "seq": 1}, {"batch": 1, "seq": 7}, {"batch": 3, "seq": 33}],
    "resnet50": [{"batch": 1, "height": 32, "width": 32}, {"batch": 3, "height": 48, "width": 40}],
    "mlp": [{"tokens": 1}, {"tokens": 5}, {"tokens": 130}],
    "mobilenet_v2": [{"batch": 1, "height": 32, "width": 32}, {"batch": 2, "height": 45, "width": 37}],
}
CASES = [(name, dims) for name, all_dims in TINY_DIMS.items() for dims in all_dims]
CASE_IDS = [f"{name}-{'x'.join(map(str, dims.values()))}" for name, dims in CASES]


def _expected_shape(name: str, dims: dict[str, int]) -> tuple[int, ...]:
    if name == "bert":
        return (dims["batch"], dims["seq"], models.MODELS["bert"].config("tiny").hidden)
    if name in ("resnet50", "mobilenet_v2"):
        return (dims["batch"], models.MODELS[name].config("tiny").classes)
    return (dims["tokens"], models.MODELS["mlp"].config("tiny").d_model)


@functools.lru_cache(maxsize=None)
def _session(name: str, dtype: str = "float32", seed: int = 0) -> ort.InferenceSession:
    model = models.build(name, "tiny", dtype, seed)
    return _load(model.SerializeToString())


def _load(model: bytes | str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def _run(name: str, dims: dict[str, int], dtype: str = "float32", seed: int = 0) -> np.ndarray:
    feeds = models.MODELS[name].example_inputs("tiny", dims, dtype, seed=1)
    return _session(name, dtype, seed).run(None, feeds)[0]


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("name", "dims"), CASES, ids=CASE_IDS)
def test_tiny_model_runs_at_each_symbol_value(name: str, dims: dict[str, int], dtype: str) -> None:
    out = _run(name, dims, dtype)
    assert out.shape == _expected_shape(name, dims)
    assert out.dtype == np.dtype(dtype)
    assert np.isfinite(out).all()
    assert float(np.abs(out).max()) > 1e-3  # not a graph that collapsed to zeros


@pytest.mark.parametrize("name", list(models.MODELS))
def test_float16_model_tracks_float32(name: str) -> None:
    dims = TINY_DIMS[name][-1]
    ref = _run(name, dims, "float32").astype(np.float32)
    half = _run(name, dims, "float16").astype(np.float32)
    assert np.abs(half - ref).max() <= 0.02 * np.abs(ref).max() + 1e-3


@pytest.mark.parametrize("name", list(models.MODELS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_inputs_outputs_and_checker(name: str, dtype: str) -> None:
    model = models.build(name, "tiny", dtype)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    builder = models.MODELS[name]
    symbols = {d for vi in model.graph.input for d in _dims(vi) if isinstance(d, str)}
    assert symbols == set(builder.symbols)
    float_type = onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.FLOAT
    for vi in [*model.graph.input, *model.graph.output]:
        expected = onnx.TensorProto.INT64 if vi.name in ("input_ids", "attention_mask") else float_type
        assert vi.type.tensor_type.elem_type == expected, vi.name
    assert {t.data_type for t in model.graph.initializer} <= {float_type, onnx.TensorProto.INT64}


def test_batch_rows_are_independent() -> None:
    """Row i of a batch-3 run equals a batch-1 run of row i: batch is a real, free dim."""
    cases = (("bert", {"batch": 3, "seq": 7}), ("resnet50", {"batch": 3, "height": 40, "width": 36}),
             ("mobilenet_v2", {"batch": 3, "height": 33, "width": 40}))
    for name, dims in cases:
        feeds = models.MODELS[name].example_inputs("tiny", dims, seed=5)
        full = _session(name).run(None, feeds)[0]
        for row in range(3):
            one = _session(name).run(None, {k: v[row:row + 1] for k, v in feeds.items()})[0]
            np.testing.assert_allclose(one[0], full[row], rtol=1e-4, atol=1e-5)


def test_bert_mask_hides_padded_tokens() -> None:
    feeds = models.MODELS["bert"].example_inputs("tiny", {"batch": 2, "seq": 9}, seed=2)
    feeds["attention_mask"][1, 5:] = 0
    base = _session("bert").run(None, feeds)[0]
    padded = {k: v.copy() for k, v in feeds.items()}
    padded["input_ids"][1, 5:] = (padded["input_ids"][1, 5:] + 17) % 1000
    out = _session("bert").run(None, padded)[0]
    np.testing.assert_allclose(out[1, :5], base[1, :5], rtol=1e-5, atol=1e-5)
    visible = {k: v.copy() for k, v in feeds.items()}
    visible["input_ids"][1, 2] = (visible["input_ids"][1, 2] + 17) % 1000
    assert np.abs(_session("bert").run(None, visible)[0][1, 0] - base[1, 0]).max() > 1e-3


def test_mlp_matches_numpy_reference() -> None:
    model = models.build("mlp", "tiny", seed=4)
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    x = models.MODELS["mlp"].example_inputs("tiny", {"tokens": 6})["hidden"]
    gate, up = x @ w["mlp.gate_proj.weight"], x @ w["mlp.up_proj.weight"]
    ref = (gate / (1 + np.exp(-gate)) * up) @ w["mlp.down_proj.weight"]
    np.testing.assert_allclose(_session("mlp", seed=4).run(None, {"hidden": x})[0], ref, rtol=1e-4, atol=1e-5)


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("name", list(models.MODELS))
def test_seed_determines_weights(name: str) -> None:
    a, b = models.build(name, "tiny", seed=7), models.build(name, "tiny", seed=7)
    assert a.SerializeToString() == b.SerializeToString()
    wa, wc = _weights(a), _weights(models.build(name, "tiny", seed=8))
    random_names = [k for k, v in wa.items() if v.dtype == np.float32 and v.size > 1 and v.std() > 0]
    assert random_names and all(not np.array_equal(wa[k], wc[k]) for k in random_names)
    half = _weights(models.build(name, "tiny", "float16", seed=7))
    for k in random_names:  # float16 weights are the float32 ones rounded
        np.testing.assert_array_equal(half[k], wa[k].astype(np.float16))


def test_bert_exporter_patterns() -> None:
    model = models.build("bert", "tiny")
    cfg = models.MODELS["bert"].config("tiny")
    producer = {o: n for n in model.graph.node for o in n.output}
    weights = {t.name for t in model.graph.initializer}
    ops = Counter(n.op_type for n in model.graph.node)
    # Every Reshape takes its shape from Concat(Unsqueeze(Gather(Shape(x))), ..., constants).
    reshapes = [n for n in model.graph.node if n.op_type == "Reshape"]
    assert len(reshapes) == 4 * cfg.layers
    for r in reshapes:
        concat = producer[r.input[1]]
        assert concat.op_type == "Concat"
        chains = [producer[i] for i in concat.input if i in producer]
        assert len(chains) == 2
        for unsq in chains:
            gather = producer[unsq.input[0]]
            assert (unsq.op_type, gather.op_type, producer[gather.input[0]].op_type) == \
                ("Unsqueeze", "Gather", "Shape")
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    dense = [m for m in matmuls if m.input[1] in weights]
    attn = [m for m in matmuls if m.input[1] not in weights]
    assert (len(dense), len(attn)) == (6 * cfg.layers, 2 * cfg.layers)
    consumers = {i: n for n in model.graph.node for i in n.input}
    assert all(consumers[m.output[0]].op_type == "Add" for m in dense)  # bias Add after every dense MatMul
    assert all(producer[m.input[0]].op_type == "Softmax" for m in attn[1::2])
    assert ops["LayerNormalization"] == 1 + 2 * cfg.layers
    assert ops["Erf"] == cfg.layers and "Gelu" not in ops
    assert ops["Range"] == 1 and ops["Softmax"] == cfg.layers


def test_big_presets_structure() -> None:
    """base / full / llama-7b-layer: graph structure and symbolic inputs, never run."""
    bert = models.build("bert", "base", "float16")
    matmuls = [n for n in bert.graph.node if n.op_type == "MatMul"]
    weights = {t.name for t in bert.graph.initializer}
    assert sum(m.input[1] in weights for m in matmuls) == 12 * 6
    assert sum(m.input[1] not in weights for m in matmuls) == 24
    assert [_dims(vi) for vi in bert.graph.input] == [["batch", "seq"], ["batch", "seq"]]
    assert _dims(bert.graph.output[0]) == ["batch", "seq", 768]
    onnx.checker.check_model(bert)
    del bert

    resnet = models.build("resnet50", "full", "float16")
    ops = Counter(n.op_type for n in resnet.graph.node)
    assert (ops["Conv"], ops["Add"], ops["Gemm"], ops["MaxPool"]) == (1 + 16 * 3 + 4, 16, 1, 1)
    assert _dims(resnet.graph.input[0]) == ["batch", 3, "height", "width"]
    assert _dims(resnet.graph.output[0]) == ["batch", 1000]
    gemm = next(n for n in resnet.graph.node if n.op_type == "Gemm")
    assert onnx.helper.get_attribute_value(next(a for a in gemm.attribute if a.name == "transB")) == 1
    onnx.checker.check_model(resnet)
    del resnet

    # torchvision's MobileNetV2: 52 convs (17 of them depthwise, group = channels), 10 residual Adds, 3.5M weights
    mobile = models.build("mobilenet_v2", "full", "float16")
    convs = [n for n in mobile.graph.node if n.op_type == "Conv"]
    groups = [onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "group")) for n in convs]
    weights = {t.name: tuple(t.dims) for t in mobile.graph.initializer}
    assert (len(convs), sum(g > 1 for g in groups)) == (52, 17)
    assert all(weights[n.input[1]][0] == g and weights[n.input[1]][1] == 1 for n, g in zip(convs, groups) if g > 1)
    assert Counter(n.op_type for n in mobile.graph.node)["Add"] == 10
    assert sum(int(np.prod(d)) for d in weights.values()) == 3_487_818  # torchvision: 3,504,872 with BN's
    assert _dims(mobile.graph.output[0]) == ["batch", 1000]
    onnx.checker.check_model(mobile)
    del mobile

    mlp = models.build("mlp", "llama-7b-layer", "float16")
    shapes = {t.name: tuple(t.dims) for t in mlp.graph.initializer}
    assert sorted(shapes.values()) == [(4096, 11008), (4096, 11008), (11008, 4096)]
    assert _dims(mlp.graph.input[0]) == ["tokens", 4096]
    onnx.checker.check_model(mlp)


def test_cli_writes_a_model_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "mlp.onnx"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-m", "models", "mlp", "--preset", "tiny", "-o", str(out),
                           "--dtype", "float16", "--seed", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    saved = onnx.load(str(out))
    assert saved.ir_version == 10
    assert _weights(saved).keys() == _weights(models.build("mlp", "tiny", "float16", 3)).keys()
    for k, v in _weights(models.build("mlp", "tiny", "float16", 3)).items():
        np.testing.assert_array_equal(_weights(saved)[k], v)
    feeds = models.MODELS["mlp"].example_inputs("tiny", {"tokens": 9}, "float16")
    np.testing.assert_array_equal(_load(str(out)).run(None, feeds)[0],
                                  _session("mlp", "float16", 3).run(None, feeds)[0])


def test_external_data_round_trip(tmp_path: Path) -> None:
    model = models.build("bert", "tiny")
    path, data = tmp_path / "bert.onnx", tmp_path / "bert.onnx.data"
    big = sum(len(t.raw_data) for t in model.graph.initializer if len(t.raw_data) >= 1024)
    sizes = []
    for _ in range(2):  # saving again must not grow the data file (onnx appends to an existing one)
        save_model(model, path, external_threshold=0)
        sizes.append(data.stat().st_size)
    assert sizes[0] == sizes[1] and big <= sizes[0] < big + 1_000_000
    assert path.stat().st_size < 100_000
    assert all(len(t.raw_data) > 0 for t in model.graph.initializer)  # the caller's model keeps its weights
    feeds = models.MODELS["bert"].example_inputs("tiny", {"batch": 2, "seq": 5})
    np.testing.assert_array_equal(_load(str(path)).run(None, feeds)[0], _session("bert").run(None, feeds)[0])
    save_model(model, path)  # under the protobuf limit: one self-contained file
    assert not data.exists() and path.stat().st_size > big


@pytest.mark.parametrize(("argv", "allowed"), [
    (["nope", "--preset", "tiny", "-o", "x.onnx"], "bert, resnet50, mlp, mobilenet_v2"),
    (["bert", "--preset", "huge", "-o", "x.onnx"], "tiny, base"),
    (["resnet50", "--preset", "tiny", "--dtype", "int8", "-o", "x.onnx"], "float32, float16"),
    (["mlp", "-o", "x.onnx"], "tiny, llama-7b-layer"),
])
def test_cli_bad_input_is_one_line(argv: list[str], allowed: str, capsys: pytest.CaptureFixture[str],
                                   tmp_path: Path) -> None:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and allowed in err
    assert not (tmp_path / "x.onnx").exists()


def test_cli_subprocess_error_and_list() -> None:
    bad = subprocess.run([sys.executable, "-m", "models", "gpt", "--preset", "tiny", "-o", "x.onnx"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "error: unknown model 'gpt'; allowed: bert, resnet50, mlp, mobilenet_v2"
    listed = subprocess.run([sys.executable, "-m", "models", "--list"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0
    for name in models.MODELS:
        assert any(line.startswith(f"{name}: presets {', '.join(models.presets(name))}")
                   for line in listed.stdout.splitlines())
