"""TMA configs (``MicroKernel.tma``): the gemm and bmm templates reading A and B through tensor descriptors made
on the device. Interpreted against float64 (tests/_tma_cases.py), compiled for sm_90 (TMA copies feeding wgmma,
256 B of global scratch per program), the sm_90-only space axis, the bundle's scratch records (both readers),
the workspace that carries the scratch (C and Python agree) and, on an sm_90 GPU, a launch through the C
launcher against torch. Compiles are few and small."""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import pytest

from _interpreter import run_interpreted
from _tma_cases import CASES as TMA_CASES
from dietcode_ort.bundle import seal
from dietcode_ort.errors import DietcodeError
from tuner.hardware import get_profile
from tuner.space import Family, MicroKernel, enumerate_space, prune_report, validate, wgmma_eligible
from tuner.workload import Epilogue

TMA = MicroKernel(64, 64, 64, 4, 3, tma=1)
TMA_SPLIT = MicroKernel(64, 64, 64, 4, 3, 8, 4, tma=1)
FULL = Epilogue(bias=True, activation="gelu", alpha=0.5, residual=True)


# ---- the template under the interpreter ----

@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_interpreted("_tma_cases.py")


@pytest.mark.parametrize("name", list(TMA_CASES))
def test_tma_template_matches_float64(interpreted: dict[str, Any], name: str) -> None:
    outcome = interpreted[name]
    assert outcome["ok"], outcome.get("error")
    assert outcome["shape_ok"] and outcome["dtype_ok"], outcome
    assert outcome["excess"] <= 0.0, f"{name}: max error {outcome['max_err']}"


def test_tma_run_refuses_rows_tma_cannot_read(interpreted: dict[str, Any]) -> None:
    assert interpreted["refusal"]["ok"] and "multiples of 16 bytes" in interpreted["refusal"]["error"]


# ---- the space ----

def test_only_sm90_wgmma_gemm_and_bmm_configs_get_tma() -> None:
    for target in ("sm_80", "sm_89"):
        for op in ("gemm", "bmm", "conv"):
            for dtype in ("float32", "float16", "bfloat16"):
                assert not any(c.tma for c in enumerate_space(Family(op, dtype, target))), (target, op, dtype)
    h100 = get_profile("sm_90")
    for op in ("gemm", "bmm"):
        for dtype in ("float16", "bfloat16"):
            space = enumerate_space(Family(op, dtype, "sm_90"))
            tma = [c for c in space if c.tma and not c.persistent]  # persistent twins: tests/test_persistent.py
            plain = {c for c in space if not c.tma}
            # every wgmma config has a TMA twin, and nothing else does
            assert {MicroKernel(**{**c.to_dict(), "tma": 0}) for c in tma} == {c for c in plain
                                                                             if wgmma_eligible(c, dtype, h100)}
            assert len(tma) == 294 and len(space) == 1007 + 222
        assert not any(c.tma for c in enumerate_space(Family(op, "float32", "sm_90"), "ieee"))  # ieee: no wgmma
        assert any(c.tma for c in enumerate_space(Family(op, "float32", "sm_90"), "tf32"))  # tf32 dots use wgmma
    assert not any(c.tma for c in enumerate_space(Family("conv", "float16", "sm_90")))
    assert prune_report(Family("conv", "float16", "sm_90"))["tma"] > 0
    with pytest.raises(DietcodeError, match="tma=1 is outside the space"):
        validate(Family("gemm", "float16", "sm_80"), TMA)
    with pytest.raises(DietcodeError, match="rule 'tma'"):
        validate(Family("gemm", "float16", "sm_90"), MicroKernel(32, 64, 64, 4, 3, tma=1))  # a decode tile: mma.sync


def test_tma_keys_and_records_leave_other_configs_unchanged() -> None:
    plain = MicroKernel(64, 64, 64, 4, 3)
    assert plain.key() == "m64n64k64w4s3g8k1" and "tma" not in plain.to_dict()
    assert TMA.key() == "m64n64k64w4s3g8k1t" and TMA.to_dict()["tma"] == 1
    for config in (plain, TMA, TMA_SPLIT):
        assert MicroKernel.from_key(config.key()) == config
        assert MicroKernel.from_dict(config.to_dict()) == config
    with pytest.raises(DietcodeError, match="bad micro-kernel key"):
        MicroKernel.from_key("m64n64k64w4s3g8k1x")


# ---- ahead-of-time compilation ----

@pytest.mark.ptx
def test_tma_gemm_compiles_to_bulk_tensor_copies_and_wgmma_on_sm90(tmp_path: Path) -> None:
    from tuner.aot import compile_kernel, shipped_div16

    div16 = shipped_div16("gemm", True, None, None, residual=True)  # symbolic N and K: no assumption on them
    assert "K" not in div16 and "N" not in div16
    kernel = compile_kernel(Family("gemm", "float16", "sm_90"), TMA, epilogue=FULL, div16=div16, cache_dir=tmp_path)
    assert "cp.async.bulk.tensor" in kernel.ptx and "tensormap.replace" in kernel.ptx and kernel.mma == "wgmma"
    assert (kernel.global_scratch_size, kernel.global_scratch_align) == (256, 128)  # two 128-byte descriptors
    assert {"a", "b", "K", "N"} <= set(kernel.div16)  # the TMA rules, checked per call
    assert kernel.params == ("a", "b", "bias", "c", "M", "N", "K", "residual") and kernel.n_spills == 0
    plain = compile_kernel(Family("gemm", "float16", "sm_90"), MicroKernel(64, 64, 64, 4, 3), epilogue=FULL,
                           div16=div16, cache_dir=tmp_path)
    assert "cp.async.bulk.tensor" not in plain.ptx and plain.global_scratch_size == 0 and plain.mma == "wgmma"
    assert "K" not in plain.div16


@pytest.mark.ptx
def test_tma_split_k_and_bmm_compile_on_sm90(tmp_path: Path) -> None:
    from tuner.aot import compile_kernel

    split = compile_kernel(Family("gemm", "float16", "sm_90"), TMA_SPLIT, epilogue=FULL, cache_dir=tmp_path)
    assert "cp.async.bulk.tensor" in split.ptx and split.params[-2:] == ("workspace", "counters")
    assert split.global_scratch_size == 256 and "atom.global.gpu.acq_rel.add.u32" in split.ptx
    bmm = compile_kernel(Family("bmm", "bfloat16", "sm_90"), MicroKernel(128, 128, 64, 8, 4, tma=1),
                         epilogue=Epilogue(alpha=0.125), trans_b=True, cache_dir=tmp_path)
    assert "cp.async.bulk.tensor" in bmm.ptx and bmm.mma == "wgmma" and bmm.global_scratch_size == 256
    assert {"stride_a_batch", "stride_b_batch", "a", "b", "K", "N"} <= set(bmm.div16)
    # sm_80 has no TMA: the same config compiles to ordinary loads and asks for no scratch
    ampere = compile_kernel(Family("gemm", "float16", "sm_80"), TMA, cache_dir=tmp_path)
    assert "cp.async.bulk.tensor" not in ampere.ptx and ampere.global_scratch_size == 0


def test_scratch_records_and_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from tuner import aot

    assert aot.check_scratch(256, 128) and aot.check_scratch(0, 1)
    assert not aot.check_scratch(256, 96) and not aot.check_scratch(1 << 20, 128) and not aot.check_scratch(64, 128)
    with pytest.raises(DietcodeError, match="no TMA variant"):
        aot.tma_div16("conv")
    fake = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=1 << 20, global_scratch_align=128,
                                                    profile_scratch_size=0, num_ctas=1, cluster_dims=(1, 1, 1)),
                           asm={"ptx": "", "cubin": b""})
    monkeypatch.setattr(aot, "_triton_compile", lambda *a, **k: (fake, ""))
    with pytest.raises(DietcodeError, match="needs scratch memory .*refused"):
        aot.compile_kernel(Family("gemm", "float16", "sm_90"), TMA, cache_dir=tmp_path)


# ---- bundle records and the workspace ----

def _tma_bundle_kernel(**changes: Any) -> Any:
    from dietcode_ort.bundle import BundleKernel

    fields = dict(name="k", images=(("sm_90a", b"\x7fELF"),), image_scratch=((256, 128),),
                  ptx=".version 8.0\n.target sm_90a\n", ptx_scratch=(256, 128),
                  params=("a", "b", "c", "M", "N", "K"), block_m=64, block_n=64, div16=("a", "b", "K", "N"),
                  dtype="float16")
    fields.update(changes)
    return BundleKernel(**fields)


def _payload(kernel: Any) -> bytes:
    from dietcode_ort.bundle import Bundle, DispatchTree

    return Bundle((), (kernel,), DispatchTree.single(0)).to_bytes()


def test_bundle_round_trips_the_scratch_records() -> None:
    from dietcode_ort.bundle import read_bundle

    kernel = _tma_bundle_kernel(image_scratch=((256, 128),), ptx_scratch=(512, 256))
    back = read_bundle(_payload(kernel)).kernels[0]
    assert back.image_scratch == ((256, 128),) and back.ptx_scratch == (512, 256)
    plain = read_bundle(_payload(_tma_bundle_kernel(image_scratch=(), ptx_scratch=(0, 1)))).kernels[0]
    assert plain.image_scratch == ((0, 1),) and plain.ptx_scratch == (0, 1)


def test_from_compiled_records_the_scratch(tmp_path: Path) -> None:
    from dietcode_ort.bundle import BundleKernel
    from tuner.aot import compile_kernel

    kernel = compile_kernel(Family("gemm", "float16", "sm_90"), TMA, cache_dir=tmp_path)
    bundled = BundleKernel.from_compiled([kernel])
    assert bundled.image_scratch == ((256, 128),) and bundled.ptx_scratch == (256, 128)


@pytest.mark.parametrize("bad", [(256, 96), (256, 0), (1 << 17, 128), (64, 128), (256, 2048)])
def test_bad_scratch_records_are_refused_by_both_readers(bad: tuple[int, int]) -> None:
    from dietcode_ort.runtime import load_core

    with pytest.raises(DietcodeError, match="global scratch"):
        _tma_bundle_kernel(image_scratch=(bad,)).validate(0)
    with pytest.raises(DietcodeError, match="global scratch"):
        _tma_bundle_kernel(ptx_scratch=bad).validate(0)
    # the C reader, given the bytes the writer would refuse: patch a valid payload's image record (resealed)
    good = _payload(_tma_bundle_kernel(ptx_scratch=(0, 1)))
    record = struct.pack("<II", 256, 128)
    assert good.count(record) == 1
    with pytest.raises(DietcodeError, match="invalid kernel bundle: .*global scratch"):
        load_core().parse(seal(good.replace(record, struct.pack("<II", *bad))))
    ptx_record = struct.pack("<II", 512, 256)  # the PTX's record, last in the kernel record
    good = _payload(_tma_bundle_kernel(ptx_scratch=(512, 256)))
    assert good.count(ptx_record) == 1
    with pytest.raises(DietcodeError, match="invalid kernel bundle: kernel 0: PTX: global scratch"):
        load_core().parse(seal(good.replace(ptx_record, struct.pack("<II", *bad))))
    with pytest.raises(DietcodeError, match="global scratch record for PTX it does not carry"):
        _tma_bundle_kernel(ptx="", ptx_scratch=(256, 128)).validate(0)


@pytest.mark.parametrize("m, n, batch, split_k", [(1, 64, 1, 1), (768, 768, 1, 1), (37, 100, 6, 1), (16, 768, 1, 4),
                                                  (130, 70, 3, 8)])
def test_workspace_bytes_with_scratch_agree(m: int, n: int, batch: int, split_k: int) -> None:
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.templates import workspace_bytes

    params = ("a", "b", "c", "M", "N", "K") + (("workspace", "counters") if split_k > 1 else ())
    bundle = load_core().parse(_payload(_tma_bundle_kernel(params=params, split_k=split_k)))
    args = LaunchArgs(M=m, N=n, K=64, batch=batch)
    got = bundle.workspace_bytes(0, args)
    programs = math.ceil(m / 64) * math.ceil(n / 64) * batch * split_k
    split_part = workspace_bytes(m, n, batch, 64, 64, split_k)
    assert got == workspace_bytes(m, n, batch, 64, 64, split_k, 256, 128)
    assert got == split_part + (128 - 16) + programs * 256  # room to align the scratch up to 128 bytes
    assert got % 16 == 0
    if (m, n) == (768, 768):
        assert programs * 256 == 36 * 1024  # docs/abi.md's example
    # without scratch the size is the split-K part alone
    plain = load_core().parse(_payload(_tma_bundle_kernel(params=params, split_k=split_k, image_scratch=(),
                                                          ptx_scratch=(0, 1))))
    assert plain.workspace_bytes(0, args) == split_part


def test_workspace_overflow_with_scratch_is_refused() -> None:
    from dietcode_ort.runtime import LaunchArgs, load_core

    params = ("a", "b", "c", "M", "N", "K", "workspace", "counters")
    bundle = load_core().parse(_payload(_tma_bundle_kernel(params=params, block_m=1, block_n=1, split_k=1024,
                                                           image_scratch=((1 << 16, 128),), ptx_scratch=(1 << 16, 128))))
    args = LaunchArgs(M=2**31 - 1, N=1, K=64, batch=65535)  # the split-K part fits int64, the scratch does not
    with pytest.raises(DietcodeError, match="overflows int64"):
        bundle.workspace_bytes(0, args)
    fit, why = bundle.fit(0, args)
    assert fit == "workspace size" and "global scratch" in why


# ---- on an sm_90 GPU: the real launcher ----

@pytest.mark.gpu
@pytest.mark.parametrize("config", [TMA, TMA_SPLIT], ids=["tma", "tma_split_k4"])
def test_tma_gemm_through_the_launcher(config: MicroKernel, tmp_path: Path) -> None:
    """A TMA kernel compiled ahead of time, bundled and launched with dc_launch (which passes the global scratch
    from the workspace, past the split-K part), against torch in float64; the workspace starts as garbage."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.aot import compile_kernel

    kernel = compile_kernel(Family("gemm", "float16", "sm_90"), config, epilogue=FULL, cache_dir=tmp_path)
    assert kernel.global_scratch_size == 256
    cb = load_core().parse(Bundle((), (BundleKernel.from_compiled([kernel]),), DispatchTree.single(0)).to_bytes())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(768, 768, 768), (37, 112, 200), (1, 64, 3072)]:
        a = torch.randn(m, k, device="cuda", generator=gen).half()
        b = torch.randn(k, n, device="cuda", generator=gen).half()
        bias = torch.randn(n, device="cuda", generator=gen).half()
        residual = torch.randn(m, n, device="cuda", generator=gen).half()
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        args = LaunchArgs(a=a.data_ptr(), b=b.data_ptr(), bias=bias.data_ptr(), c=c.data_ptr(),
                          residual=residual.data_ptr(), M=m, N=n, K=k, batch=1)
        size = cb.workspace_bytes(0, args)
        assert size >= -(-m // 64) * -(-n // 64) * config.split_k * 256
        workspace = torch.full((size,), 0xAB, device="cuda", dtype=torch.uint8)
        args.workspace, args.workspace_bytes = workspace.data_ptr(), size
        cb.launch(0, args, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        ref = 0.5 * (a.double() @ b.double()) + bias.double()
        ref = 0.5 * ref * (1 + torch.erf(ref / math.sqrt(2))) + residual.double()
        tol = 2e-2 * max(1.0, float(ref.abs().max()))
        assert float((c.double() - ref).abs().max()) <= tol, (m, n, k)
        short = LaunchArgs(**{f: getattr(args, f) for f, _ in LaunchArgs._fields_})
        short.workspace_bytes = size - 16  # the launcher refuses a workspace without room for the scratch
        with pytest.raises(DietcodeError, match="global scratch 256 B per program"):
            cb.launch(0, short, torch.cuda.current_stream().cuda_stream)


def test_the_launch_passes_the_scratch_past_the_split_k_part_aligned() -> None:
    """dc_kernel_scratch_pointer is the pointer dc_launch_fit passes: the first 128-byte multiple at or past the
    workspace's split-K part; with the programs' scratch it stays inside dc_kernel_workspace_bytes, whatever the
    16-byte alignment of the workspace; an image without scratch gets null."""
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.templates import workspace_bytes

    params = ("a", "b", "c", "M", "N", "K", "workspace", "counters")
    bundle = load_core().parse(_payload(_tma_bundle_kernel(params=params, split_k=4, image_scratch=((256, 128),),
                                                           ptx_scratch=(0, 1))))
    m, n = 100, 130
    split_part = workspace_bytes(m, n, 1, 64, 64, 4)
    programs = 2 * 3 * 4
    for base in (0x10000, 0x10010, 0x10070, 0x10080):
        args = LaunchArgs(M=m, N=n, K=64, batch=1, workspace=base)
        size = bundle.workspace_bytes(0, args)
        pointer = bundle.scratch_pointer(0, 0, args)
        assert pointer % 128 == 0 and base + split_part <= pointer < base + split_part + 128
        assert pointer + programs * 256 <= base + size
        assert bundle.scratch_pointer(0, -1, args) == 0  # the PTX records no scratch
    with pytest.raises(DietcodeError, match="has no image 1"):
        bundle.scratch_pointer(0, 1, args)


@pytest.mark.parametrize("n, k, trans_b, tma", [("768", "768", False, True), ("768", "100", False, False),
                                                 ("50257", "768", True, False), ("seq", "64", False, False)])
def test_tma_configs_are_tuned_only_where_k_and_n_keep_tma_launchable(n: str, k: str, trans_b: bool,
                                                                      tma: bool) -> None:
    """A TMA kernel is compiled assuming K and N are multiples of 16 (aot.tma_div16): a workload whose K or N is
    another constant, or symbolic, would run every (or some) call on the vendor path, so its candidates hold
    no TMA config; the rest of the sm_90 space stays."""
    from tuner.optimize import OptimizeOptions, candidate_space
    from tuner.space import Family, enumerate_space
    from tuner.workload import Workload

    w = Workload(op="gemm", onnx_op="MatMul", nodes=("mm",), m="batch*seq", n=n, k=k, dtype="float16",
                 symbols=("batch", "seq"), trans_b=trans_b)
    space = candidate_space(w, OptimizeOptions(targets=("sm_90",)))
    full = enumerate_space(Family("gemm", "float16", "sm_90"))
    assert any(c.tma for c in space) is tma
    assert [c for c in full if not c.tma] == [c for c in space if not c.tma]
    # two targets: only configs both have, so no TMA (sm_80 has none)
    assert not any(c.tma for c in candidate_space(w, OptimizeOptions(targets=("sm_90", "sm_80"))))
