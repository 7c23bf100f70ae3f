"""Toolchain and driver: what made each image, the oldest driver that loads it (bundle format 4), the
per-session fit against the running driver through the C ABI, the PTX ISA cap of AOT compiles, and doctor's
report for a model."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dietcode_ort import toolchain as tc
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature, ImageChoice, Toolchain, read_bundle, select_image
from dietcode_ort.cli import main
from dietcode_ort.doctor import model_check
from dietcode_ort.errors import DietcodeError
from dietcode_ort.runtime import load_core

PTX80_94 = "//\n.version 9.4\n.target sm_80\n.address_size 64\n"
PTX80_88 = "//\n.version 8.8\n.target sm_80\n.address_size 64\n"
CUBIN_13 = Toolchain("3.9.0", "13.4.59", 90, 13000)  # ptxas 13.4 from PTX capped at 9.0
CUBIN_12 = Toolchain("3.9.0", "12.9.86", 88, 12000)
PTX_94 = Toolchain("3.9.0", "13.4.59", 94, 13040)
PTX_88 = Toolchain("3.9.0", "12.9.86", 88, 12090)
SM90, SM100 = (9, 0, 227 * 1024), (10, 0, 227 * 1024)


def _kernel(name: str, **kw: object) -> BundleKernel:
    base = dict(name=name, images=(("sm_90a", b"\x7fELF90" + name.encode()), ("sm_80", b"\x7fELF80")),
                image_toolchains=(CUBIN_13, CUBIN_12), ptx=PTX80_94, ptx_toolchain=PTX_94,
                params=("a", "b", "c", "M", "N", "K"), num_warps=4, shared=16384, block_m=64, block_n=64)
    base.update(kw)
    return BundleKernel(**base)  # type: ignore[arg-type]


def _bundle(*kernels: BundleKernel) -> Bundle:
    return Bundle((Feature("M", ((0, 0),)),), kernels, DispatchTree.single(0))


@pytest.fixture(scope="module")
def core():
    return load_core()


def _both_refuse(core, data: bytes, match: str) -> None:
    """The C core refuses ``data`` with ``match``, and so does Python's view of it (read_bundle)."""
    with pytest.raises(DietcodeError, match=match):
        read_bundle(data)
    with pytest.raises(DietcodeError, match=match):
        core.parse(data)


def test_driver_table_follows_the_ptx_isa_release_history() -> None:
    assert [tc.ptx_min_driver(isa) for isa in (87, 88, 90, 91, 94)] == [12080, 12090, 13000, 13010, 13040]
    assert tc.ptx_min_driver(86) == 12070  # 12.6 introduced no PTX ISA: 8.5 is 12.5, 8.6 is 12.7
    assert tc.max_ptx_isa(13000) == 90 and tc.max_ptx_isa(12080) == 87 and tc.max_ptx_isa(12060) == 85
    assert tc.cubin_min_driver("13.4.59") == 13000 and tc.cubin_min_driver("12.9.86") == 12000
    assert tc.parse_driver("13.0") == 13000 and tc.format_driver(12090) == "12.9"
    with pytest.raises(DietcodeError, match="PTX ISA 9.9 is not in"):
        tc.ptx_min_driver(99)
    with pytest.raises(DietcodeError, match="not MAJOR.MINOR"):
        tc.parse_driver("580")
    with pytest.raises(DietcodeError, match="older than every driver"):
        tc.max_ptx_isa(10000)


def test_toolchain_fields_round_trip_through_the_c_reader(core) -> None:
    plain = _kernel("plain", images=(("sm_80", b"\x7fELF"),), image_toolchains=(), ptx="", ptx_toolchain=Toolchain())
    b = _bundle(BundleKernel.vendor(), _kernel("k"), plain)
    data = b.to_bytes()
    back = read_bundle(data)
    assert back == b
    assert back.kernels[1].image_toolchains == (CUBIN_13, CUBIN_12) and back.kernels[1].ptx_toolchain == PTX_94
    assert back.kernels[2].image_toolchains == (Toolchain(),) and back.kernels[2].ptx_toolchain == Toolchain()
    parsed = core.parse(data)
    assert parsed.image_toolchains(1) == [
        {"image": 0, "triton": "3.9.0", "ptxas": "13.4.59", "ptx_isa": 90, "min_driver": 13000},
        {"image": 1, "triton": "3.9.0", "ptxas": "12.9.86", "ptx_isa": 88, "min_driver": 12000},
        {"image": -1, "triton": "3.9.0", "ptxas": "13.4.59", "ptx_isa": 94, "min_driver": 13040}]
    assert parsed.image_toolchains(2) == [{"image": 0, "triton": "", "ptxas": "", "ptx_isa": 0, "min_driver": 0}]
    assert parsed.image_toolchains(0) == []  # vendor: no image


def test_format_3_is_refused_with_the_version_named(core) -> None:
    data = bytearray(_bundle(_kernel("k")).to_bytes())
    struct.pack_into("<I", data, 8, 3)
    _both_refuse(core, bytes(data), "version 3, this reader knows 13")


def test_recorded_ptx_isa_must_be_the_ptx_version_line(core) -> None:
    _both_refuse(core, _bundle(_kernel("k", ptx_toolchain=PTX_88)).to_bytes(validate=False),
                 "PTX toolchain says ISA 8.8, the PTX's .version says 9.4")
    _both_refuse(core, _bundle(_kernel("k", ptx="", ptx_toolchain=PTX_94)).to_bytes(validate=False),
                 "toolchain record for PTX it does not carry")
    _both_refuse(core, _bundle(_kernel("k", ptx_toolchain=Toolchain("x" * 65))).to_bytes(validate=False),
                 "64")
    # both readers read the same ISA from the same text, edge cases included
    texts = ["\t.version 9.4\r\n", ".version 9.4 // c\n", "  .version  10.0", ".version 9.45\n", ".version 9\n",
             "x .version 9.4\n.version 8.8\n", ".versionx 9.4\n", "// .version 9.4\n", ".version 1234.5\n"]
    for text in texts:
        for claimed in (0, 88, 94, 100):
            ptx = text + ("" if text.endswith("\n") else "\n") + ".target sm_80\n"
            kernel = _kernel("k", ptx=ptx, ptx_toolchain=Toolchain(ptx_isa=claimed))
            data = _bundle(kernel).to_bytes(validate=False)
            try:  # the writer's validation and the C reader agree
                _bundle(kernel).to_bytes(validate=True)
                py = True
            except DietcodeError:
                py = False
            try:
                core.parse(data)
                cc = True
            except DietcodeError:
                cc = False
            assert py == cc == (claimed in (0, tc.ptx_isa(ptx))), (text, claimed)
    assert [tc.ptx_isa(t) for t in texts] == [94, 0, 100, 0, 0, 88, 0, 0, 0]


def test_fit_against_the_driver_through_the_c_abi(core) -> None:
    """An image whose minimum driver exceeds the running driver does not load: the kernel takes the next
    image for the device, else runs as the vendor kind with the reason; driver 0 checks nothing."""
    kernels = (BundleKernel.vendor(),
               _kernel("k"),  # sm_90a cubin (13.0), sm_80 cubin (12.0), sm_80 PTX 9.4 (13.4)
               _kernel("new_cubin", image_toolchains=(Toolchain(min_driver=13040), CUBIN_12), ptx=PTX80_88,
                       ptx_toolchain=PTX_88))
    bundle = _bundle(*kernels)
    parsed = core.parse(bundle.to_bytes())
    # sm_90 on the lent GPUs' driver 13.0: the sm_90a cubin loads
    assert parsed.fit_device(*SM90, driver=13000) == ([True, True, True], ["", "", ""])
    # sm_100 needs the PTX: 9.4 needs 13.4
    fits, why = parsed.fit_device(*SM100, driver=13000)
    assert fits == [True, False, True]
    assert why[1] == "kernel 'k': ptx sm_80 needs driver >= 13.4, this driver is 13.0"
    assert parsed.fit_device(*SM100, driver=13040)[0] == [True, True, True]
    assert parsed.fit_device(*SM100, driver=0)[0] == [True, True, True]  # not checked
    # a cubin that needs a newer driver is passed over for the PTX the driver can JIT
    fits, why = parsed.fit_device(*SM90, driver=12090)
    assert fits == [True, False, True]
    assert why[1] == "kernel 'k': cubin sm_90a needs driver >= 13.0, this driver is 12.9"
    assert parsed.pick_image(2, 9, 0) == ("cubin", "sm_90a")  # without a driver: the preferred image
    assert select_image(kernels[2], 9, 0, 13000) == ImageChoice("ptx", "sm_80")
    assert select_image(kernels[2], 9, 0, 13040) == ImageChoice("cubin", "sm_90a")
    assert parsed.fit_device(*SM90, driver=12080) == (
        [True, False, False], ["", "kernel 'k': cubin sm_90a needs driver >= 13.0, this driver is 12.8",
                               "kernel 'new_cubin': cubin sm_90a needs driver >= 13.4, this driver is 12.8"])
    # the Python mirror decides the same
    for device in (SM90, SM100):
        for driver in (0, 12080, 12090, 13000, 13040):
            fits, why = parsed.fit_device(*device, driver=driver)
            for k, kernel in enumerate(kernels[1:], start=1):
                try:
                    select_image(kernel, device[0], device[1], driver)
                    assert fits[k], (device, driver, k)
                except DietcodeError as exc:
                    assert not fits[k] and str(exc) == why[k], (device, driver, k)


def _model(path: Path, bundle: Bundle) -> Path:
    payload = np.frombuffer(bundle.to_bytes(), np.uint8)
    node = helper.make_node("MatMul", ["A", "B", "bundle"], ["Y"], name="mm", domain="ai.dietcode")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", 8])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", 8])],
                              [numpy_helper.from_array(np.zeros((8, 8), np.float32), "B"),
                               numpy_helper.from_array(payload, "bundle")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.dietcode", 2)],
                              ir_version=10)
    onnx.save(model, path)
    return path


def test_doctor_says_which_images_the_driver_does_not_load(tmp_path: Path, capsys) -> None:
    path = _model(tmp_path / "m.onnx", _bundle(_kernel("k"), _kernel("j")))
    ok = model_check(str(path), 13040)
    assert ok.status == "ok" and "every image loads under driver 13.4" in ok.detail
    bad = model_check(str(path), 13000, device=(10, 0))
    assert bad.status == "warn"
    assert ("ptx sm_80 (triton 3.9.0, ptxas 13.4.59, PTX ISA 9.4) needs driver >= 13.4, this driver is 13.0: "
            "2 image(s) would not load") in bad.detail
    assert "2 kernel(s) would run as ORT's kernel on sm_100" in bad.detail
    on_hopper = model_check(str(path), 13000, device=(9, 0))  # the cubins load: only the PTX would not
    assert "would run as ORT's kernel" not in on_hopper.detail and "would not load" in on_hopper.detail
    nothing = model_check(str(path), None)
    assert nothing.status == "warn" and "no driver on this machine" in nothing.detail
    assert "cubin sm_90a (triton 3.9.0, ptxas 13.4.59, PTX ISA 9.0) needs driver >= 13.0: 2" in nothing.detail
    assert main(["doctor", str(path), "--driver", "13.0", "--no-build", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "this driver is 13.0 (given)" in rows["model m.onnx"]["detail"]
    assert main(["doctor", str(path), "--driver", "580", "--no-build"]) == 2
    assert "not MAJOR.MINOR" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "absent.onnx"), "--no-build"]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path), "--no-build"]) == 2
    assert f"error: {tmp_path} is a directory, not a model file" in capsys.readouterr().err
    assert main(["doctor", "--driver", "13.0", "--no-build"]) == 2
    assert "name the model" in capsys.readouterr().err


def test_inspect_shows_the_toolchain(tmp_path: Path, capsys) -> None:
    # the sm_90a cubin as a TMA kernel's: 256 B of global scratch per program (docs/abi.md)
    path = _model(tmp_path / "m.onnx", _bundle(_kernel("k", image_scratch=((256, 128), (0, 1)))))
    assert main(["inspect", str(path), "--json"]) == 0
    (node,) = json.loads(capsys.readouterr().out)["nodes"]
    none = {"bytes": 0, "align": 1}
    assert node["kernels"][0]["images"] == [
        {"kind": "cubin", "arch": "sm_90a", "triton": "3.9.0", "ptxas": "13.4.59", "ptx_isa": "9.0",
         "min_driver": "13.0", "global_scratch": {"bytes": 256, "align": 128}},
        {"kind": "cubin", "arch": "sm_80", "triton": "3.9.0", "ptxas": "12.9.86", "ptx_isa": "8.8",
         "min_driver": "12.0", "global_scratch": none},
        {"kind": "ptx", "arch": "sm_80", "triton": "3.9.0", "ptxas": "13.4.59", "ptx_isa": "9.4",
         "min_driver": "13.4", "global_scratch": none}]
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "global scratch 256 B per program (aligned to 128)" in text and text.count("global scratch") == 1


@pytest.mark.ptx
def test_inspect_says_which_mma_each_kernels_ptx_uses(tmp_path: Path, capsys) -> None:
    wgmma = PTX80_94.replace("sm_80", "sm_90a") + "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%f1}, %rd1;\n"
    path = _model(tmp_path / "m.onnx", _bundle(_kernel("k"), _kernel("j", ptx=wgmma, ptx_toolchain=PTX_94)))
    assert main(["inspect", str(path), "--json"]) == 0
    (node,) = json.loads(capsys.readouterr().out)["nodes"]
    assert [k["ptx_mma"] for k in node["kernels"]] == [{"target": "sm_80", "mma": "none", "shapes": []},
                                                       {"target": "sm_90a", "mma": "wgmma", "shapes": ["m64n64k16"]}]
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "(none, sm_80 PTX)" in text and "(wgmma, sm_90a PTX)" in text


def test_optimize_refuses_a_ptxas_that_does_not_run(tmp_path: Path, capsys) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    assert main(["optimize", str(model), "-o", str(tmp_path / "o.onnx"), "--ptxas", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["optimize", str(model), "-o", str(tmp_path / "o.onnx"), "--min-driver", "9.0"]) == 2
    assert "older than every driver" in capsys.readouterr().err


@pytest.mark.ptx
@pytest.mark.slow
def test_aot_caps_the_ptx_isa_at_the_drivers(tmp_path: Path) -> None:
    """A real compile: Triton 3.9's ptxas-blackwell (CUDA 13.4) would write PTX ISA 9.4, which driver 13.0
    does not JIT; the default cap writes 9.0, and the bundle records it. Triton 3.6 (the GPU image's) carries
    CUDA 12.8's ptxas, which writes ISA 8.7 under the default cap: a cap at driver 12.6 writes 8.5 (12.5's)."""
    pytest.importorskip("triton")
    from tuner.aot import CompileToolchain, compile_kernel
    from tuner.space import Family, MicroKernel

    config = MicroKernel(32, 32, 32, 4, 2)
    version = re.compile(r"^\.version (\d+\.\d+)$", re.MULTILINE)
    capped = compile_kernel(Family("gemm", "float16", "sm_90"), config, cache_dir=tmp_path)
    if capped.ptxas_version.startswith("12."):  # Triton 3.6: the default cap does not bind
        assert version.search(capped.ptx).group(1) == "8.7" and capped.ptx_isa == 87  # type: ignore[union-attr]
        assert (capped.cubin_min_driver, capped.ptx_min_driver) == (12000, 12080)
        lower = compile_kernel(Family("gemm", "float16", "sm_90"), config, cache_dir=tmp_path,
                               toolchain=CompileToolchain(min_driver=12060))
        assert version.search(lower.ptx).group(1) == "8.5" and lower.ptx_min_driver == 12050  # type: ignore[union-attr]
        kernel = BundleKernel.from_compiled([capped])
        assert kernel.image_toolchains[0].min_driver == 12000 and kernel.ptx_toolchain.ptx_isa == 87
        assert select_image(kernel, 9, 0, 12000).kind == "cubin"
        return
    assert version.search(capped.ptx).group(1) == "9.0"  # type: ignore[union-attr]
    assert capped.ptxas_version.startswith("13.") and capped.ptx_isa == 90
    assert (capped.cubin_min_driver, capped.ptx_min_driver) == (13000, 13000)
    uncapped = compile_kernel(Family("gemm", "float16", "sm_90"), config, cache_dir=tmp_path,
                              toolchain=CompileToolchain(min_driver=13040))
    assert version.search(uncapped.ptx).group(1) == "9.4" and uncapped.ptx_min_driver == 13040  # type: ignore[union-attr]
    with pytest.raises(DietcodeError, match="makes cubins that need a CUDA 13.0 driver.*--ptxas"):
        compile_kernel(Family("gemm", "float16", "sm_90"), config, cache_dir=tmp_path,
                       toolchain=CompileToolchain(min_driver=12080))
    kernel = BundleKernel.from_compiled([capped])
    assert kernel.image_toolchains[0].min_driver == 13000 and kernel.ptx_toolchain.ptx_isa == 90
    assert kernel.image_toolchains[0].triton == capped.triton_version
    assert select_image(kernel, 9, 0, 13000).kind == "cubin"
