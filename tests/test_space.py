"""The shape-generic space, the hardware profiles and the ``space`` command (no compilation here)."""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import math
import re

import pytest

from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError
from tuner import space
from tuner.hardware import PROFILES, TARGETS, get_profile, resident_blocks
from tuner.space import (AXES, FAMILIES, RULES, Family, MicroKernel, axes_for, enumerate_space,
                         estimate_registers, estimate_shared, prune_report, validate, wgmma_eligible)
from tuner.workload import Instance, Workload


def test_key_round_trip_and_order() -> None:
    config = MicroKernel(64, 64, 32, 4, 3)
    assert config.key() == "m64n64k32w4s3g8k1"
    assert MicroKernel.from_key("m128n16k64w2s4g1k4") == MicroKernel(128, 16, 64, 2, 4, 1, 4)
    assert MicroKernel.from_dict(config.to_dict()) == config
    assert MicroKernel(16, 16, 16, 2, 2) < MicroKernel(32, 16, 16, 2, 2)
    with pytest.raises(DietcodeError, match="m64n64k32w4s3g8k1"):
        MicroKernel.from_key("64x64x32")


def _workload(instances: tuple[Instance, ...]) -> Workload:
    return Workload(op="gemm", onnx_op="MatMul", nodes=("mm",), m="batch*seq", n="768", k="768",
                    dtype="float16", symbols=("batch", "seq"), instances=instances)


def test_space_does_not_depend_on_shapes() -> None:
    # the family, the float32 precision (which shapes the float32 spaces) and a conv's layout, never a shape
    assert list(inspect.signature(enumerate_space).parameters) == ["family", "fp32_precision", "channels_last"]
    small = _workload((Instance.of({"batch": 1, "seq": 1}), Instance.of({"batch": 1, "seq": 7})))
    large = _workload(tuple(Instance.of({"batch": b, "seq": s}) for b in (8, 32) for s in (128, 512)))
    assert small.problems() != large.problems()
    spaces = [enumerate_space(Family(w.op, w.dtype, "sm_90")) for w in (small, large)]
    assert spaces[0] == spaces[1]
    assert spaces[0] == sorted(spaces[0]) and len(set(spaces[0])) == len(spaces[0])


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f"{f.op}-{f.dtype}-{f.target}")
def test_pruning_counts_add_up_and_respect_limits(family: Family) -> None:
    report = prune_report(family)
    configs = enumerate_space(family)
    assert report["total"] == math.prod(len(v) for v in axes_for(get_profile(family.target)).values())
    assert sum(report[rule] for rule in RULES) + report["kept"] == report["total"]
    assert report["kept"] == len(configs)
    assert 80 <= len(configs) <= 1500  # explorable: about a hundred (16-bit conv) to hundreds (sm_90 16-bit gemm:
    # 1229 with its TMA and persistent twins; sm_90 float32 gemm in tf32, the default precision: 1344)
    p = get_profile(family.target)
    for c in configs:
        assert c.threads <= p.max_threads_per_block
        assert estimate_shared(c, family.dtype) <= p.smem_per_block_optin
        assert estimate_registers(c, family.dtype, op=family.op) <= p.regs_per_thread
        assert min(c.block_m, c.block_n, c.block_k) >= 16
        assert c.split_k == 1 or (c.block_m <= c.block_n and c.block_m * c.block_n <= 4096)


@pytest.mark.parametrize("target", TARGETS)
def test_split_k_for_every_dtype_on_small_wide_tiles(target: str) -> None:
    """Split-K meets its splits in an fp32 workspace, so every dtype has it, with each split value, on tiles
    no taller than wide and at most 64x64; a taller or a larger tile is pruned by the 'split_k' rule."""
    split = MicroKernel(16, 64, 64, 2, 2, 8, 8)  # BERT-base's N = 768 at M = 16: 12 tiles x 8 splits
    for op in ("gemm", "bmm", "conv"):
        for dtype in ("float32", "float16", "bfloat16"):
            family = Family(op, dtype, target)
            configs = enumerate_space(family)
            assert {c.split_k for c in configs} == {1, 2, 4, 8}, (op, dtype)
            assert prune_report(family)["split_k"] > 0
            if op != "conv":
                validate(family, split)
            # tiles the space keeps unsplit but not split: taller than wide, or larger than 64x64
            unsplit = [c for c in configs if c.split_k == 1 and (c.block_m > c.block_n or c.block_m * c.block_n > 4096)]
            assert {c.block_m > c.block_n for c in unsplit} == {True, False}, (op, dtype)
            for c in unsplit[::7]:
                with pytest.raises(DietcodeError, match="rule 'split_k'"):
                    validate(family, dataclasses.replace(c, split_k=2))


def test_limits_shape_the_space() -> None:
    """Smaller shared memory (L4) and 4-byte elements prune more; the rules actually fire."""
    sizes = {t: len(enumerate_space(Family("gemm", "float16", t))) for t in TARGETS}
    assert sizes["sm_89"] < sizes["sm_80"] < sizes["sm_90"]
    l4, h100 = prune_report(Family("gemm", "float32", "sm_89")), prune_report(Family("gemm", "float32", "sm_90"))
    assert l4["shared_memory"] / l4["total"] > h100["shared_memory"] / h100["total"]  # sm_90 has more axes
    assert prune_report(Family("gemm", "float16", "sm_80"))["k_bytes"] > 0
    assert prune_report(Family("gemm", "float32", "sm_80"))["k_bytes"] == 0
    fp16 = enumerate_space(Family("gemm", "float16", "sm_80"))
    assert MicroKernel(128, 128, 64, 8, 3) in fp16 and MicroKernel(256, 256, 64, 8, 3) not in fp16


def test_docstring_sizes_are_measured() -> None:
    rows = re.findall(r"^\s+(sm_\d+)\s+(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", space.__doc__ or "", re.M)
    assert len(rows) == 9
    columns = (("float32", "tf32"), ("float32", "ieee"), ("float16", "tf32"), ("bfloat16", "tf32"))
    for target, op, *sizes in rows:
        for (dtype, precision), size in zip(columns, sizes):
            assert len(enumerate_space(Family(op, dtype, target), precision)) == int(size), (target, op, dtype, precision)
    assert enumerate_space(Family("gemm", "float32", "sm_90")) == enumerate_space(Family("gemm", "float32", "sm_90"),
                                                                                  "tf32")  # optimize's default


def test_validate_names_allowed_values() -> None:
    family = Family("gemm", "float16", "sm_80")
    validate(family, MicroKernel(64, 64, 32, 4, 3))
    with pytest.raises(DietcodeError, match="block_m=48 .*allowed: 16, 32, 64, 128, 256"):
        validate(family, MicroKernel(48, 64, 32, 4, 3))
    with pytest.raises(DietcodeError, match="split_k=3 .*allowed: 1, 2, 4, 8"):
        validate(family, MicroKernel(64, 64, 32, 4, 3, 8, 3))
    with pytest.raises(DietcodeError, match="rule 'registers'"):
        validate(family, MicroKernel(256, 256, 64, 4, 2))
    with pytest.raises(DietcodeError, match="rule 'k_bytes'"):
        validate(family, MicroKernel(64, 64, 16, 4, 3))
    for bad, message in ((Family("gemm", "float16", "sm_70"), "known targets: sm_80, sm_89, sm_90"),
                         (Family("matmul", "float16", "sm_80"), "allowed: gemm, bmm, conv"),
                         (Family("gemm", "int8", "sm_80"), "allowed: float32, float16, bfloat16")):
        with pytest.raises(DietcodeError, match=message):
            enumerate_space(bad)


def test_profiles_and_resident_blocks() -> None:
    assert PROFILES["sm_80"].num_sms == 108 and PROFILES["sm_90"].num_sms == 132
    assert [PROFILES[t].arch for t in TARGETS] == [80, 89, 90]
    with pytest.raises(DietcodeError, match="known targets: sm_80, sm_89, sm_90"):
        get_profile("sm_75")
    a100 = get_profile("sm_80")
    # 4 warps x 64 regs = 8 KiB registers per block -> 8 blocks; threads alone would allow 16.
    assert resident_blocks(a100, 128, 64, 0) == 8
    assert resident_blocks(a100, 128, 32, 0) == 16
    assert resident_blocks(a100, 64, 16, 0) == 32  # capped by max blocks per SM
    assert resident_blocks(a100, 256, 128, 100 * 1024) == 1  # shared memory limits
    assert resident_blocks(a100, 128, 64, 40 * 1024) == 4  # 164 KiB // (40 KiB + 1 KiB reserved)
    assert resident_blocks(a100, 128, 64, 41 * 1024) == 3  # the reserved 1 KiB per block matters
    assert resident_blocks(a100, 128, 64, 200 * 1024) == 0  # over the opt-in limit
    assert resident_blocks(a100, 2048, 32, 0) == 0
    assert resident_blocks(get_profile("sm_89"), 512, 32, 0) == 3  # 1536 threads per SM on L4


def test_space_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["space", "--target", "sm_90", "--op", "bmm", "--dtype", "bfloat16", "--json", "--estimate"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["target"], out["op"], out["dtype"]) == ("sm_90", "bmm", "bfloat16")
    assert out["limits"]["smem_per_block_optin"] == 227 * 1024
    configs = [MicroKernel.from_dict(c) for c in out["configs"]]
    assert configs == enumerate_space(Family("bmm", "bfloat16", "sm_90"))
    assert all(set(c) >= {"block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "split_k",
                          "shared_bytes"} for c in out["configs"])
    assert out["shared_source"] == "estimate"
    assert out["axes"]["num_stages"] == [2, 3, 4, 5]  # sm_90's fifth stage


def test_space_command_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["space", "--target", "sm_89", "--op", "conv", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "374 of 3600" in text and "shared_memory" in text
    assert main(["space", "--target", "sm_70", "--op", "gemm"]) == 2
    assert "known targets: sm_80, sm_89, sm_90" in capsys.readouterr().err
    assert main(["space", "--target", "sm_80", "--op", "gemm", "--dtype", "fp8"]) == 2
    assert "allowed: float32, float16, bfloat16" in capsys.readouterr().err
    for workers in ("0", "-2"):  # refused before anything compiles
        assert main(["space", "--target", "sm_90", "--op", "gemm", "--compile", "--workers", workers]) == 2
        assert f"error: --workers must be at least 1, got {workers}\n" == capsys.readouterr().err


def test_axes_products_are_all_enumerated() -> None:
    family = Family("conv", "float32", "sm_90")
    every = set(itertools.product(*axes_for(get_profile("sm_90")).values()))
    assert {dataclasses.astuple(c) for c in enumerate_space(family)} <= every


def test_space_command_json_compiles_on_demand(capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path) -> None:
    import tuner.space as space_mod

    family = Family("gemm", "float16", "sm_90")
    sample = enumerate_space(family)[:2]
    monkeypatch.setattr(space_mod, "enumerate_space", lambda f, precision="tf32": list(sample))  # a short compile
    assert main(["space", "--target", "sm_90", "--op", "gemm", "--json", "--cache-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shared_source"] == "compiled"
    assert [MicroKernel.from_dict(c) for c in out["configs"]] == sample
    assert all(isinstance(c["shared_bytes"], int) and c["shared_bytes"] > 0 for c in out["configs"])
    assert list(tmp_path.glob("*.json"))  # cached for the next call
    # 16-row decode tiles on sm_90: mma.sync, as the compiled PTX says
    assert [c["mma"] for c in out["configs"]] == ["mma.sync", "mma.sync"] and out["mma"] == {"mma.sync": 2}


def test_representative_epilogue_is_the_heaviest_under_split_k_too() -> None:
    """Split-K takes every epilogue now, so the compile filter compiles split configs with gelu as well (and
    the residual where the template has one)."""
    from tuner.space import representative_epilogue
    from tuner.templates import check_epilogue
    from tuner.workload import Epilogue

    split = MicroKernel(16, 64, 64, 2, 2, 8, 8)
    assert representative_epilogue(split, "gemm") == Epilogue(True, "gelu", residual=True)
    assert representative_epilogue(split, "bmm") == Epilogue(True, "gelu")
    assert representative_epilogue(split, "conv") == Epilogue(True, "gelu", residual=True)  # ResNet's shortcut
    for op in ("gemm", "bmm", "conv"):
        check_epilogue(op, representative_epilogue(split, op), split.split_k)


def test_only_sm90_has_the_wgmma_rule_and_fifth_stage() -> None:
    """Hopper's extra stage and its wgmma rule leave the other targets' axes and spaces as they were
    (the docstring table pins their sizes) and leave sm_90's ieee float32 space without a fifth stage."""
    for target in ("sm_80", "sm_89"):
        assert axes_for(get_profile(target)) == AXES
        for op, dtype, precision in itertools.product(("gemm", "bmm", "conv"), ("float32", "float16", "bfloat16"),
                                                      ("tf32", "ieee")):
            assert prune_report(Family(op, dtype, target), precision)["wgmma"] == 0
            assert enumerate_space(Family(op, dtype, target), precision) == enumerate_space(Family(op, dtype, target))
    assert axes_for(get_profile("sm_90"))["num_stages"] == (2, 3, 4, 5)
    assert all(c.num_stages <= 4 for c in enumerate_space(Family("gemm", "float32", "sm_90"), "ieee"))


def test_only_sm90_has_the_tma_axis() -> None:
    """TMA configs exist on sm_90 only, for wgmma gemm / bmm configs of 16-bit types and of float32 in tf32
    precision (the ``tma`` rule); the other targets' axes keep tma = 0 only, so their spaces and keys are
    unchanged, and ieee float32 (no tensor cores) has none."""
    for target in ("sm_80", "sm_89"):
        assert axes_for(get_profile(target))["tma"] == (0,)
        for op, dtype in itertools.product(("gemm", "bmm", "conv"), ("float32", "float16", "bfloat16")):
            assert prune_report(Family(op, dtype, target))["tma"] == 0
    assert axes_for(get_profile("sm_90"))["tma"] == (0, 1)
    profile = get_profile("sm_90")
    for op, dtype, precision in itertools.product(("gemm", "bmm", "conv"), ("float32", "float16", "bfloat16"),
                                                  ("tf32", "ieee")):
        tf32 = dtype == "float32" and precision == "tf32"
        tma = [c for c in enumerate_space(Family(op, dtype, "sm_90"), precision) if c.tma]
        assert all(wgmma_eligible(c, dtype, profile, tf32=tf32) for c in tma)
        assert bool(tma) == (op != "conv" and (dtype != "float32" or tf32)), (op, dtype, precision)
        assert all(c.key().endswith("t") for c in tma if not c.persistent)  # persistent twins: "tp1", "tp2"


def test_sm90_float32_space_follows_the_precision() -> None:
    """tf32 dots use wgmma on sm_90 (``wgmma_eligible``), so the tf32 float32 space gets the 16-bit spaces'
    rules: mma.sync configs only as decode tiles, the fifth stage and a TMA twin for wgmma configs; the ieee
    space is today's (FMA units: no wgmma pruning, no TMA). Checked against the compiled PTX in
    test_tf32_space_compiles_to_wgmma_on_sm90 (tests/test_hopper.py)."""
    profile = get_profile("sm_90")
    family = Family("gemm", "float32", "sm_90")
    tf32, ieee = enumerate_space(family, "tf32"), enumerate_space(family, "ieee")
    for c in tf32:
        assert wgmma_eligible(c, "float32", profile, tf32=True) or (c.block_m <= 32 and c.num_stages <= 4), c.key()
    wgmma = {c for c in tf32 if not c.tma and wgmma_eligible(c, "float32", profile, tf32=True)}
    assert {replace_tma(c) for c in tf32 if c.tma and not c.persistent} == wgmma and len(wgmma) == 319
    assert any(c.num_stages == 5 for c in wgmma)
    assert not any(c.tma or c.num_stages == 5 for c in ieee)
    assert MicroKernel(64, 64, 32, 2, 3) in ieee and MicroKernel(64, 64, 32, 2, 3) not in tf32  # mma.sync, 64 rows
    validate(family, MicroKernel(64, 64, 32, 4, 3, tma=1))
    with pytest.raises(DietcodeError, match=r"float32/sm_90 \(ieee\) space by rule 'tma'"):
        validate(family, MicroKernel(64, 64, 32, 4, 3, tma=1), "ieee")
    with pytest.raises(DietcodeError, match=r"\(tf32\) space by rule 'wgmma'"):
        validate(family, MicroKernel(64, 64, 32, 2, 3))
    with pytest.raises(DietcodeError, match="allowed: tf32, ieee"):
        enumerate_space(family, "fp32")


def replace_tma(config: MicroKernel) -> MicroKernel:
    return dataclasses.replace(config, tma=0)


def test_space_command_takes_the_fp32_precision(capsys: pytest.CaptureFixture[str]) -> None:
    for precision, size in (("tf32", 1344), ("ieee", 811)):
        assert main(["space", "--target", "sm_90", "--op", "gemm", "--dtype", "float32", "--json", "--estimate",
                     "--fp32-precision", precision]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["fp32_precision"] == precision and len(out["configs"]) == size
    assert main(["space", "--target", "sm_90", "--op", "gemm", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "float32 (tf32 dots)" in text and "1344 of 28800" in text
    with pytest.raises(SystemExit):
        main(["space", "--target", "sm_90", "--op", "gemm", "--fp32-precision", "fp64"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_16bit_space_spends_its_candidates_on_wgmma(dtype: str) -> None:
    family = Family("gemm", dtype, "sm_90")
    profile = get_profile("sm_90")
    configs = enumerate_space(family)
    for c in configs:  # every config uses wgmma, except decode tiles
        assert wgmma_eligible(c, dtype, profile) or (c.block_m <= 32 and c.num_stages <= 4), c.key()
    keys = {c.key() for c in configs}
    # decode tiles stay, mma.sync included (a 64-row wgmma tile would pad M = 1..32)
    assert {"m16n64k64w2s3g8k1", "m32n128k64w4s3g8k1", "m16n256k64w8s4g8k1"} <= keys
    assert not wgmma_eligible(MicroKernel.from_key("m16n64k64w2s3g8k1"), dtype, profile)
    # what wgmma-heavy kernels need: deep pipelines and 128x256 / 256x128 tiles on two warpgroups
    assert {"m128n128k64w8s5g8k1", "m128n256k32w8s5g8k1", "m256n128k64w8s4g8k1", "m128n256k64w8s4g8k1"} <= keys
    assert "m64n64k64w2s3g8k1" not in keys  # 64 rows on two warps: mma.sync, no decode tile
    with pytest.raises(DietcodeError, match="rule 'wgmma'"):
        validate(family, MicroKernel(64, 64, 64, 2, 3))
    with pytest.raises(DietcodeError, match="rule 'wgmma'"):
        validate(family, MicroKernel(16, 128, 64, 4, 5))  # no fifth stage for mma.sync
    report = prune_report(family)
    assert report["total"] == 28800 and report["wgmma"] > 0  # 4800 axis combinations x tma 0, 1 x persistent 0, 1, 2



def test_a_device_name_picks_its_products_figures_over_its_architectures_limits() -> None:
    """A GPU of a target's architecture other than the profile's own product (an H200, an H100 PCIe) is modelled
    with its datasheet's SMs, bandwidth and peaks and the architecture's limits (so the same kernel space); the
    profile's own product, a GPU without figures here and another architecture's name keep the target's profile."""
    from tuner.hardware import PRODUCTS, device_profile

    h100 = get_profile("sm_90")
    cases = {"NVIDIA H200": ("NVIDIA H200 SXM", 132, 4800.0, 989.4), "NVIDIA H200 NVL": ("NVIDIA H200 NVL", 132, 4800.0, 835.5),
             "NVIDIA H100 PCIe": ("NVIDIA H100 PCIe", 114, 2000.0, 756.5),
             "NVIDIA H100 NVL": ("NVIDIA H100 NVL", 132, 3900.0, 835.5),
             "model=NVIDIA H200;arch=sm_90;driver=13000;triton=3.6.0": ("NVIDIA H200 SXM", 132, 4800.0, 989.4)}
    for device, want in cases.items():
        got = device_profile(device, "sm_90")
        assert (got.name, got.num_sms, got.dram_bandwidth_gbs, got.fp16_tensor_tflops) == want, device
        assert {k: v for k, v in got.limits().items() if k != "num_sms"} == \
            {k: v for k, v in h100.limits().items() if k != "num_sms"}
        assert (got.arch, got.wgmma, got.fp16_flops_per_clk_sm) == (90, True, 4096)
    for device in ("NVIDIA H100 80GB HBM3", "NVIDIA H800", "Fake CUDA device (host memory)", "", h100.name):
        assert device_profile(device, "sm_90") == h100, device
    assert device_profile("NVIDIA H200", "sm_80") == get_profile("sm_80")  # the H200 is no sm_80 product
    assert device_profile("NVIDIA A100-SXM4-40GB", "sm_80").dram_bandwidth_gbs == 1555.0
    assert device_profile("NVIDIA A100-PCIE-40GB", "sm_80").dram_bandwidth_gbs == 1555.0
    assert device_profile("NVIDIA A100 80GB PCIe", "sm_80").dram_bandwidth_gbs == 1935.0
    assert device_profile("NVIDIA A100-SXM4-80GB", "sm_80") == get_profile("sm_80")
    l40s, l40 = device_profile("NVIDIA L40S", "sm_89"), device_profile("NVIDIA L40", "sm_89")
    assert (l40s.num_sms, l40s.dram_bandwidth_gbs, l40.name) == (142, 864.0, "NVIDIA L40")
    assert l40s.tensor_clock_hz == pytest.approx(l40.tensor_clock_hz, rel=0.01)  # one clock, half the rate
    for p in PRODUCTS:  # each product's name names it again, and its peaks imply a boost clock a GPU runs at
        profile = device_profile(p.name, p.target)
        assert profile.name == p.name and 1.2e9 < profile.tensor_clock_hz < 2.6e9, p
    for target in TARGETS:  # an analytic device key names the profile: it must not read as another product
        assert device_profile(get_profile(target).name, target) == get_profile(target)
