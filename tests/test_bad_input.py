"""Bad input to every command gets one ``error: ...`` line naming the problem and exit status 2: never a
traceback (the CLI's last-resort handler would exit 70 instead), a crash or a hang, and nothing written.

Commands run in-process through ``cli.main`` (fast); tiny one-MatMul models, the analytic measurer and
small budgets keep optimize cheap, and the kernel cache is shared by the module.
"""
from __future__ import annotations

import json
import os
import stat
import sqlite3
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import models.__main__ as models_cli
from _bad_models import broken_files, conv_model, matmul_model, save
from dietcode_ort.bundle import node_bundles
from dietcode_ort.errors import DietcodeError
from dietcode_ort.cli import main

BAD = 2


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("bad_input")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIETCODE_CACHE", str(folder / "kernels"))  # compiled kernels shared by the module
        yield _make_models(folder)


def _make_models(folder: Path) -> Path:
    save(matmul_model(), folder / "tiny.onnx")
    save(matmul_model(rows=4), folder / "static.onnx")
    save(matmul_model(TensorProto.INT8), folder / "int8.onnx")
    save(matmul_model(TensorProto.DOUBLE), folder / "float64.onnx")
    save(matmul_model(k=0), folder / "k0.onnx")
    unnamed = matmul_model()
    unnamed.graph.input[0].type.tensor_type.shape.dim[0].Clear()  # dynamic, but neither a value nor a name
    save(unnamed, folder / "unnamed.onnx")
    save(matmul_model(rows=-3), folder / "negative.onnx")
    save(conv_model(), folder / "conv.onnx")
    broken_files(folder)
    return folder


def _optimize_args(work: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["optimize", str(model), "-o", str(out), "--dim", "n=1:32", "--measure", "analytic", "--budget", "8",
            "--quiet", "--db", str(work / "tuning.db"), *extra]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run the CLI; it must exit 2 with one error line containing every needle."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == BAD, f"exit {code}, stderr:\n{err}"
    assert "Traceback" not in err and "internal error" not in err, err
    line = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line, err
    for needle in needles:
        assert needle in line[-1], line[-1]
    return line[-1]


# --- model files ----------------------------------------------------------------------------------------

FILE_MESSAGES = {"missing": "not found", "empty": "", "truncated": "not a readable ONNX model",
                 "text": "not a readable ONNX model", "directory": "is a directory, not a model file"}


@pytest.mark.parametrize("kind", sorted(FILE_MESSAGES))
@pytest.mark.parametrize("command", ["scan", "optimize", "inspect", "bench-model", "bench-optimized"])
def test_broken_model_files(work, capsys, kind, command):
    path = str(work / {"missing": "missing.onnx", "empty": "empty.onnx", "truncated": "truncated.onnx",
                       "text": "text.onnx", "directory": "folder.onnx"}[kind])
    if kind == "directory":
        Path(path).mkdir(exist_ok=True)
    argv = {"scan": ["scan", path, "--dim", "n=1:4"],
            "optimize": _optimize_args(work, Path(path), work / "never.onnx"),
            "inspect": ["inspect", path],
            "bench-model": ["bench", path, "--optimized", str(work / "tiny.onnx"), "--repeat", "1"],
            "bench-optimized": ["bench", str(work / "tiny.onnx"), "--optimized", path, "--repeat", "1"]}[command]
    line = _refused(capsys, argv)
    assert path in line
    if kind in ("missing", "directory"):
        assert FILE_MESSAGES[kind] in line
    elif kind == "empty":
        assert "no nodes" in line or "empty" in line or "not a readable" in line, line
    assert not (work / "never.onnx").exists()


def test_model_without_a_tunable_op(work, capsys):
    """Symbolic dims but no MatMul/Gemm/Conv (MatMulInteger is another op): the error said "can be optimized:"
    and listed nothing."""
    from onnx import helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = save(model, work / "relu.onnx")
    out = work / "relu.opt.onnx"
    line = _refused(capsys, _optimize_args(work, path, out), "no MatMul, Gemm or Conv node")
    assert not line.rstrip().endswith(":"), line
    assert not out.exists()


def test_static_model_cannot_be_optimized(work, capsys):
    _refused(capsys, ["scan", str(work / "static.onnx")], "no symbolic dims")
    out = work / "static.opt.onnx"
    _refused(capsys, ["optimize", str(work / "static.onnx"), "-o", str(out), "--measure", "analytic", "--quiet",
                      "--db", str(work / "tuning.db")], "no symbolic dims")
    assert not out.exists()


def test_input_dims_negative_is_refused(work, capsys):
    """A negative dim is no shape: the input and axis are named (it was called a failed shape inference)."""
    out = work / "never.onnx"
    _refused(capsys, ["scan", str(work / "negative.onnx")], "input 'x'", "axis 0", "-3")
    _refused(capsys, ["optimize", str(work / "negative.onnx"), "-o", str(out), "--measure", "analytic", "--quiet",
                      "--db", str(work / "tuning.db")], "input 'x'", "axis 0", "-3")
    assert not out.exists()


def test_input_dims_without_a_name_are_named_as_bench_names_them(work, capsys):
    """A dynamic dim with neither a size nor a name (skl2onnx writes its batch so) goes by <input>_dim<axis> in
    scan, optimize and bench alike, and scan says so (it was refused, and --dim had no name to give it)."""
    model = str(work / "unnamed.onnx")
    assert main(["scan", model, "--dim", "x_dim0=1,4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["symbol_axes"] == {"x_dim0": ["x[0]"]} and len(data["workloads"][0]["instances"]) == 2
    assert any("named as bench names them (x_dim0)" in line for line in data["prepared"])
    out = work / "unnamed.opt.onnx"
    assert main(["optimize", model, "-o", str(out), "--dim", "x_dim0=1,4", "--measure", "analytic", "--quiet",
                 "--db", str(work / "tuning.db")]) == 0, capsys.readouterr().err
    assert main(["bench", model, "--optimized", str(out), "--dim", "x_dim0=2,3", "--repeat", "1"]) == 0


def test_an_unnamed_dim_never_takes_the_name_of_another(tmp_path, capsys):
    """x [<unnamed>, "x_dim0", 16]: the name an unnamed dim goes by is another axis's name, and the two dims became
    one (the product was refused as "data-dependent" on a name of the tool's). The unnamed one gets "x_dim0_" in
    scan, optimize and bench alike."""
    from dietcode_ort.bench import model_info

    model = matmul_model()
    x = model.graph.input[0].type.tensor_type.shape
    del x.dim[:]
    x.dim.add()
    x.dim.add().dim_param = "x_dim0"
    x.dim.add().dim_value = 16
    model.graph.output[0].type.tensor_type.ClearField("shape")
    src = save(model, tmp_path / "collide.onnx")
    assert model_info(onnx.load(str(src))).inputs[0].dims == ("x_dim0_", "x_dim0", 16)
    assert main(["scan", str(src), "--json", "--dim", "x_dim0=1,3", "--dim", "x_dim0_=2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["symbol_axes"] == {"x_dim0": ["x[1]"], "x_dim0_": ["x[0]"]}
    assert [w["m"] for w in data["workloads"]] == ["x_dim0*x_dim0_"] and not data["skipped"]
    out = tmp_path / "collide.opt.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--dim", "x_dim0=1,3", "--dim", "x_dim0_=2", "--measure",
                 "analytic", "--quiet", "--db", str(tmp_path / "t.db"), "--cache-dir", str(tmp_path / "k")]) == 0
    assert main(["bench", str(src), "--optimized", str(out), "--dim", "x_dim0=2", "--dim", "x_dim0_=3",
                 "--repeat", "1"]) == 0


def test_input_without_a_shape_is_named(work, capsys):
    """Shape inference cannot run past a graph input of unknown rank: the error names the input (it gave
    only inference's own TypeError)."""
    shapeless = matmul_model()
    shapeless.graph.input[0].type.tensor_type.ClearField("shape")
    shapeless.graph.output[0].type.tensor_type.ClearField("shape")
    second = matmul_model().graph.input[0]
    second.name = "x2"
    second.type.tensor_type.shape.dim[0].dim_param = "m"
    shapeless.graph.input.append(second)
    shapeless.graph.node.append(onnx.helper.make_node("MatMul", ["x2", "w0"], ["y2"], name="mm1"))
    shapeless.graph.output.append(onnx.helper.make_tensor_value_info("y2", TensorProto.FLOAT, None))
    path = save(shapeless, work / "shapeless.onnx")
    _refused(capsys, ["scan", str(path), "--dim", "m=1:4"], "shape inference", "input 'x' has no shape")


@pytest.mark.parametrize("dtype", ["int8", "float64"])
def test_unsupported_dtypes_are_left_with_the_reason(work, capsys, dtype):
    model = work / f"{dtype}.onnx"
    assert main(["scan", str(model), "--json"]) == 0
    skipped = json.loads(capsys.readouterr().out)["skipped"]
    assert [s["node"] for s in skipped] == ["mm0"]
    assert "unsupported dtype" in skipped[0]["reason"] and dtype.upper().replace("FLOAT64", "DOUBLE") in \
        skipped[0]["reason"]
    out = work / f"{dtype}.opt.onnx"
    _refused(capsys, _optimize_args(work, model, out), "mm0", "unsupported dtype")
    assert not out.exists()


def test_zero_size_dims_are_left_with_the_reason(work, capsys):
    """K = 0: an empty product, nothing to tune (it once reached the tuner and divided by zero)."""
    assert main(["scan", str(work / "k0.onnx"), "--json"]) == 0
    skipped = json.loads(capsys.readouterr().out)["skipped"]
    assert [s["node"] for s in skipped] == ["mm0"] and "K = 0" in skipped[0]["reason"], skipped
    out = work / "k0.opt.onnx"
    _refused(capsys, _optimize_args(work, work / "k0.onnx", out), "mm0", "K = 0")
    assert not out.exists()


def test_shapes_with_an_empty_output_are_left_out(work, capsys):
    """A 3x3 conv without padding has no output rows for h < 3: those --dim values are left out with a
    note, and a range of only such values is an error naming the workload (not a division by zero)."""
    model = work / "conv.onnx"
    assert main(["scan", str(model), "--dim", "n=1,2", "--dim", "h=1:5", "--json"]) == 0
    captured = capsys.readouterr()
    instances = json.loads(captured.out)["workloads"][0]["instances"]
    assert sorted(i["values"]["h"] for i in instances) == [3, 3, 4, 4, 5, 5]
    assert "left out 4 of 10 shapes" in captured.err and "M = -6 at h=1, n=1" in captured.err, captured.err
    out = work / "conv.opt.onnx"
    args = ["optimize", str(model), "-o", str(out), "--measure", "analytic", "--budget", "8", "--quiet", "--db",
            str(work / "tuning.db"), "--dim", "n=1"]
    _refused(capsys, [*args, "--dim", "h=1,2"], "Conv workload", "every shape", "M = -6 at h=1")
    assert not out.exists()
    assert main([*args, "--dim", "h=1:6"]) == 0, capsys.readouterr().err
    assert "left out 2 of 6 shapes" in capsys.readouterr().err
    assert onnx.load(str(out)).graph.node[0].domain == "ai.dietcode"
    # a dim may be 0 (a KV-cache decoder's empty past): the shapes it empties are left out the same way
    assert main(["scan", str(model), "--dim", "n=0,2", "--dim", "h=5", "--json"]) == 0
    captured = capsys.readouterr()
    assert [i["values"] for i in json.loads(captured.out)["workloads"][0]["instances"]] == [{"h": 5, "n": 2}]
    assert "left out 1 of 2 shapes" in captured.err and "M = 0 at h=5, n=0" in captured.err, captured.err


# --- --dim specs --------------------------------------------------------------------------------------

DIMS = {"n=-1:4": "0 or more", "n=-3": "0 or more", "n=1000000000": "at most", "n=9:3": "inverted",
        "seq=1:4": "its symbols are: n", "n=1@inf": "finite", "n=1@1e300": "at most", "n=4@true": "not a number", "n=true": "not an integer"}


@pytest.mark.parametrize("spec", sorted(DIMS))
@pytest.mark.parametrize("command", ["scan", "optimize", "bench"])
def test_bad_dim_specs(work, capsys, spec, command):
    model = str(work / "tiny.onnx")
    argv = {"scan": ["scan", model, "--dim", spec],
            "optimize": _optimize_args(work, work / "tiny.onnx", work / "never.onnx")[:4] + [
                "--dim", spec, "--measure", "analytic", "--quiet", "--db", str(work / "tuning.db")],
            "bench": ["bench", model, "--optimized", model, "--dim", spec, "--repeat", "1"]}[command]
    _refused(capsys, argv, DIMS[spec])
    assert not (work / "never.onnx").exists()


@pytest.mark.parametrize("name, option", [("a=b", "a=b=1:4"), (" n ", "n=1:4"), (" n ", " n =1:4"),
                                          ("größe x", "größe x=1:4")])
def test_dim_names_as_exporters_write_them(work, capsys, name, option):
    """--dim takes a model's dim names as they are: a name may hold '=' (SPEC never does), and one with
    surrounding spaces is found by the name without them."""
    model = save(matmul_model(rows=name), work / "named.onnx")
    assert main(["scan", str(model), "--dim", option, "--json"]) == 0, capsys.readouterr().err
    (w,) = json.loads(capsys.readouterr().out)["workloads"]
    assert [i["values"] for i in w["instances"]] == [{name: v} for v in range(1, 5)]


def test_bad_shape_logs(work, capsys, tmp_path):
    cases = {'[{"x": [4, 16], "count": Infinity}]': "bad count", '[{"x": [true, 16]}]': "integers",
             '[{"x": [4, 16], "count": true}]': "bad count", '[{"x": [4, 16], "count": NaN}]': "bad count",
             '[{"x": [1000000000, 16]}]': "integers", '[{"x": [4, 16], "count": 1e300}]': "bad count", "[]": "non-empty", "[[[[": "not valid JSON"}
    for text, needle in cases.items():
        log = tmp_path / "shapes.json"
        log.write_text(text)
        _refused(capsys, ["scan", str(work / "tiny.onnx"), "--shapes", str(log)], needle)
    log.write_bytes(b"\xff\xfe[")
    _refused(capsys, ["scan", str(work / "tiny.onnx"), "--shapes", str(log)], "not valid JSON")
    _refused(capsys, ["scan", str(work / "tiny.onnx"), "--shapes", str(tmp_path)], "cannot be read")
    _refused(capsys, ["scan", str(work / "tiny.onnx"), "--shapes", str(tmp_path / "nope.json")], "not found")
    _refused(capsys, ["scan", str(work / "tiny.onnx"), "--shapes", str(log), "--dim", "n=1:4"], "not both")
    log.write_text('[{"x": [4, 16]}, {"x": [4, 17]}]')  # a log of another model: x's second dim is 16 here
    _refused(capsys, ["scan", str(work / "tiny.onnx"), "--shapes", str(log)], "record 1", "axis 1", "16", "17")


@pytest.mark.parametrize("option, needle", [(("--seed", "-1"), "--seed"), (("--seed", str(2 ** 32)), "--seed"),
                                             (("--budget", "0"), "--budget"),
                                             (("--max-kernels", "0"), "--max-kernels"),
                                             (("--measure", "magic"), "magic"),
                                             (("--analytic-gpu", "H800"), "'H800' names no sm_90 GPU"),
                                             (("--analytic-gpu", "L40S"), "known: NVIDIA H100 SXM5, NVIDIA H100 PCIe"),
                                             (("--analytic-gpu", "H200", "--measure", "replay:t.csv"),
                                              "--measure replay:t.csv models the GPU its timings come from")])
def test_bad_numbers_and_measurers(work, capsys, option, needle):
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", work / "never.onnx", *option), needle)
    assert not (work / "never.onnx").exists()


def test_unexpected_errors_are_one_line_with_their_own_status(work, capsys, monkeypatch):
    import tuner.optimize as opt

    monkeypatch.setattr(opt, "optimize_command", lambda *a, **k: [][0])
    assert main(_optimize_args(work, work / "tiny.onnx", work / "never.onnx")) == 70
    err = capsys.readouterr().err
    assert err.startswith("error: internal error (IndexError") and "Traceback" not in err
    monkeypatch.setenv("DIETCODE_TRACEBACK", "1")
    with pytest.raises(IndexError):
        main(_optimize_args(work, work / "tiny.onnx", work / "never.onnx"))


# --- targets ------------------------------------------------------------------------------------------

def test_bad_target(work, capsys):
    out = work / "never.onnx"
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", out, "--target", "sm_75"), "sm_75")
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", out, "--target", "sm_90,bogus"), "bogus")
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", out, "--target", "sm_90,sm_90"), "sm_90 twice")
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", out, "--target", ",,"), "names no GPU arch")
    _refused(capsys, ["space", "--target", "sm_75", "--op", "gemm", "--json", "--estimate"], "sm_75")
    _refused(capsys, ["space", "--target", "sm_90", "--op", "gemm", "--estimate"], "--estimate applies to --json")
    _refused(capsys, ["space", "--target", "sm_90", "--op", "gemm", "--json", "--estimate", "--compile"],
             "contradict")
    _refused(capsys, ["space", "--target", "sm_90", "--op", "nope"], "nope")
    _refused(capsys, ["space", "--target", "sm_90", "--op", "gemm", "--dtype", "int8"], "int8")
    assert not out.exists()


def test_bad_bench_options(work, capsys, read_only_dir, monkeypatch):
    import dietcode_ort.bench as bench

    model = str(work / "tiny.onnx")
    monkeypatch.setattr(bench, "run_bench", lambda options: pytest.fail("measured before checking the outputs"))
    _refused(capsys, ["bench", model, "--optimized", model, "--json", str(work)], "--json", "is a folder")
    _refused(capsys, ["bench", model, "--optimized", model, "--plot", str(read_only_dir / "p.png")], "--plot",
             str(read_only_dir))
    monkeypatch.undo()
    _refused(capsys, ["bench", model, "--optimized", model, "--provider", "tpu"], "tpu")
    _refused(capsys, ["bench", model, "--optimized", model, "--repeat", "0"], "--repeat")
    _refused(capsys, ["bench", model, "--optimized", str(work / "static.onnx"), "--repeat", "1"], "rejects shape")
    _refused(capsys, ["bench", model, "--optimized", str(work / "float64.onnx"), "--repeat", "1"], "float64")


# --- outputs ------------------------------------------------------------------------------------------

def test_output_is_checked_before_tuning(work, capsys, read_only_dir, monkeypatch):
    import tuner.optimize as opt

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuned before the output was checked")

    monkeypatch.setattr(opt, "_tune", no_tuning)
    model = work / "tiny.onnx"
    _refused(capsys, _optimize_args(work, model, work), "is a folder")
    _refused(capsys, _optimize_args(work, model, read_only_dir / "out.onnx"), str(read_only_dir), "-o")
    _refused(capsys, _optimize_args(work, model, model), "overwrite the input model")
    _refused(capsys, _optimize_args(work, model, work / "." / "tiny.onnx"), "overwrite the input model")
    _refused(capsys, _optimize_args(work, model, work / "out.textproto"), "not textproto", "name the output .onnx")
    _refused(capsys, _optimize_args(work, model, work / "out.json"), "not json")
    fifo = work / "out.fifo"  # a special file: written beside, then renamed over, it would be replaced
    os.mkfifo(fifo)
    _refused(capsys, _optimize_args(work, model, fifo), "is not a regular file")
    os.mkfifo(work / "out2.onnx.data")
    _refused(capsys, _optimize_args(work, model, work / "out2.onnx"), "out2.onnx.data exists and is not a regular")
    assert stat.S_ISFIFO((work / "out2.onnx.data").stat().st_mode) and not (work / "out2.onnx").exists()


def test_a_failed_run_leaves_no_folder_it_created(work, capsys):
    """Several models into a new folder, one of them without symbolic dims: the error, and no empty folder (nor
    its new parents) left where the outputs would have gone."""
    static = save(helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]), opset_imports=[helper.make_opsetid("", 17)]),
        work / "static.onnx")
    out = work / "new" / "outs"
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", out)[:1] + [str(work / "tiny.onnx"), str(static)]
             + _optimize_args(work, work / "tiny.onnx", out)[2:], "no symbolic dims")
    assert not (work / "new").exists()
    _refused(capsys, _optimize_args(work, static, work / "new" / "static.dc.onnx"), "does not have")
    assert not (work / "new").exists()


def test_a_failed_write_names_the_output_and_leaves_nothing(work, capsys, monkeypatch):
    """A full disk or a file size limit (EFBIG under ``ulimit -f``) while writing was an internal error naming no
    file; the old output and its folder stay as they were."""
    import errno

    import tuner.rewrite as rw

    out = work / "full.onnx"
    out.write_bytes(b"the old output")

    def full(model, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rw, "write_model", full)
    _refused(capsys, _optimize_args(work, work / "tiny.onnx", out), f"cannot write {out}: No space left on device")
    assert out.read_bytes() == b"the old output"
    assert not [p for p in work.iterdir() if p.name.startswith(".full.onnx.tmp")]


def test_a_killed_runs_temporary_folder_is_removed_by_the_next(tmp_path):
    """A run killed while writing (SIGKILL) leaves its temporary folder beside the output; the next write
    removes it when its process is gone, and leaves a live run's alone."""
    import subprocess

    from tuner.rewrite import save_model

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f".m.onnx.tmp-{gone.pid}-abc"
    live = tmp_path / f".m.onnx.tmp-{os.getppid()}-def"
    other = tmp_path / f".n.onnx.tmp-{gone.pid}-ghi"
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "m.onnx").write_bytes(b"half a model")
    save_model(matmul_model(), tmp_path / "m.onnx")
    assert not dead.exists() and live.exists() and other.exists()
    assert onnx.load(str(tmp_path / "m.onnx")).graph.node


def test_output_must_not_replace_the_inputs_external_data(work, capsys, monkeypatch):
    import models as model_lib

    src = work / "external.onnx"
    model_lib.save_model(matmul_model(), src, external_threshold=0)  # weights in external.onnx.data
    data = work / "external.onnx.data"
    before = data.read_bytes()
    assert before
    _refused(capsys, _optimize_args(work, src, data), "holds the input model's weights")
    other = work / "renamed.onnx"  # the output's own .data file would be the input's
    (work / "renamed.onnx.data").write_bytes(b"")
    m = onnx.load(str(src), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "renamed.onnx.data"
    (work / "renamed.onnx.data").write_bytes(before)
    onnx.save(m, str(work / "source2.onnx"))
    _refused(capsys, _optimize_args(work, work / "source2.onnx", other), "holds the input model's weights")
    assert data.read_bytes() == before and (work / "renamed.onnx.data").read_bytes() == before


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_external_data_outside_the_models_folder_is_refused(work, capsys, where):
    """A model names its weight files beside it (ONNX's and ORT's rule): a location that leaves the folder, by
    '..', an absolute path or a symbolic link, is refused before anything is read or written."""
    import models as model_lib

    src_dir, model_dir = work / "weights", work / f"model-{where}"
    src_dir.mkdir(exist_ok=True)
    model_dir.mkdir()
    model_lib.save_model(matmul_model(), src_dir / "m.onnx", external_threshold=0)  # weights in m.onnx.data
    target = src_dir / "m.onnx.data"
    location = {"parent": "../weights/m.onnx.data", "absolute": str(target), "symlink": "link.data"}[where]
    if where == "symlink":
        (model_dir / "link.data").symlink_to(target)
    m = onnx.load(str(src_dir / "m.onnx"), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(m, str(model_dir / "m.onnx"))
    out = work / f"out-{where}.onnx"
    _refused(capsys, ["scan", str(model_dir / "m.onnx")], "points outside the model's folder")
    _refused(capsys, _optimize_args(work, model_dir / "m.onnx", out), "points outside the model's folder")
    assert not out.exists() and not (work / f"out-{where}.onnx.data").exists()


def test_missing_output_folder_is_created(work, capsys):
    out = work / "new" / "folder" / "tiny.opt.onnx"
    assert main(_optimize_args(work, work / "tiny.onnx", out)) == 0, capsys.readouterr().err
    assert onnx.load(str(out)).graph.node[0].domain == "ai.dietcode"


def test_rerun_onto_external_data_replaces_it(work, capsys, monkeypatch):
    import tuner.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_TWO_GB", 0)  # every model counts as large: weights go to OUT.data
    out = work / "ext.opt.onnx"
    data = work / "ext.opt.onnx.data"
    assert main(_optimize_args(work, work / "tiny.onnx", out)) == 0
    first = data.stat().st_size
    assert main(_optimize_args(work, work / "tiny.onnx", out)) == 0
    capsys.readouterr()
    assert data.stat().st_size == first  # replaced, not appended to
    onnx.checker.check_model(str(out), full_check=False)
    assert not [p for p in work.iterdir() if p.name.startswith(".ext.opt.onnx.tmp")]
    # a rerun whose output keeps its weights inline removes the data file of the output it replaces, and
    # leaves alone a file of that name that the replaced output did not use
    monkeypatch.setattr(rewrite, "_TWO_GB", 2 ** 31)
    assert main(_optimize_args(work, work / "tiny.onnx", out)) == 0
    assert not data.exists()
    data.write_bytes(b"someone else's")
    assert main(_optimize_args(work, work / "tiny.onnx", out)) == 0
    assert data.read_bytes() == b"someone else's"
    onnx.checker.check_model(str(out), full_check=False)


# --- databases ----------------------------------------------------------------------------------------

def _with_db(work: Path, db: Path) -> list[str]:
    argv = _optimize_args(work, work / "tiny.onnx", work / "never.onnx")
    argv[argv.index("--db") + 1] = str(db)
    return argv


def test_database_that_is_a_folder(work, capsys, tmp_path):
    _refused(capsys, _with_db(work, tmp_path), "is a folder", "--db")


def test_corrupt_database(work, capsys, tmp_path):
    db = tmp_path / "corrupt.db"
    db.write_bytes(b"garbage, not SQLite" * 100)
    _refused(capsys, _with_db(work, db), str(db), "corrupt")
    assert not (work / "never.onnx").exists()


def test_database_in_read_only_folder(work, capsys, read_only_dir):
    _refused(capsys, _with_db(work, read_only_dir / "tuning.db"), str(read_only_dir), "--db")


def test_read_only_database_file(work, capsys, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes read-only files")
    db = tmp_path / "ro.db"
    sqlite3.connect(db).close()
    db.chmod(0o444)
    _refused(capsys, _with_db(work, db), str(db), "cannot be written")


def test_database_locked_by_another_process(work, capsys, tmp_path, monkeypatch):
    from tuner import database

    db = tmp_path / "locked.db"
    database.Database(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    original = database.Database.__init__
    monkeypatch.setattr(database.Database, "__init__",
                        lambda self, path, timeout_s=5.0: original(self, path, timeout_s=0.2))
    try:
        _refused(capsys, _with_db(work, db), "locked by another process")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_database_shared_by_two_runs(work, tmp_path):
    """Two optimize processes on one database at the same time both finish with the same result."""
    import os
    import subprocess
    import sys

    from _bad_models import ROOT

    db = tmp_path / "shared.db"
    outs = [tmp_path / f"shared{i}.onnx" for i in range(2)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "dietcode_ort", *_with_db(work, db)[:3], str(o),
                               *_with_db(work, db)[4:]], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              text=True) for o in outs]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    bundles = [[b.payload for b in node_bundles(onnx.load(str(o)))] for o in outs]
    assert bundles[0] == bundles[1] and bundles[0]


# --- inspect ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def optimized(work: Path) -> Path:
    out = work / "tiny.opt.onnx"
    assert main(_optimize_args(work, work / "tiny.onnx", out)) == 0
    return out


@pytest.mark.parametrize("argv", [["inspect", "--json"], ["scan", "--dim", "n=1:4", "--json"]])
def test_output_piped_into_a_reader_that_stops(work, optimized, argv):
    """``dietcode-ort inspect --json OUT | head``: the reader leaving is no bug (it was an internal error)."""
    import os
    import subprocess
    import sys

    from _bad_models import ROOT

    model = str(optimized if argv[0] == "inspect" else work / "tiny.onnx")
    proc = subprocess.Popen([sys.executable, "-m", "dietcode_ort", argv[0], model, *argv[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: its first write finds no reader
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "internal error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def _edit_custom_node(src: Path, dst: Path, attr: str, value) -> Path:
    from onnx import helper

    model = onnx.load(str(src))
    node = next(n for n in model.graph.node if n.domain == "ai.dietcode")
    kept = [a for a in node.attribute if a.name != attr]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(attr, value)])
    onnx.save(model, str(dst))
    return dst


@pytest.mark.parametrize("attr, value, needle", [
    ("info", "{not json", "'info' attribute is not JSON"),
    ("info", "[1, 2]", "'info' attribute is not a description"),
    ("info", '{"ranges": {"M": 4}}', "'info' attribute is not a description"),
    ("bundle", "not a tensor", "carries its kernel bundle as an attribute"),
    ("scale", "0.5", "the 'scale' attribute is STRING, not FLOAT"),
    ("scale", [0.5, 0.5], "the 'scale' attribute is FLOATS, not FLOAT"),
])
def test_inspect_malformed_attributes(work, capsys, optimized, attr, value, needle):
    bad = _edit_custom_node(optimized, work / "edited.onnx", attr, value)
    _refused(capsys, ["inspect", str(bad)], "mm0", needle)
    _refused(capsys, ["inspect", str(bad), "--json"], needle)


def test_inspect_an_attention_node_without_its_scale():
    from onnx import helper

    from dietcode_ort.inspect_model import _attention

    node = helper.make_node("Attention", ["q", "kt", "v", "", "b"], ["o"], domain="ai.dietcode", name="att",
                            head_dim=64)
    with pytest.raises(DietcodeError, match="custom node 'att' \\(Attention\\): the 'scale' attribute is missing"):
        _attention(node)
    node.attribute.append(helper.make_attribute("scale", 0.125))
    assert _attention(node)["scale"] == 0.125 and _attention(node)["head_dim"] == 64


@pytest.mark.parametrize("name", ["[/]", "[b]X[/b]", "mm\x1b[31m0"])
def test_inspect_shows_names_as_they_are(work, capsys, optimized, name):
    """Node names come from the model: rich must not read them as markup (``[/]`` failed as an internal
    error, ``[b]`` styled the table), and a terminal's escape sequence is shown escaped."""
    model = onnx.load(str(optimized))
    next(n for n in model.graph.node if n.domain == "ai.dietcode").name = name
    path = work / "named.onnx"
    onnx.save(model, str(path))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert name.replace("\x1b", "\\x1b") in out and "\x1b" not in out


def test_inspect_refuses_an_ambiguous_or_empty_bundle_input(work, capsys, optimized):
    """Two initializers of the bundle's name (a tool reading one, onnxruntime the other) and an empty bundle input
    are refused naming the problem (the empty one read as a wrong input count)."""
    model = onnx.load(str(optimized))
    node = next(n for n in model.graph.node if n.domain == "ai.dietcode")
    bundle = next(t for t in model.graph.initializer if t.name == node.input[-1])
    twin = onnx.TensorProto()
    twin.CopyFrom(bundle)
    model.graph.initializer.insert(0, twin)
    onnx.save(model, str(work / "twin-bundles.onnx"))
    _refused(capsys, ["inspect", str(work / "twin-bundles.onnx")], "mm0", f"two initializers are named {bundle.name!r}")
    model = onnx.load(str(optimized))
    node = next(n for n in model.graph.node if n.domain == "ai.dietcode")
    node.input[-1] = ""
    onnx.save(model, str(work / "empty-bundle-input.onnx"))
    _refused(capsys, ["inspect", str(work / "empty-bundle-input.onnx")], "mm0", "its kernel bundle input (the last of its 3) is empty")


# --- doctor and python -m models ----------------------------------------------------------------------

def test_doctor_with_a_bad_prebuilt_library(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(tmp_path / "missing.so"))
    assert main(["doctor", "--no-build"]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert "[fail] custom-op library" in out.out and "missing.so" in out.out
    assert "[fail] compiler" not in out.out  # the build tools are checked as for a source build
    (tmp_path / "text.so").write_text("not a library")
    monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(tmp_path / "text.so"))
    assert main(["doctor", "--no-build"]) == 1
    assert "[fail] custom-op library" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["empty", "truncated", "text"])
def test_doctor_with_a_broken_model_file(work, capsys, kind):
    """doctor MODEL fails on what inspect refuses (an empty file passed as a model without custom nodes)."""
    path = work / f"{kind}.onnx"
    assert main(["doctor", "--no-build", str(path)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if f"model {path}" in x)
    assert line.startswith("[fail]") and "not a readable ONNX model" in line, line


def test_doctor_with_an_unwritable_build_cache(capsys, monkeypatch, read_only_dir):
    monkeypatch.delenv("DIETCODE_ORT_LIBRARY", raising=False)
    monkeypatch.setenv("DIETCODE_ORT_BUILD_DIR", str(read_only_dir / "library"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[fail] custom-op library" in out and "DIETCODE_ORT_BUILD_DIR" in out and str(read_only_dir) in out


@pytest.mark.parametrize("argv, needle", [
    (["nope", "--preset", "tiny", "-o", "x.onnx"], "unknown model 'nope'"),
    (["mlp", "--preset", "huge", "-o", "x.onnx"], "huge"),
    (["mlp", "--preset", "tiny", "--dtype", "int8", "-o", "x.onnx"], "int8"),
    (["mlp", "--preset", "tiny"], "missing -o"),
    (["mlp", "--preset", "tiny", "--seed", "-1", "-o", "x.onnx"], "--seed"),
    (["mlp", "--preset", "tiny", "--seed", "x", "-o", "x.onnx"], "--seed"),
])
def test_models_cli_bad_options(capsys, argv, needle):
    assert models_cli.main(argv) == BAD
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err


def test_models_cli_bad_outputs(capsys, tmp_path, read_only_dir):
    assert models_cli.main(["mlp", "--preset", "tiny", "-o", str(tmp_path)]) == BAD
    assert str(tmp_path) in capsys.readouterr().err
    assert models_cli.main(["mlp", "--preset", "tiny", "-o", str(read_only_dir / "m.onnx")]) == BAD
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "Traceback" not in err


def test_an_optimized_model_is_refused_before_shape_inference(work, capsys, optimized):
    """optimize and scan on a model dietcode-ort wrote: one line naming the custom nodes and what to do, also for
    a model of the earlier op type names (ai.dietcode::Attention, on which onnxruntime's shape inference failed
    first with a message about its own assertion)."""
    out = work / "again.onnx"
    _refused(capsys, _optimize_args(work, optimized, out), "optimized by dietcode-ort already", "mm0",
             "optimize the original model")
    _refused(capsys, ["scan", str(optimized), "--dim", "n=1:32"], "optimized by dietcode-ort already")
    model = onnx.load(str(optimized))
    next(n for n in model.graph.node if n.domain == "ai.dietcode").op_type = "Attention"
    legacy = work / "legacy.onnx"
    onnx.save(model, str(legacy))
    _refused(capsys, ["scan", str(legacy), "--dim", "n=1:32"], "optimized by dietcode-ort already")
    assert not out.exists()


def test_a_stop_while_the_output_is_replaced_leaves_model_and_data_together(tmp_path, monkeypatch):
    """Replacing an output that has a data file renames the data file, then the model file: a SIGINT between the two
    left the old model beside the new weights (read without any error: another model's weights at its offsets).
    A SIGINT or SIGTERM that arrives during the renames is acted on after them, and the old data file is moved
    aside before the new one takes its name (replacing it freed its blocks inside the window: 80 ms for 270 MB)."""
    import signal

    import numpy as np

    import tuner.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_TWO_GB", 0)  # every model counts as large: weights go to OUT.data
    out = tmp_path / "out.onnx"
    first, second = matmul_model(), matmul_model()
    second.graph.name = "second"
    for init in second.graph.initializer:
        init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) + 1.0, init.name))
    rewrite.save_model(first, out)
    assert (tmp_path / "out.onnx.data").exists()
    real = os.replace

    def replace(src, dst):
        real(src, dst)
        if Path(dst).name == "out.onnx.data":  # the data file is in place; the model file is not yet
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        rewrite.save_model(second, out)
    monkeypatch.setattr(os, "replace", real)
    loaded = onnx.load(str(out))
    assert loaded.graph.name == "second"  # the new model file with the new data file
    want = {i.name: onnx.numpy_helper.to_array(i) for i in second.graph.initializer}
    for init in loaded.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), want[init.name])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.onnx.tmp")]
