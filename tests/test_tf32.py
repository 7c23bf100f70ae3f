"""float32 kernels in TF32 by default (``--fp32-precision``), as ONNX Runtime's CUDA EP runs float32 GEMMs: the
precision reaches the compiled constexprs and PTX, keys the kernel cache and the tuning database apart, is
recorded per kernel in the bundle and shown by ``inspect``, and sets the analytic model's peak."""
from __future__ import annotations

import json
import re

import pytest

from _bad_models import matmul_model, save
from _interpreter import run_interpreted
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, read_bundle
from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError
from tuner import aot
from tuner.cost_model import AnalyticCostModel, config_peak_flops, peak_flops
from tuner.database import family_signature
from tuner.hardware import get_profile
from tuner.measure import AnalyticMeasurer, MeasurerSpec
from tuner.optimize import OptimizeOptions, optimize
from tuner.space import Family, MicroKernel, wgmma_eligible
from tuner.workload import Epilogue, Problem

F32_80 = Family("gemm", "float32", "sm_80")
TILE = MicroKernel(64, 64, 32, 4, 2)
FAKE = "_fake_timing:FakeBackend"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, aot.CompiledKernel]:
    cache = tmp_path_factory.mktemp("tf32-kernels")
    return {p: aot.compile_kernel(F32_80, TILE, cache_dir=cache, allow_tf32=p == "tf32") for p in ("tf32", "ieee")}


@pytest.mark.ptx
def test_precision_reaches_the_constexprs_and_the_ptx(compiled):
    """A real AOT compile for sm_80: tf32 lowers the dot to TF32 mma.sync, ieee to FMAs without tensor cores."""
    tf32, ieee = compiled["tf32"], compiled["ieee"]
    assert dict(tf32.constants)["DOT_PRECISION"] == "tf32" and dict(ieee.constants)["DOT_PRECISION"] == "ieee"
    assert tf32.allow_tf32 and not ieee.allow_tf32
    assert re.search(r"mma\.sync\.aligned\.\w+\.row\.col\.f32\.tf32\.tf32\.f32", tf32.ptx), "no TF32 mma.sync"
    assert tf32.mma == "mma.sync"
    assert "mma" not in ieee.ptx and ieee.mma == "none"
    assert "fma.rn.f32" in ieee.ptx


def test_kernel_cache_keys_differ_by_precision():
    keys = {tf32: aot.cache_key(F32_80, TILE, epilogue=Epilogue(), trans_b=False, conv=None, div16=(),
                                allow_tf32=tf32) for tf32 in (True, False)}
    assert keys[True] != keys[False]


def test_tf32_is_float32_only():
    with pytest.raises(DietcodeError, match="float32 only"):
        aot.compile_kernel(Family("gemm", "float16", "sm_80"), TILE, allow_tf32=True)
    assert aot.uses_tf32("float32", "tf32") and not aot.uses_tf32("float32", "ieee")
    assert not aot.uses_tf32("float16", "tf32")
    with pytest.raises(DietcodeError, match="allowed: tf32, ieee"):
        aot.uses_tf32("float32", "fp32")


def test_database_rows_differ_by_precision():
    """The analytic measurer's answers under TF32 are another kernel's: another database family signature
    (ieee float32 and 16-bit families keep the signature they had)."""
    profile = get_profile("sm_80")
    tf32, ieee = AnalyticMeasurer(profile, "float32", tf32=True), AnalyticMeasurer(profile, "float32")
    assert family_signature(F32_80, tf32.context()) != family_signature(F32_80, ieee.context())
    assert ieee.context() == "" and AnalyticMeasurer(profile, "float16", tf32=True).context() == ""
    problem = Problem(256, 256, 256)
    faster, = tf32.measure(F32_80, [(TILE, problem)])
    slower, = ieee.measure(F32_80, [(TILE, problem)])
    assert faster.seconds < slower.seconds
    assert MeasurerSpec("analytic", target="sm_80", dtype="float32", allow_tf32=True).build().context() == "dot=tf32"


def test_gpu_timer_compiles_and_keys_by_precision(tmp_path, monkeypatch):
    """The GPU measurer compiles what optimize ships (its AOT compiles follow allow_tf32, on float32 families
    only) and its database context says so (run with the fake timing backend: no GPU needed)."""
    from tuner import gpu_timing
    from tuner.measure import GpuMeasurer

    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("DIETCODE_FAKE_TIMING", json.dumps({"log": str(log)}))
    config = MicroKernel(16, 16, 32, 2, 2)
    try:
        with GpuMeasurer(warmup=1, repeats=1, flush_bytes=0, backend=FAKE, cache_dir=tmp_path,
                         allow_tf32=True) as tf32:
            assert tf32.measure(F32_80, [(config, Problem(32, 16, 32))])[0].ok
            assert tf32.measure(Family("gemm", "float16", "sm_80"), [(config, Problem(32, 16, 32))])[0].ok
            ieee = GpuMeasurer(warmup=1, repeats=1, flush_bytes=0, backend=FAKE, cache_dir=tmp_path)
            assert ieee.measure(F32_80, [(config, Problem(32, 16, 32))])[0].ok
            assert "dot=tf32" in tf32.context() and "dot=tf32" not in ieee.context()
    finally:
        for timer in list(gpu_timing._SHARED.values()):
            timer.close()
    seen = [json.loads(line)["tf32"] for line in log.read_text().splitlines()]
    assert seen == [True, False, False]  # float32 tf32, float16 (no TF32 flag), float32 ieee


def test_bundle_records_precision_and_the_c_reader_keeps_it(compiled):
    kernels = tuple(BundleKernel.from_compiled([compiled[p]]) for p in ("tf32", "ieee"))
    assert [k.tf32 for k in kernels] == [True, False]
    bundle = Bundle((), kernels, DispatchTree.single(0))
    decoded = read_bundle(bundle.to_bytes())
    assert [k.tf32 for k in decoded.kernels] == [True, False]


def test_tf32_on_a_16_bit_kernel_is_refused_by_both_readers(compiled):
    from dataclasses import replace

    bad = replace(BundleKernel.from_compiled([compiled["tf32"]]), dtype="float16")
    bundle = Bundle((), (bad,), DispatchTree.single(0))
    with pytest.raises(DietcodeError, match="tf32 applies to float32"):
        bundle.validate()
    with pytest.raises(DietcodeError, match="tf32 applies to float32"):
        read_bundle(bundle.to_bytes(validate=False))
    vendor = replace(BundleKernel.vendor(), tf32=True)
    with pytest.raises(DietcodeError, match="build facts"):
        read_bundle(Bundle((), (vendor,), DispatchTree.single(0)).to_bytes(validate=False))


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_optimize_records_the_precision_and_inspect_shows_it(tmp_path, capsys, precision):
    from dietcode_ort.inspect_model import describe, load_optimized

    src, out = save(matmul_model(), tmp_path / "m.onnx"), tmp_path / "m.opt.onnx"
    args = ["optimize", str(src), "-o", str(out), "--dim", "n=1:32", "--measure", "analytic", "--budget", "8",
            "--quiet", "--db", str(tmp_path / "t.db"), "--cache-dir", str(tmp_path / "k"), "--target", "sm_80"]
    if precision == "ieee":
        args += ["--fp32-precision", "ieee"]
    assert main(args) == 0
    node, = describe(load_optimized(out), tmp_path)
    compiled = [k for k in node["kernels"] if k["kind"] == "triton"]
    assert compiled and {k["built_for"]["precision"] for k in compiled} == {precision}
    assert {k["ptx_mma"]["mma"] for k in compiled} == ({"mma.sync"} if precision == "tf32" else {"none"})
    assert node["workload"]["precision"] == precision
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    mma = "mma.sync" if precision == "tf32" else "none"
    assert re.search(rf"\w {precision} \({mma},", capsys.readouterr().out)


def test_cli_refuses_an_unknown_precision(tmp_path, capsys):
    src = save(matmul_model(), tmp_path / "m.onnx")
    with pytest.raises(SystemExit) as exc:
        main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--fp32-precision", "fp32"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--fp32-precision" in err and "tf32" in err and "ieee" in err and "Traceback" not in err


def test_optimize_options_refuse_an_unknown_precision(tmp_path):
    src = save(matmul_model(), tmp_path / "m.onnx")
    with pytest.raises(DietcodeError, match="unknown float32 precision 'half'"):
        optimize(src, tmp_path / "o.onnx", OptimizeOptions(fp32_precision="half", measure="analytic",
                                                           db=tmp_path / "t.db", progress=False))
    assert not (tmp_path / "o.onnx").exists()


def test_cost_model_peak_is_the_tf32_rate():
    a100, h100 = get_profile("sm_80"), get_profile("sm_90")
    assert peak_flops(a100, "float32", tf32=True) == a100.tf32_tensor_tflops * 1e12
    assert peak_flops(a100, "float32") == a100.fp32_tflops * 1e12
    assert peak_flops(a100, "float16", tf32=True) == peak_flops(a100, "float16")
    # sm_90: a TF32 config Triton lowers to wgmma gets the TF32 peak, one on mma.sync its mma.sync share
    wg, sync = MicroKernel(128, 128, 32, 4, 3), MicroKernel(32, 32, 32, 2, 2)
    assert wgmma_eligible(wg, "float32", h100, tf32=True) and not wgmma_eligible(sync, "float32", h100, tf32=True)
    assert config_peak_flops(wg, h100, "float32", tf32=True) == h100.tf32_tensor_tflops * 1e12
    assert config_peak_flops(sync, h100, "float32", tf32=True) == pytest.approx(
        h100.tf32_tensor_tflops * 1e12 * h100.mma_sync_fraction)
    assert config_peak_flops(sync, h100, "float32") == h100.fp32_tflops * 1e12  # ieee: FMA units either way
    fast = AnalyticCostModel(h100, "float32", tf32=True).f_mk([wg])[0]
    slow = AnalyticCostModel(h100, "float32").f_mk([wg])[0]
    assert fast > slow > 0


def test_interpreter_tf32_within_tf32_error_of_float64():
    """The template with TF32 dots against float64 within TF32's error. Triton 3.9's interpreter ignores the
    dot's input_precision (its create_dot is a float32 np.matmul): a TF32 dot interprets as exact float32,
    as the probe shows (1 + 2**-12 stays unrounded), so TF32 rounding itself is checked only by the PTX test
    above and on a GPU."""
    result = run_interpreted("_tf32_cases.py")
    assert result["ragged"] <= 1.0 and result["bias_split_k"] <= 1.0
    assert result["probe_tf32"] == result["probe_ieee"] == result["probe_exact"] != result["probe_tf32_rounded"]


@pytest.mark.ptx
def test_attention_kernels_follow_the_precision(tmp_path):
    """float32 attention kernels take the precision too: TF32 mma.sync in their PTX and the bundle's flag; the
    analytic attention cost uses the TF32 rate; the GPU timing context keys them apart."""
    from tuner.attention import AttentionCompileJob, attention_space
    from tuner.attention_tune import AttentionTimingSpec, AttentionWorkload, attention_time

    config = attention_space("float32", "sm_80", 32)[0]
    kernels = {}
    for tf32 in (True, False):
        job = AttentionCompileJob(config, "float32", "sm_80", 32, 0.125, False, allow_tf32=tf32)
        kernels[tf32] = BundleKernel.from_compiled([job.compile()])
    assert ".tf32.tf32.f32" in kernels[True].ptx and "mma" not in kernels[False].ptx
    assert kernels[True].tf32 and not kernels[False].tf32
    with pytest.raises(DietcodeError, match="float32 only"):
        AttentionCompileJob(attention_space("float16", "sm_80", 32)[0], "float16", "sm_80", 32, 0.125, False,
                            allow_tf32=True).compile()
    from tuner.attention_tune import AttentionProblem

    w = AttentionWorkload("float32", 32, False, False, False, False, 0.125, 3, "T", "T", "z")
    p, h100 = AttentionProblem(1024, 1024, 64), get_profile("sm_90")
    assert attention_time(config, w, p, h100, tf32=True) < attention_time(config, w, p, h100)
    from tuner import gpu_timing

    try:
        contexts = {tf32: AttentionTimingSpec(w, "sm_80", aot.CompileToolchain(), FAKE, allow_tf32=tf32).build().context()
                    for tf32 in (True, False)}
    finally:
        for timer in list(gpu_timing._SHARED.values()):
            timer.close()
    assert contexts[True] == contexts[False] + ";dot=tf32"


def test_candidate_space_follows_the_fp32_precision():
    """optimize tunes a float32 workload over the space of its --fp32-precision: on sm_90, tf32 dots get the
    wgmma configs' TMA twins and fifth stage (K and N multiples of 16 here), ieee dots today's FMA space."""
    from tuner.optimize import OptimizeOptions, candidate_space
    from tuner.space import enumerate_space
    from tuner.workload import Workload

    w = Workload(op="gemm", onnx_op="MatMul", nodes=("mm",), m="batch*seq", n="768", k="768", dtype="float32",
                 symbols=("batch", "seq"))
    tf32 = candidate_space(w, OptimizeOptions(targets=("sm_90",)))
    ieee = candidate_space(w, OptimizeOptions(targets=("sm_90",), fp32_precision="ieee"))
    family = Family("gemm", "float32", "sm_90")
    assert tf32 == enumerate_space(family, "tf32") and ieee == enumerate_space(family, "ieee")
    assert any(c.tma for c in tf32) and any(c.num_stages == 5 for c in tf32)
    assert not any(c.tma or c.num_stages == 5 for c in ieee)
