"""The PyTorch side of the torch.compile comparison: the modules compute what the ONNX models compute (same
weights, checked against onnxruntime), the harness measures and records a sweep, and the report joins its
JSON with a bench JSON shape by shape."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from _scripts import load_script
from dietcode_ort import bench
from dietcode_ort.errors import DietcodeError

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from models import torch_models  # noqa: E402  (needs torch)

ROOT = Path(__file__).resolve().parents[1]


SHAPES = {"bert": [{"batch": 1, "seq": 5}, {"batch": 3, "seq": 17}],
          "resnet50": [{"batch": 1, "height": 32, "width": 32}, {"batch": 2, "height": 45, "width": 38}],
          "mlp": [{"tokens": 1}, {"tokens": 13}]}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_torch_module_computes_what_onnxruntime_computes(name: str, dtype: str) -> None:
    model, module = torch_models.build_pair(name, "tiny", dtype, seed=3)
    info = bench.model_info(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rtol, atol = (1e-4, 1e-4) if dtype == "float32" else bench.TOLERANCES["float16"]
    for shape in SHAPES[name]:
        feeds = bench.make_feeds(info, shape, seed=1)  # bench's own inputs (ids, masks with zeros, images)
        (ref,) = session.run(None, feeds)
        with torch.no_grad():
            got = module(**{k: torch.from_numpy(v) for k, v in feeds.items()}).numpy()
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert float(np.abs(ref).max()) > 0.1  # not trivially small outputs
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol)


def test_module_holds_exactly_the_onnx_weights() -> None:
    model, module = torch_models.build_pair("bert", "tiny", seed=5)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
               if not t.name.startswith("const_")}
    state = module.state_dict()
    assert set(state) == set(weights)
    for name, value in weights.items():
        assert np.array_equal(state[name].numpy(), value), name
    other = torch_models.build_pair("bert", "tiny", seed=6)[1]
    assert not torch.equal(other.state_dict()["encoder.layer.0.attention.self.query.weight"],
                           state["encoder.layer.0.attention.self.query.weight"])


def test_weights_of_another_model_are_refused() -> None:
    import models

    with pytest.raises(DietcodeError, match="wrong shape: embeddings"):
        torch_models.from_onnx(models.build("bert", "tiny"), "bert", "base")
    with pytest.raises(DietcodeError, match="missing: .*unexpected: mlp"):
        torch_models.from_onnx(models.build("mlp", "tiny"), "bert", "tiny")
    with pytest.raises(DietcodeError, match="unknown preset"):
        torch_models.module_for("resnet50", "huge")


def test_autotune_subset_spreads_over_the_sweep() -> None:
    tc = load_script("torch_compile")
    shapes = [{"n": i} for i in range(7)]
    assert tc.autotune_subset(shapes, None) == list(range(7))
    assert tc.autotune_subset(shapes, 2) == [0, 6]
    assert tc.autotune_subset(shapes, 3) == [0, 3, 6]
    assert tc.autotune_subset(shapes, 1) == [0] and tc.autotune_subset(shapes, 0) == []
    assert tc.autotune_subset(shapes, 9) == list(range(7))


@pytest.mark.parametrize("args, message", [
    (["bert", "--preset", "tiny", "--modes", "eager,turbo"], "unknown mode(s) turbo"),
    (["bert", "--preset", "huge"], "unknown preset 'huge'"),
    (["gpt", "--preset", "tiny"], "unknown model 'gpt'"),
    (["mlp", "--preset", "tiny", "--repeat", "0"], "--repeat must be >= 1"),
    (["mlp", "--preset", "tiny", "--onnx", "/nonexistent.onnx"], "no such file"),
    (["mlp", "--preset", "tiny", "--dim", "seq=4", "--modes", "eager"], "symbol"),
])
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str, capsys) -> None:
    tc = load_script("torch_compile")
    assert tc.main([*args, "--no-onnx-check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_onnx_file_of_another_dtype_is_refused(tmp_path: Path, capsys) -> None:
    import models

    path = models.save_model(models.build("mlp", "tiny", dtype="float16"), tmp_path / "mlp16.onnx")
    tc = load_script("torch_compile")
    assert tc.main(["mlp", "--preset", "tiny", "--onnx", str(path), "--modes", "eager"]) == 2
    assert "holds float16 weights, not --dtype float32" in capsys.readouterr().err


@pytest.mark.slow
def test_harness_measures_eager_and_dynamic_on_a_two_shape_sweep(tmp_path: Path) -> None:
    """torch.compile(dynamic=True) on the tiny MLP, CPU: compiled once on the warm-up shape, the JSON says
    what was compiled where (and why, for torch.compile's default mode), and the report joins it with a
    bench file of the same sweep."""
    tc = load_script("torch_compile")
    out = tmp_path / "torch.json"
    options = tc.TorchOptions(model="mlp", preset="tiny", dims=("tokens=5,9",), modes=("dynamic", "default"), repeat=3,
                              warmup=1, json_path=out, command="test")
    tc.run(options)
    record = json.loads(out.read_text())
    assert record["schema"] == tc.SCHEMA and list(record["modes"]) == ["eager", "dynamic", "default"]
    env = record["environment"]
    assert env["provider"] == "cpu" and env["torch"]["version"] == torch.__version__ and env["command"] == "test"
    assert record["settings"]["warmup_shape"] == {"tokens": 4}  # bench's warm-up shape: min - 1
    assert record["onnx_check"]["agrees"] is True and record["onnx_check"]["dims"] == {"tokens": 5}
    dynamic = record["modes"]["dynamic"]
    assert dynamic["compile"]["dims"] == {"tokens": 4} and dynamic["compile"]["frames_compiled"] == 1
    assert dynamic["compile"]["first_call_ms"] > 0 and dynamic["recompiles"] == 0
    assert [s["dims"] for s in record["shapes"]] == [{"tokens": 5}, {"tokens": 9}]
    for shape in record["shapes"]:
        eager, dyn = shape["modes"]["eager"], shape["modes"]["dynamic"]
        assert len(eager["times_ms"]) == 3 and eager["median_ms"] > 0 and eager["frames_compiled"] == 0
        assert dyn["agrees"] is True and dyn["max_abs_error"] < 1e-3 and dyn["error"] is None
        assert dyn["frames_compiled"] == 0 and dyn["steady_frames_compiled"] == 0  # dynamic: no recompile
        assert len(dyn["times_ms"]) == 3 and dyn["skipped"] is None and dyn["recompile_reasons"] == []
    # torch.compile() as is: static on the warm-up shape, recompiled (dynamic) at the first new size, then reused
    default = [s["modes"]["default"] for s in record["shapes"]]
    assert [d["frames_compiled"] for d in default] == [1, 0] and all(d["agrees"] for d in default)
    assert "hidden" in default[0]["recompile_reasons"][0] and record["modes"]["default"]["recompiles"] == 1
    assert record["summary"]["dynamic"]["shapes_measured"] == 2

    tr = load_script("torch_report")
    bench_json = _bench_json([{"tokens": 5}, {"tokens": 9}], [1.0, 2.0], [2.0, 2.0])
    bench_json["environment"]["device"] = env["device"]
    joined = tr.join(bench_json, record)
    assert [r["dims"] for r in joined["rows"]] == [{"tokens": 5}, {"tokens": 9}] and not joined["unmatched"]
    row = joined["rows"][1]["modes"]["dynamic"]
    assert row["ratio_vs_dietcode"] == pytest.approx(record["shapes"][1]["modes"]["dynamic"]["median_ms"] / 2.0)


def _bench_json(dims: list[dict], optimized_ms: list[float], stock_ms: list[float], provider: str = "cpu") -> dict:
    def timing(ms: float, first: float | None) -> dict:
        return {"times_ms": [ms], "median_ms": ms, "p90_ms": ms, "first_call_ms": first}

    return {"schema": "dietcode-ort-bench/1",
            "environment": {"device": "Test CPU", "provider": provider, "command": "dietcode-ort bench m.onnx"},
            "settings": {"model": "m.onnx"},
            "shapes": [{"dims": d, "stock": timing(s, 3 * s), "optimized": timing(o, 2 * o), "speedup": s / o}
                       for d, o, s in zip(dims, optimized_ms, stock_ms)]}


def _torch_json(rows: list[tuple[dict, dict]], device: str = "cpu") -> dict:
    def mode(median: float | None, first: float, frames: int = 0, agrees: bool | None = True,
             error: str | None = None) -> dict:
        return {"times_ms": [] if median is None else [median], "median_ms": median, "p90_ms": median,
                "first_call_ms": first, "frames_compiled": frames, "agrees": agrees, "error": error,
                "skipped": None}

    return {"schema": "dietcode-ort-torch-compile/1",
            "environment": {"device": "Test CPU", "command": "torch_compile.py m"},
            "settings": {"device": device, "dtype": "float32"},
            "modes": {"eager": {"compile": {"first_call_ms": 5.0}, "recompiles": 0, "frames_compiled": 0},
                      "dynamic": {"compile": {"first_call_ms": 900.0}, "recompiles": 1, "frames_compiled": 2}},
            "shapes": [{"dims": d, "modes": {"eager": mode(*e), "dynamic": mode(*c)}} for d, (e, c) in rows]}


def test_join_gives_ratio_per_shape_and_geomean_on_hand_built_files(tmp_path: Path, capsys) -> None:
    tr = load_script("torch_report")
    ours = _bench_json([{"batch": 1, "seq": 16}, {"batch": 4, "seq": 16}, {"batch": 4, "seq": 64}],
                       optimized_ms=[1.0, 2.0, 4.0], stock_ms=[2.0, 2.0, 8.0])
    theirs = _torch_json([
        ({"seq": 16, "batch": 1}, ((4.0, 6.0), (0.5, 700.0, 1))),     # dims in another order still match
        ({"batch": 4, "seq": 16}, ((8.0, 9.0), (8.0, 10.0, 0))),
        ({"batch": 4, "seq": 64}, ((16.0, 20.0), (1.0, 30.0, 0, False))),  # disagrees: left out
        ({"batch": 8, "seq": 16}, ((1.0, 1.0), (1.0, 1.0))),           # not in the bench file
    ])
    joined = tr.join(ours, theirs)
    assert [r["dims"] for r in joined["rows"]] == [{"seq": 16, "batch": 1}, {"batch": 4, "seq": 16},
                                                   {"batch": 4, "seq": 64}]
    assert joined["unmatched"] == [{"batch": 8, "seq": 16}]
    dyn = [r["modes"]["dynamic"] for r in joined["rows"]]
    assert [d["ratio_vs_dietcode"] for d in dyn] == [0.5, 4.0, None]
    assert [d["ratio_vs_stock"] for d in dyn] == [0.25, 4.0, None]
    assert dyn[0]["first_call_ratio_vs_dietcode"] == 700.0 / 2.0 and dyn[0]["frames_compiled"] == 1
    assert dyn[2]["note"] == "disagrees with eager"
    assert joined["summary"]["dynamic"]["geomean_ratio_vs_dietcode"] == pytest.approx(np.sqrt(0.5 * 4.0))
    assert joined["summary"]["dynamic"]["worst_ratio_vs_dietcode"] == 0.5
    assert joined["summary"]["dynamic"]["shapes"] == 2 and joined["summary"]["dynamic"]["recompiles"] == 1
    assert joined["summary"]["eager"]["geomean_ratio_vs_dietcode"] == pytest.approx((4 * 4 * 4) ** (1 / 3))
    assert joined["summary"]["dynamic"]["compile_ms"] == 900.0 and joined["warnings"] == []

    bench_path, torch_path, out = tmp_path / "b.json", tmp_path / "t.json", tmp_path / "join.json"
    bench_path.write_text(json.dumps(ours))
    torch_path.write_text(json.dumps(theirs))
    assert tr.main([str(bench_path), str(torch_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch=4 seq=16" in printed and "4.00x" in printed and "disagrees" in printed
    assert "dynamic: geomean 1.414x vs DietCode" in printed and "1 PyTorch shape(s) not in the bench" in printed
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(joined["summary"]))


def test_join_refuses_files_that_do_not_compare(tmp_path: Path, capsys) -> None:
    tr = load_script("torch_report")
    ours = _bench_json([{"tokens": 1}], [1.0], [1.0], provider="cuda")
    theirs = _torch_json([({"tokens": 1}, ((1.0, 1.0), (1.0, 1.0)))], device="cpu")
    with pytest.raises(DietcodeError, match="the bench ran on 'cuda' and PyTorch on 'cpu'"):
        tr.join(ours, theirs)
    other = copy.deepcopy(theirs)
    other["environment"]["device"] = "Other CPU"
    assert tr.join(_bench_json([{"tokens": 1}], [1.0], [1.0]), other)["warnings"] == \
        ["different devices: bench on 'Test CPU', PyTorch on 'Other CPU'"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(theirs))
    assert tr.main([str(path), str(path)]) == 2  # a torch file where the bench file goes
    assert "is not a dietcode-ort-bench/1 file" in capsys.readouterr().err
    path.write_text("{not json")
    assert tr.main([str(path), str(path)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_budget_is_shared_and_a_mode_left_without_time_is_not_compiled(tmp_path: Path, monkeypatch) -> None:
    tc = load_script("torch_compile")
    calls = []

    def fake_run_mode(ctx, name, result, wanted, budget):
        calls.append((name, budget, wanted))
        result.shapes = [tc.ShapeRun(dict(s)) for s in ctx.shapes]
        result.seconds = 7.0 if name == "dynamic" else 0.5

    monkeypatch.setattr(tc, "_run_mode", fake_run_mode)
    out = tmp_path / "t.json"
    record = tc.run(tc.TorchOptions(model="mlp", preset="tiny", dims=("tokens=2,3,4",), budget_s=12.0,
                                    modes=("dynamic", "mark_dynamic", "max-autotune"), autotune_shapes=2,
                                    check_onnx=False, json_path=out))
    assert calls == [("eager", None, [0, 1, 2]), ("dynamic", 4.0, [0, 1, 2]), ("mark_dynamic", 2.5, [0, 1, 2]),
                     ("max-autotune", 4.5, [0, 2])]
    monkeypatch.setattr(tc, "_run_mode", fake_run_mode)
    calls.clear()
    record = tc.run(tc.TorchOptions(model="mlp", preset="tiny", dims=("tokens=2,3,4",), budget_s=6.0,
                                    modes=("dynamic", "mark_dynamic"), check_onnx=False, json_path=out))
    assert [c[0] for c in calls] == ["eager", "dynamic"]  # dynamic spent 7 s of 6: mark_dynamic never compiles
    skipped = [s["modes"]["mark_dynamic"]["skipped"] for s in record["shapes"]]
    assert skipped == ["no time left in --budget-s"] * 3
    assert json.loads(out.read_text())["shapes"][0]["modes"]["mark_dynamic"]["skipped"] == skipped[0]
