"""Optimize: model -> workloads -> tuning -> dispatch -> AOT kernels -> bundles -> rewritten model.

The stages live in their own modules; this one only threads their records through, per workload:

    scan (tuner.scan) -> problems + weights -> joint search (tuner.search) over the family's space
    (tuner.space) with a measurer (tuner.measure, cached in tuner.database) -> Dispatch (tuner.dispatch)
    -> compiled kernels per target (tuner.aot) -> Bundle (dietcode_ort.bundle) -> rewrite (tuner.rewrite)
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from dietcode_ort.bundle import ATTENTION_OP, Bundle, BundleKernel, DispatchTree, Feature
from dietcode_ort.errors import DietcodeError, check_model_file
from dietcode_ort.toolchain import DEFAULT_MIN_DRIVER
from tuner.executor import Executor, LocalExecutor
from tuner.instances import merged_dims
from tuner.layout import NodeValues, choose_layouts
from tuner.scan import ScanResult, Skipped, attach_instances, load_model, prepare_graph
from tuner.workload import Problem, Workload

if TYPE_CHECKING:
    import onnx

    from tuner.branches import Unit
    from tuner.space import Family, MicroKernel

__all__ = ["default_targets", "default_db", "optimize_command", "make_measurer", "OptimizeOptions", "WorkloadReport",
           "OptimizeReport", "features_for", "problem_features", "check_output", "merge_problems", "optimize",
           "optimize_many", "output_paths", "make_executor", "candidate_space"]


@dataclass(frozen=True)
class OptimizeOptions:
    """Everything ``dietcode-ort optimize`` can be told (read at the CLI edge, nowhere else)."""

    targets: tuple[str, ...] = ("sm_90",)
    measure: str = "auto"  # "auto" | "gpu" | "analytic" | "replay:FILE"
    budget: int = 256  # measured trials per workload
    max_kernels: int = 8
    db: Path | None = None
    seed: int = 0
    dims: tuple[str, ...] = ()
    shapes_file: Path | None = None
    cache_dir: Path | None = None  # compiled-kernel cache (tuner.aot default when None)
    compile_workers: int | None = None  # parallel compile processes (default and at most: aot.usable_cpus())
    progress: bool = True
    ray: str | None = None  # run compiles and measurements on a Ray cluster: "auto", "local" or its address
    ray_gpu: str | None = None  # the GPU model (Ray accelerator type) to time on; default: the target's
    min_driver: int = DEFAULT_MIN_DRIVER  # the oldest CUDA driver the kernels must load on (13000 = 13.0)
    ptxas: str | None = None  # a ptxas for every arch instead of Triton's bundled ones
    fuse_attention: bool = True  # each attention chain -> one ai.dietcode::ScaledDotProductAttention (tuner/attention_graph.py)
    fp32_precision: str = "tf32"  # float32 dots: "tf32" (ONNX Runtime CUDA EP's default) or "ieee" (tuner.aot)
    prior: bool = True  # the search starts from the analytic roofline (tuner/search.py, SearchOptions.prior)
    warm_start: bool = True  # a gemm search starts from the run's earlier ones of its family (_tune_all)
    # measured tuning only: a conv workload whose kernels reach less than this times cuDNN's speed (weighted
    # geomean over its shapes) is left to ORT (``_loses``)
    min_speedup: float = 1.0
    conv_layout: str = "nhwc"  # "nhwc": conv workloads run channels-last where they can (tuner.layout); "nchw"
    analytic_gpu: str = ""  # the GPU analytic tuning models (tuner.hardware.named_profile); "": the target's


@dataclass(frozen=True)
class WorkloadReport:
    workload: Workload
    measurer: str
    trials: int
    seconds: float
    kernels: tuple[str, ...]  # config keys, or "vendor"
    instances: int
    geomean_vs_vendor: float | None  # > 1: dispatched kernels faster than the vendor kernel (weighted)
    regret: float  # weighted geomean of dispatched / best known time, >= 1
    measured: bool  # whether the times behind the figures were measured (else predicted / analytic)
    profile: str = ""  # the hardware profile the search modelled (tuner.measure.tuning_profile)
    checked: int = 0  # of the trials, those timing the dispatcher's pick on a shape the search had not (settle)


@dataclass(frozen=True)
class OptimizeReport:
    output: Path
    rewritten: tuple[str, ...]
    workloads: tuple[WorkloadReport, ...]
    skipped: tuple[tuple[str, str], ...] = field(default=())
    attention: int = 0  # attention chains fused into ai.dietcode nodes with tuned kernels


def default_db() -> Path:
    """The tuning database shared by all runs and models on this machine (created on first use):
    ``$XDG_CACHE_HOME/dietcode-ort/tuning.db``, else ``~/.cache/dietcode-ort/tuning.db``."""
    from dietcode_ort.paths import user_cache_dir

    return user_cache_dir() / "tuning.db"


# --- features: what the dispatch tree looks at, from the problem (tuning) and the node's inputs (runtime) --

def _dynamic(expr: str) -> bool:
    return not expr.isdigit()


def _feature_names(w: Workload) -> tuple[str, ...]:
    if w.op == "conv":
        names = ("img_n", "img_h", "img_w")
        return tuple(n for n, e in zip(names, w.conv_input or ()) if _dynamic(e))
    exprs = {"M": w.m, "N": w.n, "K": w.k, "batch": w.batch}
    return tuple(n for n, e in exprs.items() if _dynamic(e))


def problem_features(w: Workload, p: Problem) -> tuple[int, ...]:
    """The dispatch features of a problem, in ``features_for``'s order."""
    values = {"M": p.m, "N": p.n, "K": p.k, "batch": p.batch}
    if p.image is not None:
        values.update(img_n=p.image[0], img_h=p.image[1], img_w=p.image[2])
    return tuple(values[n] for n in _feature_names(w))


def features_for(w: Workload, node_index: int) -> tuple[Feature, ...]:
    """The same features as products of the node's input dims, for the C++ runtime."""
    rank_a, rank_b = w.ranks[node_index] if w.ranks else (2, 2)
    dims: dict[str, tuple[tuple[int, int], ...]]
    if w.op == "conv":  # X [N, C, H, W], or [N, H, W, C] channels-last
        h = 1 if w.conv is not None and w.conv.channels_last else 2
        dims = {"img_n": ((0, 0),), "img_h": ((0, h),), "img_w": ((0, h + 1),)}
    elif w.op == "gemm":
        n = ((1, 0),) if w.trans_b else ((1, -1),)
        dims = {"M": tuple((0, d) for d in range(rank_a - 1)), "N": n, "K": ((0, -1),)}
    else:  # bmm: the batch comes from whichever operand carries it
        batch_from, rank = (0, rank_a) if rank_a >= rank_b else (1, rank_b)
        dims = {"M": ((0, -2),), "N": ((1, -1),), "K": ((0, -1),),
                "batch": tuple((batch_from, d) for d in range(rank - 2))}
    return tuple(Feature(n, dims[n]) for n in _feature_names(w))


def merge_problems(w: Workload) -> list[tuple[Problem, float]]:
    """The workload's distinct problems with summed weights (batch=2,seq=8 and batch=4,seq=4 coincide)."""
    if not w.instances:
        raise DietcodeError(f"workload {w.nodes[0]!r} has no instances: give --dim options or --shapes")
    merged: dict[Problem, float] = {}
    for problem, weight in w.problems():
        merged[problem] = merged.get(problem, 0.0) + weight
    return sorted(merged.items())


def _geomean(values: Sequence[float], weights: Sequence[float]) -> float:
    total = sum(weights)
    return math.exp(sum(wt * math.log(v) for v, wt in zip(values, weights)) / total)


def optimize(model_path: str | Path, output: str | Path, options: OptimizeOptions,
             log: Callable[[str], None] = print) -> OptimizeReport:
    """Run the whole pipeline; nothing is written unless every workload succeeds."""
    return optimize_many([(model_path, output)], options, log)[0]


def _scan(model_path: Path, output: Path, options: OptimizeOptions, several: bool) -> list[Unit]:
    """Check the paths and options, load one model, prepare and scan its main graph and its If branches (each
    tuned as a model of its own, tuner/branches.py) and attach their instances (of several models, and of a
    branch, each takes the --dim options that name its symbols)."""
    from tuner.branches import located, scan_units

    _preflight(model_path, output, options)
    model = load_model(model_path, load_external_data=False)  # weights stay in their files: save streams them
    base_dir = model_path.parent

    def prepare(model: "onnx.ModelProto") -> tuple["onnx.ModelProto", tuple[Skipped, ...], tuple[str, ...]]:
        # the graph pre-passes (constants evaluated, Einsums as MatMuls, affine ops folded, 1-D convs as 2-D)
        model, left, changes = prepare_graph(model, base_dir)
        if options.fuse_attention:  # before the scan: each merged Q/K/V projection is one GEMM workload, N = 3*H*d
            from tuner.attention_prepare import prepare_attention

            model = prepare_attention(model, base_dir, copy=False)[0]  # exporters' Shape(Transpose) and Kt
            model = _pack_projections(model_path, model, options.targets)
        return model, left, changes

    units = scan_units(model, base_dir, prepare)
    for u in units:
        dims = _model_dims(options.dims, u.scanned.symbols) if several or u.branch else options.dims
        u.scanned = attach_instances(u.scanned, dims, options.shapes_file)
        u.scanned = replace(u.scanned, workloads=_layouts(u.model, u.scanned.workloads, options.conv_layout,
                                                           base_dir))
    if not units[0].scanned.symbols:
        raise DietcodeError(f"{model_path} has no symbolic dims: nothing to optimize")
    if not any(u.scanned.workloads or u.scanned.skipped for u in units):
        raise DietcodeError(f"{model_path}: no MatMul, Gemm or Conv node in its graph: nothing to optimize "
                            "(other ops, MatMulInteger and the quantized ones included, are not tuned)")
    if not any(u.scanned.workloads for u in units):
        raise DietcodeError(f"{model_path}: no MatMul/Gemm/Conv node with symbolic dims can be optimized: "
                            + "; ".join(f"{located(u.where, s.node)}: {s.reason}" for u in units for s in u.scanned.skipped))
    return units


def _layouts(model: "onnx.ModelProto", workloads: Sequence[Workload], layout: str,
             base_dir: Path) -> tuple[Workload, ...]:
    """The conv workloads' layouts (tuner.layout.choose_layouts), from the rewrite's plan of their nodes."""
    from dietcode_ort.bundle import op_takes_residual
    from tuner.rewrite import plan_rewrite

    if layout == "nchw" or not any(w.conv is not None for w in workloads):
        return tuple(workloads)
    sites = plan_rewrite(model, [w for w in workloads if w.conv is not None], base_dir=base_dir)
    nodes = {key: NodeValues(s.inputs[0], s.inputs[-1] if op_takes_residual(s.op) else None, s.output,
                             frozenset((s.index, *s.absorbed)), s.inputs[1]) for key, s in sites.items()}
    return choose_layouts(model.graph, workloads, layout, nodes)


def _log_at(log: Callable[[str], None], where: str, line: str) -> None:
    from tuner.branches import located

    log(located(where, line))


def _pack_projections(model_path: Path, model: "onnx.ModelProto", targets: Sequence[str]) -> "onnx.ModelProto":
    """The model with the Q/K/V projections of each attention chain that gets tuned kernels merged into one
    MatMul (tuner/attention_pack.py), which the fused node then reads packed."""
    from tuner.attention_graph import find_attention
    from tuner.attention_pack import pack_projections
    from tuner.attention_tune import unfit_reason

    sites = tuple(s for s in find_attention(model, model_path.parent).sites if unfit_reason(s, targets) is None)
    return pack_projections(model, model_path.parent, sites, copy=False)[0] if sites else model


def _split_attention(model_path: Path, model: "onnx.ModelProto", scanned: ScanResult, targets: Sequence[str],
                     log: Callable[[str], None]) -> tuple[ScanResult, tuple]:
    """The scan less the MatMuls of the model's attention chains (left to fuse_attention, after the
    rewrite), and those chains; a chain that cannot get tuned kernels is left unfused, with the reason."""
    from tuner.attention_graph import find_attention, without_attention
    from tuner.attention_tune import unfit_reason

    sites = []
    for site in find_attention(model, model_path.parent).sites:
        why = unfit_reason(site, targets)
        if why is None:
            sites.append(site)
        else:
            log(f"attention chain making {site.output} left unfused: {why}")
    return replace(scanned, workloads=without_attention(scanned.workloads, tuple(sites))), tuple(sites)


def _model_dims(dims: Sequence[str], symbols: Sequence[str]) -> list[str]:
    """The --dim options naming one of a model's symbols (several models need not share their symbols)."""
    return [d for d in dims if d.split("=", 1)[0].strip() in symbols]


def _tuning_key(w: Workload, problems: list[tuple[Problem, float]]) -> tuple:
    """Everything the tuning of a workload depends on: workloads of several models with equal keys are
    tuned once and get the same kernels and dispatch tree."""
    return (w.op, w.dtype, w.epilogue, w.trans_b, w.conv, _feature_names(w), _div16(w), tuple(problems))  # one
    # --fp32-precision per run: the precision is the same for every key


def optimize_many(jobs: Sequence[tuple[str | Path, str | Path]], options: OptimizeOptions,
                  log: Callable[[str], None] = print) -> list[OptimizeReport]:
    """Optimize several models (input, output) in one run: a workload several of them share is tuned
    once and its results written to each. Nothing is written unless every model's workloads succeed."""
    from tuner.rewrite import plan_rewrite, rewrite_model, save_model

    pairs = [(Path(m), Path(o)) for m, o in jobs]
    if not pairs:
        raise DietcodeError("no model to optimize")
    if len({o.resolve() for _, o in pairs}) < len(pairs):
        raise DietcodeError("two models would be written to the same output path")
    from tuner.branches import located, splice

    several = len(pairs) > 1
    # each model's main graph and If branches, as units; flat: (model index, unit), parents before their branches
    per_model = [_scan(model_path, output, options, several) for model_path, output in pairs]
    flat = [(i, u) for i, units in enumerate(per_model) for u in units]
    attention: list[tuple] = [()] * len(flat)
    if options.fuse_attention:
        for j, (i, u) in enumerate(flat):
            u.scanned, attention[j] = _split_attention(pairs[i][0], u.model, u.scanned, options.targets,
                                                       functools.partial(_log_at, log, u.where))
    if several:
        unused = [d for d in options.dims if not any(_model_dims([d], units[0].scanned.symbols)
                                                     for units in per_model)]
        if unused:
            raise DietcodeError(f"--dim {unused[0]!r} names a symbol none of the models has")

    def prefix(i: int, u: Unit) -> str:
        return (f"{pairs[i][0].name}: " if several else "") + located(u.where, "")

    for i, u in flat:
        if u.scanned.prepared:
            log(f"{prefix(i, u)}graph pre-passes: {'; '.join(u.scanned.prepared)}")
        for s in u.scanned.skipped:
            log(f"{prefix(i, u)}left as it is: {s.node} ({s.op}): {s.reason}")
        for s in u.scanned.unfused:
            log(f"{prefix(i, u)}not fused: {s.node} ({s.op}): {s.reason}")
        # a graph the rewrite cannot handle fails before tuning
        plan_rewrite(u.model, list(u.scanned.workloads), base_dir=pairs[i][0].parent)
    distinct: dict[tuple, tuple[Workload, list[tuple[Problem, float]]]] = {}
    for _, u in flat:
        for w in u.scanned.workloads:
            problems = merge_problems(w)
            distinct.setdefault(_tuning_key(w, problems), (w, problems))
    total = sum(len(u.scanned.workloads) for _, u in flat)
    if several or len(flat) > 1:
        where = f"{len(pairs)} models" if several else f"the main graph and {len(flat) - 1} If branch(es)"
        log(f"{total} workloads in {where}, {len(distinct)} distinct: each is tuned once")
    with make_executor(options) as executor:
        executor.expect(options.budget * len(distinct))
        chosen_by_key = _tune_all(list(distinct.items()), options, log, executor)
        compiled = _compile_all([(w, chosen_by_key[k].kernels) for k, (w, _) in distinct.items()], options, log,
                                executor)
        attention_bundles: list[dict[str, tuple[bytes, str]]] = [{} for _ in flat]
        if any(attention):  # compiled by the same executor (Ray's CPU tasks under --ray), timed here
            from tuner import aot
            from tuner.attention_tune import tune_sites

            attention_bundles = tune_sites(
                [(sites, u.scanned.symbols,
                  merged_dims(_model_dims(options.dims, u.scanned.symbols) if several or u.branch else options.dims,
                              u.scanned.merged),
                  None if options.shapes_file is None else str(options.shapes_file), u.scanned.input_dims)
                 for (_, u), sites in zip(flat, attention)],
                options.targets, max_kernels=options.max_kernels, seed=options.seed, min_driver=options.min_driver,
                ptxas=options.ptxas, measure=options.measure, budget=options.budget, log=log, db=options.db,
                executor=executor, fp32_precision=options.fp32_precision, analytic_gpu=options.analytic_gpu,
                cache_dir=options.cache_dir if options.cache_dir is not None else aot.default_cache_dir())
    rewritten: list[list[str]] = [[] for _ in pairs]
    reports: list[list[WorkloadReport]] = [[] for _ in pairs]
    left: list[list[tuple[str, str]]] = [[] for _ in pairs]  # (node, why it is left as it is)
    chains = [0 for _ in pairs]  # attention chains fused
    done: list["onnx.ModelProto"] = []
    any_lost = any_changed = False  # a workload left to ORT by --min-speedup; a node rewritten
    for (i, u), sites, attention_bundle in zip(flat, attention, attention_bundles):
        model_path = pairs[i][0]
        bundles, infos = {}, {}
        left[i].extend((located(u.where, s.node), s.reason) for s in u.scanned.skipped)
        for w in u.scanned.workloads:
            problems = merge_problems(w)
            chosen = chosen_by_key[_tuning_key(w, problems)]
            report = replace(chosen.report, workload=w)
            reports[i].append(report)
            why = _loses(report, options.min_speedup)
            if why:  # no bundle: the rewrite leaves its nodes as they are
                any_lost = True
                left[i].extend((located(u.where, node), why) for node in w.nodes)
                for node in w.nodes:
                    log(f"{prefix(i, u)}left as it is: {node} ({w.onnx_op}): {why}")
                continue
            kernels = tuple(BundleKernel.vendor() if config == "vendor"
                            else BundleKernel.from_compiled([compiled[_job_key(w, config, t, _tf32(w, options))]
                                                             for t in options.targets])
                            for config in chosen.kernels)
            for k, node in enumerate(w.nodes):
                bundle = Bundle(features_for(w, k), kernels, chosen.tree)
                bundle.validate()
                bundles[node] = bundle.to_bytes()
                infos[node] = _info(w, report, problems, options)
        result = rewrite_model(u.model, list(u.scanned.workloads), bundles, infos, base_dir=model_path.parent,
                               copy=False)  # in place: the scanned model is not needed afterwards
        if sites:
            from tuner.attention_graph import fuse_attention

            _, fused = fuse_attention(result.model, sites, base_dir=model_path.parent, copy=False,
                                      bundles=attention_bundle)
            log(f"{prefix(i, u)}{len(fused)} attention chains fused into ai.dietcode::{ATTENTION_OP} nodes "
                "with tuned kernels")
            chains[i] += len(fused)
        rewritten[i].extend(located(u.where, n) for n in result.rewritten)
        any_changed = any_changed or bool(result.rewritten or sites)
        done.append(result.model)
    if any_lost and not any_changed:
        raise DietcodeError("every tuned workload lost to cuDNN on the measured shapes, so no node was rewritten "
                            "and no model written (the figures are above; --min-speedup 0 rewrites them anyway)")
    # each If branch back into its parent's graph, the deepest first
    start = [sum(len(units) for units in per_model[:i]) for i in range(len(pairs))]
    for j in reversed(range(len(flat))):
        i, u = flat[j]
        if u.branch is not None:
            splice(done[start[i] + u.parent], u.branch, done[j])
    for i, (model_path, output) in enumerate(pairs):  # only now that every model is rewritten
        save_model(done[start[i]], output, model_path.parent)
    return [OptimizeReport(output, tuple(rewritten[i]), tuple(reports[i]), tuple(left[i]), chains[i])
            for i, (_, output) in enumerate(pairs)]


def warm_family(w: Workload, options: OptimizeOptions) -> Family | None:
    """The family whose earlier measurements warm-start ``w``'s search (its own: op, dtype, first target), for
    an op of ``tuner.search.WARM_START_OPS`` (gemm: the comment there says why); None for the others."""
    from tuner.search import WARM_START_OPS

    return _family(w, options.targets[0]) if w.op in WARM_START_OPS else None


def _loses(report: WorkloadReport, min_speedup: float) -> str:
    """Why a conv workload's tuned kernels are not worth writing into the model (its nodes are left to ORT, which
    runs cuDNN itself), or "": where its tuning was measured with the vendor timed, ``min_speedup`` is above 0,
    and its kernels reach less than ``min_speedup`` times cuDNN's speed over its tuned shapes (weighted
    geomean). A conv tree has no vendor leaf (the CUDA path's vendor conv is a correctness fallback), so a conv
    whose GEMM kernels lose everywhere (a depthwise conv's, one output column wide) can only go back to ORT
    whole; a GEMM tree takes cuBLAS per shape where it wins, and keeps the epilogue the node fuses."""
    v = report.geomean_vs_vendor
    if not report.measured or min_speedup <= 0 or report.workload.op != "conv" or v is None or v >= min_speedup:
        return ""
    return (f"its tuned kernels measured {v:.3g}x cuDNN's speed over the tuned shapes (weighted geomean), below "
            f"--min-speedup {min_speedup:g}: ORT's own cuDNN call is faster")


def _tune_all(items: list[tuple[tuple, tuple[Workload, list[tuple[Problem, float]]]]], options: OptimizeOptions,
              log: Callable[[str], None], executor: Executor) -> dict[tuple, "_Chosen"]:
    """Tune each distinct workload: one after another, or as many at once as the executor runs (each
    search is deterministic on its own, so the order they finish in changes nothing).

    One after another, a gemm search starts warm from what the searches before it in this run measured for the
    same family (op, dtype, target: ``warm_family``; tuner.search, "Warm start"): the same order and the same
    answers (a restarted run's from the database) give the same searches. Searches run at once start cold, as
    do bmm and conv searches (``warm_family``). ``LearnedCostModel.warm_start`` skips the failures."""
    chosen: dict[tuple, _Chosen] = {}
    parallel = min(executor.searches(), len(items))
    if parallel <= 1:
        seen: dict[Family, list] = {}
        for index, (key, (w, problems)) in enumerate(items):
            family = warm_family(w, options)
            warm = seen.get(family, []) if options.warm_start and family is not None else []
            chosen[key] = _tune(w, problems, options, log, executor, warm=tuple(warm))
            if family is not None:
                seen.setdefault(family, []).extend(chosen[key].measurements)
            log(_summary(index, chosen[key].report))
        return chosen
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dietcode-search")
    try:
        futures = [pool.submit(_tune, w, problems, options, log, executor) for _, (w, problems) in items]
        for index, ((key, _), future) in enumerate(zip(items, futures)):
            chosen[key] = future.result()
            log(_summary(index, chosen[key].report))
    except BaseException:
        executor.abort()  # the other searches stop at their next step; what they measured is stored
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return chosen


def _external_files(model_path: Path) -> set[Path]:
    """The external data files a model file refers to (resolved), read without loading them."""
    import onnx

    from tuner.scan import load_model

    try:
        model = load_model(model_path, load_external_data=False)  # field by field: no copy of the file
    except DietcodeError:  # unreadable input: the loader reports it when optimize loads it
        return set()
    from tuner.model_file import _graph_tensors

    files = set()
    for t in _graph_tensors(model.graph):  # subgraphs' too (a merged decoder's branches may hold their own)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), None)
            if location:
                files.add((model_path.parent / location).resolve())
    return files


def check_output(model_path: str | Path, output: str | Path) -> None:
    """Refuse an output that cannot be written or whose writing would destroy the input: the input file
    itself, or one of the input's external data files (as the output or as its ``.data`` file)."""
    from dietcode_ort.paths import writable_dir

    import onnx

    model_path, output = Path(model_path), Path(output)
    if output.is_dir():
        raise DietcodeError(f"output {output} is a folder; -o takes the path of the model file to write")
    for path in (output, output.with_name(output.name + ".data")):
        if path.exists() and not path.is_file():  # the file is written beside it, then renamed over it
            raise DietcodeError(f"output {path} exists and is not a regular file (a device, a pipe or a socket), "
                                "which writing the model would replace; -o takes the path of the model file to write")
    text = onnx.serialization.registry.get_format_from_file_extension(output.suffix)
    if text not in (None, "protobuf"):
        raise DietcodeError(f"output {output}: optimize writes binary ONNX (.onnx), not {text}; name the "
                            "output .onnx")
    source = model_path.resolve()
    written = {output.resolve(), output.with_name(output.name + ".data").resolve()}
    if source in written:
        raise DietcodeError(f"output {output} would overwrite the input model {model_path}: the output path "
                            "must differ from the input; choose another -o")
    if any(p.exists() for p in written):
        clash = written & _external_files(model_path)
        if clash:
            raise DietcodeError(f"output {output} would overwrite {sorted(clash)[0]}, which holds the input "
                                f"model's weights; choose another -o")
    writable_dir(output.parent, "output", "-o")


def _preflight(model_path: Path, output: Path, options: OptimizeOptions) -> None:
    """Everything that would otherwise fail only after tuning: the input exists, the output can be written
    without touching the input's files, the database opens, the kernel cache is writable."""
    from tuner import aot
    from tuner.hardware import get_profile, named_profile
    from tuner.measure import check_analytic_gpu

    if options.budget <= 0:
        raise DietcodeError(f"--budget must be positive, got {options.budget}")
    if options.max_kernels < 1:
        raise DietcodeError(f"--max-kernels must be at least 1, got {options.max_kernels}")
    if options.compile_workers is not None and options.compile_workers < 1:  # as `space --workers`
        raise DietcodeError(f"compile_workers must be at least 1, got {options.compile_workers}")
    if not 0 <= options.seed < 2 ** 32:
        raise DietcodeError(f"--seed must be >= 0 and below 2**32, got {options.seed}")
    if not (math.isfinite(options.min_speedup) and options.min_speedup >= 0):
        raise DietcodeError(f"--min-speedup must be a number >= 0, got {options.min_speedup}")
    if not options.targets:
        raise DietcodeError("--target names no GPU arch")
    twice = sorted({t for t in options.targets if options.targets.count(t) > 1})
    if twice:
        raise DietcodeError(f"--target gives {', '.join(twice)} twice")
    aot.check_fp32_precision(options.fp32_precision)
    for target in options.targets:
        get_profile(target)
    if options.analytic_gpu:
        named_profile(options.analytic_gpu, options.targets[0])  # a DietcodeError naming the known GPUs
        if options.measure != "auto":  # auto is checked where it resolves (make_measurer, tune_sites)
            check_analytic_gpu(options.analytic_gpu, options.measure)
    check_model_file(model_path)
    check_output(model_path, output)
    if options.db is not None:
        from tuner.database import Database

        Database(options.db).close()
    aot.ensure_cache_dir(options.cache_dir)


def _job_key(w: Workload, config, target: str, tf32: bool) -> tuple:
    return (w.op, w.dtype, target, config, w.epilogue, w.trans_b, w.conv, _div16(w), tf32)


def _tf32(w: Workload, options: OptimizeOptions) -> bool:
    """Whether ``w``'s kernels compute their dots in TF32 (float32 workloads under --fp32-precision tf32)."""
    from tuner.aot import uses_tf32

    return uses_tf32(w.dtype, options.fp32_precision)


def _compile_all(chosen: list[tuple[Workload, tuple]], options: OptimizeOptions,
                 log: Callable[[str], None], executor: Executor | None = None) -> dict[tuple, object]:
    """Compile every chosen kernel for every target, in parallel processes (cache hits cost nothing).

    Workloads that share a kernel (same op, dtype, epilogue, geometry) share one compile."""
    from tuner import aot

    jobs: dict[tuple, aot.CompileJob] = {}
    for w, kernels in chosen:
        for config in kernels:
            if config == "vendor":
                continue
            for target in options.targets:
                jobs.setdefault(_job_key(w, config, target, _tf32(w, options)), aot.CompileJob(
                    _family(w, target), config, epilogue=w.epilogue, trans_b=w.trans_b, conv=w.conv,
                    div16=_div16(w), allow_tf32=_tf32(w, options), cache_dir=options.cache_dir,
                    toolchain=aot.CompileToolchain(options.min_driver, options.ptxas)))
    started = time.perf_counter()
    executor = executor or LocalExecutor(options.compile_workers)
    results = executor.compile_many(list(jobs.values()))
    failed = [r for r in results if not r.ok]
    if failed:
        r = failed[0]
        raise DietcodeError(f"{len(failed)} of {len(results)} kernels failed to compile; first: {r.job.family.op} "
                            f"{r.job.config.key()} for {r.job.family.target}: {r.error}")
    log(f"compiled {len(results)} kernels for {', '.join(options.targets)} in {time.perf_counter() - started:.1f}s")
    return {key: r.kernel for key, r in zip(jobs, results)}


def _info(w: Workload, r: WorkloadReport, problems: list[tuple[Problem, float]], options: OptimizeOptions) -> str:
    """What ``inspect`` shows about a node: its workload, kernels, the ranges tuned for, the figures."""
    import json

    values = [problem_features(w, p) for p, _ in problems]
    ranges = {name: [min(v[i] for v in values), max(v[i] for v in values)]
              for i, name in enumerate(_feature_names(w))}
    return json.dumps({
        "workload": {"op": w.op, "m": w.m, "n": w.n, "k": w.k, "batch": w.batch, "dtype": w.dtype,
                     "precision": "tf32" if _tf32(w, options) else "ieee",
                     "epilogue": [w.epilogue.bias, w.epilogue.activation],
                     "alpha": w.epilogue.alpha, "residual": w.epilogue.residual,
                     "residual_first": w.epilogue.residual_first, "residual_mul": w.epilogue.residual_mul,
                     **({"layout": "nhwc" if w.conv.channels_last else "nchw"} if w.conv is not None else {})},
        "kernels": list(r.kernels), "ranges": ranges,
        # no wall-clock seconds: the same model, tuning and kernels give the same bytes (the log says the time)
        "tuning": {"measurer": r.measurer, "trials": r.trials,
                   "regret": r.regret, "geomean_vs_vendor": r.geomean_vs_vendor, "instances": r.instances,
                   **({"profile": r.profile} if r.profile else {})},
    })


def output_paths(models: Sequence[str | Path], output: str | Path) -> list[tuple[Path, Path]]:
    """(input, output) per model: one model is written to ``output``; several go into the folder
    ``output`` under their own file names."""
    paths, output = [Path(m) for m in models], Path(output)
    if len(paths) == 1:
        return [(paths[0], output)]
    if output.exists() and not output.is_dir():
        raise DietcodeError(f"with several models, -o names a folder; {output} is a file")
    names = [m.name for m in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DietcodeError(f"two input models are both named {twice[0]}; their outputs in {output} would collide")
    return [(m, output / m.name) for m in paths]


def optimize_command(models: Sequence[str] | str, output: str, options: OptimizeOptions) -> int:
    import sys

    jobs = output_paths([models] if isinstance(models, str) else models, output)
    folder = jobs[0][1].parent.absolute()  # -o's folder, or -o itself with several models
    created = [d for d in (folder, *folder.parents) if not d.exists()]  # what the output check will create
    try:
        reports = optimize_many(jobs, options, log=lambda line: print(line, file=sys.stderr))
    except BaseException:
        for d in created:  # deepest first: a failed run leaves no empty folders behind
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    for report in reports:
        kinds = {r.measurer for r in report.workloads}
        chains = f" and {report.attention} attention chains" if report.attention else ""
        tuned = f"; tuned with {', '.join(sorted(kinds))}" if kinds else ""
        print(f"wrote {report.output}: {len(report.rewritten)} nodes in {len(report.workloads)} workloads{chains} "
              f"now run dietcode kernels{tuned}")
    if any(not r.measured for report in reports for r in report.workloads):
        print("note: no GPU timings were used; the kernel choice follows the analytic model only "
              "(run optimize on a GPU machine, or with --measure replay:FILE, for measured choices)")
    return 0


def _family(w: Workload, target: str):
    from tuner.space import Family

    return Family(w.op, w.dtype, target)


def _div16(w: Workload) -> tuple[str, ...]:
    """What the kernels may assume 16-divisible: all pointers (ORT's allocations are aligned; the runtime
    checks each call and runs ORT's kernel for one that is not) and the int params that are constant for
    the workload and divisible by 16. Without these Triton neither vectorizes nor pipelines the loads."""
    from tuner import aot

    def constant(dim: str) -> int | None:
        return int(dim) if dim.isdigit() else None

    return aot.shipped_div16(w.op, w.epilogue.bias, constant(w.n), constant(w.k), w.epilogue.residual, constant(w.m))


def _summary(index: int, r: WorkloadReport) -> str:
    w = r.workload
    vs = "n/a" if r.geomean_vs_vendor is None else f"{r.geomean_vs_vendor:.3f}x"
    kind = "measured" if r.measured else "predicted"
    return (f"workload {index} {w.op} M={w.m} N={w.n} K={w.k} ({len(w.nodes)} nodes, {r.instances} shapes): "
            f"{r.trials} trials{_checked(r)} in {r.seconds:.1f}s with {r.measurer}{f' ({r.profile})' if r.profile else ''}; {len(r.kernels)} kernel{'s' if len(r.kernels) != 1 else ''}; "
            f"{kind} geomean vs vendor {vs}; regret {r.regret:.3f}")


def _checked(r: WorkloadReport) -> str:
    """The summary's note of the trials beyond the search's budget: the chosen kernels timed on the shapes the
    search had only predicted them on (tuner.search.settle), up to one per shape."""
    return f" ({r.checked} of them timing the chosen kernels on shapes the search had not)" if r.checked else ""


@dataclass(frozen=True)
class _Chosen:
    kernels: tuple  # MicroKernel | "vendor"
    tree: DispatchTree
    report: WorkloadReport
    measurements: tuple = ()  # the search's and the settling's (tuner.search.Measurement): later ones' warm start


def default_targets() -> tuple[str, ...]:
    """The visible GPU's target family (sm_90 for Hopper, sm_89 for Ada, sm_80 for the other Ampere
    parts, whose cubins it runs), or sm_90 on a machine without a GPU."""
    from tuner.executor import cuda_capability

    capability = cuda_capability()
    if capability is None:
        return ("sm_90",)
    major, minor = capability
    if major >= 9:
        return ("sm_90",) if (major, minor) == (9, 0) else ("sm_80",)  # sm_90a cubins run on 9.0 only
    return ("sm_89",) if (major, minor) == (8, 9) else ("sm_80",)


def make_executor(options: OptimizeOptions) -> Executor:
    """Where compiles and measurements run: this machine, or the Ray cluster ``options.ray`` names."""
    if options.ray is None:
        if options.ray_gpu is not None:
            raise DietcodeError("--ray-gpu applies only with --ray")
        return LocalExecutor(options.compile_workers)
    from tuner.distributed import GPU_MODELS, RayExecutor, RayOptions

    model = options.ray_gpu or GPU_MODELS.get(options.targets[0])
    if model is None:
        raise DietcodeError(f"no default GPU model for target {options.targets[0]}; pass --ray-gpu MODEL")
    return RayExecutor(RayOptions(address=options.ray, gpu_model=model, progress=options.progress))


def make_measurer(options: OptimizeOptions, w: Workload, executor: Executor | None = None):
    """The measurer ``--measure`` asks for (auto: gpu when a GPU is visible, else analytic), DB-cached,
    its batches run by ``executor`` (this process when None)."""
    from tuner import aot
    from tuner.measure import MeasurerSpec, check_analytic_gpu

    executor = executor or LocalExecutor(options.compile_workers)
    where = "visible to the CUDA driver" if isinstance(executor, LocalExecutor) else "on the Ray cluster"
    kind = options.measure
    if kind == "auto":
        kind = "gpu" if executor.gpu_available() else "analytic"
    check_analytic_gpu(options.analytic_gpu, kind)
    if kind == "gpu":
        if not executor.gpu_available():
            raise DietcodeError(f"--measure gpu needs a CUDA GPU {where}; none is (use analytic or replay:FILE)")
        spec = MeasurerSpec("gpu", conv=w.conv, epilogue=w.epilogue, trans_b=w.trans_b, div16=_div16(w),
                            cache_dir=options.cache_dir, allow_tf32=_tf32(w, options),
                            toolchain=aot.CompileToolchain(options.min_driver, options.ptxas))
    elif kind == "analytic":
        spec = MeasurerSpec("analytic", target=options.targets[0], dtype=w.dtype, allow_tf32=_tf32(w, options),
                            gpu=options.analytic_gpu)
    elif kind.startswith("replay:") and kind[len("replay:"):]:
        spec = MeasurerSpec("replay", path=kind[len("replay:"):])
    else:
        raise DietcodeError(f"unknown --measure {options.measure!r}; allowed: auto, gpu, analytic, replay:FILE")
    measurer, label = executor.measurer(spec), spec.label
    if options.db is not None:
        from tuner.database import CachingMeasurer, Database

        measurer = CachingMeasurer(measurer, Database(options.db))
    return measurer, label


def candidate_space(w: Workload, options: OptimizeOptions) -> list[MicroKernel]:
    """The configs ``w`` is tuned over (the space of ``--fp32-precision`` for float32 workloads): a bundle carries
    every kernel for every target, so only configs valid on all of them (split-K takes every epilogue: the last split of a tile applies it); TMA configs only where the
    workload's K and N are constant multiples of 16, which TMA's row strides need on every call (a TMA kernel is
    compiled assuming them, aot.tma_div16: with another K or N every call would run the vendor path)."""
    from tuner.space import enumerate_space

    precision = options.fp32_precision  # shapes the float32 spaces (tf32 dots use sm_90's wgmma and TMA)
    nhwc = w.conv is not None and w.conv.channels_last  # the template's NHWC form gathers in vectors: larger tiles
    others = [set(enumerate_space(_family(w, t), precision, nhwc)) for t in options.targets[1:]]
    space = [c for c in enumerate_space(_family(w, options.targets[0]), precision, nhwc)
             if all(c in other for other in others)]
    if not {"K", "N"} <= set(_div16(w)):
        space = [c for c in space if not c.tma]
    return space


def _tune(w: Workload, problems: list[tuple[Problem, float]], options: OptimizeOptions,
          log: Callable[[str], None], executor: Executor | None = None, warm: Sequence = ()) -> _Chosen:
    import numpy as np

    from tuner.dispatch import settled_dispatch
    from tuner.measure import tuning_profile
    from tuner.search import SearchOptions, tune_joint
    from tuner.workload import Instance

    if options.budget <= 0:
        raise DietcodeError(f"--budget must be positive, got {options.budget}")
    started = time.perf_counter()
    family = _family(w, options.targets[0])
    measurer, label = make_measurer(options, w, executor)
    profile = tuning_profile(measurer, options.targets[0])  # the measured GPU's product (an H200's bandwidth)
    space = candidate_space(w, options)
    result = tune_joint(family, problems, space, measurer, profile,
                        SearchOptions(max_trials=options.budget, seed=options.seed, prior=options.prior,
                                      progress=options.progress and not (executor and executor.shows_progress)),
                        tf32=_tf32(w, options), warm=warm)
    vendor = None
    try:
        answers = measurer.measure_vendor(family, list(result.problems))
        vendor = [a.seconds for a in answers]
    except DietcodeError as exc:  # analytic measurers have no vendor kernel: no vendor leaf, no comparison
        if label == "gpu":  # timing kernels needs only the driver; the vendor baseline needs torch with CUDA
            log(f"{w.nodes[0]}: no vendor baseline ({exc}): the dispatcher has no vendor leaf")
    names = _feature_names(w)
    instances = [Instance(tuple(zip(names, problem_features(w, p))), wt)
                 for p, wt in zip(result.problems, result.weights)]
    if not names:
        raise DietcodeError(f"workload {w.nodes[0]!r} has no dynamic GEMM dim to dispatch on")
    # a conv tree gets compiled kernels only: the CUDA path's vendor conv (docs/abi.md, "The vendor path") is a
    # correctness fallback (cuDNN's heuristic choice within a 256 MiB workspace, symmetric pads), not the algorithm
    # torch's conv2d runs when it is timed here;
    # the vendor time stays a comparison
    searched = result.trials
    dispatch, result = settled_dispatch(names, instances, result, None if w.op == "conv" else vendor, measurer,
                                         options.max_kernels, options.seed)
    rows = dispatch.report.rows
    dispatched = np.array([r.seconds for r in rows])
    weights = [r.weight for r in rows]
    vs_vendor = None
    if vendor is not None and all(math.isfinite(v) for v in vendor):
        vs_vendor = _geomean([v / d for v, d in zip(vendor, dispatched)], weights)
    report = WorkloadReport(workload=w, measurer=label, trials=result.trials, seconds=time.perf_counter() - started,
                            kernels=tuple(k if isinstance(k, str) else k.key() for k in dispatch.kernels),
                            instances=len(w.instances), geomean_vs_vendor=vs_vendor,
                            regret=dispatch.report.geomean, measured=label.startswith(("gpu", "replay")),
                            profile=profile.name, checked=result.trials - searched)
    return _Chosen(dispatch.kernels, dispatch.tree, report, result.measurements)
