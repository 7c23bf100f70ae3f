"""The tuner's GPU path on the CPU: GpuMeasurer, the timing child and the custom-op library's timer against the
stand-in CUDA driver (tests/_fake_libcuda.c), put first on LD_LIBRARY_PATH as libcuda.so.1 in a child process
(tests/_fake_gpu_tuning.py) whose own timing child (ChildTimer, spawned) inherits it.

What runs is the code a GPU runs: configs compiled ahead of time for sm_90 as ``optimize`` ships them, bundled,
timed by ``tuner.gpu_timing.CudaBackend`` (dc_timing_open, dc_mem_alloc / dc_mem_upload, dc_abi_view,
dc_kernel_fit_device, dc_kernel_fit, dc_time_kernel); then ``dietcode-ort optimize --measure gpu`` and
``benchmarks/record_table.py`` (the device runner's stage 2) end to end. The stand-in's event times are a
made-up function of each launch's size (1 us + 1 ns per thread launched): the checks use them to see that
each result is its own item's, never as a GPU's figure; its device name keeps every row it produces apart from
a real device's in the tuning database.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _fake_cuda_cases import build_fake_driver
from _fake_gpu_tuning import CONFIGS, ENV, PROBLEM

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAKE_DEVICE = "model=Fake CUDA device (host memory);arch=sm_90;driver=13010;"


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fake_libcuda")
    why = build_fake_driver(folder)
    if why:
        pytest.skip(why)
    return folder


def _run(fake: Path, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    full = dict(os.environ, **(env or {}), LD_LIBRARY_PATH=os.pathsep.join(
        [str(fake), os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep), PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    full.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(HERE / "_fake_gpu_tuning.py"), *args], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _fake_seconds(config: dict[str, int], sm_count: int) -> float:
    """The stand-in's made-up time of one launch of ``config`` on PROBLEM: 1 us + 1 ns per thread launched."""
    m, n, _ = PROBLEM
    programs = _ceil(m, config["block_m"]) * _ceil(n, config["block_n"])
    if config.get("persistent"):
        programs = min(programs, sm_count * config["persistent"])
    programs *= config.get("split_k", 1)
    return (1000 + programs * config["num_warps"] * 32) * 1e-9


def test_gpu_measurer_times_aot_kernels_per_item_through_the_driver(fake_lib: Path, tmp_path: Path) -> None:
    """Plain, split-K, TMA and persistent sm_90 kernels timed by CudaBackend in a spawned child: one result per
    item, in order, each its own launch's time. A launch the driver refuses (too many threads for the stand-in's
    limit) is the config's failure; one that loses the context (an illegal address) fails only that item,
    transiently, and a new child times the rest; a kernel above the device's shared memory is refused before
    its launch (dc_kernel_fit_device). The vendor baseline needs torch with CUDA and says so."""
    got, _ = _run(fake_lib, "measure", str(tmp_path / "kernels"), env={**ENV, "FAKE_CUDA_SM_COUNT": "1"})
    assert got["device"].startswith(FAKE_DEVICE)
    assert len(got["results"]) == len(CONFIGS)
    for (config, expect), key, (seconds, error, transient) in zip(CONFIGS, got["keys"], got["results"]):
        if expect == "ok":
            assert error is None and not transient, (key, error)
            assert seconds == pytest.approx(_fake_seconds(config, sm_count=1), rel=1e-5), key
        else:
            assert seconds is None, key
            reason = {"refused": "too many resources requested for launch (code 701)",
                      "lost": "context lost: warm-up (cuStreamSynchronize) failed: an illegal memory access",
                      "too_big": "does not fit this GPU"}[expect]
            assert reason in error and transient == (expect == "lost"), (key, error)
    # the persistent grid followed the device's SM count (1 x 2 programs, not the 4 tiles)
    persistent = [r[0] for (c, _), r in zip(CONFIGS, got["results"]) if c.get("persistent")]
    assert persistent == [pytest.approx((1000 + 2 * 128) * 1e-9, rel=1e-5)]
    assert got["started"] == 2  # the lost context ended the first child; the second timed the rest
    assert "torch" in got["vendor"] and "CUDA" in got["vendor"]


@pytest.mark.parametrize("name, dims", [("mlp", ["tokens=1:32"]), ("bert", ["batch=1:2", "seq=8:32:8"])])
def test_optimize_measure_gpu_end_to_end_through_the_driver(fake_lib: Path, tmp_path: Path, name: str,
                                                            dims: list[str]) -> None:
    """``dietcode-ort optimize tiny-MODEL.onnx --measure gpu --target sm_90`` with the stand-in as the only GPU:
    the driver counts as a GPU (no torch with CUDA needed to time kernels), every workload is tuned with
    timings from the timing child (tiny BERT's fused attention chains too: CudaBackend's attention view),
    stored under the stand-in's own device key, the model is written, and the missing vendor baseline is
    said, not hidden."""
    import onnx

    model, out, db = tmp_path / f"{name}.onnx", tmp_path / f"{name}.opt.onnx", tmp_path / "tuning.db"
    subprocess.run([sys.executable, "-m", "models", name, "--preset", "tiny", "--dtype", "float16", "-o",
                    str(model)], cwd=ROOT, check=True, capture_output=True)
    got, stderr = _run(fake_lib, "optimize", str(model), str(out), str(db), str(tmp_path / "kernels"), *dims)
    assert got["rc"] == 0, stderr[-3000:]
    # each workload's summary (with the trials that timed the chosen kernels where the search had not, if any)
    assert re.search(r"\d+ trials( \(\d+ of them timing the chosen kernels on shapes the search had not\))? in ",
                     stderr) and " with gpu (NVIDIA H100 SXM5);" in stderr  # no product of its own
    assert "no vendor baseline (the vendor baseline needs torch with CUDA" in stderr
    ops = {n.op_type for n in onnx.load(str(out)).graph.node if n.domain == "ai.dietcode"}
    assert any(op.startswith("MatMul") for op in ops) and ("ScaledDotProductAttention" in ops) == (name == "bert"), ops
    rows = sqlite3.connect(str(db)).execute("SELECT device, family, config, seconds, error FROM measurements").fetchall()
    assert rows and {r[0] for r in rows} == {rows[0][0]} and rows[0][0].startswith(FAKE_DEVICE)
    assert all(r[2] != "vendor" for r in rows)
    families = {r[1].split("/")[0] for r in rows if r[4] is None and r[3] is not None and math.isfinite(r[3])}
    assert families == ({"gemm", "attention"} if name == "bert" else {"gemm"})


def test_grouped_convs_are_timed_through_the_driver(fake_lib: Path, tmp_path: Path) -> None:
    """A depthwise and a grouped conv tuned with ``--measure gpu`` against the stand-in: the timing child builds
    each node call with its group (one group's N and K, the groups as the launch's batch) and times every
    config, and both convs are rewritten with kernels carrying the grouped flag."""
    import onnx

    from _grouped_convs import grouped_conv_model
    from dietcode_ort.bundle import node_bundles, read_bundle

    model, out, db = tmp_path / "g.onnx", tmp_path / "g.opt.onnx", tmp_path / "tuning.db"
    onnx.save(grouped_conv_model(), str(model))
    got, stderr = _run(fake_lib, "optimize", str(model), str(out), str(db), str(tmp_path / "kernels"), "n=1:2",
                       "h=8:24:16", "w=8:24:16")
    assert got["rc"] == 0, stderr[-3000:]
    rows = sqlite3.connect(str(db)).execute("SELECT family, seconds, error FROM measurements").fetchall()
    assert rows and all(r[0].startswith("conv/") for r in rows)
    assert all(r[2] is None and math.isfinite(r[1]) for r in rows), [r for r in rows if r[2] is not None][:3]
    bundles = {nb.node: read_bundle(nb.payload) for nb in node_bundles(onnx.load(str(out)))}
    assert set(bundles) == {"depthwise", "grouped"}
    assert all(k.grouped for b in bundles.values() for k in b.kernels)


@pytest.mark.parametrize("cc, want", [((9, 0), ["sm_90"]), ((8, 9), ["sm_89"]), ((8, 6), ["sm_80"])])
def test_the_driver_alone_makes_a_gpu_visible_and_picks_the_target(fake_lib: Path, cc: tuple[int, int],
                                                                   want: list[str]) -> None:
    """No torch with CUDA here: the driver's device is the GPU ``--measure auto`` and the default --target see."""
    env = {"FAKE_CUDA_CC_MAJOR": str(cc[0]), "FAKE_CUDA_CC_MINOR": str(cc[1])}
    assert _run(fake_lib, "targets", env=env)[0] == {"gpu": True, "targets": want}


def test_record_table_stage_two_through_the_driver(fake_lib: Path, tmp_path: Path) -> None:
    """benchmarks/record_table.py's ``record`` (the device runner's stage 2) through GpuMeasurer and the stand-in:
    every config gets a row per instance keyed by the stand-in's device, and table.json names the device the
    driver reports (the same probe as the rows' key). Each set compiles into a kernel cache of its own, removed
    after it (its compile seconds are compiles, not reads of the set before's kernels: the same binaries)."""
    got, _ = _run(fake_lib, "record", str(tmp_path / "table"), str(tmp_path / "kernels"))
    rows = list(csv.DictReader(Path(got["table"]).open()))
    meta = json.loads((tmp_path / "table" / "table.json").read_text())
    assert meta["device"] == "Fake CUDA device (host memory)" and meta["arch"] == "sm_90"
    assert meta["driver"] == "13010" and meta["sms"] == 132
    assert {r["device"] for r in rows} == {rows[0]["device"]} and rows[0]["device"].startswith(FAKE_DEVICE)
    timed = [r for r in rows if r["config"] != "vendor"]
    assert len(timed) == 2 * 3 * 2 and len({(r["family"], r["config"]) for r in timed}) == 2 * 3
    assert all(not r["error"] and 0 < float(r["seconds"]) < 1e-3 for r in timed)
    for done in meta["done"]:
        assert done["configs"] == 3 and done["cost"]["timed"] == 6 and done["cost"]["compiled"] == 3
        assert done["cost"]["cache"] == "per-set"
    caches = got["caches"]
    assert len(caches) == len(set(caches)) == 2 and not any(Path(c).exists() for c in caches)
