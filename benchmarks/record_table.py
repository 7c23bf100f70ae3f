"""Record a full micro-kernel measurement table on a GPU: every candidate of the space x every instance.

    python benchmarks/record_table.py --out DIR [--sets dense,attention,conv] [--repeats 10] [--budget-s S]

The table lets any search strategy, cost model or dispatcher be evaluated later on a CPU by replay
(``tuner.measure.ReplayMeasurer``, ``benchmarks/report_table.py``). Sets (the DietCode BERT shapes and
ResNet-50's convolutions, fp16):

- ``dense``: (N, K) in (768, 768), (3072, 768), (768, 3072); M = 16*T for T = 1..128 (384 instances).
- ``attention``: batch*heads = 192; (M, N, K) = (T, T, 64) and (T, 64, T) for T = 1..128.
- ``conv``: every distinct ResNet-50 conv layer (from ``tuner.scan`` of the full model) at batch 1, 8, 32
  and 224x224, plus batch 8 at 160 and 288.
- ``depthwise``: every distinct MobileNetV2 depthwise conv layer (grouped: a GEMM of one channel per group) at
  the same images; not in the default sets.

The configs are timed as they would ship (``tuner.measure.GpuMeasurer``): each compiled ahead of time by
``tuner.aot`` with the divisibility assumptions ``optimize`` would give the set's workload (``shipped_div16``),
its cubin launched by the custom-op library's C core in a child process, L2 flushed before each timed
launch. Rows are appended to DIR/table.csv after the first config and then after every group of ``GROUP``
configs (compiled in parallel; a run cut off keeps what it measured) with the columns ReplayMeasurer reads
plus ``family`` (the set's tag, e.g. ``dense-768x768``); each problem also gets a ``vendor`` row (cuBLAS /
cuDNN through torch). DIR/table.json holds the device, driver, library versions, the command and the date.
Compress the CSV (gzip) to commit it.

A documented sample when time is short: ``--budget-s S`` shares S seconds among the sets (each set gets
the time left over the sets left, so what one set leaves unused flows to the next) and measures a set's
configs in a seeded random order while the next group fits its share: a group is started only if the last
group measured (this set's, else the run's) would have ended within it, so a set does not overrun into the
sets after it (and the step's hard limit) by a group; ``--max-configs N``
caps each set at N configs; ``--t-max`` shortens T = 1..128. ``--order mixed`` takes, in turn, one config
from the seeded random order and one the roofline model (tuner/roofline.py) ranks best for a problem (each
problem's best, heaviest problems first, then each one's second best, and so on), so a short sample also
holds the configs most likely to be each instance's best: the per-instance oracle of a small sample then
says more about what the space can do, while half the sample stays an unbiased draw for replaying searches;
``--order random`` (the default) keeps the plain random sample. ``table.json`` records per set how many configs
of the space were measured (``done``) and what that cost (``cost``: wall seconds compiling, configs
compiled, wall seconds timing, launches timed; the units of report_table.py's tuning-cost figure). Each set
compiles into a kernel cache of its own (``cost``'s ``cache``: "per-set"), so a set's compile seconds are
its configs' compiles, not reads of kernels an earlier set compiled (the dense sets' kernels are the same
binaries: a shared cache made the later sets' compiles look 3 to 4 times cheaper).
``--measure analytic`` (no GPU; rehearsals only) fills the table from the roofline model, the vendor rows
with the roofline floor: never report its figures.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dietcode_ort.errors import DietcodeError  # noqa: E402
from tuner.workload import ConvParams, Epilogue, Problem  # noqa: E402

__all__ = ["TableSet", "dense_sets", "attention_sets", "conv_sets", "depthwise_sets", "SETS", "COLUMNS", "record", "main",
           "shipped_div16", "GROUP"]

COLUMNS = ["config", "m", "n", "k", "batch", "seconds", "device", "error", "family"]
GROUP = 16  # configs per measurement call: compiled in parallel, then timed in one batch
_clock = time.monotonic  # the recorder's clock (tests step it)
ORDERS = ("random", "mixed")


@dataclass(frozen=True)
class TableSet:
    """One workload of the table: a tag, its template and constants, and its instances."""

    tag: str
    op: str  # gemm | bmm | conv
    problems: tuple[Problem, ...]
    epilogue: Epilogue = Epilogue()
    conv: ConvParams | None = None
    dtype: str = "float16"
    meta: dict = field(default_factory=dict)


def dense_sets(t_max: int = 128) -> list[TableSet]:
    return [TableSet(f"dense-{n}x{k}", "gemm", tuple(Problem(16 * t, n, k) for t in range(1, t_max + 1)),
                     meta={"N": n, "K": k, "M": "16*T"})
            for n, k in ((768, 768), (3072, 768), (768, 3072))]


def attention_sets(t_max: int = 128, batch: int = 192) -> list[TableSet]:
    return [TableSet("attention-qk", "bmm", tuple(Problem(t, t, 64, batch) for t in range(1, t_max + 1)),
                     meta={"M": "T", "N": "T", "K": 64, "batch": batch}),
            TableSet("attention-av", "bmm", tuple(Problem(t, 64, t, batch) for t in range(1, t_max + 1)),
                     meta={"M": "T", "N": 64, "K": "T", "batch": batch})]


CONV_IMAGES = ((1, 224, 224), (8, 224, 224), (32, 224, 224), (8, 160, 160), (8, 288, 288))


def _model_conv_sets(name: str, preset: str, images: Sequence[tuple[int, int, int]],
                     grouped: bool) -> list[TableSet]:
    """The distinct conv layers of model ``name`` (as the scanner sees its ``preset``), grouped or not, at
    ``images``, each in the layout optimize gives it (``--conv-layout``'s default: channels-last where
    tuner.layout chooses it, tagged ``-nhwc``)."""
    from pathlib import Path

    import models
    from tuner.optimize import OptimizeOptions, _layouts
    from tuner.scan import scan_model
    from tuner.workload import Instance

    out = []
    model = models.build(name, preset)
    for w in _layouts(model, scan_model(model).workloads, OptimizeOptions().conv_layout, Path(".")):
        if w.op != "conv" or (w.conv.groups > 1) != grouped:
            continue
        c = w.conv
        problems = tuple(w.problem(Instance.of({"batch": n, "height": h, "width": wd})) for n, h, wd in images)
        tag = (f"conv-{c.in_channels}x{c.out_channels}-k{c.kernel[0]}s{c.strides[0]}"
               f"{f'-g{c.groups}' if c.groups > 1 else ''}"
               f"-{'bias' if w.epilogue.bias else 'nobias'}-{w.epilogue.activation}{'-nhwc' if c.channels_last else ''}")
        out.append(TableSet(tag, "conv", problems, w.epilogue, c, meta={"nodes": len(w.nodes)}))
    return out


def conv_sets(images: Sequence[tuple[int, int, int]] = CONV_IMAGES, preset: str = "full") -> list[TableSet]:
    """The distinct conv layers of ResNet-50 (as the scanner sees the model of ``preset``) at ``images``."""
    return _model_conv_sets("resnet50", preset, images, grouped=False)


def depthwise_sets(images: Sequence[tuple[int, int, int]] = CONV_IMAGES, preset: str = "full") -> list[TableSet]:
    """The distinct depthwise (grouped) conv layers of MobileNetV2 at ``images``: one GEMM of N = 1,
    K = 9 per channel, batched over the channels."""
    return _model_conv_sets("mobilenet_v2", preset, images, grouped=True)


SETS = {"dense": dense_sets, "attention": attention_sets, "conv": conv_sets, "depthwise": depthwise_sets}


def shipped_div16(s: TableSet) -> tuple[str, ...]:
    """The divisibility assumptions ``optimize`` would compile the set's workload with: M, N and K count as
    constant where every instance has the same value (conv: always; gemm: the dense (N, K); bmm: the 64, which
    makes batch strides multiples of 16 too)."""
    from tuner.aot import shipped_div16 as div16

    def constant(values: set[int]) -> int | None:
        return next(iter(values)) if len(values) == 1 else None

    return div16(s.op, s.epilogue.bias, constant({p.n for p in s.problems}), constant({p.k for p in s.problems}),
                 m=constant({p.m for p in s.problems}))


def _analytic_environment(command: str, target: str) -> dict:
    import platform

    from tuner.hardware import get_profile

    return {"device": f"analytic:{get_profile(target).name}", "arch": target, "measure": "analytic",
            "note": "roofline model, vendor rows are the roofline floor: a rehearsal, not a measurement",
            "python": platform.python_version(), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class _AnalyticTable:
    """``--measure analytic``: the roofline model for configs, the roofline floor for the vendor rows."""

    def __init__(self, target: str, dtype: str, tf32: bool = False) -> None:
        from tuner.hardware import get_profile
        from tuner.measure import AnalyticMeasurer

        self.profile = get_profile(target)
        self.inner = AnalyticMeasurer(self.profile, dtype, tf32=tf32)
        self.dtype = dtype

    def device_key(self) -> str:
        return self.inner.device_key()

    def measure(self, family, pairs):
        return self.inner.measure(family, pairs)

    def measure_vendor(self, family, problems):
        from tuner.cost_model import peak_flops, useful_flops
        from tuner.measure import ORT_CUDA_USES_TF32, MeasureResult
        from tuner.space import DTYPE_BYTES

        # the vendor library runs float32 as ORT's CUDA EP does (TF32 by default)
        elem, peak = DTYPE_BYTES[self.dtype], peak_flops(self.profile, self.dtype, tf32=ORT_CUDA_USES_TF32)
        bandwidth = self.profile.dram_bandwidth_gbs * 1e9
        return [MeasureResult(max(useful_flops(p) / peak,
                                  (p.m * p.k + p.k * p.n + p.m * p.n) * p.batch * elem / bandwidth) + 3e-6)
                for p in problems]


def _environment(command: str) -> dict:
    """The device as the CUDA driver names it (the rows' device key comes from the same probe,
    ``tuner.gpu_timing.CudaBackend.device_key``), and the library versions."""
    import ctypes
    import platform

    import triton

    from dietcode_ort.runtime import load_core

    probe = load_core().cuda_probe(0)  # DietcodeError naming what is missing (driver, device)
    sms = ctypes.c_int()
    cuda = ctypes.CDLL("libcuda.so.1")  # loaded by the probe
    if cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, 0):  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        sms.value = 0
    env = {"device": probe["name"], "arch": f"sm_{probe['major']}{probe['minor']}", "measure": "gpu",
           "sms": sms.value, "driver": str(probe["driver_version"]), "triton": triton.__version__,
           "python": platform.python_version(), "command": command,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:  # the vendor rows' library
        import torch

        env.update(cuda=torch.version.cuda, torch=torch.__version__)
    except ImportError:
        pass
    return env


def sample_order(space: Sequence, problems: Sequence[Problem], target: str, dtype: str, tf32: bool, seed: int,
                 order: str = "random", device: str = "") -> list:
    """The order ``record`` measures ``space`` in (see the module docstring): the seeded random order, or
    for ``mixed`` that order interleaved with the roofline's per-problem rankings (on ``device``'s profile,
    ``tuner.hardware.device_profile``: the GPU recorded on), each config once."""
    if order not in ORDERS:
        raise DietcodeError(f"unknown --order {order!r}; allowed: {', '.join(ORDERS)}")
    shuffled = list(space)
    random.Random(seed).shuffle(shuffled)
    if order == "random" or not shuffled:
        return shuffled
    import numpy as np

    from tuner.hardware import device_profile
    from tuner.roofline import roofline_matrix

    predicted = roofline_matrix(shuffled, problems, device_profile(device, target), dtype, tf32)
    heaviest = sorted(range(len(problems)), key=lambda j: -problems[j].m * problems[j].n * problems[j].k
                      * problems[j].batch)
    ranks = [np.argsort(predicted[:, j], kind="stable") for j in heaviest]
    by_model = [int(r[depth]) for depth in range(len(shuffled)) for r in ranks]  # unlaunchable (inf) last
    out: list = []
    seen: set[int] = set()
    streams = [iter(range(len(shuffled))), iter(by_model)]
    turn = 0
    while len(out) < len(shuffled):
        for i in streams[turn % 2]:
            if i not in seen:
                seen.add(i)
                out.append(shuffled[i])
                break
        turn += 1
    return out


def record(sets: Sequence[TableSet], out: Path, *, repeats: int = 10, max_configs: int | None = None,
           seed: int = 0, command: str = "", budget_s: float | None = None, measure: str = "gpu",
           fp32_precision: str = "tf32", order: str = "random") -> Path:
    """Measure the configs of each set's space (all, or the sample ``max_configs`` / ``budget_s`` allow;
    see the module docstring) on each of its problems; returns the CSV path. float32 kernels are compiled in
    ``fp32_precision`` (tuner.aot: "tf32", optimize's default, or "ieee")."""
    from tuner.aot import check_fp32_precision, uses_tf32
    from rich.progress import Progress

    from tuner.measure import GpuMeasurer
    from tuner.space import Family, enumerate_space

    check_fp32_precision(fp32_precision)
    out.mkdir(parents=True, exist_ok=True)
    if measure == "analytic":
        env = _analytic_environment(command, "sm_90")
    else:
        env = _environment(command)
    target = "sm_90" if env["arch"].startswith("sm_9") else "sm_89" if env["arch"] == "sm_89" else "sm_80"
    started = _clock()
    timing: object = "analytic model"
    if measure != "analytic":
        from dataclasses import asdict

        from tuner.gpu_timing import TimingSettings

        timing = {"kernels": "AOT cubins as shipped, launched through the custom-op library's C core "
                             "(dc_time_kernel); median of the timed launches", "vendor": "torch (cuBLAS / cuDNN)",
                  **asdict(TimingSettings(repeats=repeats))}
    meta = {**env, "target_space": target, "repeats": repeats, "seed": seed, "order": order, "budget_s": budget_s,
            "timing": timing,
            "max_configs": max_configs, "fp32_precision": fp32_precision,
            "sets": [{"tag": s.tag, "op": s.op, "dtype": s.dtype, "instances": len(s.problems), **s.meta}
                     for s in sets], "done": []}
    meta_path, table = out / "table.json", out / "table.csv"
    new = not table.exists()
    if not new and meta_path.is_file():  # appending to an earlier run's table: keep what it recorded
        earlier = json.loads(meta_path.read_text())
        meta["sets"] = earlier.get("sets", []) + meta["sets"]
        meta["done"] = earlier.get("done", [])
        meta["earlier_runs"] = earlier.get("earlier_runs", []) + [
            {k: earlier.get(k) for k in ("command", "date", "budget_s", "max_configs", "device", "driver")}]
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    group_s: list[float] = []  # wall seconds of each full group measured so far (the next one's estimate)
    with table.open("a", newline="") as fh, Progress() as bar:
        writer = csv.writer(fh)
        if new:
            writer.writerow(COLUMNS)
        for index, s in enumerate(sets):
            family = Family(s.op, s.dtype, target)
            full = enumerate_space(family, fp32_precision)  # every config, split-K too (it takes any epilogue)
            # a run cut off still covers the space evenly (and, mixed, each problem's likeliest best)
            space = sample_order(full, s.problems, target, s.dtype, uses_tf32(s.dtype, fp32_precision), seed, order,
                                 str(env.get("device", "")))
            space = space[:max_configs] if max_configs else space
            deadline = None
            if budget_s is not None:  # this set's share of the time left
                deadline = _clock() + (budget_s - (_clock() - started)) / (len(sets) - index)
            kernels = None
            if measure == "analytic":
                measurer = _AnalyticTable(target, s.dtype, uses_tf32(s.dtype, fp32_precision))
            else:
                kernels = tempfile.TemporaryDirectory(prefix="dietcode-table-kernels-")  # this set's compiles only
                measurer = GpuMeasurer(repeats=repeats, conv=s.conv, epilogue=s.epilogue, div16=shipped_div16(s),
                                       allow_tf32=uses_tf32(s.dtype, fp32_precision), cache_dir=Path(kernels.name))
            try:
                measured = _record_set(s, family, space, measurer, writer, fh, bar, deadline, group_s)
            finally:
                if isinstance(measurer, GpuMeasurer):
                    measurer.close()
                if kernels is not None:
                    kernels.cleanup()
            done: dict = {"tag": s.tag, "configs": measured, "space": len(full)}
            if isinstance(measurer, GpuMeasurer):  # the tuning cost's units (report_table.py)
                done["cost"] = {"compile_s": measurer.compile_seconds, "compiled": measurer.compiled,
                                "timing_s": measurer.timing_seconds, "timed": measurer.timed, "cache": "per-set"}
            meta["done"].append(done)
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return table


def _record_set(s: TableSet, family, space: list, measurer, writer, fh, bar, deadline: float | None,
                group_s: list[float]) -> int:
    """The vendor rows, then the configs of ``space``: the first alone (so every set can be reported, whatever
    the deadline), the others in groups of GROUP while the next group is expected to end by ``deadline`` (the
    last full group's time, this set's or an earlier set's, appended to ``group_s``; before any, while
    ``deadline`` is ahead); how many configs were measured."""
    device = measurer.device_key()
    task = bar.add_task(s.tag, total=len(space) + 1)
    for r, p in zip(measurer.measure_vendor(family, s.problems), s.problems):
        writer.writerow(["vendor", p.m, p.n, p.k, p.batch, repr(r.seconds), device, r.error or "", s.tag])
    fh.flush()
    bar.advance(task)
    measured = 0
    for group in [space[:1]] + [space[i:i + GROUP] for i in range(1, len(space), GROUP)]:
        if deadline is not None and measured and _clock() + (group_s[-1] if group_s else 0.0) > deadline:
            break
        started = _clock()
        results = measurer.measure(family, [(config, p) for config in group for p in s.problems])
        for i, config in enumerate(group):
            for r, p in zip(results[i * len(s.problems):(i + 1) * len(s.problems)], s.problems):
                writer.writerow([config.key(), p.m, p.n, p.k, p.batch, repr(r.seconds), device, r.error or "", s.tag])
        fh.flush()
        if len(group) == GROUP:
            group_s.append(_clock() - started)
        measured += len(group)
        bar.advance(task, len(group))
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for table.csv and table.json")
    p.add_argument("--sets", default="dense,attention,conv", help=f"comma list of: {', '.join(SETS)}")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement (median; default 10)")
    p.add_argument("--max-configs", type=int, help="measure only this many configs per set (a seeded sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=ORDERS, default="random",
                   help="random (default): a seeded random sample; mixed: half of it the roofline's per-problem picks")
    p.add_argument("--budget-s", type=float, help="seconds for the whole table, shared among the sets")
    p.add_argument("--t-max", type=int, default=128, help="T = 1..T_MAX for the dense and attention sets")
    p.add_argument("--conv-preset", default="full", help="the ResNet-50 preset the conv layers come from")
    p.add_argument("--measure", default="gpu", choices=["gpu", "analytic"],
                   help="gpu (default) or analytic: the roofline model, to rehearse the recorder without a GPU")
    p.add_argument("--fp32-precision", choices=("tf32", "ieee"), default="tf32",
                   help="float32 kernels' dots: tf32 (default, as optimize compiles them) or ieee")
    args = p.parse_args(argv)
    try:
        names = [n.strip() for n in args.sets.split(",") if n.strip()]
        unknown = [n for n in names if n not in SETS]
        if unknown or not names:
            raise DietcodeError(f"unknown set(s) {unknown or args.sets!r}; allowed: {', '.join(SETS)}")
        if args.repeats < 1:
            raise DietcodeError(f"--repeats must be >= 1, got {args.repeats}")
        if args.t_max < 1 or (args.budget_s is not None and args.budget_s <= 0):
            raise DietcodeError(f"--t-max must be >= 1 and --budget-s > 0 (got {args.t_max}, {args.budget_s})")
        if args.measure == "gpu":
            try:
                import torch
            except ImportError:
                raise DietcodeError("recording a table needs torch with CUDA") from None
            if not torch.cuda.is_available():
                raise DietcodeError("recording a table needs a CUDA GPU and none is visible")
        makers = {"dense": lambda: dense_sets(args.t_max), "attention": lambda: attention_sets(args.t_max),
                  "conv": lambda: conv_sets(preset=args.conv_preset),
                  "depthwise": lambda: depthwise_sets(preset=args.conv_preset)}
        sets = [s for n in names for s in makers[n]()]
        path = record(sets, args.out, repeats=args.repeats, max_configs=args.max_configs, seed=args.seed,
                      command=shlex.join(sys.argv), budget_s=args.budget_s, measure=args.measure,
                      fp32_precision=args.fp32_precision, order=args.order)
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {args.out / 'table.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
