"""``dietcode-ort bench``: shapes, inputs, agreement check, interleaving, bad input, JSON and plot.

Tiny models built here with onnx.helper; the "optimized" model is a copy (or a deliberately wrong
variant) of the original, run without the custom-op library (a no-op register).
"""
from __future__ import annotations

import functools
import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dietcode_ort import bench, bench_report
from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError

FAST = dict(repeat=3, warmup=1)


def _no_register(_options: object) -> None:
    return None


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def _mlp(path: Path, scale: float = 1.0, dtype: int = TensorProto.FLOAT, name: str = "hidden",
         dims: tuple = ("tokens", 8)) -> Path:
    """hidden [tokens, 8] -> MatMul(W) + b -> Relu -> y [tokens, 4]."""
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 4)) * scale).astype(np_dtype), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np_dtype), "b")
    nodes = [helper.make_node("MatMul", [name, "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["pre"]),
             helper.make_node("Relu", ["pre"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(name, dtype, list(dims))],
                              [helper.make_tensor_value_info("y", dtype, [dims[0], 4])], [w, b])
    return _save(graph, path)


def _encoder(path: Path, vocab: int = 50) -> Path:
    """input_ids, attention_mask int64 [batch, seq] -> embedding (Gather) * mask -> MatMul -> y."""
    rng = np.random.default_rng(1)
    emb = numpy_helper.from_array(rng.standard_normal((vocab, 8)).astype(np.float32), "emb")
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["e"]),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "axes"], ["mu"]),
             helper.make_node("Mul", ["e", "mu"], ["em"]),
             helper.make_node("MatMul", ["em", "w"], ["y"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
              for n in ("input_ids", "attention_mask")]
    graph = helper.make_graph(nodes, "enc", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
                              [emb, w, axes])
    return _save(graph, path)


def _reshape_model(path: Path) -> Path:
    """x [batch, 8] -> Reshape to the constant [2, 8]: only batch=2 runs."""
    shape = numpy_helper.from_array(np.array([2, 8], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "rs",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [shape])
    return _save(graph, path)


def _options(model: Path, optimized: Path, tmp_path: Path, **kw: object) -> bench.BenchOptions:
    return bench.BenchOptions(model=model, optimized=optimized, command="dietcode-ort bench test",
                              **{**FAST, **kw})  # type: ignore[arg-type]


# --- end to end on tiny models ------------------------------------------------------------------------

def test_json_schema_and_plot(tmp_path: Path) -> None:
    model = _mlp(tmp_path / "m.onnx")
    opts = _options(model, model, tmp_path, dims=("tokens=1,3,5",), json_path=tmp_path / "r.json",
                    plot_path=tmp_path / "r.png")
    report = bench.run_bench(opts, register=_no_register)
    bench_report.write_json(report, opts.json_path)
    bench_report.write_plot(report, opts.plot_path)
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) == {"schema", "environment", "settings", "optimized_custom_nodes", "shapes", "summary"}
    env = data["environment"]
    for key in ("device", "provider", "onnxruntime", "numpy", "python", "dietcode_ort", "command", "date"):
        assert isinstance(env[key], str) and env[key], key
    assert env["provider"] == "cpu" and env["command"] == "dietcode-ort bench test"
    # tokens has no value below 1: the warm-up takes a gap of the sweep, never a value past the largest given
    assert data["settings"]["repeat"] == 3 and data["settings"]["warmup_shape"] == {"tokens": 2}
    assert [s["dims"] for s in data["shapes"]] == [{"tokens": 1}, {"tokens": 3}, {"tokens": 5}]
    for shape in data["shapes"]:
        for side in ("stock", "optimized"):
            t = shape[side]
            assert len(t["times_ms"]) == 3 and all(isinstance(v, float) and v > 0 for v in t["times_ms"])
            assert t["median_ms"] == pytest.approx(float(np.median(t["times_ms"])))
            assert t["p90_ms"] >= t["median_ms"] and isinstance(t["first_call_ms"], float)
        ratio = shape["stock"]["median_ms"] / shape["optimized"]["median_ms"]
        assert shape["speedup_of_medians"] == pytest.approx(ratio)
        paired = np.median(np.array(shape["stock"]["times_ms"]) / np.array(shape["optimized"]["times_ms"]))
        assert shape["speedup"] == pytest.approx(paired)
        assert shape["max_abs_error"] == {"y": 0.0}
    assert data["summary"]["worst"]["speedup"] == min(s["speedup"] for s in data["shapes"])
    assert isinstance(data["summary"]["geomean_speedup"], float)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_with_two_swept_symbols(tmp_path: Path) -> None:
    model = _encoder(tmp_path / "e.onnx")
    report = bench.run_bench(_options(model, model, tmp_path, dims=("batch=1,2", "seq=4,8")),
                             register=_no_register)
    assert [dict(s.dims) for s in report.shapes] == [{"batch": 1, "seq": 4}, {"batch": 1, "seq": 8},
                                                     {"batch": 2, "seq": 4}, {"batch": 2, "seq": 8}]
    bench_report.write_plot(report, tmp_path / "p" / "plot.png")
    assert (tmp_path / "p" / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_wrong_weight_fails_the_agreement_check(tmp_path: Path) -> None:
    model, wrong = _mlp(tmp_path / "m.onnx"), _mlp(tmp_path / "bad.onnx", scale=1.5)
    with pytest.raises(DietcodeError, match=r"disagrees .* shape tokens=2: output 'y' max abs error"):
        bench.run_bench(_options(model, wrong, tmp_path, dims=("tokens=2",)), register=_no_register)


def test_agreement_tolerance_depends_on_dtype() -> None:
    ref = np.linspace(-1, 1, 16, dtype=np.float32)
    assert bench.check_agreement("s", {"y": ref}, {"y": ref + 5e-4})["y"] == pytest.approx(5e-4, rel=1e-2)
    with pytest.raises(DietcodeError, match=r"float32: rtol=0.001"):
        bench.check_agreement("s", {"y": ref}, {"y": ref + 1e-2})
    half = ref.astype(np.float16)
    bench.check_agreement("s", {"y": half}, {"y": half + np.float16(1e-2)})
    with pytest.raises(DietcodeError, match="float16"):
        bench.check_agreement("s", {"y": half}, {"y": half + np.float16(0.1)})
    with pytest.raises(DietcodeError, match=r"output 'y' is float32\[8\]"):
        bench.check_agreement("s", {"y": ref}, {"y": ref[:8]})


def test_agreement_tolerance_follows_a_narrower_compute_dtype(tmp_path: Path) -> None:
    """A float16 model with float32 inputs and outputs (keep_io_types conversion: Casts around a float16 graph)
    is checked at float16's tolerance on its float32 outputs: fused epilogues round once where the original
    rounds after every node. Integer outputs stay exact; a plain float32 model keeps float32's tolerance."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    plain = _mlp(tmp_path / "m.onnx")
    converted = tmp_path / "c.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(plain)), keep_io_types=True), str(converted))
    info = bench.load_model_info(converted)
    assert [s.dtype for s in info.inputs] == ["float32"] and info.computes_in == "float16"
    assert bench.load_model_info(plain).computes_in == ""
    ref = np.linspace(-1, 1, 16, dtype=np.float32)
    bench.check_agreement("s", {"y": ref}, {"y": ref + 1e-2}, computes_in="float16")
    with pytest.raises(DietcodeError, match=r"tolerance for float16: rtol=0.02"):
        bench.check_agreement("s", {"y": ref}, {"y": ref + 0.1}, computes_in="float16")
    with pytest.raises(DietcodeError, match=r"tolerance for float32"):
        bench.check_agreement("s", {"y": ref}, {"y": ref + 1e-2}, computes_in="")
    ids = np.arange(4)
    with pytest.raises(DietcodeError, match=r"tolerance for int64"):
        bench.check_agreement("s", {"i": ids}, {"i": ids + 1}, computes_in="float16")


def _classifier(path: Path, scale: float = 1.0) -> Path:
    """x [n, 4] -> MatMul -> Softmax -> ZipMap: a list of {label: probability}, as skl2onnx writes classifiers."""
    w = numpy_helper.from_array((np.arange(12, dtype=np.float32).reshape(4, 3) / 10 * scale), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"]), helper.make_node("Softmax", ["logits"], ["p"]),
             helper.make_node("ZipMap", ["p"], ["probs"], domain="ai.onnx.ml", classlabels_int64s=[0, 1, 2])]
    probs = helper.make_value_info("probs", helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))))
    graph = helper.make_graph(nodes, "clf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [probs], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def test_outputs_that_are_no_tensors_are_compared_item_by_item(tmp_path: Path) -> None:
    """A ZipMap output (a sequence of maps) is compared per item and key; it was an internal error."""
    model = _classifier(tmp_path / "c.onnx")
    report = bench.run_bench(_options(model, model, tmp_path, dims=("n=1,3",)), register=_no_register)
    assert all(dict(r.max_abs_error)["probs"] == 0.0 for r in report.shapes)
    with pytest.raises(DietcodeError, match=r"disagrees .* output 'probs' max abs error"):
        bench.run_bench(_options(model, _classifier(tmp_path / "bad.onnx", scale=2.0), tmp_path, dims=("n=2",)),
                        register=_no_register)
    ref = [{0: np.float32(0.5), 1: np.float32(0.5)}]
    with pytest.raises(DietcodeError, match="another structure"):
        bench.check_agreement("s", {"probs": ref}, {"probs": [{0: np.float32(0.5), 2: np.float32(0.5)}]})


def test_fp16_model_gets_fp16_inputs(tmp_path: Path) -> None:
    model = _mlp(tmp_path / "h.onnx", dtype=TensorProto.FLOAT16)
    info = bench.load_model_info(model)
    feeds = bench.make_feeds(info, {"tokens": 5}, seed=0)
    assert feeds["hidden"].dtype == np.float16 and feeds["hidden"].shape == (5, 8)
    report = bench.run_bench(_options(model, model, tmp_path, dims=("tokens=4",)), register=_no_register)
    assert report.shapes[0].stock.first_call is not None


def test_feeds_ids_in_vocab_masks_with_trailing_zeros_and_seeded(tmp_path: Path) -> None:
    info = bench.load_model_info(_encoder(tmp_path / "e.onnx", vocab=37))
    assert dict(info.vocab) == {"input_ids": 37} and info.symbols == ["batch", "seq"]
    feeds = bench.make_feeds(info, {"batch": 3, "seq": 16}, seed=4)
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    assert ids.dtype == np.int64 and ids.shape == (3, 16) and 0 <= ids.min() and ids.max() < 37
    assert mask.dtype == np.int64 and set(np.unique(mask)) == {0, 1}
    for row in mask:  # ones, then a few zeros at the end
        zeros = int((row == 0).sum())
        assert 1 <= zeros <= 3 and (row[16 - zeros:] == 0).all() and (row[:16 - zeros] == 1).all()
    again = bench.make_feeds(info, {"batch": 3, "seq": 16}, seed=4)
    assert np.array_equal(again["input_ids"], ids)
    assert not np.array_equal(bench.make_feeds(info, {"batch": 3, "seq": 16}, seed=5)["input_ids"], ids)


def test_sweep_defaults_ties_and_unknown_symbols() -> None:
    symbols = ["batch", "height", "width"]
    shapes = bench.sweep(symbols, ["height=32,64"], ["width=height"])
    assert shapes == [{"batch": 1, "height": 32, "width": 32}, {"batch": 1, "height": 64, "width": 64}]
    assert bench.sweep(["batch", "seq", "other"], []) == [{"batch": 1, "seq": 128, "other": 1}]
    # batch, a default bench chose, may go past its 1; height's values were given (bounded)
    assert bench.warmup_shape(shapes, ["width=height"], bounded=["height"]) == {"batch": 2, "height": 31, "width": 31}
    assert bench.warmup_shape(shapes, ["width=height"]) == {"batch": 1, "height": 31, "width": 31}  # all bounded
    with pytest.raises(DietcodeError, match="symbol 'seq'.*batch, height, width"):
        bench.sweep(symbols, ["seq=1:4"])
    with pytest.raises(DietcodeError, match="not a dim"):
        bench.sweep(symbols, [], ["depth=height"])
    with pytest.raises(DietcodeError, match="must not be swept"):
        bench.sweep(symbols, ["width=4"], ["width=height"])


def test_a_huge_sweep_says_how_many_shapes_bench_runs(caplog: pytest.LogCaptureFixture) -> None:
    """Past MAX_INSTANCES shapes bench runs evenly spaced ones, and its notes say so in bench's words (the tuner's
    parser words them as tuning); the warm-up shape stays within the values given."""
    caplog.set_level(logging.WARNING)
    shapes = bench.sweep(["batch", "seq"], ["batch=1:100000", "seq=16:100000"])
    assert len(shapes) == 1024
    assert "--dim: 1048576 combinations of batch, seq; benchmarking 1024 of them" in caplog.text
    assert "--dim batch: 100000 values; benchmarking 1024 evenly spaced ones" in caplog.text
    assert "tuning" not in caplog.text
    warm = bench.warmup_shape(shapes, bounded=["batch", "seq"])
    assert warm == {"batch": 2, "seq": 15}  # batch: a gap between the bucketed values; seq: below the sweep
    assert all(s["batch"] != warm["batch"] and s["seq"] != warm["seq"] for s in shapes)


@pytest.mark.parametrize("dims, bounded, want", [
    (["tokens=1:4"], ["tokens"], 1),       # no unseen value in 1..4: a swept one, not 5
    (["tokens=1:4"], [], 5),               # a default's: one past (bench chose the values, not the user)
    (["tokens=1,2,8"], ["tokens"], 3),     # the smallest gap
    (["tokens=0,7"], ["tokens"], 1),       # an empty past and 7: 1, not 0 (an empty tensor warms nothing)
    (["tokens=0,1"], ["tokens"], 1),
    (["tokens=0"], ["tokens"], 0),         # nothing else given
    (["tokens=5,9"], ["tokens"], 4),       # below the sweep
])
def test_the_warmup_shape_never_exceeds_the_largest_value_given(dims: list[str], bounded: list[str],
                                                                want: int) -> None:
    shapes = bench.sweep(["tokens"], dims)
    warm = bench.warmup_shape(shapes, bounded=bounded)
    assert warm == {"tokens": want}
    if bounded:
        assert warm["tokens"] <= max(s["tokens"] for s in shapes)


def test_a_swept_shape_the_warmup_ran_has_no_first_call() -> None:
    """A warm-up shape bounded to the values given can be one of the swept shapes (``--dim n=1:2``): that shape's
    first call was the warm-up run, so it is left out, as when the model rejects the warm-up shape."""
    log: list = []
    clock = _Clock()
    stock, opt = _Recorder("A", 2.0, log, clock), _Recorder("B", 1.0, log, clock)
    shapes = [{"n": 1}, {"n": 2}]
    warm = bench.warmup_shape(shapes)
    assert warm == {"n": 1}
    results = bench.measure(stock, opt, shapes, lambda s: {"x": np.zeros(s["n"])}, repeat=1, warmup=0,
                            warm_shape=warm, clock=clock)
    assert log[:2] == [("A", 1), ("B", 1)]
    assert results[0].stock.first_call is None and results[0].optimized.first_call is None
    assert results[1].stock.first_call == 2.0 and results[1].optimized.first_call == 1.0


def test_a_tie_to_a_sum_gives_a_merged_decoders_mask_length() -> None:
    """A merged decoder's attention mask spans the past and the new tokens: its length is the sum of two swept
    symbols (stock ORT refuses any other), in the sweep and in the warm-up shape."""
    symbols = ["batch", "past", "seq", "mask_len"]
    shapes = bench.sweep(symbols, ["past=0,7", "seq=1,4"], ["mask_len=past+seq"])
    assert [(s["past"], s["seq"], s["mask_len"]) for s in shapes] == [(0, 1, 1), (0, 4, 4), (7, 1, 8), (7, 4, 11)]
    warm = bench.warmup_shape(shapes, ["mask_len=past+seq"])
    assert warm["mask_len"] == warm["past"] + warm["seq"]
    assert bench.sweep(symbols, ["seq=3"], ["mask_len=seq+2"])[0]["mask_len"] == 5
    for bad in ("mask_len=past+", "mask_len=", "mask_len=past+depth"):
        with pytest.raises(DietcodeError, match="bad --tie|not a dim"):
            bench.sweep(symbols, ["seq=3"], [bad])
    with pytest.raises(DietcodeError, match="must not be tied itself"):
        bench.sweep(symbols, ["seq=3"], ["mask_len=past+seq", "past=seq"])


# --- the measuring protocol, with a recording runner and a fake clock ---------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Recorder:
    """A runner whose calls log (model, shape) and advance the fake clock by a fixed cost."""

    def __init__(self, name: str, cost: float, log: list, clock: _Clock) -> None:
        self.name, self.cost, self.log, self.clock = name, cost, log, clock

    def prepare(self, feeds):  # type: ignore[no-untyped-def]
        runner, shape = self, int(feeds["x"].shape[0])

        class Call:
            def run(self) -> None:
                runner.log.append((runner.name, shape))
                runner.clock.now += runner.cost

            def outputs(self) -> dict[str, np.ndarray]:
                return {"y": np.zeros(shape, np.float32)}
        return Call()


def test_dims_the_graph_makes_equal_follow_the_swept_one() -> None:
    """``x[batch, n] + y[batch, m]``: scan keeps ``n`` for both (``{"m": "n"}``); whichever of them --dim sweeps,
    the other follows, and a dim found equal to a size takes it. Both swept is an error; a set a --tie names is the
    user's."""
    merged = {"m": "n", "p": "n", "k": 16}
    assert bench.merged_ties(merged, ["m=8,16"], []) == ("n=m", "p=m", "k=16")
    assert bench.merged_ties(merged, ["n=8"], []) == ("m=n", "p=n", "k=16")
    assert bench.merged_ties(merged, ["batch=2", "k=16"], []) == ("m=n", "p=n")
    assert bench.merged_ties(merged, ["m=8"], ["p=4", "n=m"]) == ("k=16",)
    assert bench.merged_ties(merged, [], ["q=k+1"]) == ("m=n", "p=n")
    with pytest.raises(DietcodeError, match="both 'n' and 'm', which the graph makes equal.*--tie NAME=SIZE"):
        bench.merged_ties(merged, ["n=8", "m=8"], [])
    shapes = bench.sweep(["batch", "k", "m", "n", "p"], ["m=8,16"], bench.merged_ties(merged, ["m=8,16"], []))
    assert [(s["m"], s["n"], s["p"], s["k"]) for s in shapes] == [(8, 8, 8, 16), (16, 16, 16, 16)]


def _two_inputs(path: Path) -> Path:
    """x [batch, n, 8] + y [batch, m, 8] -> MatMul: the Add makes n and m one dim (a seq the exporter named
    twice); stock ORT refuses n != m unless one is 1."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("MatMul", ["s", "w"], ["out"])]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n", 8]),
                                             helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "m", 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], [w])
    return _save(graph, path)


def test_bench_ties_the_dims_the_graph_makes_equal(tmp_path: Path) -> None:
    """Sweeping ``m`` alone used to leave ``n`` at its default 1, so bench timed broadcasts of one row, not the
    shapes asked for; now ``n`` follows, in the shapes, the warm-up shape and the settings."""
    model = _two_inputs(tmp_path / "two.onnx")
    report = bench.run_bench(_options(model, model, tmp_path, dims=("m=3,5",)), register=_no_register)
    assert [dict(r.dims) for r in report.shapes] == [{"batch": 1, "m": 3, "n": 3}, {"batch": 1, "m": 5, "n": 5}]
    assert report.settings["ties"] == ["n=m"] and report.settings["merged_dims"] == {"m": "n"}
    assert report.settings["warmup_shape"]["n"] == report.settings["warmup_shape"]["m"]
    with pytest.raises(DietcodeError, match="which the graph makes equal"):
        bench.run_bench(_options(model, model, tmp_path, dims=("m=3", "n=3")), register=_no_register)
    report = bench.run_bench(_options(model, model, tmp_path, dims=("m=3",), ties=("n=1",)), register=_no_register)
    assert [dict(r.dims) for r in report.shapes] == [{"batch": 1, "m": 3, "n": 1}]  # a broadcast, as asked


def test_measure_warms_up_checks_first_then_interleaves_abba() -> None:
    log: list = []
    clock = _Clock()
    stock, opt = _Recorder("A", 2.0, log, clock), _Recorder("B", 1.0, log, clock)
    shapes = [{"n": 3}, {"n": 5}]
    results = bench.measure(stock, opt, shapes, lambda s: {"x": np.zeros(s["n"])}, repeat=4, warmup=2,
                            warm_shape={"n": 7}, clock=clock)
    assert log[:2] == [("A", 7), ("B", 7)]                      # one warm-up run each, on another shape
    assert log[2:6] == [("A", 3), ("B", 3), ("B", 5), ("A", 5)]  # first calls of every shape, alternating
    steady = log[6:]
    assert [m for m, n in steady if n == 3] == list("ABBA" * 3)  # (2 warm-up + 4 timed) x 2 models
    assert [m for m, n in steady if n == 5] == list("ABBA" * 3)
    assert [n for _, n in steady] == [3] * 12 + [5] * 12
    for r in results:
        assert r.stock.times == (2.0,) * 4 and r.optimized.times == (1.0,) * 4
        assert r.stock.first_call == 2.0 and r.optimized.first_call == 1.0 and r.speedup == 2.0


def test_speedup_pairs_the_calls_of_each_iteration() -> None:
    """Both models' calls fall into the same two latency modes, in the same iterations but for two: the
    medians land in different modes (a 0.71x "slowdown"), the per-iteration ratios say they are equal."""
    stock = (0.05,) * 26 + (0.07,) * 24
    optimized = (0.05,) * 24 + (0.07,) * 26
    same = bench.ShapeResult((("t", 1),), bench.Timing(stock, None), bench.Timing(optimized, None), ())
    assert same.speedup_of_medians == pytest.approx(0.05 / 0.07)
    assert same.speedup == pytest.approx(1.0)
    faster = bench.ShapeResult((("t", 1),), bench.Timing(stock, None),
                               bench.Timing(tuple(t / 2 for t in stock), None), ())
    assert faster.speedup == pytest.approx(2.0) and faster.speedup_of_medians == pytest.approx(2.0)
    unpaired = bench.ShapeResult((("t", 1),), bench.Timing(stock, None), bench.Timing(optimized[:3], None), ())
    assert unpaired.speedup == unpaired.speedup_of_medians == pytest.approx(0.05 / 0.05)


def test_measure_falls_back_when_the_warmup_shape_is_rejected(tmp_path: Path) -> None:
    model = _reshape_model(tmp_path / "r.onnx")
    report = bench.run_bench(_options(model, model, tmp_path, dims=("batch=2",)), register=_no_register)
    (only,) = report.shapes
    assert only.stock.first_call is None and only.optimized.first_call is None
    assert len(only.stock.times) == 3
    assert bench.BenchReport(report.environment, report.settings, report.shapes).as_json()[
        "shapes"][0]["stock"]["first_call_ms"] is None


# --- bad input ----------------------------------------------------------------------------------------

def test_shape_the_model_rejects_is_named(tmp_path: Path) -> None:
    model = _reshape_model(tmp_path / "r.onnx")
    with pytest.raises(DietcodeError, match=r"stock model rejects shape batch=3: .*"):
        bench.run_bench(_options(model, model, tmp_path, dims=("batch=2,3",)), register=_no_register)


def test_unknown_and_unavailable_provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp(tmp_path / "m.onnx")
    with pytest.raises(DietcodeError, match="unknown provider 'rocm'; choose one of cpu, cuda"):
        bench.run_bench(_options(model, model, tmp_path, provider="rocm"), register=_no_register)
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(DietcodeError, match="'cuda' is not available .*available: CPUExecutionProvider"):
        bench.run_bench(_options(model, model, tmp_path, provider="cuda"), register=_no_register)


def test_cuda_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    model = _mlp(tmp_path / "m.onnx")
    try:
        bench.OrtRunner(model, "cuda")
    except DietcodeError as exc:
        assert "CUDAExecutionProvider could not be initialised" in str(exc)
    else:
        pytest.skip("CUDA works here")


@pytest.mark.parametrize("variant, message", [
    (dict(name="h2"), r"inputs \['h2'\] do not match the original's \['hidden'\]"),
    (dict(dtype=TensorProto.FLOAT16),
     "input 'hidden': original is float32 rank 2, optimized is float16 rank 2"),
    (dict(dims=("tokens", 8, 1)), "original is float32 rank 2, optimized is float32 rank 3"),
])
def test_optimized_inputs_must_match(tmp_path: Path, variant: dict, message: str) -> None:
    model = _mlp(tmp_path / "m.onnx")
    if "dims" in variant:  # only the declared input changes: the check runs before any session
        other = _mlp(tmp_path / "o.onnx")
        proto = onnx.load(str(other))
        proto.graph.input[0].type.tensor_type.shape.dim.add().dim_value = 1
        onnx.save(proto, str(other))
    else:
        other = _mlp(tmp_path / "o.onnx", **variant)
    with pytest.raises(DietcodeError, match=message):
        bench.run_bench(_options(model, other, tmp_path), register=_no_register)


def test_missing_model_file(tmp_path: Path) -> None:
    model = _mlp(tmp_path / "m.onnx")
    with pytest.raises(DietcodeError, match="model file not found"):
        bench.run_bench(_options(model, tmp_path / "nope.onnx", tmp_path), register=_no_register)
    with pytest.raises(DietcodeError, match=f"{tmp_path} is a directory, not a model file"):
        bench.run_bench(_options(model, tmp_path, tmp_path), register=_no_register)


# --- the command line ---------------------------------------------------------------------------------

def test_cli_bench_writes_json_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    model = _mlp(tmp_path / "m.onnx")
    monkeypatch.setattr(bench, "_library_register", lambda: _no_register)
    rc = main(["bench", str(model), "--optimized", str(model), "--dim", "tokens=2:6:2", "--repeat", "2",
               "--warmup", "0", "--json", str(tmp_path / "o.json"), "--plot", str(tmp_path / "o.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tokens=4" in out and "geometric-mean speedup" in out
    assert len(json.loads((tmp_path / "o.json").read_text())["shapes"]) == 3
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_provider_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _mlp(tmp_path / "m.onnx")
    assert main(["bench", str(model), "--optimized", str(model), "--provider", "tpu"]) == 2
    assert "error: unknown provider 'tpu'" in capsys.readouterr().err


# --- the suite script ---------------------------------------------------------------------------------

def _suite_module():  # type: ignore[no-untyped-def]
    """benchmarks/run_suite.py is a script, not a package module: load it by path (once)."""
    import importlib.util
    import sys

    if "run_suite" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "benchmarks" / "run_suite.py"
        spec = importlib.util.spec_from_file_location("run_suite", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["run_suite"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["run_suite"]


def test_suite_optimizes_for_the_benchmarked_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Build, then optimize with a shape log of exactly the swept shapes, then bench with the same dims."""
    rs = _suite_module()
    assert rs.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    calls: list[list[str]] = []

    def fake_run(cmd, what, log=None):  # type: ignore[no-untyped-def]
        calls.append(list(cmd))
        if "models" in cmd:  # the builder: a model with the resnet's input
            graph = helper.make_graph([helper.make_node("Identity", ["image"], ["y"])], "g",
                                      [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                     ["batch", 3, "height", "width"])],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
            _save(graph, Path(cmd[cmd.index("-o") + 1]))
    monkeypatch.setattr(rs, "_run", fake_run)
    monkeypatch.setattr(rs.subprocess, "run", lambda cmd, **kw: (calls.append(list(cmd)),  # optimize
                                                                  subprocess.CompletedProcess(cmd, 0, stderr=""))[1])
    out = rs.run_suite(rs.SUITES["resnet50"], "cpu", tmp_path / "w", tmp_path / "res", preset="tiny")
    build, optimize, run = calls
    assert build[1:6] == ["-m", "models", "resnet50", "--preset", "tiny"]
    assert optimize[2:4] == ["dietcode_ort", "optimize"] and "--shapes" in optimize
    log = json.loads(Path(optimize[optimize.index("--shapes") + 1]).read_text())["shapes"]
    assert log[0] == {"image": [1, 3, 160, 160]} and log[-1] == {"image": [4, 3, 288, 288]} and len(log) == 6
    assert run[2:4] == ["dietcode_ort", "bench"] and run[run.index("--tie") + 1] == "width=height"
    assert out.parent.parent == tmp_path / "res" and out.name == "resnet50-tiny-cpu.json"


@pytest.mark.parametrize("stderr, args, retried", [
    ("error: every tuned workload lost to cuDNN on the measured shapes, ...\n", (), True),
    ("error: every tuned workload lost to cuDNN on the measured shapes, ...\n", ("--min-speedup=1.2",), False),
    ("error: a crash\n", (), False)])
def test_suite_times_the_kernels_when_every_workload_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          stderr: str, args: tuple, retried: bool) -> None:
    """An optimize that rewrote nothing because every tuned workload lost to cuDNN (--min-speedup) is run again
    with --min-speedup 0, and a note beside the results says so with its figures; any other failure, or one
    under a --min-speedup the caller gave, stops the suite."""
    rs = _suite_module()
    calls: list[list[str]] = []

    def fake_run(cmd, what, log=None):  # type: ignore[no-untyped-def]
        calls.append(list(cmd))
        if "models" in cmd:
            _mlp(Path(cmd[cmd.index("-o") + 1]), name="x", dims=("tokens", 8))
    monkeypatch.setattr(rs, "_run", fake_run)
    monkeypatch.setattr(rs.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stderr=stderr))
    suite = rs.Suite("t", "mlp", "tiny", {"cpu": ("tokens=1,2",)})
    run = functools.partial(rs.run_suite, suite, "cpu", tmp_path / "w", tmp_path / "res", optimize_args=args)
    if not retried:
        with pytest.raises(DietcodeError, match="optimize failed"):
            run()
        return
    out = run()
    build, again, bench_cmd = calls
    assert again[-2:] == ["--min-speedup", "0"] and "optimize" in again and "bench" in bench_cmd
    note = out.with_name(out.stem + ".note.txt").read_text()
    assert "every tuned workload lost to cuDNN" in note and "--min-speedup 0" in note


@pytest.mark.parametrize("kw, message", [(dict(repeat=0), "--repeat must be >= 1"),
                                         (dict(warmup=-1), "--warmup and --seed >= 0"),
                                         (dict(seed=-3), r"got 3, 1, -3")])
def test_bad_counts(tmp_path: Path, kw: dict, message: str) -> None:
    model = _mlp(tmp_path / "m.onnx")
    with pytest.raises(DietcodeError, match=message):
        bench.run_bench(_options(model, model, tmp_path, **kw), register=_no_register)


@pytest.mark.parametrize("name, dims", [("bert", ("batch=1,2", "seq=5,16")), ("mlp", ("tokens=1,33",))])
def test_rewritten_tiny_model_runs_through_bench(tmp_path: Path, name: str, dims: tuple) -> None:
    """A real ai.dietcode model (stock ORT runs its fallback functions, no library): inputs match, the
    outputs agree, and the custom nodes are counted."""
    import models
    from tuner.rewrite import rewrite_model, save_model
    from tuner.scan import scan_model

    model = models.build(name, "tiny", "float32")
    scanned = scan_model(model)
    bundles = {n: b"bundle" for w in scanned.workloads for n in w.nodes}
    rewritten = rewrite_model(model, list(scanned.workloads), bundles).model
    original, optimized = tmp_path / "m.onnx", tmp_path / "m.dietcode.onnx"
    save_model(model, original)
    save_model(rewritten, optimized)
    report = bench.run_bench(_options(original, optimized, tmp_path, dims=dims), register=_no_register)
    assert report.custom_nodes == len(bundles) > 0
    assert len(report.shapes) == (4 if name == "bert" else 2)
    assert all(err == 0.0 for s in report.shapes for _, err in s.max_abs_error)
