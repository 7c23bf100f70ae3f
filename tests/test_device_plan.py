"""benchmarks/device_plan.py: a device session's calls fit its device time, the tool's per-command and per-call
limits, carry each onnxruntime-gpu part once and in order, and name only what device_run.sh accepts."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


dp = load_script("device_plan")


@pytest.mark.parametrize("session", dp.SESSIONS)
@pytest.mark.parametrize("nparts", [1, 2, 3, 4])
@pytest.mark.parametrize("minutes", [15, 30])
def test_every_plan_fits_the_session_and_the_tools_limits(session: str, nparts: int, minutes: int) -> None:
    time = dp.DeviceTime(device_s=minutes * 60)
    calls = dp.plan(nparts, session, time)
    assert dp.device_seconds(calls, time) <= time.device_s - time.margin_s
    assert all(0 < c.deadline and c.timeout_s <= time.command_s for c in calls)
    parts = [p for c in calls for p in c.carry if p.startswith(".ortgpu/")]
    if session == "compare":  # stage 6 needs no onnxruntime-gpu
        assert parts == [] and len(calls) == 1 and "--stage 6" in calls[0].command
    else:
        assert parts == [f".ortgpu/p{k}" for k in range(1, nparts + 1)]
        *stash, main = [c for c in calls if any(p.startswith(".ortgpu/") for p in c.carry)]
        assert all("--stage" not in c.command and c.deadline == dp.STASH_S for c in stash)
        assert "--stage" in main.command and main.deadline >= dp.MIN_MAIN_S
        assert calls.index(main) == nparts - 1  # the install comes right after the last stash
    assert all(".device" in c.carry for c in calls)


def test_the_default_session_is_one_install_call_then_the_table() -> None:
    """15 minutes, the sm_90-only part: install, stage 1 (capped), BERT then the MLP, stage 4; then the dense
    and attention table with the rest."""
    main, table = dp.plan(1, "bringup")
    args = shlex.split(main.command)
    assert args[:2] == ["bash", "benchmarks/device_run.sh"]
    assert args[args.index("--stage") + 1] == "1,3,4" and args[args.index("--suites") + 1] == "bert,mlp"
    cap = int(args[args.index("--cap") + 1].removeprefix("1="))
    assert 90 <= cap < main.deadline // 2  # stage 3 keeps most of the call
    assert table.carry == (".device",) and "--stage 2 --sets dense,attention" in table.command
    assert table.deadline >= dp.MIN_TAIL_S


def test_the_followup_session_reruns_the_gpu_tests_and_profiles_bert_and_the_mlp() -> None:
    """Stage 1 (the GPU tests the bring-up cut off), stage 3 (BERT-base and the MLP again, then ResNet-50) and
    stage 7 (per-kernel profiles of stage 3's models) ride in the followup's main call, each capped, and the
    caps leave the install, stage 4 and the packing their reserve."""
    main, table = dp.plan(1, "followup")
    args = shlex.split(main.command)
    assert args[args.index("--stage") + 1] == "1,3,7,4" and args[args.index("--suites") + 1] == "mlp,bert,resnet50"
    assert args[args.index("--profile") + 1] == "bert,mlp"
    caps = {k: int(v) for k, v in (kv.split("=") for kv in args[args.index("--cap") + 1].split(","))}
    assert caps.keys() == {"1", "3", "7"} and caps["7"] == dp.PROFILE_S and caps["1"] >= 90
    assert sum(caps.values()) + dp.RESERVE_S == main.deadline
    assert caps["3"] >= 3 * 80  # about the bring-up's per-suite time for each of the three suites
    assert "--stage 2 --sets conv" in table.command


def test_more_time_lengthens_the_calls_up_to_the_command_limit() -> None:
    short = dp.plan(1, "bringup", dp.DeviceTime(device_s=900))
    long = dp.plan(1, "bringup", dp.DeviceTime(device_s=3600))
    assert [c.deadline for c in long] == [570, 570] and all(a.deadline < b.deadline for a, b in zip(short, long))


def test_a_session_too_short_for_its_parts_is_refused_with_the_way_out() -> None:
    with pytest.raises(dp.PlanError, match="fewer parts: --ort sm90"):
        dp.plan(4, "bringup", dp.DeviceTime(device_s=600))
    with pytest.raises(dp.PlanError, match="unknown session"):
        dp.plan(1, "everything")
    with pytest.raises(dp.PlanError, match="at least one part"):
        dp.plan(0, "followup")


def test_a_tail_too_short_to_be_worth_a_call_goes_to_the_main_call() -> None:
    (only,) = dp.plan(1, "bringup", dp.DeviceTime(device_s=560, start_s=150))
    assert only.deadline == 560 - 150 - 60 - 20


def test_the_session_follows_the_committed_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    assert dp.session_for(results) == "bringup"
    (results / "nvidia-h100-80gb-hbm3").mkdir(parents=True)
    (results / "nvidia-h100-80gb-hbm3" / "bert-base-fp16-cpu.json").write_text("{}")  # a CPU figure: not it
    assert dp.session_for(results) == "bringup"
    for name, then in (("bert-base-fp16-cuda.json", "followup"), ("resnet50-full-fp16-cuda.json", "compare"),
                       ("torch-compile-bert-base-fp16-cuda.json", "bringup")):
        (results / "nvidia-h100-80gb-hbm3" / name).write_text("{}")
        assert dp.session_for(results) == then


def test_the_planned_arguments_are_ones_the_runner_takes(tmp_path: Path) -> None:
    """Every option a plan puts on a command is one device_run.sh parses: it refuses an unknown option and a
    bad --cap with exit 2 before anything runs, so a plan with either would fail here."""
    runner = ROOT / "benchmarks" / "device_run.sh"
    usage = subprocess.run(["bash", str(runner), "--help"], capture_output=True, text=True, check=True).stdout
    for session in dp.SESSIONS:
        for call in dp.plan(3, session):
            for arg in shlex.split(call.command)[2:]:
                if arg.startswith("--"):
                    assert arg in usage, (session, arg)
    for bad in ("8=10", "1=soon", "1"):
        proc = subprocess.run(["bash", str(runner), "--dry-run", "--out", str(tmp_path / "o"), "--stage", "1",
                               "--cap", bad], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "--cap takes STAGE=SECONDS" in proc.stderr, bad
    assert not (tmp_path / "o").exists()


def test_the_command_line_writes_the_plan_and_refuses_an_oversized_call(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / ".ortgpu" / "p1").mkdir(parents=True)
    (root / ".ortgpu" / "p1" / "part").write_bytes(b"\0" * (3 << 20))
    (root / ".device").mkdir()
    run = [sys.executable, str(ROOT / "benchmarks" / "device_plan.py"), "--parts", "1", "--root", str(root),
           "--tree-bytes", str(1 << 20), "--out", str(root / ".device")]
    ok = subprocess.run([*run, "--limit-mib", "8"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    plan = json.loads((root / ".device" / "plan.json").read_text())
    assert plan["session"] == "bringup" and plan["device_time"]["device_s"] == 900
    assert [c["carried_mib"] for c in plan["calls"]] == [4.0, 1.0]
    assert "run(command='bash benchmarks/device_run.sh --ortgpu .ortgpu/p1 --stage 1,3,4" in ok.stdout
    assert (root / ".device" / "plan.md").read_text() == ok.stdout
    over = subprocess.run([*run, "--limit-mib", "3"], capture_output=True, text=True, timeout=60)
    assert over.returncode == 1 and "call(s) [1] carry more than 3 MiB" in over.stderr
