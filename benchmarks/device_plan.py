"""The `run` calls of one device session, sized to the session's device time.

A session that is lent a GPU machine has ``device_s`` seconds of it in all (15 minutes at present, every try at
the same issue together): the machine's start, each call, the transfers and the idle seconds between calls all
count, no machine starts with under 4 minutes left, one command runs at most 600 s, one call carries at most
64 MiB and the machine goes back 30 s after a call ends. This module turns what a session is for and how many
parts onnxruntime-gpu travels in into the calls to make, in order, each with its ``--deadline`` and
``timeout_s``, so that the whole session fits; ``scripts/prepare_device.sh`` runs it and prints the plan.

Sessions (``session_for`` picks the first whose results are not committed yet):

- ``bringup``: onnxruntime-gpu installed from its last part; stage 1 (its check, ``doctor``, the GPU tests);
  stage 3 on BERT-base and the LLaMA-7B MLP layer (fp16, tuned on the GPU, against stock ORT's CUDA EP);
  stage 4; then stage 2, the measurement table's dense and attention sets, in a second call.
- ``followup``: onnxruntime-gpu; stage 1 again (the bring-up's GPU tests ran out of time); stage 3 on
  BERT-base and the MLP layer again (none of the changes made for their losses since the bring-up was
  measured: the settled trees, the cuBLASLt-fused vendor leaf, the aligned attention kernels) and on ResNet-50
  fp16, at budget 8; stage 7 on stage 3's BERT-base and MLP models (per-kernel profiles against stock ORT, where
  the bring-up's bench lost and one shape where it won, their host gaps included); stage 4; then the table's
  conv sets. Stage 5 (host overhead) waits for a session with time to spare (``--stage 5``, about 90 s).
- ``compare``: stage 6 (PyTorch eager and torch.compile on BERT-base and ResNet-50; ``torch_report.py`` joins
  them with the committed bench files afterwards); it needs no onnxruntime-gpu, so no parts travel.

Parts before the last only travel (a short stash call each): they are what a session pays for onnxruntime-gpu
in more than one part, which is why the sm_90-only build in one part is the default (docs/device.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

RUNNER = "bash benchmarks/device_run.sh"
SESSIONS = ("bringup", "followup", "compare")
GRACE_S = 30          # timeout_s over --deadline: the runner's last packing and the tool's own margin
STASH_S = 60          # a stash call's deadline: the preflight, copying one part, the archive
MIN_MAIN_S = 240      # below this the session's main call would not get past onnxruntime-gpu's install
MIN_TAIL_S = 90       # a second call shorter than this is left out, and its time goes to the main call
TAIL_SHARE = 0.3      # of the time after the stash calls, what the second call gets
PROFILE_S = 90        # stage 7's cap in the followup call: the profiles of stage 3's BERT-base and MLP models
STAGE1_SHARE = 0.2    # of the followup's main call, stage 1's cap (at least 90 s; the bring-up's, 0.3)
RESERVE_S = 40        # of the followup's main call, beside stages 1, 3 and 7: the install, stage 4, packing


class PlanError(ValueError):
    """The session's device time does not hold the calls it is for."""


@dataclass(frozen=True)
class DeviceTime:
    """A session's device time and what it costs to use it (seconds). The start and per-call figures come from
    the first H100 session (2026-11-27: the first call held the machine 31 s longer than its command ran, with
    61 MiB carried; the second, 19 s longer, the time between the calls included), with room to spare."""
    device_s: int = 900
    start_s: int = 60       # asking for the machine until the first command starts, the first transfer included
    per_call_s: int = 20    # each later call's transfer and the seconds between calls
    margin_s: int = 60      # kept back: a call that overruns its estimate, the give-back
    command_s: int = 600    # the most one command may run

    @property
    def longest_deadline(self) -> int:
        return self.command_s - GRACE_S


@dataclass(frozen=True)
class Call:
    why: str
    args: tuple[str, ...]
    carry: tuple[str, ...]
    deadline: int

    @property
    def timeout_s(self) -> int:
        return self.deadline + GRACE_S

    @property
    def command(self) -> str:
        return " ".join((RUNNER, *self.args, "--deadline", str(self.deadline)))


def session_for(results: Path) -> str:
    """The first session whose end-to-end results are not under ``results`` (benchmarks/results) yet."""
    def have(name: str) -> bool:
        return any(results.glob(f"*/{name}"))
    if not have("bert-base-fp16-cuda.json"):
        return "bringup"
    if not have("resnet50-full-fp16-cuda.json"):
        return "followup"
    if not have("torch-compile-bert-base-fp16-cuda.json"):
        return "compare"
    return "bringup"  # everything is there once: measure the bring-up again on the code as it is now


def _main_and_tail(session: str, part: str | None, main_s: int, tail_s: int) -> list[Call]:
    ort = ("--ortgpu", part) if part else ()
    carry = (part, ".device") if part else (".device",)
    calls: list[Call] = []
    if session == "bringup":
        stage1 = max(90, main_s * 3 // 10)
        calls.append(Call(f"install onnxruntime-gpu; stage 1 (its check, doctor, GPU tests, at most {stage1} s); "
                          "stage 3: BERT-base and the LLaMA-7B MLP layer, fp16, tuned on the GPU, against stock "
                          "ORT's CUDA EP; stage 4: the tuning DB and bundles",
                          (*ort, "--stage", "1,3,4", "--suites", "bert,mlp", "--budget", "16", "--cap", f"1={stage1}"),
                          carry, main_s))
        if tail_s:
            calls.append(Call("stage 2: the table's dense and attention sets (seeded sample of the sm_90 space, "
                              "cuBLAS on every instance), then its report", ("--stage", "2", "--sets", "dense,attention"),
                              (".device",), tail_s))
    elif session == "followup":
        stage1 = max(90, int(main_s * STAGE1_SHARE))  # the GPU tests: cut off twice in the bring-up, in parallel now
        stage3 = main_s - stage1 - PROFILE_S - RESERVE_S
        calls.append(Call(f"install onnxruntime-gpu; stage 1 (its check, doctor, GPU tests, at most {stage1} s); "
                          "stage 3: the LLaMA-7B MLP layer and BERT-base again, then ResNet-50 (stock with EXHAUSTIVE "
                          f"and HEURISTIC cuDNN search), fp16, budget 8, at most {stage3} s; stage 7: per-kernel "
                          f"profiles of stage 3's BERT-base and MLP against stock ORT (at most {PROFILE_S} s); stage 4",
                          (*ort, "--stage", "1,3,7,4", "--suites", "mlp,bert,resnet50", "--profile", "bert,mlp",
                           "--budget", "8", "--cap", f"1={stage1},3={stage3},7={PROFILE_S}"), carry, main_s))
        if tail_s:
            calls.append(Call("stage 2: the table's conv sets, then its report", ("--stage", "2", "--sets", "conv"),
                              (".device",), tail_s))
    else:
        calls.append(Call("stage 6: BERT-base and ResNet-50 fp16 under PyTorch eager and torch.compile (dynamic, "
                          "mark_dynamic, max-autotune); benchmarks/torch_report.py joins them with the committed "
                          "bench files afterwards",
                          ("--stage", "6", "--suites", "bert,resnet50"), carry, main_s))
    return calls


def plan(nparts: int, session: str, time: DeviceTime = DeviceTime()) -> list[Call]:
    """The calls of one session, in order: a stash call per part before the last, then the session's main
    call (with the last part) and, where the time holds one, a second call. Raises PlanError when the
    session's device time cannot hold the main call."""
    if session not in SESSIONS:
        raise PlanError(f"unknown session {session!r} (one of {', '.join(SESSIONS)})")
    if session == "compare":
        nparts = 0  # stage 6 needs no onnxruntime-gpu
    elif nparts < 1:
        raise PlanError(f"the {session} session installs onnxruntime-gpu: it needs at least one part")
    calls = [Call(f"onnxruntime-gpu part {k} of {nparts}: stashed for the install", ("--ortgpu", f".ortgpu/p{k}"),
                  (f".ortgpu/p{k}", ".device"), STASH_S) for k in range(1, nparts)]
    left = time.device_s - time.start_s - time.margin_s - len(calls) * (STASH_S + time.per_call_s)
    left -= time.per_call_s  # the main call's own transfer (the first call's is in start_s when it is first)
    if left < MIN_MAIN_S:
        raise PlanError(f"{time.device_s} s of device time leave {left} s for the {session} session's main call "
                        f"after {len(calls)} stash call(s): it needs {MIN_MAIN_S} s (fewer parts: --ort sm90)")
    main = min(left - int(left * TAIL_SHARE), time.longest_deadline)  # the second call takes the rest
    tail = min(left - main - time.per_call_s, time.longest_deadline)
    if session == "compare" or tail < MIN_TAIL_S:  # compare is one call
        main, tail = min(left, time.longest_deadline), 0
    part = f".ortgpu/p{nparts}" if nparts else None
    return calls + _main_and_tail(session, part, main, tail)


def device_seconds(calls: Sequence[Call], time: DeviceTime = DeviceTime()) -> int:
    """The most device time the calls take if each runs to its deadline and follows the last at once."""
    return time.start_s + sum(c.deadline for c in calls) + time.per_call_s * (len(calls) - 1)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def render(calls: Sequence[Call], session: str, time: DeviceTime, tree_bytes: int, root: Path,
           limit_mib: float) -> tuple[list[dict], str]:
    """plan.json's records (carried MiB measured under ``root``) and plan.md's text."""
    records = []
    for i, c in enumerate(calls, 1):
        carried = (tree_bytes + sum(_size(root / p) for p in c.carry)) / 2**20
        records.append({"call": i, "why": c.why, "command": c.command, "carry": list(c.carry),
                        "deadline": c.deadline, "timeout_s": c.timeout_s, "carried_mib": round(carried, 1)})
    worst = device_seconds(calls, time)
    lines = [f"# Device calls for the {session} session ({len(calls)}), in order, each within 30 s of the last", ""]
    for r in records:
        lines += [f"## call {r['call']}: {r['why']}",
                  f"run(command={r['command']!r}, carry={json.dumps(r['carry'])}, timeout_s={r['timeout_s']})",
                  f"   carries {r['carried_mib']} MiB of {limit_mib:g}", ""]
    lines += [f"Device time if every call runs to its deadline: {worst} s ({worst / 60:.1f} min) of the session's "
              f"{time.device_s} s, counting {time.start_s} s for the machine's start and {time.per_call_s} s "
              f"between calls; {time.device_s - worst} s stay in hand.",
              "Make each call as soon as the last returns (the machine goes back 30 s after a call). A call that "
              "ends early leaves its time to the next: raise the next call's --deadline (and timeout_s) by the "
              f"seconds saved, up to {time.longest_deadline}.",
              "Keep each call's files (device-run.tar.gz, metadata.json, progress.log) outside the checkout and "
              "unpack the last archive at the repository root at the end (docs/device.md)."]
    return records, "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, required=True, help="onnxruntime-gpu parts in .ortgpu/")
    ap.add_argument("--session", default="auto", choices=("auto", *SESSIONS),
                    help="what the session is for (auto: the first whose results are not committed)")
    ap.add_argument("--device-minutes", type=float, default=15.0, help="the session's device time")
    ap.add_argument("--start-s", type=int, default=DeviceTime.start_s, help="estimated machine start")
    ap.add_argument("--tree-bytes", type=int, default=0, help="what every call carries anyway")
    ap.add_argument("--limit-mib", type=float, default=64.0, help="the most one call may carry")
    ap.add_argument("--root", type=Path, default=Path("."), help="the checkout (carried paths are under it)")
    ap.add_argument("--out", type=Path, help="write plan.json and plan.md here")
    args = ap.parse_args(argv)
    session = session_for(args.root / "benchmarks" / "results") if args.session == "auto" else args.session
    time = DeviceTime(device_s=int(args.device_minutes * 60), start_s=args.start_s)
    try:
        calls = plan(args.parts, session, time)
    except PlanError as exc:
        print(f"device_plan: {exc}", file=sys.stderr)
        return 1
    records, text = render(calls, session, time, args.tree_bytes, args.root, args.limit_mib)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(json.dumps({"session": session, "device_time": asdict(time),
                                                        "calls": records}, indent=1) + "\n")
        (args.out / "plan.md").write_text(text)
    print(text, end="")
    over = [r["call"] for r in records if r["carried_mib"] > args.limit_mib]
    if over:
        print(f"device_plan: call(s) {over} carry more than {args.limit_mib:g} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
