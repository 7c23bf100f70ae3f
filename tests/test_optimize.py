"""optimize end to end on the CPU: analytic tuning, real AOT kernels, bundles, rewrite, and the CPU EP."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import dietcode_ort
import models
from dietcode_ort.bundle import node_bundles
from dietcode_ort.errors import DietcodeError
from dietcode_ort.inspect_model import describe
from tuner.optimize import OptimizeOptions, features_for, optimize, problem_features
from tuner.scan import scan_model
from tuner.space import Family
from tuner.workload import Instance

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("optimize")


def _options(work: Path, *dims: str, **kw) -> OptimizeOptions:
    kw.setdefault("measure", "analytic")  # the same choice with or without a GPU
    return OptimizeOptions(dims=dims, budget=64, db=work / "tuning.db", cache_dir=work / "kernels",
                           progress=False, **kw)


def _optimized(work: Path, name: str, dims: tuple[str, ...], fuse_attention: bool = True) -> tuple[Path, Path]:
    src, out = work / f"{name}.onnx", work / f"{name}{'' if fuse_attention else '.unfused'}.opt.onnx"
    if not out.exists():
        if not src.exists():
            models.save_model(models.build(name, "tiny"), src)
        optimize(src, out, _options(work, *dims, fuse_attention=fuse_attention), log=lambda _: None)
    return src, out


def _sessions(src: Path, out: Path):
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    options = ort.SessionOptions()
    dietcode_ort.register(options)  # the library's CPU kernels (a CPU-only InferenceSession leaves it out)
    with_lib = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    fallback = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    return stock, with_lib, fallback


CASES = {
    # tuned over the --dim ranges; the sweep goes outside them on purpose
    "mlp": (("tokens=1:64",), [{"tokens": t} for t in (1, 2, 3, 7, 16, 31, 32, 33, 48, 63, 64, 65, 100, 127,
                                                        128, 129, 200, 255, 256, 300)]),
    "bert": (("batch=1:2", "seq=1:64:8"),
             [{"batch": b, "seq": s} for b in (1, 2, 3, 5) for s in (1, 9, 31, 64, 100)]),
    # every block end a ConvBiasResidualRelu (the shortcut added before the Relu)
    "resnet50": (("batch=1:2", "height=32:64:16", "width=32:64:16"),
                 [{"batch": b, "height": h, "width": w} for b in (1, 3) for h, w in
                  ((32, 32), (33, 47), (45, 38), (48, 64), (64, 48), (17, 20), (70, 33), (40, 40), (56, 61), (32, 96))]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_optimized_model_matches_original_with_and_without_library(work, name):
    dims, shapes = CASES[name]
    src, out = _optimized(work, name, dims)
    stock, with_lib, fallback = _sessions(src, out)
    model = onnx.load(str(out))
    assert any(n.domain == "ai.dietcode" for n in model.graph.node)
    assert len(shapes) >= 20
    for dims_ in shapes:
        feeds = models.get(name).example_inputs("tiny", dims_, seed=3)
        want = stock.run(None, feeds)[0]
        np.testing.assert_allclose(with_lib.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(fallback.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)


def test_inspect_lists_kernels_tree_and_ranges(work):
    src, out = _optimized(work, "mlp", CASES["mlp"][0])
    result = subprocess.run([sys.executable, "-m", "dietcode_ort", "inspect", str(out), "--json"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    nodes = json.loads(result.stdout)["nodes"]
    assert len(nodes) == 3
    for node in nodes:
        assert {"name", "op", "kernels", "tree", "ranges"} <= set(node)
        assert node["ranges"] == {"M": [1, 64]}
        assert node["workload"]["m"] == "tokens"
        assert all(k["kind"] == "triton" and k["archs"] == ["sm_90a"] for k in node["kernels"])
        assert all(set(k["image_shared"]) == {"sm_90a"} and k["image_shared"]["sm_90a"] > 0 for k in node["kernels"])
        gate = "gate_proj" in node["name"]  # the gate projection takes its SiLU and the product by up's output
        # pointers always (the gate's residual, up's output, too), and N/K because 64 and 176 are multiples of
        # 16 (checked again per call)
        assert all(k["div16"] == ["a", "b", "c", "N", "K"] + ["residual"] * gate for k in node["kernels"])
        assert (node["op"], node["epilogue"]["residual_mul"]) == (("MatMulSiluMul", True) if gate else ("MatMulPlain", False))
        act = "silu" if gate else "none"
        assert all(k["built_for"] == {"dtype": "float32", "activation": act, "trans_b": False, "conv": [],
                                      "grouped": False, "nhwc": False, "precision": "tf32"}  # --fp32-precision's default
                   for k in node["kernels"])
        assert node["tree"]["if_chain"]
    # the same bundle and tree describe() reads in-process
    assert [n["name"] for n in describe(onnx.load(str(out)))] == [n["name"] for n in nodes]


def test_attention_nodes_take_the_bmm_view(work):
    """With --no-fuse-attention the attention MatMuls' kernels are bmm kernels, so the CUDA path launches them
    with the batch on grid z (dc_bundle_kernel_view), and the dense layers' are gemm kernels."""
    src, out = _optimized(work, "bert", CASES["bert"][0], fuse_attention=False)
    nodes = describe(onnx.load(str(out)))
    batched = [n for n in nodes if n["workload"]["batch"] != "1"]
    dense = [n for n in nodes if n["workload"]["batch"] == "1"]
    assert len(batched) == 4 and {n["view"] for n in batched} == {"bmm"}
    assert dense and {n["view"] for n in dense} == {"gemm"}
    assert all(k["view"] == "bmm" for n in batched for k in n["kernels"] if k["kind"] == "triton")


def test_features_match_between_problem_and_node_inputs():
    result = scan_model(models.build("bert", "tiny"))
    dense, qk = result.workloads[0], result.workloads[1]
    inst = Instance.of({"batch": 3, "seq": 17})
    shapes = {"dense": [[3, 17, 128], [128, 128]], "qk": [[3, 2, 17, 64], [3, 2, 64, 17]]}
    for w, key in ((dense, "dense"), (qk, "qk")):
        feats = features_for(w, 0)
        values = [f.value(shapes[key]) for f in feats]
        assert tuple(values) == problem_features(w, w.problem(inst))
    assert [f.name for f in features_for(qk, 0)] == ["M", "N", "batch"]  # K = head dim, constant


def test_bad_inputs_write_nothing(work, tmp_path):
    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    out = tmp_path / "out.onnx"
    with pytest.raises(DietcodeError, match="no instances"):
        optimize(src, out, _options(work), log=lambda _: None)
    with pytest.raises(DietcodeError, match="--budget must be positive"):
        optimize(src, out, OptimizeOptions(dims=("tokens=1:4",), budget=0, db=work / "t.db",
                                           cache_dir=work / "kernels", progress=False), log=lambda _: None)
    with pytest.raises(DietcodeError, match="unknown --measure"):
        optimize(src, out, _options(work, "tokens=1:4", measure="magic"), log=lambda _: None)
    with pytest.raises(DietcodeError, match="must differ"):
        optimize(src, src, _options(work, "tokens=1:4"), log=lambda _: None)
    with pytest.raises(DietcodeError, match="model file not found"):
        optimize(tmp_path / "missing.onnx", out, _options(work, "tokens=1:4"), log=lambda _: None)
    with pytest.raises(DietcodeError, match="is a directory, not a model file"):
        optimize(tmp_path, out, _options(work, "tokens=1:4"), log=lambda _: None)
    with pytest.raises(DietcodeError, match="compile_workers must be at least 1, got 0"):  # as space --workers
        optimize(src, out, _options(work, "tokens=1:4", compile_workers=0), log=lambda _: None)
    assert not out.exists()


def _sparse_weight_model(as_constant: bool) -> onnx.ModelProto:
    """x[batch, 16] @ W[16, 8] + b, W a sparse tensor (linear indices): a sparse initializer, or a Constant's
    sparse_value. ORT makes either dense at load."""
    from onnx import TensorProto, helper, numpy_helper

    dense = np.zeros((16, 8), np.float32)
    dense[::3, ::2] = np.arange(1, 25, dtype=np.float32).reshape(6, 4) / 7
    flat = np.flatnonzero(dense)
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(dense.ravel()[flat], "W"),
                                       numpy_helper.from_array(flat.astype(np.int64), "W_indices"), [16, 8])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"), helper.make_node("Add", ["t", "b"], ["y"])]
    if as_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["W"], sparse_value=sparse))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                              [numpy_helper.from_array(np.linspace(-1, 1, 8, dtype=np.float32), "b")],
                              sparse_initializer=[] if as_constant else [sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("as_constant", [False, True], ids=["sparse_initializer", "sparse_constant"])
def test_sparse_weights_are_tuned_and_agree_with_stock(work, tmp_path, as_constant):
    """A weight stored sparse failed shape inference ('Invalid model with cyclic graph' for a sparse
    initializer, an AttributeError for a Constant's sparse_value): stock ORT runs both. The weight stays
    sparse in the output, and the library's kernel agrees with stock ORT."""
    src, out = tmp_path / "sparse.onnx", tmp_path / "sparse.opt.onnx"
    onnx.save(_sparse_weight_model(as_constant), str(src))
    (w,) = scan_model(onnx.load(str(src))).workloads
    assert (w.m, w.n, w.k, w.epilogue.bias) == ("batch", "8", "16", True)
    optimize(src, out, _options(work, "batch=1:8"), log=lambda _: None)
    model = onnx.load(str(out))
    assert [n.domain for n in model.graph.node if n.op_type != "Constant"] == ["ai.dietcode"]
    assert len(model.graph.sparse_initializer) == (0 if as_constant else 1)
    stock, with_lib, fallback = _sessions(src, out)
    for batch in (1, 3, 8, 11):
        x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
        want = stock.run(None, {"x": x})[0]
        for sess in (with_lib, fallback):
            np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def test_auto_pad_convs_agree_with_stock(work, tmp_path):
    """SAME_UPPER at stride 1 and VALID at stride 2 over dynamic H and W, SAME_LOWER at strides (2, 3) over
    fixed sizes: the custom nodes (and so their fallback bodies) take the resolved pads, and the library's
    kernels and the fallback agree with stock ORT."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def w(name, shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="same_upper", auto_pad="SAME_UPPER"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="valid", auto_pad="VALID", strides=[2, 2]),
             helper.make_node("Conv", ["z", "w3"], ["y2"], name="same_lower", auto_pad="SAME_LOWER", strides=[2, 3])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"]),
                                           helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 2, 9, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)],
                              [w("w1", (4, 3, 4, 3)), w("b1", (4,)), w("w2", (5, 4, 3, 3)), w("w3", (3, 2, 3, 4))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    src, out = tmp_path / "auto_pad.onnx", tmp_path / "auto_pad.opt.onnx"
    onnx.save(model, str(src))
    optimize(src, out, _options(work, "n=1:2", "h=8:16", "w=8:16"), log=lambda _: None)
    custom = {n.name: n for n in onnx.load(str(out)).graph.node if n.domain == "ai.dietcode"}
    assert set(custom) == {"same_upper", "valid", "same_lower"}
    pads = {name: [a.ints for a in n.attribute if a.name == "pads"][0] for name, n in custom.items()}
    assert pads == {"same_upper": [1, 1, 2, 1], "valid": [0, 0, 0, 0], "same_lower": [1, 2, 1, 1]}  # W: 3 in all, the odd one first
    stock, with_lib, fallback = _sessions(src, out)
    for n, h, wd in ((1, 8, 8), (2, 11, 16), (1, 17, 9), (3, 5, 6)):
        feeds = {"x": rng.standard_normal((n, 3, h, wd)).astype(np.float32),
                 "z": rng.standard_normal((n, 2, 9, 10)).astype(np.float32)}
        want = stock.run(None, feeds)
        for sess in (with_lib, fallback):
            for got, ref in zip(sess.run(None, feeds), want):
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_cli_optimize_reports_and_exit_codes(work, tmp_path):
    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    out = tmp_path / "o.onnx"
    cmd = [sys.executable, "-m", "dietcode_ort", "optimize", str(src), "-o", str(out), "--dim", "tokens=1:16",
           "--budget", "32", "--db", str(work / "tuning.db"), "--quiet", "--measure", "analytic"]
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                        env={**__import__("os").environ, "DIETCODE_CACHE": str(work / "kernels")})
    assert ok.returncode == 0, ok.stderr
    assert "analytic" in ok.stdout and "no GPU timings were used" in ok.stdout
    assert "regret" in ok.stderr and out.exists()
    bad = subprocess.run(cmd[:-2] + ["--measure", "gpu"], capture_output=True, text=True, cwd=REPO,
                         timeout=600)
    if bad.returncode != 0:  # no GPU here: a one-line error, no traceback
        assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in bad.stderr


def test_inspect_and_doctor_name_nodes_that_onnx_compose_renamed(work, tmp_path, capsys):
    """onnx.compose's merge_models prefixes the second model's local functions, and with them its ai.dietcode op
    types (MatMulPlain -> m2_MatMulPlain), which the library does not run: ORT runs those nodes' fallback functions,
    correctly but with no dietcode kernel. inspect warns, and doctor's model check warns, naming them; the optimized
    model itself draws no such warning."""
    from onnx import compose

    from dietcode_ort.doctor import model_check
    from dietcode_ort.inspect_model import inspect_command

    _, out = _optimized(work, "mlp", CASES["mlp"][0])
    first, second = onnx.load(str(out)), onnx.load(str(out))
    merged = compose.merge_models(first, second, io_map=[(first.graph.output[0].name, first.graph.input[0].name)],
                                  prefix2="m2_")
    onnx.save(merged, str(tmp_path / "merged.onnx"))
    renamed = sorted({n.op_type for n in merged.graph.node if n.op_type.startswith("m2_")})
    assert renamed and all(n.domain == "ai.dietcode" for n in merged.graph.node)
    for path, warned in ((out, False), (tmp_path / "merged.onnx", True)):
        assert inspect_command(str(path), False) == 0
        printed = " ".join(capsys.readouterr().out.split())
        check = model_check(str(path), None)
        for text in (printed, check.detail):
            assert ("have an op type the library does not run" in text) == warned, text
            assert all(f"({op})" in text for op in renamed) == warned
        assert check.status == "warn"  # no driver here either way
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    sess = ort.InferenceSession(str(tmp_path / "merged.onnx"), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    stock = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (once,) = stock.run(None, {"hidden": x})
    np.testing.assert_allclose(sess.run(None, {"hidden": x})[0], stock.run(None, {"hidden": once})[0], rtol=1e-4,
                               atol=1e-4)


def test_cli_optimize_piped_prints_no_empty_lines(tmp_path):
    """Piped (no terminal), optimize without --quiet prints its lines and nothing else: the search's progress bar
    drew nothing there but ended with an empty line on stdout per workload."""
    from _bad_models import matmul_model, save

    src = save(matmul_model(layers=2), tmp_path / "m.onnx")
    res = subprocess.run([sys.executable, "-m", "dietcode_ort", "optimize", str(src), "-o", str(tmp_path / "o.onnx"),
                          "--dim", "n=1:16", "--measure", "analytic", "--budget", "8", "--db", str(tmp_path / "t.db"),
                          "--cache-dir", str(tmp_path / "k")], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "wrote " in res.stdout and "trials" in res.stderr
    for stream in (res.stdout, res.stderr):
        assert "" not in stream.splitlines(), stream


@pytest.mark.ptx
def test_two_targets_give_a_cubin_each_and_portable_ptx(work, tmp_path):
    from dietcode_ort.bundle import node_bundles, read_bundle

    src, out = tmp_path / "mlp.onnx", tmp_path / "mlp.2.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    optimize(src, out, _options(work, "tokens=1:8", targets=("sm_80", "sm_90")), log=lambda _: None)
    bundle = read_bundle(node_bundles(onnx.load(str(out)))[0].payload)
    for kernel in bundle.kernels:
        assert sorted(arch for arch, _ in kernel.images) == ["sm_80", "sm_90a"]
        assert ".target sm_80" in kernel.ptx  # JIT-able by GPUs newer than both cubins


def test_several_models_share_the_tuning_of_identical_workloads(work, tmp_path):
    import onnx

    from tuner.optimize import optimize_many, output_paths

    for name, builder, seed in (("a.onnx", "mlp", 0), ("b.onnx", "mlp", 1), ("c.onnx", "bert", 0)):
        models.save_model(models.build(builder, "tiny", seed=seed), tmp_path / name)
    lines: list[str] = []
    jobs = output_paths([tmp_path / n for n in ("a.onnx", "b.onnx", "c.onnx")], tmp_path / "out")
    reports = optimize_many(jobs, _options(work, "tokens=1:8", "batch=1:2", "seq=8,16"), lines.append)
    assert [r.output for r in reports] == [tmp_path / "out" / n for n in ("a.onnx", "b.onnx", "c.onnx")]
    # bert's attention MatMuls (its bmm workloads) become one attention workload, tuned on its own
    # mlp: gate (with its SiLU), up and down
    distinct = 3 + len([w for w in scan_model(models.build("bert", "tiny")).workloads if w.op != "bmm"])
    total = 6 + distinct - 3
    assert f"{total} workloads in 3 models, {distinct} distinct: each is tuned once" in lines
    assert sum(line.startswith("workload ") for line in lines) == distinct  # one search per distinct workload
    assert sum(line.startswith("attention workload ") for line in lines) == 1

    def bundles(path):
        return [b.payload for b in node_bundles(onnx.load(str(path)))]

    assert bundles(reports[0].output) == bundles(reports[1].output) and bundles(reports[0].output)
    assert [w.workload.nodes for w in reports[1].workloads] == [w.nodes for w in scan_model(
        onnx.load(str(tmp_path / "b.onnx"))).workloads]  # each model's report names its own nodes
    with pytest.raises(DietcodeError, match="none of the models has"):
        optimize_many(jobs, _options(work, "tokens=1:8", "batch=1:2", "seq=8,16", "height=1:2"), lines.append)
    with pytest.raises(DietcodeError, match="both named a.onnx"):
        output_paths([tmp_path / "a.onnx", tmp_path / "out" / "a.onnx"], tmp_path / "o2")
    with pytest.raises(DietcodeError, match="names a folder"):
        output_paths([tmp_path / "a.onnx", tmp_path / "b.onnx"], tmp_path / "c.onnx")


@pytest.mark.parametrize("warm_start", [True, False])
def test_each_search_starts_warm_from_the_earlier_ones_of_its_family(work, tmp_path, monkeypatch, warm_start):
    """The tiny MLP's three float32 GEMM workloads (gate with its SiLU, up, down) are tuned one after another: the
    second search is given what the first measured (its search's and its tree's settling), the third what both
    did (--no-warm-start: nothing); bmm and conv workloads are never warm-started."""
    import tuner.search
    from tuner.optimize import warm_family

    calls: list[tuple[set, set]] = []  # per search: what it was given, what it measured
    sizes: list[int] = []
    real = tuner.search.tune_joint

    def spy(*args, warm=(), **kw):
        result = real(*args, warm=warm, **kw)
        calls.append((set(warm), {m for m in result.measurements if np.isfinite(m.seconds)}))
        sizes.append(len(warm))
        return result

    monkeypatch.setattr(tuner.search, "tune_joint", spy)
    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    options = _options(work, "tokens=1:64", warm_start=warm_start)
    optimize(src, tmp_path / "mlp.opt.onnx", replace(options, budget=16, db=tmp_path / "t.db"), log=lambda _: None)
    assert len(calls) == 3 and all(measured for _, measured in calls)
    if not warm_start:
        assert all(not given for given, _ in calls)
    else:
        (first, ran_first), (second, ran_second), (third, _) = calls
        assert not first and ran_first < second and second | ran_second <= third
        # gate and up have the same shapes: with the analytic measurer their measurements are equal, not merged
        assert sizes[2] > sizes[1] > len(ran_first)  # the settling's measurements too
    conv = [w for w in scan_model(models.build("resnet50", "tiny")).workloads if w.op == "conv"]
    bmm = [w for w in scan_model(models.build("bert", "tiny")).workloads if w.op == "bmm"]
    assert conv and bmm and all(warm_family(w, options) is None for w in conv + bmm)
    gemm = scan_model(models.build("mlp", "tiny")).workloads[0]
    assert warm_family(gemm, options) == Family("gemm", "float32", "sm_90")


def _ort_optimized_ops(path: Path, library: bool) -> list[str]:
    """The op types of the graph ORT's CPU EP runs after its own graph optimizer (ORT_ENABLE_ALL)."""
    options = ort.SessionOptions()
    if library:
        dietcode_ort.register(options)
    options.optimized_model_filepath = str(path.with_suffix(f".ort{int(library)}.onnx"))
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def test_bert_runs_fewer_nodes_than_stock_ort(work):
    """Stock ORT fuses the scores' MatMul + Div into FusedMatMul and MatMul + Add + Gelu into BiasGelu but
    keeps each output projection's residual Add; the optimized model (here with --no-fuse-attention) absorbs
    the Div (alpha) and the residual Adds too, so the graph ORT runs has fewer nodes, and the same outputs
    (checked above)."""
    src, out = _optimized(work, "bert", CASES["bert"][0], fuse_attention=False)
    stock, ours = _ort_optimized_ops(src, False), _ort_optimized_ops(out, True)
    model = onnx.load(str(out))
    custom = [n for n in model.graph.node if n.domain == "ai.dietcode"]
    assert sorted(n.op_type for n in custom).count("MatMulBiasResidual") == 4  # attention output + FFN, 2 layers
    scores = [n for n in custom if any(a.name == "scale" for a in n.attribute)]
    assert len(scores) == 2 and all(onnx.helper.get_attribute_value(a) == 0.125 for n in scores
                                    for a in n.attribute if a.name == "scale")  # 1 / sqrt(64)
    assert "Div" not in {n.op_type for n in model.graph.node}
    assert stock.count("Add") - ours.count("Add") >= 4 and "FusedMatMul" not in ours
    assert len(ours) < len(stock), (len(ours), len(stock))
    described = {d["name"]: d["epilogue"] for d in describe(model)}
    plain = {"residual": False, "residual_first": False, "residual_mul": False}
    assert {"alpha": 0.125, "bias": False, "activation": "none", **plain} in described.values()
    assert {"alpha": 1.0, "bias": True, "activation": "none", "residual": True, "residual_first": False,
            "residual_mul": False} in described.values()


def test_resnet_block_ends_are_one_node_each(work):
    """Each bottleneck's Conv -> Add(shortcut) -> Relu is one ConvBiasResidualRelu node whose kernels add the
    residual before the Relu: the optimized tiny ResNet-50 keeps no Add and no Relu, and the graph ORT's CPU EP
    runs with the library has fewer nodes than stock ORT's own (its outputs checked above), the two Transposes
    where the channels-last chain starts and ends aside (stock's count depends on the CPU: its NCHWc layout
    pass adds reorder nodes as the CPU's vector width allows)."""
    src, out = _optimized(work, "resnet50", CASES["resnet50"][0])
    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ConvBiasResidualRelu") == 4 and "Add" not in ops and "Relu" not in ops
    assert sum(n.domain == "ai.dietcode" for n in model.graph.node) == 18  # 17 convs and the classifier
    described = [d for d in describe(model) if d["op"] == "ConvBiasResidualRelu"]
    assert len(described) == 4
    assert all(d["epilogue"] == {"alpha": 1.0, "bias": True, "activation": "relu", "residual": True,
                                 "residual_first": True, "residual_mul": False} for d in described)
    assert all(json.loads(next(a.s for a in n.attribute if a.name == "info"))["workload"]["residual_first"]
               for n in model.graph.node if n.op_type == "ConvBiasResidualRelu")
    stock, ours = _ort_optimized_ops(src, False), _ort_optimized_ops(out, True)
    assert ours.count("Transpose") == 2
    assert len(ours) - 2 < len(stock), (ours, stock)


def test_fused_attention_runs_fewer_nodes_than_the_unfused_rewrite(work):
    """By default each attention chain is one Attention node: ORT's graph has no Softmax left and fewer nodes
    than with --no-fuse-attention."""
    _, fused = _optimized(work, "bert", CASES["bert"][0])
    _, unfused = _optimized(work, "bert", CASES["bert"][0], fuse_attention=False)
    ours, theirs = _ort_optimized_ops(fused, True), _ort_optimized_ops(unfused, True)
    assert ours.count("ScaledDotProductAttention") == 2 and "Softmax" not in ours and "Softmax" in theirs
    assert len(ours) < len(theirs), (len(ours), len(theirs))


def test_tuning_models_the_gpu_its_timings_come_from(monkeypatch) -> None:
    """The search over a measurer's timings models the GPU its device key names (an H200's bandwidth, not that of
    the sm_90 profile's H100 SXM5), and the workload's summary says which; a key naming no product of the target
    (the analytic model's own) keeps the target's profile."""
    from tuner import optimize as opt
    from tuner import search
    from tuner.hardware import get_profile
    from tuner.measure import AnalyticMeasurer, make_device_key, tuning_profile
    from tuner.scan import attach_instances

    class OnH200(AnalyticMeasurer):
        def device_key(self) -> str:
            return make_device_key("NVIDIA H200", "sm_90", "13000", "3.6.0")

    monkeypatch.setattr(opt, "make_measurer", lambda o, w, executor=None: (
        OnH200(get_profile("sm_90"), w.dtype), "replay:h200"))
    seen, real = [], search.tune_joint

    def spy(family, problems, space, measurer, profile, *args, **kwargs):
        seen.append(profile)
        return real(family, problems, space, measurer, profile, *args, **kwargs)

    monkeypatch.setattr(search, "tune_joint", spy)
    w = attach_instances(scan_model(models.build("mlp", "tiny")), ("tokens=1:64",)).workloads[0]
    chosen = opt._tune(w, opt.merge_problems(w), OptimizeOptions(budget=8, max_kernels=2, progress=False),
                       lambda _: None)
    assert [(p.name, p.dram_bandwidth_gbs) for p in seen] == [("NVIDIA H200 SXM", 4800.0)]
    assert chosen.report.profile == "NVIDIA H200 SXM"
    assert "with replay:h200 (NVIDIA H200 SXM);" in opt._summary(0, chosen.report)
    assert tuning_profile(AnalyticMeasurer(get_profile("sm_90"), "float16"), "sm_90") == get_profile("sm_90")


def test_the_summary_says_which_trials_checked_the_chosen_kernels(tmp_path) -> None:
    """--budget bounds the search; settling then times each shape's chosen kernel where the search only predicted
    it (up to one trial per shape). The report keeps the two apart, and the summary says how many were checks."""
    from tuner import optimize as opt
    from tuner.scan import attach_instances

    w = attach_instances(scan_model(models.build("mlp", "tiny")), ("tokens=1:64",)).workloads[0]
    options = OptimizeOptions(budget=8, measure="analytic", progress=False, db=tmp_path / "t.db",
                              cache_dir=tmp_path / "k")
    report = opt._tune(w, opt.merge_problems(w), options, lambda _: None).report
    assert 0 < report.checked <= 64 and report.trials - report.checked <= 8
    assert f"{report.trials} trials ({report.checked} of them timing the chosen kernels" in opt._summary(0, report)
    assert "of them" not in opt._summary(0, replace(report, checked=0))


def test_analytic_tuning_models_the_gpu_it_is_told(tmp_path, capsys) -> None:
    """``--analytic-gpu "NVIDIA H200"``: the analytic measurer and the search model the H200 (4.8 TB/s), its answers
    are stored apart from the H100 model's, and the summary names the profile."""
    import sqlite3

    from dietcode_ort.cli import main

    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    argv = ["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--dim", "tokens=1:64", "--measure",
            "analytic", "--target", "sm_90", "--budget", "8", "--quiet", "--db", str(tmp_path / "t.db"),
            "--cache-dir", str(tmp_path / "k"), "--analytic-gpu", "NVIDIA H200"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "with analytic (no GPU timing) (NVIDIA H200 SXM);" in err, err
    devices = {r[0] for r in sqlite3.connect(str(tmp_path / "t.db")).execute("SELECT device FROM measurements")}
    assert devices and all("NVIDIA H200 SXM" in d for d in devices), devices


def test_the_same_tuning_writes_the_same_bytes(tmp_path):
    """Two runs on one model with fresh databases and kernel caches, the second with another PYTHONHASHSEED and
    from a copy of the package installed elsewhere, write byte-identical models: a build pipeline can compare
    them (each node's info carried the tuning's wall-clock seconds, which changed every run, and the kernels'
    line info named the template's and Triton's files by their absolute paths: the build machine's folders
    shipped in every model)."""
    import os
    import shutil
    import subprocess
    import sys

    from _bad_models import ROOT, matmul_model, save

    src = save(matmul_model(layers=2), tmp_path / "m.onnx")
    elsewhere = tmp_path / "installed" / "elsewhere"
    for package in ("dietcode_ort", "tuner"):
        shutil.copytree(ROOT / package, elsewhere / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    outs = []
    for run, seed, root in (("a", "1", ROOT), ("b", "2", elsewhere)):
        out = tmp_path / f"{run}.onnx"
        res = subprocess.run([sys.executable, "-m", "dietcode_ort", "optimize", str(src), "-o", str(out), "--dim",
                              "n=1:64", "--measure", "analytic", "--budget", "8", "--quiet", "--db",
                              str(tmp_path / f"{run}.db"), "--cache-dir", str(tmp_path / f"k{run}")],
                             capture_output=True, text=True, timeout=900, cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED=seed))
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append(out.read_bytes())
    assert str(ROOT).encode() not in outs[0] and str(elsewhere).encode() not in outs[1]
    assert outs[0] == outs[1]
