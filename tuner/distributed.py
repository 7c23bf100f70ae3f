"""Tuning on a Ray cluster: compile jobs as CPU tasks, measurement batches as GPU tasks.

What runs where:

- the driver (the machine running ``dietcode-ort optimize --ray``) scans the model, runs the searches
  (cost model, proposals), keeps the one tuning database, writes each task's results to it as the task
  finishes, and builds the dispatch trees, bundles and the rewritten model;
- compile jobs (``tuner.aot.compile_kernel``) run as tasks with ``num_cpus=1``; the compiled records come
  back to the driver;
- a search round's measurement batch is cut into parts of at most ``chunk`` measurements, each a task with
  ``num_gpus=1`` plus a sliver of ``accelerator_type:MODEL`` (the resource Ray gives every node after its
  GPU model), so one cluster can tune for H100 and A100 at once and never mixes their timings. The
  measurer is built on the worker from a ``MeasurerSpec``. Analytic and replay measurers need no GPU: they
  use the model's GPUs when the cluster has them, else one CPU each.

Faults: Ray retries a task whose worker or node died (``max_retries``). A part that still fails, or that
runs past its time limit (it is cancelled), is split into single measurements which are sent again; a
single one that fails that way is recorded as failed (inf seconds and the reason), so a kernel that kills
its worker costs a few retries, never the run. An error a measurer raises on purpose (``DietcodeError``:
a replay table without the row) ends the run as it would in one process. Interrupting the driver cancels
the tasks in flight; what finished is in the database and a rerun measures only the rest.

``import ray`` happens only here, when a ``RayExecutor`` is made.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dietcode_ort.errors import DietcodeError
from tuner.executor import Executor
from tuner.measure import VENDOR_KEY, MeasureResult, Measurer, MeasurerSpec
from tuner.space import Family
from tuner.workload import Problem

if TYPE_CHECKING:  # tuner.aot imports triton; measuring workers need not
    from tuner.aot import CompileJob, CompileResult

__all__ = ["RayOptions", "RayExecutor", "GPU_MODELS", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'dietcode-ort[distributed]'"
# The GPU model (Ray's accelerator type) a tuning target is timed on unless told otherwise.
GPU_MODELS = {"sm_90": "H100", "sm_80": "A100", "sm_89": "L4"}
Pair = tuple[Any, Problem]  # (MicroKernel or VENDOR_KEY, problem)


@dataclass(frozen=True)
class RayOptions:
    """How to reach the cluster and how to run tasks on it."""

    address: str = "auto"  # "auto" (the running cluster, RAY_ADDRESS), "local" (start one here), or an address
    gpu_model: str = "H100"  # Ray accelerator type the measurements run on
    max_retries: int = 2  # Ray's retries of a task whose worker or node died
    measure_timeout_s: float = 120.0  # per measurement in a task (a part's limit scales with its size)
    compile_timeout_s: float = 900.0  # per compile task
    chunk: int = 8  # most measurements per task
    progress: bool = True

    def check(self) -> None:
        if self.max_retries < 0 or self.chunk <= 0:
            raise DietcodeError(f"ray: max_retries must be >= 0 and chunk > 0, got {self.max_retries}, "
                                f"{self.chunk}")
        if not (self.measure_timeout_s > 0 and self.compile_timeout_s > 0):
            raise DietcodeError("ray: time limits must be positive")
        if not self.gpu_model or not self.address:
            raise DietcodeError("ray: the address and the GPU model must not be empty")


def _import_ray():
    try:
        import ray
    except ImportError:
        raise DietcodeError(f"--ray needs Ray, which is not installed here: {INSTALL_HINT}") from None
    return ray


# --- what runs on the workers ---------------------------------------------------------------------------

_BUILT: dict[Any, Measurer] = {}  # per worker process: measurers built so far, by spec


def _worker_measurer(spec: Any) -> Measurer:
    measurer = _BUILT.get(spec)
    if measurer is None:
        measurer = _BUILT[spec] = spec.build()
    return measurer


def _measure_part(spec: Any, family: Family, pairs: list[Pair], vendor: bool) -> list[MeasureResult]:
    measurer = _worker_measurer(spec)
    if vendor:
        return measurer.measure_vendor(family, [p for _, p in pairs])
    return measurer.measure(family, pairs)


def _describe(spec: Any) -> tuple[str, str]:
    measurer = _worker_measurer(spec)
    return measurer.device_key(), measurer.context()


def _compile_part(job: CompileJob) -> CompileResult:
    from tuner.aot import _run_job

    return _run_job(job)


# --- the driver's side -----------------------------------------------------------------------------------

class _Progress:
    """One bar for the cluster: work items done (measurements and compiles), measurements per second,
    tasks done of sent, failures, ETA."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)  # on a terminal only: elsewhere rich would end it with an empty line
        enabled = enabled and console.is_terminal
        self.bar = Progress(TextColumn("cluster"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]} meas/s, tasks {task.fields[done]}/{task.fields[sent]}"
                                       ", {task.fields[failed]} failed"), TimeRemainingColumn(),
                            console=console, disable=not enabled, transient=True)
        self.task = self.bar.add_task("cluster", total=None, rate="-", done=0, sent=0, failed=0)
        self.total = self.items = self.measurements = self.sent = self.done = self.failed = 0
        self.measure_started: float | None = None  # the first measurement task's start
        if enabled:
            self.bar.start()

    def expect(self, items: int) -> None:
        self.total += items
        self.show()

    def show(self) -> None:
        seconds = 0.0 if self.measure_started is None else time.perf_counter() - self.measure_started
        rate = "-" if not (seconds and self.measurements) else f"{self.measurements / seconds:.1f}"
        self.bar.update(self.task, total=max(self.total, self.items) or None, completed=self.items, rate=rate,
                        done=self.done, sent=self.sent, failed=self.failed)

    def close(self) -> None:
        self.bar.stop()


class RayExecutor(Executor):
    """Compile jobs and measurement batches as tasks on a Ray cluster (see the module docstring).

    Uses the Ray session already initialised in this process if there is one (and leaves it running),
    else connects to ``options.address`` and disconnects on ``close``."""

    shows_progress = True

    def __init__(self, options: RayOptions = RayOptions()) -> None:
        options.check()
        self.options = options
        self.ray = ray = _import_ray()
        self._owned = not ray.is_initialized()
        if self._owned:
            kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            try:
                if options.address == "local":
                    ray.init(**kwargs)
                else:
                    ray.init(address=options.address, **kwargs)
            except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError
                raise DietcodeError(
                    f"cannot reach a Ray cluster at {options.address!r}: {type(exc).__name__}: {exc}; start one "
                    "with `ray start --head` (and `ray start --address=HEAD:6379` on each node), or pass "
                    "--ray local to start one on this machine") from None
        self.progress = _Progress(options.progress)
        self._lock = threading.Lock()  # guards the in-flight counts and the bar (searches run in threads)
        self._inflight: dict[str, int] = {}
        self._stop = threading.Event()
        # GPU measurers get a fresh worker process (and CUDA context) per task; the others reuse theirs
        self._remote_measure = {True: ray.remote(max_calls=1)(_measure_part),
                                False: ray.remote(max_calls=0)(_measure_part)}
        self._remote_describe = {True: ray.remote(max_calls=1)(_describe),
                                 False: ray.remote(max_calls=0)(_describe)}
        self._remote_compile = ray.remote(_compile_part)

    # resources ------------------------------------------------------------------------------------------
    @property
    def model_resource(self) -> str:
        return f"accelerator_type:{self.options.gpu_model}"

    def _alive(self) -> list[dict[str, float]]:
        return [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]

    def model_gpus(self) -> int:
        """GPUs on the live nodes whose GPU model is ``gpu_model``."""
        return int(sum(r.get("GPU", 0) for r in self._alive() if r.get(self.model_resource, 0) > 0))

    def gpu_available(self) -> bool:
        return self.model_gpus() > 0

    def _cpus(self) -> int:
        return max(1, int(sum(r.get("CPU", 0) for r in self._alive())))

    def _measure_placement(self, spec: Any) -> tuple[dict[str, Any], int, bool]:
        """(task options, slots, whether it times on a GPU) for a spec's measurement tasks."""
        gpus = self.model_gpus()
        on_gpu = dict(num_gpus=1, resources={self.model_resource: 0.001})
        timed = getattr(spec, "kind", "gpu") == "gpu"
        if timed and not gpus:
            raise DietcodeError(self._no_gpu_message())
        if gpus:
            return on_gpu, gpus, timed
        return dict(num_cpus=1), self._cpus(), timed

    def _no_gpu_message(self) -> str:
        models = sorted({k.split(":", 1)[1] for r in self._alive() for k in r if k.startswith("accelerator_type:")})
        return (f"the Ray cluster has no live node with a {self.options.gpu_model} GPU (resource "
                f"{self.model_resource}); its GPU models: {', '.join(models) or 'none'} (pick one with --ray-gpu)")

    # the executor interface -----------------------------------------------------------------------------
    def measurer(self, spec: MeasurerSpec) -> Measurer:
        return RemoteMeasurer(self, spec)

    def expect(self, measurements: int) -> None:
        self.progress.expect(measurements)

    def compile_many(self, jobs: Sequence[CompileJob]) -> list[CompileResult]:
        from tuner import aot

        jobs = list(jobs)
        results: list[CompileResult | None] = [None] * len(jobs)

        def submit(part: tuple[int, ...]):
            return self._remote_compile.options(num_cpus=1, max_retries=self.options.max_retries).remote(
                jobs[part[0]])

        def done(part: tuple[int, ...], values: Any) -> None:
            results[part[0]] = values

        def fail(i: int, reason: str) -> None:
            results[i] = aot.CompileResult(jobs[i], None, reason)

        self.progress.expect(len(jobs))
        self._drive([(i,) for i in range(len(jobs))], submit, done, fail, self._cpus(),
                    self.options.compile_timeout_s, measurements=False)
        return [r if r is not None else aot.CompileResult(j, None, "not run") for r, j in zip(results, jobs)]

    def measure_pairs(self, spec: Any, family: Family, pairs: Sequence[Pair], vendor: bool,
                      store: Callable[[Sequence[Pair], list[MeasureResult]], None] | None) -> list[MeasureResult]:
        """Measure ``pairs`` in parts on the cluster; ``store`` gets each part as it finishes."""
        pairs = list(pairs)
        if not pairs:
            return []
        placement, slots, timed = self._measure_placement(spec)
        placement = dict(placement, max_retries=self.options.max_retries)
        remote = self._remote_measure[timed]
        size = max(1, min(self.options.chunk, math.ceil(len(pairs) / slots)))
        parts = [tuple(range(i, min(i + size, len(pairs)))) for i in range(0, len(pairs), size)]
        results: list[MeasureResult | None] = [None] * len(pairs)

        def submit(part: tuple[int, ...]):
            return remote.options(**placement).remote(spec, family, [pairs[i] for i in part], vendor)

        def done(part: tuple[int, ...], values: list[MeasureResult]) -> None:
            for i, r in zip(part, values):
                results[i] = r
            if store is not None:
                store([pairs[i] for i in part], list(values))

        def fail(i: int, reason: str) -> None:
            done((i,), [MeasureResult(math.inf, reason)])

        self._drive(parts, submit, done, fail, slots, self.options.measure_timeout_s, measurements=True)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:  # cannot happen: every part ends in done or fail
            raise DietcodeError(f"ray: {len(missing)} measurements came back without a result")
        return results  # type: ignore[return-value]

    def describe(self, spec: Any) -> tuple[str, str]:
        """(device key, context) of the measurer ``spec`` builds, asked of a worker that would run it."""
        placement, _, timed = self._measure_placement(spec)
        ref = self._remote_describe[timed].options(**placement, max_retries=self.options.max_retries).remote(spec)
        try:
            return self.ray.get(ref, timeout=self.options.measure_timeout_s)
        except self.ray.exceptions.RayTaskError as exc:
            self._reraise(exc)
            raise
        except self.ray.exceptions.GetTimeoutError:
            self.ray.cancel(ref, force=True)
            raise DietcodeError(f"ray: no worker described the measurer within {self.options.measure_timeout_s}s "
                                f"(is a {self.options.gpu_model} node free?)") from None

    def _reraise(self, exc: Exception) -> None:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DietcodeError):
            raise DietcodeError(str(cause)) from None

    # the scheduler -----------------------------------------------------------------------------------
    def searches(self) -> int:
        """Searches to run at once: while one computes its next round, the others' batches keep the GPUs
        busy; a round of 64 fills 8 tasks of 8, so more GPUs take more searches."""
        return max(2, math.ceil(max(self.model_gpus(), 1) / 8) + 1)

    def abort(self) -> None:
        self._stop.set()

    def _take(self, pool: str, slots: int) -> bool:
        with self._lock:
            if self._inflight.get(pool, 0) >= slots:
                return False
            self._inflight[pool] = self._inflight.get(pool, 0) + 1
            return True

    def _give(self, pool: str, count: int = 1) -> None:
        with self._lock:
            self._inflight[pool] -= count

    def _drive(self, parts: list[tuple[int, ...]], submit: Callable, done: Callable, fail: Callable, slots: int,
               limit_per_item: float, measurements: bool) -> None:
        """Run ``parts`` with at most ``slots`` tasks in flight over all the searches running at once (so a
        task starts when it is sent and its time limit, ``limit_per_item`` per item, counts its run); see
        the module docstring for faults. Thread-safe: each search thread drives its own parts."""
        ray, bar, lock = self.ray, self.progress, self._lock
        pool = "measure" if measurements else "compile"
        pending = deque(parts)
        running: dict[Any, tuple[tuple[int, ...], float]] = {}
        if measurements and bar.measure_started is None:
            bar.measure_started = time.perf_counter()

        def split(part: tuple[int, ...], reason: str) -> None:
            if len(part) > 1:
                pending.extend((i,) for i in part)
                return
            fail(part[0], reason)
            with lock:
                bar.failed += 1
                bar.items += 1

        try:
            while pending or running:
                if self._stop.is_set():
                    raise DietcodeError("ray: the run was stopped")
                while pending and self._take(pool, slots):
                    part = pending.popleft()
                    running[submit(part)] = (part, time.monotonic())
                    with lock:
                        bar.sent += 1
                if not running:  # every slot is another search's: wait for one
                    time.sleep(0.02)
                    continue
                ready, rest = ray.wait(list(running), num_returns=1, timeout=0.5)
                if ready and rest:  # and whatever else has finished meanwhile
                    ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
                for ref in ready:
                    part, _ = running.pop(ref)
                    self._give(pool)
                    try:
                        values = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        self._reraise(exc)
                        raise
                    except ray.exceptions.RayError as exc:  # worker or node died, Ray's retries spent
                        split(part, f"worker died ({type(exc).__name__}) after {self.options.max_retries} "
                                    f"retries")
                        continue
                    done(part, values)
                    with lock:
                        bar.done += 1
                        bar.items += len(part)
                        bar.measurements += len(part) if measurements else 0
                now = time.monotonic()
                for ref, (part, sent) in list(running.items()):
                    limit = limit_per_item * len(part)
                    if now - sent > limit:
                        ray.cancel(ref, force=True)
                        del running[ref]
                        self._give(pool)
                        split(part, f"timed out after {limit:g}s")
                with lock:
                    bar.show()
        finally:  # an error or an interrupt: stop what is in flight and collect it (Ray logs uncollected errors)
            for ref in running:
                ray.cancel(ref, force=True)
            if running:
                self._give(pool, len(running))
            for ref in ray.wait(list(running), num_returns=len(running), timeout=2.0)[0] if running else ():
                try:
                    ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - cancelled or failed: nothing more to learn from it
                    pass

    def close(self) -> None:
        self._stop.set()
        self.progress.close()
        if self._owned and self.ray.is_initialized():
            self.ray.shutdown()


class RemoteMeasurer(Measurer):
    """A measurer whose batches run as tasks of a RayExecutor; the device key and context come from a
    worker (the driver may have no GPU)."""

    def __init__(self, executor: RayExecutor, spec: Any) -> None:
        self.executor, self.spec = executor, spec
        self._identity: tuple[str, str] | None = None

    def _describe(self) -> tuple[str, str]:
        if self._identity is None:
            self._identity = self.executor.describe(self.spec)
        return self._identity

    def device_key(self) -> str:
        return self._describe()[0]

    def context(self) -> str:
        return self._describe()[1]

    def measure(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[MeasureResult]:
        return self.executor.measure_pairs(self.spec, family, configs_and_problems, False, None)

    def measure_each(self, family: Family, configs_and_problems: Sequence[Pair],
                     store: Callable[[Sequence[Pair], list[MeasureResult]], None]) -> list[MeasureResult]:
        return self.executor.measure_pairs(self.spec, family, configs_and_problems, False, store)

    def refusals(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[str | None]:
        """A GPU spec's div16 refusals (as ``GpuMeasurer.refusals``, worked out here); none foreseen for others."""
        from tuner.measure import div16_refusals

        if isinstance(self.spec, MeasurerSpec) and self.spec.kind == "gpu":
            return div16_refusals(family, configs_and_problems, self.spec.epilogue, self.spec.div16)
        return super().refusals(family, configs_and_problems)

    def measure_vendor(self, family: Family, problems: Sequence[Problem]) -> list[MeasureResult]:
        return self.executor.measure_pairs(self.spec, family, [(VENDOR_KEY, p) for p in problems], True, None)
