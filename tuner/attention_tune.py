"""Tuning fused attention: each distinct attention chain is a workload tuned jointly over its instances.

A chain's workload (``AttentionWorkload``) is what its kernels are compiled for: dtype, head dim, whether a
mask is added and whether it varies along the queries, causal, NaN-to-zero and the scale (all constexprs of
``templates.attention_kernel``). Its instances are the chain's recorded ``seq_q`` / ``seq_k`` / batch x heads
expressions (tuner/attention_graph.py) evaluated at the model's instances (``--dim`` options or a shape log).
Every config of ``tuner.attention.attention_space`` is costed on every instance, ``tuner.dispatch`` picks at
most ``max_kernels`` of them and a decision tree over the dynamic sizes (no vendor leaf: the CUDA EP has no
vendor attention), and the chosen configs are compiled for every target (``tuner.attention.compile_attention``).

The cost is analytic (``attention_time``): FLOPs ``4 * z * Tq * Tk * d`` and the bytes of Q, K, V, O and the
mask, with Tq / Tk padded to BLOCK_M / BLOCK_N, whole waves of programs over the SMs, and a per-step latency.
With ``--measure gpu`` (or auto on a GPU machine) the ``budget`` configs this cost ranks best are compiled as
they ship and timed through tuner.gpu_timing's child process (``AttentionMeasurer``, on this machine or, under
``--ray``, as Ray GPU tasks like the GEMM measurements; the C core launches them with
``dc_attention_view``'s arguments) and the dispatch is built from those times. With ``--db`` the timings are
kept in the tuning database (tuner.database; ``timing_family`` / ``timing_context`` key them) and a rerun
reuses them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dietcode_ort.bundle import Bundle, BundleKernel, Feature
from dietcode_ort.errors import DietcodeError
from tuner.attention import ATTENTION_DTYPES, AttentionConfig, attention_space, block_d
from tuner.cost_model import LAUNCH_SECONDS  # one kernel launch, as the GEMM roofline charges it
from tuner.hardware import HardwareProfile, named_profile
from tuner.measure import Measurer, check_analytic_gpu
from tuner.workload import Instance, Workload

if TYPE_CHECKING:
    import numpy as np

    from pathlib import Path

    from tuner.database import Database
    from tuner.executor import Executor
    from tuner.gpu_timing import TimingSettings
    from tuner.measure import MeasureResult
    from tuner.space import Family

    from tuner.attention_graph import AttentionSite
    from tuner.dispatch import Dispatch

__all__ = ["AttentionWorkload", "AttentionProblem", "attention_workload", "attention_features",
           "problem_values", "attention_time", "attention_instances", "tune_attention", "TunedAttention",
           "compile_tuned", "carrier", "report_line", "FEATURE_NAMES", "gpu_times", "one_kernel_bundle",
           "tune_sites", "info_json", "unfit_reason", "shipped_kernels"]

FEATURE_NAMES = ("seq_q", "seq_k", "batch")
_STEP_SECONDS = 4e-8  # one key block of the online softmax, per program (latency, not throughput)


@dataclass(frozen=True)
class AttentionWorkload:
    """One distinct attention computation: what its kernels are compiled for, and its size expressions."""

    dtype: str
    head_dim: int
    has_mask: bool
    mask_rows: bool
    causal: bool
    nan_to_zero: bool
    scale: float
    rank: int
    seq_q: str
    seq_k: str
    batch: str
    layout: int = 0  # the node's operand layouts (tuner.attention.LAYOUT_BITS), constexprs of its kernels
    heads: int = 0  # the packed layout's heads (its inputs [B, T, 3 * heads * d] have no heads dim); else 0

    def key(self) -> tuple:
        return (self.dtype, self.head_dim, self.has_mask, self.mask_rows, self.causal, self.nan_to_zero,
                self.scale, self.rank, self.seq_q, self.seq_k, self.batch, self.layout, self.heads)

    def dynamic(self) -> tuple[str, ...]:
        """The feature names whose expression is not a constant (the dispatch tree splits on these)."""
        exprs = dict(zip(FEATURE_NAMES, (self.seq_q, self.seq_k, self.batch)))
        return tuple(n for n in FEATURE_NAMES if not exprs[n].isdigit())


@dataclass(frozen=True, order=True)
class AttentionProblem:
    seq_q: int
    seq_k: int
    batch: int  # z = batch x heads


def attention_workload(site: "AttentionSite") -> AttentionWorkload:
    kernel_mask = site.mask is not None and not site.causal  # a causal mask is the kernels' causal mode
    return AttentionWorkload(site.dtype, site.head_dim, kernel_mask, kernel_mask and site.mask_rows, site.causal,
                             site.nan_to_zero, float(site.scale),
                             site.rank, site.seq_q, site.seq_k, site.batch, site.layout, site.packed_heads)


def attention_features(w: AttentionWorkload) -> tuple[Feature, ...]:
    """The dispatch features as products of the node's input dims (Q [..., Tq, d], Kt [..., d, Tk]; with the
    head-split layouts Q [B, Tq, H, d] and K [B, Tk, H, d]; packed, Q and K [B, T, 3 * H * d], whose batch
    feature is B alone: ``problem_values`` gives it as batch x heads / heads)."""
    from tuner.attention import LAYOUT_BITS

    q_bshd, k_bshd = w.layout & LAYOUT_BITS["q"], w.layout & LAYOUT_BITS["k"]
    terms = {"seq_q": ((0, -3),) if q_bshd else ((0, -2),), "seq_k": ((1, -3),) if k_bshd else ((1, -1),),
             "batch": ((0, 0), (0, 2)) if q_bshd else tuple((0, d) for d in range(w.rank - 2))}
    if w.layout & LAYOUT_BITS["packed"]:
        terms = {"seq_q": ((0, 1),), "seq_k": ((1, 1),), "batch": ((0, 0),)}
    return tuple(Feature(n, terms[n]) for n in w.dynamic())


def problem_values(w: AttentionWorkload, p: AttentionProblem) -> tuple[int, ...]:
    values = {"seq_q": p.seq_q, "seq_k": p.seq_k, "batch": p.batch // w.heads if w.heads else p.batch}
    return tuple(values[n] for n in w.dynamic())


def unfit_reason(site: "AttentionSite", targets: Sequence[str]) -> str | None:
    """Why a chain cannot get tuned kernels (then it is left unfused), or None: its sizes are all static (no
    dispatch), or no config of the space fits its head dim and dtype on every target."""
    w = attention_workload(site)
    if not w.dynamic():
        return "its sequence lengths and batch x heads are all static"
    for t in targets:
        try:
            if not attention_space(w.dtype, t, w.head_dim):
                return f"no attention config fits head dim {w.head_dim} ({w.dtype}) on {t}"
        except DietcodeError as exc:  # a head dim outside the template's range
            return str(exc)
    return None


def attention_time(config: AttentionConfig, w: AttentionWorkload, p: AttentionProblem,
                   profile: HardwareProfile, tf32: bool = False) -> float:
    """Predicted seconds of one launch: the slower of padded tensor-core FLOPs and memory traffic, over whole
    waves of programs, plus the online softmax's serial steps (``tf32``: float32 dots at the TF32 rate)."""
    if p.seq_q <= 0 or p.seq_k <= 0 or p.batch <= 0:
        return LAUNCH_SECONDS
    size = ATTENTION_DTYPES[w.dtype]
    d = block_d(w.head_dim)
    q_blocks = -(-p.seq_q // config.block_m)
    k_steps = -(-p.seq_k // config.block_n)
    programs = q_blocks * p.batch
    threads = config.num_warps * profile.warp_size
    smem = (config.block_m * d + config.num_stages * 2 * config.block_n * d) * size
    per_sm = max(1, min(profile.max_blocks_per_sm, profile.max_threads_per_sm // threads,
                        profile.smem_per_sm // max(1, smem + profile.smem_reserved_per_block)))
    slots = profile.num_sms * per_sm
    waves = -(-programs // slots)
    utilization = programs / (waves * slots)
    # causal: query block b stops at key min(Tk, (b+1)*BLOCK_M + Tk - Tq), so the blocks' key steps run from
    # about BLOCK_M/BLOCK_N up to k_steps: on average half the keys for long sequences
    first = -(-max(0, min(p.seq_k, config.block_m + p.seq_k - p.seq_q)) // config.block_n)
    mean_steps = (first + k_steps) / 2 if w.causal else k_steps
    flops = 4.0 * p.batch * q_blocks * config.block_m * mean_steps * config.block_n * d
    peak = (profile.fp16_tensor_tflops if size == 2 else profile.tf32_tensor_tflops if tf32 else
            profile.fp32_tflops) * 1e12
    # small tiles keep the tensor cores under-fed; one stage leaves the loads unpipelined
    tile = min(1.0, config.block_m / 64) * math.sqrt(min(1.0, config.block_n / 64))
    stages = 0.75 if config.num_stages == 1 else 1.0
    compute = flops / (peak * utilization * tile * stages)
    traffic = size * p.batch * (2 * p.seq_q * w.head_dim + q_blocks * 2 * p.seq_k * w.head_dim * mean_steps / k_steps)
    if w.has_mask:
        traffic += size * p.batch * (p.seq_q if w.mask_rows else q_blocks) * p.seq_k
    memory = traffic / (profile.dram_bandwidth_gbs * 1e9)
    return LAUNCH_SECONDS + max(compute, memory) + waves * k_steps * _STEP_SECONDS


def attention_instances(w: AttentionWorkload, instances: Sequence[Instance]
                        ) -> list[tuple[AttentionProblem, float]]:
    """The workload's distinct problems at the model's instances, with summed weights."""
    from tuner.shape_expr import ShapeExprError, evaluate

    merged: dict[AttentionProblem, float] = {}
    for inst in instances:
        values = inst.as_dict()
        try:
            p = AttentionProblem(evaluate(w.seq_q, values), evaluate(w.seq_k, values), evaluate(w.batch, values))
        except ShapeExprError as exc:
            raise DietcodeError(f"attention workload: {exc}") from None
        merged[p] = merged.get(p, 0.0) + inst.weight
    if not merged:
        raise DietcodeError("an attention workload has no instances: give --dim options or --shapes")
    return sorted(merged.items())


def carrier(w: AttentionWorkload, symbols: Sequence[str]) -> Workload:
    """A plain Workload over the symbols the size expressions name, so that tuner.scan.attach_instances gives
    the attention workload the instances it gives the GEMM workloads."""
    from tuner.shape_expr import free_names

    names = set().union(*(free_names(e) for e in (w.seq_q, w.seq_k, w.batch)))
    return Workload("bmm", "MatMul", ("attention",), w.seq_q, w.seq_k, str(w.head_dim), w.dtype,
                    tuple(s for s in symbols if s in names), batch=w.batch)


@dataclass(frozen=True)
class TunedAttention:
    workload: AttentionWorkload
    kernels: tuple[AttentionConfig, ...]
    dispatch: "Dispatch"
    problems: tuple[tuple[AttentionProblem, float], ...]
    measurer: str
    candidates: int
    from_db: tuple[int, int] | None = None  # (timings found in the database, timings used) when it was consulted
    allow_tf32: bool = False  # the kernels' dots in TF32 (float32 workloads under --fp32-precision tf32)


def one_kernel_bundle(config: AttentionConfig, w: AttentionWorkload, target: str, toolchain: Any,
                      allow_tf32: bool = False) -> bytes | str:
    """The config compiled as it ships, as a one-kernel bundle (what the GPU timer launches), or the error."""
    from dietcode_ort.bundle import DispatchTree
    from tuner.attention import compile_attention

    try:
        compiled = compile_attention(config, w.dtype, target, w.head_dim, scale=w.scale, has_mask=w.has_mask,
                                     mask_rows=w.mask_rows, causal=w.causal, nan_to_zero=w.nan_to_zero,
                                     toolchain=toolchain, allow_tf32=allow_tf32, layout=w.layout)
    except DietcodeError as exc:
        return f"compile error: {exc}"[:2000]
    return Bundle((), (BundleKernel.from_compiled([compiled]),), DispatchTree.single(0)).to_bytes()


def timing_family(w: AttentionWorkload, target: str) -> tuple["Family", str]:
    """The database family and workload text of ``w``'s GPU timings on ``target``: what its kernels are
    compiled for (dtype, head dim, mask kind and rows, causal, nan_to_zero, scale)."""
    from tuner.space import Family

    mask = "none" if not w.has_mask else "rows" if w.mask_rows else "row"
    return (Family("attention", w.dtype, target),
            f"d={w.head_dim};mask={mask};causal={int(w.causal)};nan_to_zero={int(w.nan_to_zero)};scale={w.scale!r}"
            + (f";layout={w.layout}" if w.layout else ""))


def timing_context(toolchain: Any, settings: Any) -> str:
    """What else changes a timed attention kernel: the templates' and AOT compiler's source, the timing
    settings and the toolchain (as ``GpuMeasurer.context`` for GEMMs)."""
    from tuner.aot import aot_hash, template_hash

    return (f"templates={template_hash()[:16]};aot={aot_hash()[:16]};timing=aot-cubin-{settings.key()}"
            f";min_driver={toolchain.min_driver};ptxas={toolchain.ptxas or 'triton'}").replace(" ", "")


@dataclass(frozen=True)
class AttentionTimingSpec:
    """What times an attention workload's configs on a GPU, as tuner.measure's ``MeasurerSpec`` does for GEMM
    kernels: hashable and picklable, ``build()`` makes the measurer where it runs (this process, or a Ray GPU
    task of the optimize executor: ``Executor.measurer``). ``kind`` "gpu" places it on the GPU model's nodes."""

    workload: AttentionWorkload
    target: str
    toolchain: Any  # tuner.aot.CompileToolchain: how the shipped kernels are compiled
    backend: str | None = None  # tuner.gpu_timing backend (None: the CUDA one)
    settings: Any = None  # tuner.gpu_timing.TimingSettings (None: the defaults)
    kind: str = "gpu"
    allow_tf32: bool = False  # float32 kernels with TF32 dots (tuner.aot's precision)

    def build(self) -> "AttentionMeasurer":
        return AttentionMeasurer(self)


class AttentionMeasurer(Measurer):
    """Times (AttentionConfig, Problem(m=seq_q, n=seq_k, k=head_dim, batch=z)) pairs: each config compiled as it
    ships (``one_kernel_bundle``; a compile error is its result) and its cubin launched by the C core in the
    timing child (tuner.gpu_timing; the launch arguments from dc_attention_view)."""

    def __init__(self, spec: AttentionTimingSpec) -> None:
        from tuner.gpu_timing import CUDA_BACKEND, TimingSettings, shared_timer

        self.spec = spec
        self.timer = shared_timer(spec.backend or CUDA_BACKEND, spec.settings or TimingSettings())

    def device_key(self) -> str:
        return self.timer.device_key()

    def context(self) -> str:
        _, workload_text = timing_family(self.spec.workload, self.spec.target)
        return (f"{workload_text};{timing_context(self.spec.toolchain, self.timer.settings)}"
                + (";dot=tf32" if self.spec.allow_tf32 else ""))

    def measure(self, family: "Family", configs_and_problems: Sequence[tuple[Any, Any]]) -> list["MeasureResult"]:
        from tuner.gpu_timing import TimingItem
        from tuner.measure import MeasureResult

        w, pairs = self.spec.workload, list(configs_and_problems)
        mask = None if not w.has_mask else "rows" if w.mask_rows else "row"
        results: list[MeasureResult | None] = [None] * len(pairs)
        bundles: dict[AttentionConfig, bytes | str] = {}
        items: list[TimingItem] = []
        where: list[int] = []
        for i, (config, shape) in enumerate(pairs):
            if config not in bundles:
                bundles[config] = one_kernel_bundle(config, w, self.spec.target, self.spec.toolchain,
                                                    self.spec.allow_tf32)
            bundle = bundles[config]
            if isinstance(bundle, str):  # deterministic: the database stores it, a rerun compiles it no more
                results[i] = MeasureResult(math.inf, bundle)
                continue
            items.append(TimingItem(len(items), config.key(), bundle, "attention", w.dtype, shape, mask=mask))
            where.append(i)
        if items:
            for i, result in zip(where, self.timer.time(items)):
                results[i] = result
        return results  # type: ignore[return-value]


def attention_measurer(w: AttentionWorkload, target: str, toolchain: Any, backend: str | None = None,
                       settings: "TimingSettings | None" = None, executor: "Executor | None" = None,
                       allow_tf32: bool = False) -> Measurer:
    """The measurer of ``w``'s configs where ``executor`` measures (an executor builds any spec with build()
    there; RayExecutor: a GPU task for kind "gpu")."""
    from tuner.executor import LocalExecutor

    spec = AttentionTimingSpec(w, target, toolchain, backend, settings, allow_tf32=allow_tf32)
    return (executor or LocalExecutor()).measurer(spec)  # type: ignore[arg-type]


def gpu_times(w: AttentionWorkload, problems: Sequence[tuple[AttentionProblem, float]],
              configs: Sequence[AttentionConfig], target: str, toolchain: Any,
              backend: str | None = None, db: "Database | None" = None,
              settings: "TimingSettings | None" = None, executor: "Executor | None" = None,
              allow_tf32: bool = False, measurer: Measurer | None = None) -> tuple["np.ndarray", int]:
    """Seconds [problem, config] of each config's shipped cubin (``AttentionMeasurer``, run where ``executor``
    measures: this machine by default, a Ray GPU task under ``--ray``; ``measurer``: one ``attention_measurer``
    made already); inf where it failed. With ``db``, stored timings are reused and new ones stored (compile
    errors too; transient failures never): returns the times and how many came from the database."""
    import numpy as np

    from tuner.database import row_key
    from tuner.workload import Problem

    if measurer is None:
        measurer = attention_measurer(w, target, toolchain, backend, settings, executor, allow_tf32)
    shapes = [Problem(m=p.seq_q, n=p.seq_k, k=w.head_dim, batch=p.batch) for p, _ in problems]
    family, _ = timing_family(w, target)
    device, context = "", ""
    known: dict = {}
    if db is not None:
        device, context = measurer.device_key(), measurer.context()
        known = db.get(device, family, [(c.key(), s) for c in configs for s in shapes], context)
    times = np.full((len(problems), len(configs)), np.inf)
    hits = 0
    todo: list[tuple[Any, Problem]] = []  # (AttentionConfig, shape): the pairs AttentionMeasurer takes
    where: list[tuple[int, int]] = []
    for j, config in enumerate(configs):
        for i, s in enumerate(shapes):
            stored = known.get(row_key(config.key(), s))
            if stored is None:
                todo.append((config, s))
                where.append((i, j))
            else:
                times[i, j], hits = stored.seconds, hits + 1
    if todo:
        results = measurer.measure(family, todo)  # type: ignore[arg-type]
        for (i, j), result in zip(where, results):
            times[i, j] = result.seconds
        if db is not None:  # Database.put leaves out transient failures
            db.put(device, family, [(c.key(), s) for c, s in todo], results, context)
    return times, hits


def tune_attention(w: AttentionWorkload, problems: list[tuple[AttentionProblem, float]],
                   targets: Sequence[str], max_kernels: int = 8, seed: int = 0, *, measure: str = "analytic",
                   budget: int = 16, toolchain: Any = None, backend: str | None = None,
                   db: "Database | None" = None, settings: "TimingSettings | None" = None,
                   executor: "Executor | None" = None, allow_tf32: bool = False,
                   analytic_gpu: str = "") -> TunedAttention:
    """Cost every config valid on all targets on every problem and build the dispatch (no vendor leaf).
    ``measure="gpu"``: the ``budget`` configs the analytic cost ranks best (weighted geomean over the
    problems) are compiled and timed on the GPU instead, and the dispatch is built from those times (with
    ``db``, stored timings are reused: see ``gpu_times``; ``executor`` runs them: see ``gpu_times``); the
    analytic cost models that GPU, else ``analytic_gpu`` (``hardware.named_profile``), else ``targets[0]``'s."""
    import numpy as np

    from tuner.dispatch import build_dispatch

    if not targets:
        raise DietcodeError("attention tuning needs at least one target")
    space = attention_space(w.dtype, targets[0], w.head_dim)
    for t in targets[1:]:
        other = set(attention_space(w.dtype, t, w.head_dim))
        space = [c for c in space if c in other]
    if not space:
        raise DietcodeError(f"attention d={w.head_dim} {w.dtype}: no config fits every target of {list(targets)}")
    names = w.dynamic()
    if not names:
        raise DietcodeError("an attention workload with no dynamic size has nothing to dispatch on")
    if measure not in ("analytic", "gpu"):
        raise DietcodeError(f"attention tuning: unknown measure {measure!r}; allowed: analytic, gpu")
    profile = named_profile(analytic_gpu, targets[0])
    measurer = None
    if measure == "gpu":  # the analytic ranking that picks what to time models the GPU it is timed on
        from tuner import aot
        from tuner.measure import tuning_profile

        toolchain = toolchain or aot.CompileToolchain()
        measurer = attention_measurer(w, targets[0], toolchain, backend, settings, executor, allow_tf32)
        profile = tuning_profile(measurer, targets[0])
    times = np.array([[attention_time(c, w, p, profile, allow_tf32) for c in space] for p, _ in problems])
    label = f"analytic({targets[0]})"
    from_db: tuple[int, int] | None = None
    if measurer is not None:
        weights = np.array([wt for _, wt in problems])
        rank = np.argsort((np.log(times) * weights[:, None]).sum(axis=0), kind="stable")[:max(1, budget)]
        space = [space[j] for j in sorted(rank)]
        times, stored = gpu_times(w, problems, space, targets[0], toolchain, backend, db, settings, executor,
                                  allow_tf32, measurer)
        from_db = None if db is None else (stored, int(times.size))
        ok = np.isfinite(times).all(axis=0)
        if not ok.any():
            raise DietcodeError(f"attention d={w.head_dim} {w.dtype}: no config ran on every shape on the GPU")
        space, times = [c for c, good in zip(space, ok) if good], times[:, ok]
        label = "gpu (aot cubin)"
    instances = [Instance(tuple(zip(names, problem_values(w, p))), wt) for p, wt in problems]
    dispatch = build_dispatch(names, instances, space, times, None, max_kernels, seed)  # type: ignore[arg-type]
    kernels = tuple(k for k in dispatch.kernels if isinstance(k, AttentionConfig))
    return TunedAttention(w, kernels, dispatch, tuple(problems), label, len(space), from_db, allow_tf32)


def shipped_kernels(tuned: TunedAttention) -> list[tuple[AttentionConfig, bool]]:
    """The bundle's kernels in order as (config, aligned): the tree's, compiled assuming Q, K, V and the output
    16-byte aligned (what was timed), then the first of them without that assumption, outside the tree, for the
    calls the others refuse (Attention has no vendor path to take them instead)."""
    return [(config, True) for config in tuned.kernels] + [(tuned.kernels[0], False)]


def compile_tuned(tuned: TunedAttention, targets: Sequence[str], features: tuple[Feature, ...], *,
                  min_driver: int, ptxas: str | None = None, executor: "Executor | None" = None,
                  cache_dir: "Path | None" = None) -> bytes:
    """Compile the chosen configs for every target and return the node's bundle bytes. The compiles are
    ``AttentionCompileJob``s run by ``executor`` (default: this machine's compile pool; under ``--ray`` the
    cluster's CPU tasks, as the GEMM kernels' are). The kernels are ``shipped_kernels``: the runtime runs the
    last, unaligned one for a call whose pointers the tree's kernels refuse. ``cache_dir``: the kernel cache
    the compiles answer from and store in (``attention.compile_attention``)."""
    from tuner import aot
    from tuner.attention import AttentionCompileJob
    from tuner.executor import LocalExecutor

    w = tuned.workload
    chain = aot.CompileToolchain(min_driver, ptxas)
    shipped = shipped_kernels(tuned)
    jobs = [AttentionCompileJob(config, w.dtype, t, w.head_dim, w.scale, w.has_mask, w.mask_rows, w.causal,
                                w.nan_to_zero, chain, tuned.allow_tf32, layout=w.layout, aligned=aligned,
                                cache_dir=cache_dir)
            for config, aligned in shipped for t in targets]
    # aot._run_job runs any job with compile(), locally or in a Ray task, as it runs GEMM CompileJobs
    results = (executor or LocalExecutor()).compile_many(jobs)  # type: ignore[arg-type]
    kernels = []
    for i, (config, aligned) in enumerate(shipped):
        compiled = []
        for t, result in zip(targets, results[i * len(targets):(i + 1) * len(targets)]):
            if not result.ok:
                raise DietcodeError(f"attention {config.key()}{'' if aligned else ' (unaligned)'} for {t} did not "
                                    f"compile: {result.error}")
            compiled.append(result.kernel)
        kernels.append(BundleKernel.from_compiled(compiled))
    bundle = Bundle(features, tuple(kernels), tuned.dispatch.tree)
    bundle.validate()
    return bundle.to_bytes()


def report_line(index: int, tuned: TunedAttention) -> str:
    w = tuned.workload
    return (f"attention workload {index} d={w.head_dim} {w.dtype} Tq={w.seq_q} Tk={w.seq_k} z={w.batch} "
            f"({len(tuned.problems)} shapes): {tuned.candidates} configs costed with {tuned.measurer}"
            + ("" if tuned.from_db is None else f" ({tuned.from_db[0]} of {tuned.from_db[1]} timings from the "
                                                f"database)") + "; "
            f"{len(tuned.kernels)} kernel{'s' if len(tuned.kernels) != 1 else ''}; regret {tuned.dispatch.report.geomean:.3f}")



def info_json(tuned: TunedAttention) -> str:
    """What ``inspect`` shows about an Attention node: its workload, kernels, the ranges tuned for, figures."""
    import json

    w = tuned.workload
    names = w.dynamic()
    values = [problem_values(w, p) for p, _ in tuned.problems]
    return json.dumps({
        "workload": {"op": "attention", "seq_q": w.seq_q, "seq_k": w.seq_k, "batch": w.batch,
                     "head_dim": w.head_dim, "dtype": w.dtype, "mask": w.has_mask, "mask_rows": w.mask_rows,
                     "causal": w.causal, "nan_to_zero": w.nan_to_zero, "scale": w.scale,
                     "precision": "tf32" if tuned.allow_tf32 else "ieee", "layout": w.layout},
        "kernels": [c.key() + ("" if aligned else " unaligned") for c, aligned in shipped_kernels(tuned)],
        "ranges": {n: [min(v[i] for v in values), max(v[i] for v in values)] for i, n in enumerate(names)},
        "tuning": {"measurer": tuned.measurer, "trials": tuned.candidates * len(tuned.problems),
                   "regret": tuned.dispatch.report.geomean, "geomean_vs_vendor": None,
                   "instances": len(tuned.problems)},
    })


def tune_sites(models: Sequence[tuple[Sequence["AttentionSite"], Sequence[str], Sequence[str],
                                      "str | None", dict]],
               targets: Sequence[str], *, max_kernels: int, seed: int, min_driver: int, ptxas: str | None,
               measure: str = "analytic", budget: int = 16, log: Callable[[str], None] = print,
               db: "str | Path | None" = None, backend: str | None = None, executor: "Executor | None" = None,
               fp32_precision: str = "tf32", analytic_gpu: str = "", cache_dir: "Path | None" = None
               ) -> list[dict[str, tuple[bytes, str]]]:
    """The bundle of every attention chain of several models: per model (its sites, symbols, --dim options,
    shape log, input dims), a map from each chain's output to its bundle bytes and ``info`` JSON. Chains of equal workload and
    instances (within and across models) are tuned and compiled once. ``db``: the tuning database GPU
    timings are reused from and stored in (``--db``). ``executor`` (optimize's; default this machine's) compiles
    the chosen kernels (the compile pool, or Ray's CPU tasks under ``--ray``) and runs the GPU timings (this
    machine's GPU, or Ray GPU tasks). ``analytic_gpu``: the GPU the analytic cost models (``--analytic-gpu``).
    ``cache_dir``: the kernel cache the chosen kernels' compiles answer from and store in (``--cache-dir``)."""
    from tuner.executor import LocalExecutor

    runner = executor or LocalExecutor()
    kind = measure
    if kind == "auto":
        kind = "gpu" if runner.gpu_available() else "analytic"
    elif kind.startswith("replay:"):
        if any(sites for sites, *_ in models):
            log("attention workloads are tuned with the analytic attention cost (a replay file holds GEMM "
                "timings only)")
        kind = "analytic"
    elif kind not in ("analytic", "gpu"):
        raise DietcodeError(f"unknown --measure {measure!r}; allowed: auto, gpu, analytic, replay:FILE")
    if kind == "gpu" and not runner.gpu_available():
        if any(sites for sites, *_ in models):
            where = "this machine" if isinstance(runner, LocalExecutor) else "the executor's cluster"
            log(f"attention workloads are tuned with the analytic attention cost: {where} has no GPU to time "
                "them on")
        kind = "analytic"
    check_analytic_gpu(analytic_gpu, kind)
    store = None
    if kind == "gpu" and db is not None:
        from tuner.database import Database

        store = Database(db)
    try:
        return _tune_models(models, targets, max_kernels=max_kernels, seed=seed, min_driver=min_driver,
                            ptxas=ptxas, kind=kind, budget=budget, log=log, db=store, backend=backend,
                            executor=executor, fp32_precision=fp32_precision, analytic_gpu=analytic_gpu,
                            cache_dir=cache_dir)
    finally:
        if store is not None:
            store.close()


def _tune_models(models: Sequence[tuple[Sequence["AttentionSite"], Sequence[str], Sequence[str], "str | None",
                                        dict]],
                 targets: Sequence[str], *, max_kernels: int, seed: int, min_driver: int, ptxas: str | None,
                 kind: str, budget: int, log: Callable[[str], None], db: "Database | None", backend: str | None,
                 executor: "Executor | None" = None, fp32_precision: str = "tf32",
                 analytic_gpu: str = "", cache_dir: "Path | None" = None) -> list[dict[str, tuple[bytes, str]]]:
    from tuner.scan import ScanResult, attach_instances

    tuned: dict[tuple, tuple[bytes, str]] = {}
    out: list[dict[str, tuple[bytes, str]]] = []
    index = 0
    for sites, symbols, dims, shapes_file, input_dims in models:
        bundles: dict[str, tuple[bytes, str]] = {}
        for site in sites:
            w = attention_workload(site)
            scanned = attach_instances(ScanResult(tuple(symbols), (carrier(w, symbols),), (), input_dims),
                                       dims, shapes_file)
            problems = attention_instances(w, scanned.workloads[0].instances)
            key = (w.key(), tuple(problems))
            if key not in tuned:
                from tuner import aot

                result = tune_attention(w, problems, targets, max_kernels, seed, measure=kind, budget=budget,
                                        toolchain=aot.CompileToolchain(min_driver, ptxas), backend=backend, db=db,
                                        executor=executor, allow_tf32=aot.uses_tf32(w.dtype, fp32_precision),
                                        analytic_gpu=analytic_gpu)
                log(report_line(index, result))
                index += 1
                payload = compile_tuned(result, targets, attention_features(w), min_driver=min_driver,
                                        ptxas=ptxas, executor=executor, cache_dir=cache_dir)
                tuned[key] = (payload, info_json(result))
            bundles[site.output] = tuned[key]
        out.append(bundles)
    return out
