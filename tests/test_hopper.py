"""sm_90 (Hopper): which MMA Triton lowers a config to (the rule against the committed compile evidence and
against fresh compiles), the MMA kind in compiled kernels, the cost model's wgmma feature and mma.sync rate.
The TMA configs are tests/test_tma.py's. Compiles are few and small."""
from __future__ import annotations

import csv
import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from _interpreter import ROOT
from dietcode_ort.errors import DietcodeError
from tuner.aot import CompiledKernel, compile_kernel, ptx_mma, ptx_mma_shapes
from tuner.cost_model import FEATURE_NAMES, AnalyticCostModel, config_peak_flops, kernel_features, peak_flops
from tuner.hardware import get_profile
from tuner.measure import AnalyticMeasurer
from tuner.space import Family, MicroKernel, wgmma_eligible
from tuner.workload import Problem

EVIDENCE = ROOT / "benchmarks" / "results" / "compile" / "sm90-mma.csv"  # the gemm spaces before the wgmma rule
EVIDENCE_AFTER = ("sm90-mma-space.csv", "sm90-mma-conv.csv")  # the 16-bit gemm and conv spaces after it
H100, A100 = get_profile("sm_90"), get_profile("sm_80")
W4 = MicroKernel(64, 64, 64, 4, 3)  # a warpgroup, 64 rows: wgmma on sm_90
W2 = MicroKernel(64, 64, 64, 2, 3)  # two warps: no whole warpgroup, mma.sync


def _evidence(path: Path = EVIDENCE) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


@pytest.mark.ptx
def test_wgmma_rule_matches_the_compiled_evidence() -> None:
    """Every config of the committed sm_90 sample compiled to wgmma exactly when ``wgmma_eligible`` says so;
    ieee float32 uses no tensor core. The sample holds the whole float16 and bfloat16 gemm spaces."""
    rows = _evidence()
    kinds = Counter((r["precision"], r["mma"]) for r in rows)
    for precision in ("float16", "bfloat16", "tf32"):
        assert kinds[(precision, "wgmma")] > 50 and kinds[(precision, "mma.sync")] > 50, kinds
    assert set(k for p, k in kinds if p == "ieee") == {"none"}
    for r in rows:
        config = MicroKernel.from_key(r["config"])
        predicted = wgmma_eligible(config, r["dtype"], H100, tf32=r["precision"] == "tf32")
        assert (r["mma"] == "wgmma") == predicted, r
        assert not r["error"], r


@pytest.mark.ptx
@pytest.mark.parametrize("name", EVIDENCE_AFTER)
def test_the_sm90_spaces_compile_as_the_wgmma_rule_says(name: str) -> None:
    """The committed compiles of today's sm_90 16-bit spaces: each config's PTX uses wgmma exactly when
    predicted, and a config that does not is a decode tile (the space's ``wgmma`` rule)."""
    rows = _evidence(EVIDENCE.parent / name)
    assert {r["op"] for r in rows} == {"conv" if "conv" in name else "gemm"}
    for r in rows:
        config = MicroKernel.from_key(r["config"])
        assert (r["mma"] == "wgmma") == wgmma_eligible(config, r["dtype"], H100), r
        assert r["mma"] == "wgmma" or config.block_m <= 32, r
    assert len({(r["dtype"], r["config"]) for r in rows}) == len(rows) > 90


def test_ptx_mma_reads_the_instruction() -> None:
    wg = "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;"
    ms = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1}, {%r2}, {%f5};"
    assert (ptx_mma(wg), ptx_mma_shapes(wg)) == ("wgmma", ("m64n128k16",))
    assert (ptx_mma(ms), ptx_mma_shapes(ms)) == ("mma.sync", ("m16n8k16",))
    assert (ptx_mma("fma.rn.f32 %f1, %f2, %f3, %f4;"), ptx_mma_shapes("ld.global.f32 %f1, [%rd1];")) == ("none", ())
    assert ptx_mma(ms + "\n" + wg) == "wgmma"  # a kernel with both is a wgmma kernel


@pytest.mark.ptx
def test_compiled_kernels_record_their_mma(tmp_path: Path) -> None:
    """Fresh compiles agree with the rule: 64 rows on a warpgroup is wgmma on sm_90, two warps or sm_80
    is mma.sync; the kind survives the kernel cache's record."""
    got = {}
    for target, config in (("sm_90", W4), ("sm_90", W2), ("sm_80", W4)):
        kernel = compile_kernel(Family("gemm", "float16", target), config, cache_dir=tmp_path)
        assert kernel.mma == ("wgmma" if wgmma_eligible(config, "float16", get_profile(target)) else "mma.sync")
        again = CompiledKernel.from_dict(kernel.to_dict())
        assert again.mma == kernel.mma == kernel.to_dict()["mma"]
        got[(target, config.num_warps)] = kernel.mma
    assert got == {("sm_90", 4): "wgmma", ("sm_90", 2): "mma.sync", ("sm_80", 4): "mma.sync"}


@pytest.mark.ptx
def test_tf32_space_compiles_to_wgmma_on_sm90(tmp_path: Path) -> None:
    """A real sm_90 AOT compile of configs of the float32 space in tf32 precision (optimize's default): the PTX
    uses wgmma on tf32 operands exactly where ``wgmma_eligible`` says so: a warpgroup tile with pointer loads,
    its TMA twin and a fifth-stage tile (which only the tf32 space holds), as B [K, N] and as B^T; the decode
    tile the space keeps on mma.sync stays there."""
    from tuner.aot import tma_div16
    from tuner.space import enumerate_space

    family = Family("gemm", "float32", "sm_90")
    space = set(enumerate_space(family, "tf32"))
    wg, decode = MicroKernel(64, 64, 32, 4, 3), MicroKernel(16, 64, 32, 2, 3)
    cases = [(wg, False), (wg, True), (dataclasses.replace(wg, tma=1), False), (MicroKernel(64, 128, 32, 4, 5), False),
             (decode, False)]
    for config, trans_b in cases:
        assert config in space, config.key()
        kernel = compile_kernel(family, config, trans_b=trans_b, cache_dir=tmp_path, allow_tf32=True,
                                div16=tma_div16("gemm") if config.tma else ())
        wgmma = wgmma_eligible(config, "float32", H100, tf32=True)
        assert kernel.mma == ("wgmma" if wgmma else "mma.sync"), (config.key(), trans_b, kernel.mma)
        if wgmma:
            assert "wgmma.mma_async" in kernel.ptx and ".tf32.tf32" in kernel.ptx, config.key()
        if config.tma:
            assert "cp.async.bulk.tensor" in kernel.ptx
    assert not wgmma_eligible(decode, "float32", H100, tf32=True)


def test_cost_model_tells_wgmma_kernels_apart() -> None:
    col = FEATURE_NAMES.index("wgmma")
    assert kernel_features([W4, W2], H100, "float16")[:, col].tolist() == [1.0, 0.0]
    assert kernel_features([W4, W2], A100, "float16")[:, col].tolist() == [0.0, 0.0]
    assert kernel_features([W4], H100, "float32")[:, col].tolist() == [0.0]  # ieee fp32: no tensor core
    # The two configs differ only in warps, which the analytic f_MK ignores but for the MMA's peak. Its
    # tile roofline makes every tile memory bound at the H100's real bandwidth (f_MK = intensity x bandwidth,
    # whatever the peak), so the peak shows on a profile with ample bandwidth.
    fast = dataclasses.replace(H100, dram_bandwidth_gbs=1e6)
    h100 = AnalyticCostModel(fast, "float16").f_mk([W4, W2])
    assert h100[1] / h100[0] == pytest.approx(H100.mma_sync_fraction) and H100.mma_sync_fraction < 0.7
    a100 = AnalyticCostModel(dataclasses.replace(A100, dram_bandwidth_gbs=1e6), "float16").f_mk([W4, W2])
    assert a100[1] == pytest.approx(a100[0])
    assert config_peak_flops(W2, H100, "bfloat16") == pytest.approx(peak_flops(H100, "bfloat16") * 2 / 3)
    assert config_peak_flops(W2, H100, "float32") == peak_flops(H100, "float32")


def test_analytic_measurer_uses_the_mma_sync_rate() -> None:
    # The compute term is the MMAs plus the loop's load issue (tuner/roofline.py); with ample bandwidth its MMA
    # term shows the mma.sync config at 2/3 of the wgmma rate and the call is slower. (Four stages: at three, or
    # at five with fewer resident blocks, these 64 x 64 tiles wait on their loads' round trips as much as on
    # their MMAs.)
    big = Problem(4096, 4096, 4096)
    fast = dataclasses.replace(H100, dram_bandwidth_gbs=1e6)
    m = AnalyticMeasurer(fast, "float16")
    deep4, deep2 = (dataclasses.replace(c, num_stages=4) for c in (W4, W2))
    w4, w2 = (m.terms(c, big) for c in (deep4, deep2))
    assert w4 is not None and w2 is not None
    assert w2.mma == pytest.approx(w4.mma * 1.5)
    slow, quick = (r.seconds for r in m.measure(Family("gemm", "float16", "sm_90"), [(deep2, big), (deep4, big)]))
    assert slow > 1.2 * quick
    assert "mma.sync=" in AnalyticMeasurer(H100, "float16").device_key()
    assert "mma.sync" not in AnalyticMeasurer(A100, "float16").device_key()  # other targets' records stay valid


def test_a_cost_model_saved_before_the_wgmma_feature_is_refused(tmp_path: Path) -> None:
    """Its regressor was fitted on one feature fewer: loading it says so instead of failing at predict."""
    import pickle

    from tuner.cost_model import load_model

    model = AnalyticCostModel(H100, "float16")
    path = tmp_path / "old.pkl"
    path.write_bytes(pickle.dumps(("dietcode-cost-model-v1", model)))
    with pytest.raises(DietcodeError, match="is not a dietcode cost model"):
        load_model(path)
    model.save(tmp_path / "new.pkl")
    assert isinstance(load_model(tmp_path / "new.pkl"), AnalyticCostModel)
