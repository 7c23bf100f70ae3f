"""custom_ops/launch.cc without a GPU: the custom-op library's launches through a stand-in CUDA driver.

tests/_fake_libcuda.c, built here against the library's cuda.h and installed as libcuda.so.1 on a child
process's LD_LIBRARY_PATH, is the driver launch.cc opens: host memory for device memory, a per-thread context
stack, modules parsed for their kernels' parameter lists, and a log of every module load, function attribute,
memset and launch with the raw bytes of each kernel parameter. The kernels are compiled ahead of time for sm_90
(tuner/aot.py and tuner/attention.py, with the local Triton), bundled one per case, and launched through the C
ABI (tests/_fake_cuda_cases.py). Checked: the parameters match the kernel's PTX .param list in count and size
and the ABI (docs/abi.md) in value (buffers, sizes, strides, the split-K workspace, the TMA global scratch, the
two trailing scratch pointers), the grid is dc_kernel_grid's, the block the kernel's warps, the shared memory the
bundle's with the attribute above 48 KiB, the split-K counters kept per (context, stream) and zeroed once when
allocated (in the workspace, zeroed per call, when no memory is had), the persistent grid
follows the device's SM count, modules load once per context (a bundle's cubins all at its first launch there,
PTX on first use, a refused cubin failing only its own launch), the vendor epilogue's PTX launch, the tuner's
GPU timer (custom_ops/timing.cc) on a CUDA 13.1 and a 12.0 driver; and for every case the recorded parameters,
fed to the interpreted template, compute the node's result.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _fake_cuda_cases import (CASES, EAGER_KERNELS, EAGER_LAUNCHES, FILL, SM_COUNT, build_fake_driver, compile_case,
                              decode_params, eager_bundle)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}


def _fnv1a(data: bytes) -> str:
    h = 1469598103934665603
    for byte in data:
        h = ((h ^ byte) * 1099511628211) & (2**64 - 1)
    return f"{h:016x}"


def ptx_param_sizes(ptx: str, name: str) -> list[int]:
    """The byte size of each .param of entry ``name``, in order."""
    start = ptx.index(f".entry {name}(")
    header = ptx[start:ptx.index(")", start)]
    return [SIZES[t] for t in re.findall(r"\.param\s+\.(\w+)", header)]


def _build_fake(tmp_path_factory: pytest.TempPathFactory, driver: int) -> Path:
    """The stand-in playing CUDA driver ``driver``, built as libcuda.so.1 in a folder of its own."""
    folder = tmp_path_factory.mktemp(f"fake_libcuda_{driver}")
    why = build_fake_driver(folder, driver)
    if why:
        pytest.skip(why)
    return folder


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_fake(tmp_path_factory, 13010)


def _run_child(fake: Path, folder: Path, *extra: str) -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="1", LD_LIBRARY_PATH=os.pathsep.join(
        [str(fake), os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep), PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, str(HERE / "_fake_cuda_cases.py"), str(folder), *extra], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = tmp_path_factory.mktemp("kernels")
    return {case.name: compile_case(case, cache) for case in CASES}


@pytest.fixture(scope="module")
def bundles(bundled: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of one-kernel bundles, one per case, and the eager-load bundle of several (eager.bundle)."""
    from dietcode_ort.bundle import Bundle, DispatchTree
    from dietcode_ort.runtime import load_core

    load_core()  # built before the children, which only load it
    folder = tmp_path_factory.mktemp("bundles")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is not None:  # the cuBLASLt stand-in, for the child's lt_handles
        subprocess.run([cc, "-O1", "-shared", "-fPIC", str(HERE / "_fake_vendor_libs.c"), "-o",
                        str(folder / "libfakevendor.so"), "-lm", "-ldl"], check=True, capture_output=True)
    for name, kernel in bundled.items():
        (folder / f"{name}.bundle").write_bytes(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes())
    (folder / "eager.bundle").write_bytes(eager_bundle(bundled))
    return folder


@pytest.fixture(scope="module")
def launched(fake_lib: Path, bundles: Path) -> dict[str, Any]:
    """The child's report (tests/_fake_cuda_cases.py) for bundles of the compiled kernels."""
    return _run_child(fake_lib, bundles)


@pytest.fixture(scope="module")
def bundled(compiled: dict[str, Any]) -> dict[str, Any]:
    from dietcode_ort.bundle import BundleKernel

    return {name: BundleKernel.from_compiled([kernel]) for name, kernel in compiled.items()}


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _expected_params(case: Any, kernel: Any, got: dict[str, Any]) -> list[int]:
    """The ABI's value of each of the kernel's params for the call, then the global and profile scratch."""
    args, ptr = got["args"], got["pointers"]
    pointers = ({"q": ptr["q"], "k": ptr["kt"], "v": ptr["v"], "mask": ptr["mask"], "out": ptr["out"]}
                if case.op == "attention" else
                {"a": ptr.get("a", ptr.get("x")), "b": ptr.get("b", ptr.get("w")), "bias": ptr.get("bias"),
                 "c": ptr["out"], "residual": ptr.get("residual"), "workspace": args["workspace"]})
    allocs = _of(got["events"], "alloc")
    if allocs:  # the split-K counters the launcher keeps for the stream
        pointers["counters"] = allocs[0]["ptr"]
    want = [pointers[p] if p in pointers else args[p] & 0xFFFFFFFF for p in kernel.params]
    split_bytes = 0
    if kernel.split_k > 1:
        tiles = _ceil(args["M"], kernel.block_m) * _ceil(args["N"], kernel.block_n) * max(1, args["batch"])
        split_bytes = _ceil(tiles * (kernel.split_k * kernel.block_m * kernel.block_n * 4 + 4), 16) * 16
    size, align = kernel.image_scratch[0]
    scratch = _ceil(args["workspace"] + split_bytes, align) * align if size else 0
    return [*want, scratch, 0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_launch_passes_what_the_kernel_and_the_abi_expect(launched: dict[str, Any], compiled: dict[str, Any],
                                                          bundled: dict[str, Any], case: Any) -> None:
    got = launched[case.name]
    assert "error" not in got, got.get("error")
    events, kernel, built = got["events"], bundled[case.name], compiled[case.name]
    assert not _of(events, "error"), _of(events, "error")
    # the image: the sm_90 cubin, or the PTX where the bundle has no cubin the device runs
    (load,) = _of(events, "load")
    image = kernel.images[0][1] if case.target == "sm_90" else kernel.ptx.encode() + b"\0"
    assert load["kind"] == ("cubin" if case.target == "sm_90" else "ptx")
    assert (load["size"], load["fnv1a"]) == (len(image), _fnv1a(image))
    sizes = ptx_param_sizes(built.ptx, kernel.name)
    assert len(sizes) == len(kernel.params) + 2  # the ABI's params and Triton's global and profile scratch
    (function,) = _of(events, "function")
    assert (function["name"], function["n_params"]) == (kernel.name, len(sizes))  # the image's own count
    shared = kernel.image_shared[0] if case.target == "sm_90" else kernel.shared
    assert shared == built.shared
    attributes = _of(events, "set_attribute")
    assert [(a["attribute"], a["value"]) for a in attributes] == ([(8, shared)] if shared > 48 * 1024 else [])
    (launch,) = _of(events, "launch")
    assert launch["name"] == kernel.name and launch["stream"] == got["stream"]
    assert launch["grid"] == got["grid"] and launch["block"] == [built.num_warps * 32, 1, 1]
    assert launch["shared"] == shared
    assert [p["size"] for p in launch["params"]] == sizes
    want = _expected_params(case, kernel, got)
    assert decode_params(launch) == want, dict(zip([*kernel.params, "global_scratch", "profile_scratch"],
                                                   zip(decode_params(launch), want)))
    # the stream's context, pushed for the call and popped after
    assert [e["event"] for e in events if e["event"] in ("push", "pop")] == ["push", "pop"]
    assert events[0]["event"] == "push" and events[-1]["event"] == "pop"


@pytest.mark.parametrize("case", [c for c in CASES if c.tma], ids=[c.name for c in CASES if c.tma])
def test_tma_scratch_lies_in_the_workspace_128_aligned(launched: dict[str, Any], bundled: dict[str, Any],
                                                       case: Any) -> None:
    got, kernel = launched[case.name], bundled[case.name]
    (launch,) = _of(got["events"], "launch")
    scratch = decode_params(launch)[-2]
    grid = launch["grid"]
    workspace, size = got["args"]["workspace"], got["args"]["workspace_bytes"]
    assert kernel.image_scratch[0] == (256, 128) and workspace % 128 != 0  # the alignment is the launcher's
    assert scratch % 128 == 0 and workspace <= scratch and scratch - workspace < 128 + (
        size - 256 * grid[0] * grid[1] * grid[2])
    assert scratch + 256 * grid[0] * grid[1] * grid[2] <= workspace + size  # 256 B per program, inside


@pytest.mark.parametrize("case", [c for c in CASES if c.config[5:6] and c.config[6] > 1],
                         ids=[c.name for c in CASES if c.config[5:6] and c.config[6] > 1])
def test_split_k_counters_are_kept_for_the_stream_and_zeroed_once(launched: dict[str, Any],
                                                                  bundled: dict[str, Any], case: Any) -> None:
    got, kernel = launched[case.name], bundled[case.name]
    args = got["args"]
    tiles = _ceil(args["M"], kernel.block_m) * _ceil(args["N"], kernel.block_n) * max(1, args["batch"])
    assert tiles <= 4096
    (alloc,) = _of(got["events"], "alloc")
    assert alloc["bytes"] == 4096 * 4  # 16 KiB at least
    (memset,) = _of(got["events"], "memset")
    assert (memset["ptr"], memset["value"], memset["bytes"], memset["stream"]) == (alloc["ptr"], 0, 16384,
                                                                                     got["stream"])
    events = [e["event"] for e in got["events"]]
    assert events.index("alloc") < events.index("memset") < events.index("launch")  # on the stream, before it
    (launch,) = _of(got["events"], "launch")
    assert decode_params(launch)[-3] == alloc["ptr"]  # counters, then the two scratch pointers
    assert decode_params(launch)[-4] == args["workspace"]
    assert set(bytes.fromhex(got["workspace_after"])) == {FILL}  # the launcher wrote nothing there
    assert got["interpreted"]["counters_left"] == 0  # the kernel put every counter back to zero


def test_only_split_k_allocates_counters(launched: dict[str, Any], bundled: dict[str, Any]) -> None:
    for case in CASES:
        events = launched[case.name]["events"]
        split = bundled[case.name].split_k > 1
        assert (len(_of(events, "alloc")), len(_of(events, "memset"))) == ((1, 1) if split else (0, 0)), case.name


def test_split_k_counters_per_stream(launched: dict[str, Any]) -> None:
    """Kept per (context, stream): the same stream's next launch takes the same counters with no memset; a call
    needing more allocates at least twice as many (zeroed once) and keeps the smaller block until the bundle is
    freed; another stream gets its own; while the stream is captured into a graph, or without memory (then for
    good on that stream), the counters go in the workspace, zeroed per call."""
    got = launched["resident_counters"]
    assert "error" not in got, got

    def counters(name: str) -> int:
        (launch,) = _of(got[name]["events"], "launch")
        return decode_params(launch)[-3]

    def kinds(name: str) -> list[str]:
        return [e["event"] for e in got[name]["events"] if e["event"] in ("alloc", "memset", "launch", "free")]

    (first,) = _of(got["first"]["events"], "alloc")
    assert kinds("first") == ["alloc", "memset", "launch"] and counters("first") == first["ptr"]
    assert kinds("again") == ["launch"] and counters("again") == first["ptr"]
    (larger,) = _of(got["larger"]["events"], "alloc")
    assert (got["larger"]["M"], got["larger"]["N"]) == (4200, 2048)
    assert larger["bytes"] == 8192 * 4  # 132 x 32 tiles = 4224 needed: twice the 4096 kept
    (memset,) = _of(got["larger"]["events"], "memset")
    assert (memset["ptr"], memset["bytes"], memset["stream"]) == (larger["ptr"], 8192 * 4, got["larger"]["stream"])
    assert kinds("larger") == ["alloc", "memset", "launch"] and counters("larger") == larger["ptr"]
    assert kinds("small_after") == ["launch"] and counters("small_after") == larger["ptr"]
    partials = 4 * 4 * 32 * 64 * 4  # the 2 x 2 tiles' 4 splits of 32 x 64 fp32 partials, then the counter room
    for name in ("capturing", "no_memory", "no_memory_again"):  # the fallback: the room, zeroed before the launch
        call = got[name]
        (memset,) = _of(call["events"], "memset")
        assert (memset["ptr"], memset["bytes"], memset["stream"]) == (call["workspace"] + partials, 4 * 4,
                                                                      call["stream"]), name
        assert counters(name) == call["workspace"] + partials, name
        assert call["untouched"] == call["workspace_bytes"] - 16, name
    assert [e["capturing"] for e in _of(got["capturing"]["events"], "is_capturing")] == [1]
    assert not _of(got["capturing"]["events"], "alloc")  # the stream's counters are left alone too
    assert [e["call"] for e in _of(got["no_memory"]["events"], "error")] == ["cuMemAlloc"]
    assert kinds("no_memory_again") == ["memset", "launch"]  # the refusal is remembered: no second cuMemAlloc
    (second,) = _of(got["other_stream"]["events"], "alloc")
    assert second["ptr"] not in (first["ptr"], larger["ptr"]) and counters("other_stream") == second["ptr"]
    assert kinds("other_stream") == ["alloc", "memset", "launch"]
    for name in ("first", "again", "small_after", "other_stream"):  # the launcher wrote nothing there
        assert got[name]["untouched"] == got[name]["workspace_bytes"], name
    freed = sorted(e["ptr"] for e in _of(got["freed"], "free"))
    assert freed == sorted((first["ptr"], larger["ptr"], second["ptr"]))


def test_persistent_grid_follows_the_devices_sm_count(launched: dict[str, Any], bundled: dict[str, Any]) -> None:
    (case,) = [c for c in CASES if c.persistent]
    got, kernel = launched[case.name], bundled[case.name]
    args = got["args"]
    assert args["sm_count"] == 0  # the launcher asked the device
    queries = [e for e in _of(got["events"], "device_attribute") if e["attribute"] == 16]  # MULTIPROCESSOR_COUNT
    assert [q["value"] for q in queries] == [SM_COUNT]
    tiles = _ceil(args["M"], kernel.block_m) * _ceil(args["N"], kernel.block_n) * args["batch"]
    (launch,) = _of(got["events"], "launch")
    assert tiles > SM_COUNT * case.persistent and launch["grid"] == [SM_COUNT * case.persistent, 1, 1]
    assert got["workspace_bytes"] == (128 - 16) + SM_COUNT * case.persistent * 256


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_recorded_parameters_drive_the_template_to_the_result(launched: dict[str, Any], case: Any) -> None:
    """The bytes the launcher gave the driver, as the interpreted template's arguments (pointers mapped back to
    the buffers, the split-K counters as the launcher's memset left them), compute the node's result."""
    got = launched[case.name]["interpreted"]
    assert "error" not in got, got
    assert got["max_err"] <= 2e-3 * max(1.0, got["scale"]), got


def test_modules_load_once_per_context_and_the_context_is_restored(launched: dict[str, Any]) -> None:
    ctx = launched["contexts"]
    kinds = {name: [e["event"] for e in ctx[name] if e["event"] != "device_attribute"]
             for name in ("first", "again", "other", "other_again")}
    assert kinds["first"] == kinds["other"] == ["push", "load", "function", "launch", "pop"]
    assert kinds["again"] == kinds["other_again"] == ["push", "launch", "pop"]  # loaded once per context
    assert [e["context"] for e in _of(ctx["other"], "push") + _of(ctx["other"], "load")] == [2, 2]
    assert all(ctx[f"{name}_depth"] == 0 for name in kinds)  # nothing left current
    assert _of(ctx["other"], "launch")[0]["stream"] == ctx["streams"]["other"]
    assert "no CUDA context is current on this thread and no stream was given" in ctx["null_without_context"]
    # the null stream: the thread's current context, nothing pushed, the module loaded there reused
    assert [e["event"] for e in ctx["null_in_current"]] == ["launch"] and ctx["null_in_current_depth"] == 1
    assert _of(ctx["null_in_current"], "launch")[0]["stream"] == 0
    # a stream of another context than the current one: its context pushed, and popped back to the current one
    assert [(e["event"], e.get("context")) for e in ctx["first_over_current"]] == [
        ("push", 1), ("launch", None), ("pop", 1)] and ctx["first_over_current_depth"] == 1
    # freeing the bundle unloads each module in its own context
    assert [(e["event"], e.get("context")) for e in ctx["freed"]] == [
        ("push", 1), ("unload", None), ("pop", 1), ("push", 2), ("unload", None), ("pop", 2)]


def _driver_calls(step: dict[str, Any]) -> list[str]:
    """A launch's driver events, without the device attribute queries and the split-K counters' capture query,
    allocation and memset."""
    return [e["event"] for e in step["events"]
            if e["event"] not in ("device_attribute", "is_capturing", "alloc", "memset")]


def test_a_bundles_cubins_load_at_its_first_launch_in_a_context(launched: dict[str, Any],
                                                                 bundled: dict[str, Any]) -> None:
    """launch.cc's LoadCubins: the first launch of any kernel of a bundle in a context loads every kernel the
    device runs from a cubin (kernels 0 and 1), so a shape that picks another of them loads nothing at its
    first call; the kernel the device runs from PTX only (2) is JIT-compiled at its own first launch."""
    got = launched["eager"]
    assert "error" not in got, got.get("error")
    steps, kernels = got["launches"], [bundled[name] for name in EAGER_KERNELS]
    assert [(s["context"], s["kernel"]) for s in steps] == [(c + 1, k) for c, k in EAGER_LAUNCHES]
    first = steps[0]
    assert first["error"] == ""
    loads = _of(first["events"], "load")
    assert sorted((e["kind"], e["context"], e["fnv1a"]) for e in loads) == sorted(
        ("cubin", 1, _fnv1a(k.images[0][1])) for k in kernels[:2])
    assert [(e["call"], e["why"]) for e in _of(first["events"], "error")] == [("cuModuleLoadData", "cubin for another SM")]
    assert [e["name"] for e in _of(first["events"], "launch")] == [kernels[0].name]
    assert _driver_calls(first)[-2:] == ["launch", "pop"]  # loaded before the launch, in the stream's context
    # kernel 1's first launch, kernel 0's second: nothing loads; each runs the module loaded for it then
    for step in (steps[1], steps[5]):
        assert step["error"] == "" and _driver_calls(step) == ["push", "launch", "pop"], step
    m0, m1, m0_again = (_of(step["events"], "launch")[0]["module"] for step in (first, steps[1], steps[5]))
    assert m0 == m0_again != m1 and {m0, m1} == {e["module"] for e in loads}
    # the PTX-only kernel: loaded (JIT) at its own first launch, not before
    assert steps[2]["error"] == "" and _driver_calls(steps[2]) == ["push", "load", "function", "launch", "pop"]
    (ptx,) = _of(steps[2]["events"], "load")
    assert (ptx["kind"], ptx["fnv1a"]) == ("ptx", _fnv1a(kernels[2].ptx.encode() + b"\0"))


def test_a_cubin_that_fails_to_load_fails_only_its_own_launch(launched: dict[str, Any],
                                                              bundled: dict[str, Any]) -> None:
    """Kernel 3's cubin, refused by the driver during the eager load, fails no other kernel's launch: its error
    is kept and reported at its own launch, with the message a load at launch gives; the launch after that
    loads it again (and is refused again, with the same message)."""
    steps = launched["eager"]["launches"]
    message = ("cuModuleLoadData failed: no kernel image is available for execution on the device (code 209) "
               f"for kernel '{bundled['gemm_ptx_jit'].name}' (cubin on sm_90)")
    assert [s["error"] for s in steps] == ["", "", "", message, message, "", "", message, ""]
    assert _driver_calls(steps[3]) == _driver_calls(steps[7]) == ["push", "pop"]  # the kept error
    assert _driver_calls(steps[4]) == ["push", "error", "pop"]  # tried again, refused again
    assert _of(steps[4]["events"], "error")[0]["why"] == "cubin for another SM"


def test_each_context_loads_a_bundles_cubins_once(launched: dict[str, Any]) -> None:
    """Two contexts: each loads the bundle's cubins at the bundle's first launch there (whichever kernel it is),
    once, and freeing the bundle unloads every module in its own context."""
    got = launched["eager"]
    loads = [(s["context"], s["kernel"], e["kind"], e["context"]) for s in got["launches"]
             for e in _of(s["events"], "load")]
    assert loads == [(1, 0, "cubin", 1), (1, 0, "cubin", 1), (1, 2, "ptx", 1), (2, 1, "cubin", 2), (2, 1, "cubin", 2)]
    refused = [(s["context"], s["kernel"]) for s in got["launches"] if _of(s["events"], "error")]
    assert refused == [(1, 0), (1, 3), (2, 1)]  # the eager load in each context, and the retry
    unloads, context = [], None
    for e in got["freed"]:
        if e["event"] == "push":
            context = e["context"]
        elif e["event"] == "unload":
            unloads.append(context)
    assert unloads == [1, 1, 1, 2, 2]


def test_vendor_epilogue_launch_runs_its_ptx_to_the_result(launched: dict[str, Any]) -> None:
    """launch.cc's LaunchPtx (the vendor path's epilogue): the PTX loaded once per context on the stream's (by
    dc_vendor_epilogue_load, which a node that may take the vendor path calls at its first call; the launches
    reuse it), its .param list filled in count and size, a 2-D grid of 256-thread blocks (32 column threads by 8 row
    threads for 7 columns), and the
    recorded values, run as that PTX on the host over the buffers they point at, give act(y + scale * bias) +
    residual."""
    got = launched["vendor_epilogue"]
    assert "error" not in got, got.get("error")
    events = got["events"]
    assert not _of(events + got["loaded"], "error"), _of(events + got["loaded"], "error")
    (load,) = _of(got["loaded"], "load")  # the second dc_vendor_epilogue_load finds it loaded
    image = got["ptx"].encode() + b"\0"
    assert load["kind"] == "ptx" and (load["size"], load["fnv1a"]) == (len(image), _fnv1a(image))
    assert [e["event"] for e in got["loaded"] if e["event"] in ("push", "load", "function", "pop")] == [
        "push", "load", "function", "pop", "push", "pop"]  # in the stream's context, then nothing
    assert not _of(events, "load")  # the launches load nothing
    launches = _of(events, "launch")
    assert len(launches) == 2 and launches[0]["params"] == launches[1]["params"]
    launch = launches[0]
    assert launch["name"] == "dc_epilogue" and launch["stream"] == got["stream"]
    assert [p["size"] for p in launch["params"]] == ptx_param_sizes(got["ptx"], "dc_epilogue")
    values = dict(zip(got["names"], decode_params(launch)))
    ptr = got["pointers"]
    assert (values["p_y"], values["p_bias"], values["p_res"]) == (ptr["y"], ptr["bias"], ptr["residual"])
    assert (values["p_rows"], values["p_cols"], values["p_brows"], values["p_brs"], values["p_bcs"]) == (5, 7, 1, 0, 1)
    assert values["p_act"] == 2 and values["p_scale"] == 0x3F000000  # gelu, 0.5f
    assert launch["grid"] == [1, 1, 1] and launch["block"] == [32, 8, 1] and launch["shared"] == 0
    assert got["max_err"] <= 2e-3 * max(1.0, got["scale"]), got["max_err"]
    assert values["p_first"] == 0  # the residual added after the activation
    # dc_epilogue.residual_mul (LLaMA's SwiGLU gate, silu(y) * residual): launched as p_first 2, no bias
    assert (got["mul_first"], got["mul_bias"]) == (2, 0)
    assert got["mul_max_err"] <= 2e-3 * max(1.0, got["mul_scale"]), got["mul_max_err"]
    refused, message, launches = got["both_refused"]
    assert refused != 0 and "both adds the residual first and multiplies by it" in message and launches == 0


def test_cublaslt_handle_is_created_once_per_context_with_it_current(launched: dict[str, Any]) -> None:
    """dc_vendor_cublaslt_handle: cublasLtCreate runs with the stream's context current (a cuBLASLt context is
    tied to the device current at creation), once per context: two streams of one context share the handle, a
    stream of the other context gets its own; the pushed context is popped after."""
    got = launched["lt_handles"]
    if "skipped" in got:
        pytest.skip(got["skipped"])
    assert "error" not in got, got.get("error")
    first, second, other, again = got["handles"]
    assert first == second == again and other != first and first and other
    assert got["creates"] == 2 and got["contexts"] == got["context_of"]
    assert got["depth"] == 0


def test_probe_and_sm_count_through_the_driver(launched: dict[str, Any]) -> None:
    ctx = launched["contexts"]
    assert ctx["probe"] == {"name": "Fake CUDA device (host memory)", "major": 9, "minor": 0, "driver_version": 13010}
    assert ctx["sm_count_current"] == ctx["sm_count_stream"] == SM_COUNT


@pytest.mark.parametrize("driver", [13010, 12000])
def test_gpu_timer_runs_on_drivers_the_bundles_target(driver: int, bundles: Path,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """dc_timing_open, dc_mem_alloc/upload and dc_time_kernel through the stand-in, playing a CUDA 13.1 driver and
    a 12.0 one (the oldest a bundle's cubins target: docs/bundle.md), which has no cuEventElapsedTime_v2 (CUDA
    12.8), the name cuda.h maps cuEventElapsedTime to. Each timed launch sits between its two events, after its
    L2 flush."""
    got = _run_child(_build_fake(tmp_path_factory, driver), bundles, "timing")
    assert got["driver"] == driver
    assert got.get("rc") == 0 and not got["error"], got.get("error")
    events = got["events"]
    assert not _of(events, "error"), _of(events, "error")
    assert _of(events, "set_current")[0]["context"] == 1  # the primary context
    (launch, *_) = _of(events, "launch")
    threads = math.prod(launch["grid"]) * math.prod(launch["block"])
    # one launch between the events, at the stand-in's made-up cost of 1 us + 1 ns per thread
    assert len(_of(events, "launch")) == 5 and got["times"] == pytest.approx([(1000 + threads) / 1e6] * 3)
    timed = [e for e in events if e["event"] in ("memset", "event_record", "launch")][2:]  # after the warm-up
    assert [e["event"] for e in timed] == ["memset", "event_record", "launch", "event_record"] * 3
    assert [(m["ptr"], m["value"], m["bytes"]) for m in _of(timed, "memset")] == [
        (got["pointers"]["flush"], i, 4096) for i in range(3)]
    assert {e["stream"] for e in timed} == {got["stream"]}
    assert decode_params(launch)[:4] == [got["pointers"][p] for p in ("a", "b", "bias", "out")]
    assert len(_of(events, "event_destroy")) == 6


def test_an_attention_call_of_another_head_dim_is_refused_before_the_launch(launched: dict[str, Any],
                                                                            bundled: dict[str, Any]) -> None:
    """The attention kernel's rows are HEAD_DIM long (the kernel record's head_dim): a call whose head dim is
    another (8 for a kernel of 16) is refused by the launcher, naming the kernel and both values, and the driver
    launches nothing."""
    got = launched["head_dim"]
    assert got.get("call_head_dim") == 8, got.get("error")
    assert bundled["attention_mask"].head_dim == 16
    assert re.search(r"kernel 'attention_kernel[^']*': head dim: compiled for head dim 16, the call's is 8",
                     got["error"]), got["error"]
    assert not _of(got["events"], "launch") and got["out_untouched"]
