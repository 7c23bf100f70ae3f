"""benchmarks/device_run.sh, rehearsed with --dry-run (CPU, analytic measurer, tiny sizes): the files that
come back from a device call, the archive's layout, the records of every step, and what a time limit does."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "device_run.sh"


def _run(out: Path, *args: str, timeout: int = 120, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(RUNNER), "--dry-run", "--out", str(out), "--work", str(out.parent / "work"),
                           *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _members(archive: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(archive) as tar:
        return {m.name: m for m in tar.getmembers()}


def _read(archive: Path, name: str) -> str:
    with tarfile.open(archive) as tar:
        fh = tar.extractfile(name)
        assert fh is not None, name
        return fh.read().decode()


def _check_returnable(out: Path) -> None:
    """What the device tool brings back: at most 8 files, 16 MiB each, no more than 2 folders down."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8
    assert all(p.stat().st_size <= 16 * 2**20 for p in files)
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)


def test_dry_run_packs_every_stage_into_one_archive(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(out, "--stage", "2,4", "--sets", "dense")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["device-run.tar.gz", "metadata.json", "progress.log"]
    _check_returnable(out)

    members = _members(out / "device-run.tar.gz")
    runs = [n for n in members if n.endswith("/device-run/metadata.json")]
    assert len(runs) == 1 and runs[0].startswith("benchmarks/results/"), sorted(members)
    base = runs[0].removesuffix("metadata.json")
    for name in ("progress.log", "stage2/table.csv", "stage2/table.json", "stage2/record.log", "stage2/report.txt",
                 "stage2/report.json"):
        assert base + name in members, name

    meta = json.loads(_read(out / "device-run.tar.gz", runs[0]))
    assert meta == json.loads((out / "metadata.json").read_text())
    (call,) = meta["calls"]
    assert call["dry_run"] == 1 and call["stages"] == "2,4" and "--dry-run" in call["command"]
    assert call["environment"]["python_executable"] and "torch" in call["environment"]
    steps = {s["step"]: s for s in meta["steps"]}
    assert steps["record_table dense"]["rc"] == 0 and steps["report_table"]["rc"] == 0
    assert "record_table.py" in steps["record_table dense"]["command"]
    assert meta["timed_out"] == [] and meta["failed"] == []

    rows = list(csv.DictReader(io.StringIO(_read(out / "device-run.tar.gz", base + "stage2/table.csv"))))
    families = {r["family"] for r in rows}
    assert families == {"dense-768x768", "dense-3072x768", "dense-768x3072"}
    vendor = [r for r in rows if r["config"] == "vendor"]
    assert len(vendor) == 3 * 4 and len(rows) == 3 * 4 * (1 + 3)  # t-max 4, vendor + 3 configs per set
    table = json.loads(_read(out / "device-run.tar.gz", base + "stage2/table.json"))
    assert table["measure"] == "analytic" and [d["configs"] for d in table["done"]] == [3, 3, 3]

    # a second call on the same machine (same work folder) adds to the records and re-packs everything
    proc = _run(out, "--stage", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = json.loads((out / "metadata.json").read_text())
    assert [c["call"] for c in meta["calls"]] == [1, 2]
    assert base + "stage2/table.csv" in _members(out / "device-run.tar.gz")
    assert "no tuning database yet" in (out / "progress.log").read_text()


def test_a_step_past_its_limit_is_recorded_and_the_archive_kept(tmp_path: Path) -> None:
    slow = tmp_path / "python"  # the interpreter, except that the table recorder hangs
    slow.write_text(f"#!/bin/bash\ncase \"$1\" in *record_table.py) sleep 60 ;; esac\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    out = tmp_path / "out"
    proc = _run(out, "--stage", "2", "--sets", "dense", "--limit", "9", python=str(slow))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a step timed out
    meta = json.loads((out / "metadata.json").read_text())
    record = next(s for s in meta["steps"] if s["step"] == "record_table dense")
    assert record["timed_out"] is True and record["limit"] == 8 and record["rc"] == 124
    assert meta["timed_out"] == ["stage 2: record_table dense"]
    assert any(n.endswith("device-run/progress.log") for n in _members(out / "device-run.tar.gz"))
    _check_returnable(out)


KIT = next((d for d in (ROOT.parent / "shared" / "tools" / "ortgpu", Path("/work/shared/tools/ortgpu"))
            if (d / "prepare_ort_gpu_parts.sh").is_file()), None)


@pytest.mark.slow
@pytest.mark.skipif(KIT is None, reason="needs the ortgpu kit (../shared/tools/ortgpu) to make parts")
def test_parts_are_stashed_across_calls_then_installed(tmp_path: Path) -> None:
    """The onnxruntime-gpu chain with a stand-in wheel in two parts: call 1 stashes part 1, call 2 installs
    from part 2 and later calls find it; a fresh machine (another work folder) refuses part 2 alone."""
    parts = _standin_parts(tmp_path)
    assert sorted(p.name for p in parts.iterdir() if p.is_dir()) == ["p1", "p2"]
    out = tmp_path / "out"

    fresh = _run(out, "--ortgpu", str(parts / "p2"), "--work", str(tmp_path / "fresh"))
    assert fresh.returncode == 1 and "start again at part 1" in fresh.stdout

    assert _run(out, "--ortgpu", str(parts / "p1")).returncode == 0
    second = _run(out, "--ortgpu", str(parts / "p2"))
    assert second.returncode == 0, second.stdout + second.stderr
    target = tmp_path / "work" / "ortgpu"
    assert (target / "ortgpu_standin" / "blob.bin").stat().st_size == 1_500_000
    assert (target / ".installed").is_file()
    third = _run(out, "--stage", "4")  # a later call on the same machine sets up the installed package
    assert third.returncode == 0 and f"onnxruntime-gpu from {target}" in third.stdout
    meta = json.loads((out / "metadata.json").read_text())
    assert [s["step"] for s in meta["steps"]] == ["ortgpu stash part 1 of 2", "ortgpu install (part 2 of 2)"]
    assert str(target) in meta["calls"][-1]["environment"]["env"]["PYTHONPATH"].split(":")[0]


@pytest.mark.slow
@pytest.mark.skipif(KIT is None, reason="needs the ortgpu kit (../shared/tools/ortgpu) to make parts")
def test_a_failed_onnxruntime_gpu_check_skips_the_stages_that_need_it(tmp_path: Path) -> None:
    """The stand-in wheel installs but is no onnxruntime-gpu: its check fails (run here on the CPU through
    DEVICE_RUN_CHECK=1), so stages 3 and 5 are skipped with the reason, in this call and the next on the
    same machine, and the call ends early instead of spending its time on suites that cannot run."""
    parts = _standin_parts(tmp_path)
    out = tmp_path / "out"
    assert _run(out, "--ortgpu", str(parts / "p1")).returncode == 0
    env = {**os.environ, "DEVICE_RUN_CHECK": "1", "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(RUNNER), "--dry-run", "--out", str(out), "--work", str(tmp_path / "work"),
                           "--ortgpu", str(parts / "p2"), "--stage", "1,3,5", "--cap", "1=40"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 1 and "onnxruntime-gpu failed its check" in proc.stdout, proc.stdout + proc.stderr
    steps = [json.loads(line) for line in (tmp_path / "work" / "steps.jsonl").read_text().splitlines()]
    check = next(s for s in steps if s["step"] == "ortgpu check")
    assert check["rc"] not in (0, None) and check["call"] == 2
    skipped = {s["stage"]: s["reason"] for s in steps if s.get("skipped")}
    assert skipped == {3: "onnxruntime-gpu failed its check", 5: "onnxruntime-gpu failed its check"}
    assert all(s["limit"] <= 40 for s in steps if s["stage"] == 1)  # --cap 1=40
    again = _run(out, "--stage", "3", "--suites", "mlp")
    assert "stage 3: SKIPPED: onnxruntime-gpu failed its check" in again.stdout


def _standin_parts(tmp_path: Path, size: int = 1_500_000) -> Path:
    """A stand-in onnxruntime-gpu wheel of ``size`` random bytes, made into parts of 1 MiB by the kit."""
    import random
    import zipfile

    wheel = tmp_path / "onnxruntime_gpu-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("ortgpu_standin/blob.bin", random.Random(0).randbytes(size))
        z.writestr("ortgpu_standin/__init__.py", "")
        z.writestr("onnxruntime_gpu-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: onnxruntime-gpu\n"
                                                               "Version: 9.9.9\n")
        z.writestr("onnxruntime_gpu-9.9.9.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                            "Tag: py3-none-any\n")
        z.writestr("onnxruntime_gpu-9.9.9.dist-info/RECORD", "")
    parts = tmp_path / "cache" / "ortgpu-9.9.9"
    subprocess.run(["bash", str(KIT / "prepare_ort_gpu_parts.sh"), str(parts), "--wheel", str(wheel),
                    "--part-mib", "1", "--threads", "0"], check=True, capture_output=True, timeout=120)
    return parts


@pytest.mark.slow
@pytest.mark.skipif(KIT is None, reason="needs the ortgpu kit (../shared/tools/ortgpu) to make parts")
def test_prepare_device_sizes_parts_to_the_room_left_and_plans_the_calls(tmp_path: Path) -> None:
    """In a clone of this checkout: the headers are copied for real, the cached parts are re-split to what a
    call can still carry, the folders are ignored, and the plan names every part once, in order."""
    stock = _standin_parts(tmp_path, 3_000_000)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(clone)], check=True, timeout=60)
    include = ROOT / ".deps" / "onnxruntime" / "include" / "onnxruntime"
    if not (include / "onnxruntime_cxx_api.h").is_file():
        pytest.skip("needs the ONNX Runtime headers in .deps")
    env = {**os.environ, "DIETCODE_ORT_INCLUDE": str(include)}
    # a call limit that leaves 2 MiB for a part (1 MiB margin) whatever the size of the tree today
    files = subprocess.run(["git", "ls-files"], cwd=clone, capture_output=True, text=True, check=True).stdout.split()
    carried = sum((clone / f).stat().st_size for f in files) + sum(
        f.stat().st_size for f in include.parent.parent.rglob("*") if f.is_file()) + 4096
    # du's apparent sizes also count .device's folders (4 KiB each): a quarter MiB of slack keeps the room at
    # 2 to 3 MiB wherever the tree's size falls within its last MiB
    limit = -(-(carried + 2**18) // 2**20) + 3
    proc = subprocess.run(["bash", "scripts/prepare_device.sh", "--ort", "full", "--version", "9.9.9", "--cache",
                           str(stock.parent), "--limit-mib", str(limit), "--session", "bringup"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (clone / ".device" / "deps" / "onnxruntime" / "include" / "onnxruntime" /
            "onnxruntime_cxx_api.h").is_file()
    assert not (clone / ".device" / "deps").is_symlink()
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                          check=True).stdout == ""
    parts = sorted(p.name for p in (clone / ".ortgpu").iterdir())
    # the kit made 1 MiB parts (3); a call with 2 MiB of room past the tree and .device takes 2 MiB parts
    assert len(list(stock.glob("p*/part"))) == 3
    assert parts == [f"p{k}" for k in range(1, len(parts) + 1)]
    assert len(parts) < 3 and (clone / ".ortgpu" / "p1" / "part").stat().st_size > 2**20
    plan = json.loads((clone / ".device" / "plan.json").read_text())
    calls = plan["calls"]
    carried = [c for call in calls for c in call["carry"] if c.startswith(".ortgpu/")]
    assert carried == [f".ortgpu/p{k}" for k in range(1, len(parts) + 1)]
    assert all(call["carried_mib"] <= limit and ".device" in call["carry"] for call in calls)
    # the install call runs stage 1 and the end-to-end suites; the table takes what is left, in a call of its own
    assert f"--ortgpu .ortgpu/p{len(parts)} --stage 1,3,4" in calls[len(parts) - 1]["command"]
    assert "--stage 2 --sets dense,attention" in calls[-1]["command"]
    time = plan["device_time"]  # every call to its deadline, the start and the gaps: inside the device time
    assert (time["start_s"] + sum(c["deadline"] for c in calls) + time["per_call_s"] * (len(calls) - 1)
            <= time["device_s"] == 15 * 60)
    assert "run(command=" in proc.stdout
    source = json.loads((clone / ".device" / "source.json").read_text())
    assert source["commit"] == subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                                              text=True, check=True).stdout.strip()
    assert source["onnxruntime_gpu"] == "9.9.9" and source["sm90_only"] is False


@pytest.mark.parametrize("args, message", [
    (["--stage", "8"], "unknown stage '8'"),
    (["--stage", "7", "--cap", "8=10"], "--cap takes STAGE=SECONDS"),
    ([], "nothing to do"),
    (["--stage", "2", "--deadline", "soon"], "whole numbers"),
    (["--ortgpu", "nowhere"], "holds no MANIFEST"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _run(tmp_path / "out", *args, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_environment_reads_nvidia_smi_and_falls_back_to_basic_fields(tmp_path: Path, monkeypatch) -> None:
    """A driver that refuses one of the extra query fields still gives name, driver and clocks."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/bash\ncase "$1" in *persistence_mode*) echo "Field \\"x\\" is not valid" >&2; exit 2 ;; esac\n'
                    'echo "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 1980 MHz, 2619 MHz, 1980 MHz, 120.50 W, 35"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    device_info = load_script("device_info")
    smi = device_info._nvidia_smi()
    assert smi == dict(zip(device_info.SMI_BASIC, ["NVIDIA H100 80GB HBM3", "580.159.04", "81559 MiB", "1980 MHz",
                                                   "2619 MHz", "1980 MHz", "120.50 W", "35"]))
    fake.write_text("#!/bin/bash\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert device_info._nvidia_smi().startswith("nvidia-smi exit 9: NVIDIA-SMI has failed")


def test_record_table_samples_to_a_time_budget_and_appends(tmp_path: Path) -> None:
    """--budget-s: a set whose share of the time is spent stops after one config (every set stays
    reportable); a second run appends to the table and keeps the first run's sets in table.json."""
    record_table = load_script("record_table")
    dense = record_table.dense_sets(2)
    path = record_table.record(dense[:2], tmp_path, measure="analytic", budget_s=1e-6, command="first")
    meta = json.loads((tmp_path / "table.json").read_text())
    from tuner.space import Family, enumerate_space

    space = len(enumerate_space(Family("gemm", "float16", "sm_90")))  # every config, split-K ones too
    assert [d["configs"] for d in meta["done"]] == [1, 1] and meta["done"][0]["space"] == space == 1229  # 713 + 294 TMA twins + 222 persistent
    record_table.record(record_table.attention_sets(2)[:1], tmp_path, measure="analytic", max_configs=2,
                        command="second")
    meta = json.loads((tmp_path / "table.json").read_text())
    assert [s["tag"] for s in meta["sets"]] == ["dense-768x768", "dense-3072x768", "attention-qk"]
    assert [(d["tag"], d["configs"]) for d in meta["done"]] == [("dense-768x768", 1), ("dense-3072x768", 1),
                                                                ("attention-qk", 2)]
    assert meta["command"] == "second" and meta["earlier_runs"][0]["command"] == "first"
    rows = list(csv.DictReader(path.open()))
    assert rows[0].keys() == set(record_table.COLUMNS) and len(rows) == 2 * (2 + 2) + 2 * (1 + 2)


def test_record_table_starts_a_group_only_where_the_last_one_would_fit(tmp_path: Path, monkeypatch) -> None:
    """On a stepped clock (a lone config costs 0.1 s, a group of GROUP 4 s): the first set, with no group
    measured yet, runs one past its share; later sets start a group only where the last group's time fits
    what is left of theirs, so the time they leave flows on to the last set, and the table ends within
    --budget-s (measuring a group per set as they came would end at 12.4 s of 10)."""
    record_table = load_script("record_table")
    now = [0.0]
    monkeypatch.setattr(record_table, "_clock", lambda: now[0])

    class Stepped(record_table._AnalyticTable):  # type: ignore[name-defined]
        def measure(self, family, pairs):
            now[0] += 0.1 if len({c for c, _ in pairs}) == 1 else 4.0
            return super().measure(family, pairs)

    monkeypatch.setattr(record_table, "_AnalyticTable", Stepped)
    sets = record_table.dense_sets(2) + record_table.attention_sets(2)[:1]
    record_table.record(sets, tmp_path, measure="analytic", budget_s=10.0)
    meta = json.loads((tmp_path / "table.json").read_text())
    group = 1 + record_table.GROUP
    assert [d["configs"] for d in meta["done"]] == [group, 1, 1, group]
    assert now[0] == pytest.approx(8.4) and now[0] <= 10.0


@pytest.mark.slow
def test_dry_run_suite_keeps_results_db_and_bundles(tmp_path: Path) -> None:
    """Stages 3 and 4 on the tiny MLP: the suite's results where run_suite puts them, the tuning DB and the
    optimized model's bundles (no weights) in the archive."""
    out = tmp_path / "out"
    proc = _run(out, "--stage", "3,4", "--suites", "mlp", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    members = _members(out / "device-run.tar.gz")
    (suite,) = [n for n in members if n.endswith("/mlp-tiny-fp16-cpu.json")]
    base = suite.removesuffix("mlp-tiny-fp16-cpu.json")
    report = json.loads(_read(out / "device-run.tar.gz", suite))
    assert report["optimized_custom_nodes"] > 0 and report["shapes"]
    for name in ("mlp-tiny-fp16-cpu.txt", "device-run/stage3/mlp.log", "device-run/stage4/tuning.db",
                 "device-run/stage4/bundles/index.json",
                 "device-run/stage4/bundles/mlp-tiny-fp16.cpu.dietcode/inspect.json.gz"):
        assert base + name in members, name
    bundles = [n for n in members if n.endswith(".bundle.xz")]
    index = json.loads(_read(out / "device-run.tar.gz", base + "device-run/stage4/bundles/index.json"))
    assert index["mlp-tiny-fp16.cpu.dietcode.onnx"]["bundles"] == len(bundles) > 0
    assert all(members[n].size < 1_000_000 for n in bundles)
    import lzma

    from dietcode_ort.bundle import read_bundle
    with tarfile.open(out / "device-run.tar.gz") as tar:  # each is a whole bundle, xz-compressed
        for n in bundles:
            member = tar.extractfile(n)
            assert member is not None
            assert read_bundle(lzma.decompress(member.read())).kernels


@pytest.mark.slow
def test_dry_run_stage_5_records_the_host_overhead(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(out, "--stage", "5", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    members = _members(out / "device-run.tar.gz")
    (raw,) = [n for n in members if n.endswith("/device-run/stage5/host-overhead.txt")]
    text = _read(out / "device-run.tar.gz", raw)
    assert "provider cpu" in text and "decision path in C (dc_bench_select" in text
    assert "stock per-node cost" in text and "optimized+library per-node overhead" in text
    steps = [json.loads(line) for line in (tmp_path / "work" / "steps.jsonl").read_text().splitlines()]
    assert [(s["stage"], s["step"], s["rc"]) for s in steps] == [(5, "host overhead", 0)]


def test_dry_run_stage_1_keeps_doctor_and_gpu_test_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(out, "--stage", "1", timeout=600)
    members = _members(out / "device-run.tar.gz")
    (doctor,) = [n for n in members if n.endswith("/stage1/doctor.json")]
    base = doctor.removesuffix("doctor.json")
    checks = json.loads(_read(out / "device-run.tar.gz", doctor))
    assert {c["name"] for c in checks} >= {"onnxruntime", "custom-op library", "GPU"}
    for name in ("doctor.txt", "pytest-gpu.log", "pytest-gpu.xml", "pytest-gpu-e2e.log", "nvidia-smi.txt"):
        assert base + name in members, name
    assert "test_gpu_end_to_end.py" in _read(out / "device-run.tar.gz", base + "pytest-gpu-e2e.log")
    steps = json.loads((out / "metadata.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["doctor", "doctor --json", "pytest -m gpu (kernels)",
                                          "pytest -m gpu (end to end)"]
    assert proc.returncode == (0 if all(s["rc"] == 0 for s in steps) else 1)


@pytest.mark.slow
def test_dry_run_stage_7_profiles_a_suite_it_builds_itself(tmp_path: Path) -> None:
    """Stage 7 on a fresh work folder: the tiny MLP is built and optimized as stage 3 would, then both sessions
    are profiled (CPU: ORT's profiler) at the dry run's shapes; JSON, table and log come back."""
    out = tmp_path / "out"
    proc = _run(out, "--stage", "7", "--profile", "mlp", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "work" / "models" / "mlp-tiny-fp16.cpu.dietcode.onnx").is_file()
    members = _members(out / "device-run.tar.gz")
    (profile,) = [n for n in members if n.endswith("/device-run/stage7/mlp.json")]
    base = profile.removesuffix("mlp.json")
    assert base + "mlp.txt" in members and base + "mlp.log" in members
    record = json.loads(_read(out / "device-run.tar.gz", profile))
    assert record["complete"] and record["settings"]["source"] == "ort"
    assert [s["dims"] for s in record["shapes"]] == [{"tokens": 7}, {"tokens": 64}]
    for shape in record["shapes"]:
        assert shape["disagreement"] is None
        assert "dietcode op" in shape["sessions"]["dietcode"]["categories"]
        assert "dietcode op" not in shape["sessions"]["stock"]["categories"]
        # each shape's first call, after the warm-up shape, against its steady runs
        for ses in shape["sessions"].values():
            assert ses["first_call"]["wall_ms"] > 0 and "run_ms" in ses["first_call"]["figures"]
    assert record["settings"]["warmup_shape"] == {"tokens": 6}
    table = _read(out / "device-run.tar.gz", base + "mlp.txt")
    assert "## tokens=64" in table and table.count("first call vs steady") == 2
    steps = [json.loads(line) for line in (tmp_path / "work" / "steps.jsonl").read_text().splitlines()]
    assert [(s["stage"], s["step"], s["rc"]) for s in steps] == [(7, "profile mlp", 0)]


@pytest.mark.slow
def test_dry_run_torch_compile_stage_joins_the_bench_file(tmp_path: Path) -> None:
    """Stage 6 on the tiny MLP (fp16, CPU, eager and dynamic=True): the torch.compile JSON beside the suite's
    bench file, and torch_report's join of the two (here against a hand-made bench file of the same sweep)."""
    device_info = load_script("device_info")
    results = tmp_path / "work" / "tree" / "benchmarks" / "results" / device_info.slug("cpu")
    results.mkdir(parents=True)
    timing = {"times_ms": [1.0], "median_ms": 1.0, "p90_ms": 1.0, "first_call_ms": 2.0}
    (results / "mlp-tiny-fp16-cpu.json").write_text(json.dumps({
        "schema": "dietcode-ort-bench/1", "settings": {"model": "mlp-tiny-fp16.onnx"},
        "environment": {"provider": "cpu", "device": "a CPU", "command": "bench"},
        "shapes": [{"dims": {"tokens": t}, "stock": timing, "optimized": timing} for t in (7, 16)]}))
    out = tmp_path / "out"
    proc = _run(out, "--stage", "6", "--suites", "mlp", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    members = _members(out / "device-run.tar.gz")
    (torch_json,) = [n for n in members if n.endswith("/torch-compile-mlp-tiny-fp16-cpu.json")]
    base = torch_json.removesuffix("torch-compile-mlp-tiny-fp16-cpu.json")
    record = json.loads(_read(out / "device-run.tar.gz", torch_json))
    assert list(record["modes"]) == ["eager", "dynamic"] and record["settings"]["dtype"] == "float16"
    assert [s["dims"] for s in record["shapes"]] == [{"tokens": 7}, {"tokens": 16}]
    assert all(s["modes"]["dynamic"]["agrees"] for s in record["shapes"])
    join = json.loads(_read(out / "device-run.tar.gz", base + "device-run/stage6/mlp-join.json"))
    assert len(join["rows"]) == 2 and join["summary"]["dynamic"]["shapes"] == 2
    assert "geomean" in _read(out / "device-run.tar.gz", base + "torch-compile-mlp-tiny-fp16-cpu.txt")
    steps = [s["step"] for s in json.loads((out / "metadata.json").read_text())["steps"]]
    assert steps == ["torch.compile mlp", "torch_report mlp"]
