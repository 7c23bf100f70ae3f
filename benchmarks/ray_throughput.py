"""Throughput of ``optimize --ray`` on a local Ray instance (a benchmark, not a test).

    python benchmarks/ray_throughput.py [--compile-jobs 6] [--compile-workers 1,2]
                                        [--gpus 1,2,4,8] [--measure-ms 0,20] [--budget 512]
                                        [--workloads 4]

1. Compile: ``--compile-jobs`` distinct gemm kernels for sm_90, each into an empty kernel cache, with 1
   and 2 Ray workers (``ray.init(num_cpus=W)``, workers start cold), against ``aot.compile_many`` with as
   many forked processes. Reported as kernels per second.
2. A simulated cluster: the joint search over a SYNTHETIC replay table (tuner.simulate), its measurement
   batches run as GPU tasks on N simulated GPUs (``num_gpus=N`` plus ``accelerator_type:H100``); each
   measurement also sleeps ``--measure-ms`` (0: Ray's overhead alone; 20: about what GpuMeasurer spends
   per kernel and shape with 3 warm-up and 20 timed launches). Reported as measurements per second, the
   same search in one process beside it, and whether the Ray run chose the same kernels. The N workers
   are started before the timing (a cold Python worker costs seconds on a small machine).
3. Several workloads (``--workloads``) on the most GPUs and the slowest measurement: their searches one
   after another, then as many at once as ``optimize --ray`` runs.

Results go to stdout and to benchmarks/results/<this machine>/ray-throughput.txt (command at the top).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tuner.database import CachingMeasurer, Database  # noqa: E402
from tuner.hardware import get_profile  # noqa: E402
from tuner.measure import MeasurerSpec  # noqa: E402
from tuner.search import SearchOptions, tune_joint  # noqa: E402
from tuner.simulate import simulate_table, synthetic_table_name, write_synthetic_table  # noqa: E402
from tuner.space import Family, enumerate_space  # noqa: E402
from tuner.workload import Problem  # noqa: E402

FAMILY = Family("gemm", "float16", "sm_90")


@dataclass(frozen=True)
class Slowed:
    """The replay measurer, each measurement taking ``seconds`` as a GPU would (travels by value)."""

    inner: MeasurerSpec
    seconds: float
    kind: str = "replay"

    def build(self):
        return _Slowed(self.inner.build(), self.seconds)


class _Slowed:
    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def device_key(self) -> str:
        return self.inner.device_key()

    def context(self) -> str:
        return self.inner.context()

    def measure(self, family, pairs):
        time.sleep(self.seconds * len(pairs))
        return self.inner.measure(family, pairs)

    def measure_each(self, family, pairs, store):
        results = self.measure(family, pairs)
        store(pairs, results)
        return results


def _init(ray, **kw) -> None:
    ray.init(include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False,
             logging_level="ERROR", **kw)


def compile_rows(ray, jobs: int, workers: list[int]) -> list[str]:
    from tuner import aot
    from tuner.distributed import RayExecutor, RayOptions

    configs = enumerate_space(FAMILY)[:: max(1, len(enumerate_space(FAMILY)) // jobs)][:jobs]
    rows = []
    for w in workers:
        for where in ("local processes", "ray workers"):
            with tempfile.TemporaryDirectory() as cache:
                batch = [aot.CompileJob(FAMILY, c, cache_dir=Path(cache)) for c in configs]
                if where == "ray workers":
                    _init(ray, num_cpus=w)
                    started = time.perf_counter()
                    with RayExecutor(RayOptions(progress=False)) as executor:
                        results = executor.compile_many(batch)
                    seconds = time.perf_counter() - started
                    ray.shutdown()
                else:
                    started = time.perf_counter()
                    results = aot.compile_many(batch, workers=w)
                    seconds = time.perf_counter() - started
            ok = sum(r.ok for r in results)
            rows.append(f"compile  {where:<16} workers={w}  {ok}/{len(batch)} kernels in {seconds:6.1f}s  "
                        f"{ok / seconds:5.2f} kernels/s")
            print(rows[-1], flush=True)
    return rows


def cluster_rows(ray, gpus: list[int], measure_ms: list[float], budget: int) -> list[str]:
    from tuner.distributed import RayExecutor, RayOptions

    profile = get_profile("sm_90")
    space = enumerate_space(FAMILY)[::3]
    problems = [(Problem(16 * t, 768, 768), 1.0) for t in range(1, 33)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        table = write_synthetic_table(Path(tmp) / synthetic_table_name(profile, "float16", 11),
                                      simulate_table(space, [p for p, _ in problems], profile, "float16", 11),
                                      profile, 11)
        options = SearchOptions(max_trials=budget, seed=0, progress=False)
        warm = SearchOptions(max_trials=64, seed=1, progress=False)  # imports and first-call costs, untimed
        tune_joint(FAMILY, problems, space, MeasurerSpec("replay", path=str(table)).build(), profile, warm)
        for ms in measure_ms:
            spec = Slowed(MeasurerSpec("replay", path=str(table)), ms / 1e3)
            seconds = float("inf")
            for attempt in range(2):  # the better of two runs, each with a fresh database
                inner, db = spec.build(), Database(Path(tmp) / f"local-{ms}-{attempt}.db")
                started = time.perf_counter()
                local = tune_joint(FAMILY, problems, space, CachingMeasurer(inner, db), profile, options)
                seconds = min(seconds, time.perf_counter() - started)
            rows.append(f"search   one process      measure={ms:4.0f}ms        {local.trials} measurements in "
                        f"{seconds:6.1f}s  {local.trials / seconds:7.1f} meas/s")
            print(rows[-1], flush=True)
            for n in gpus:
                _init(ray, num_cpus=n, num_gpus=n, resources={"accelerator_type:H100": 1})
                with RayExecutor(RayOptions(progress=False)) as executor:
                    # start the N workers first (one slow part each), outside the timing and the database
                    executor.measurer(Slowed(spec.inner, 0.5)).measure(FAMILY, [(space[0], problems[0][0])] * n)
                    executor.measurer(spec).measure(FAMILY, [(space[0], problems[0][0])] * (8 * n))
                    warm_tasks = executor.progress.done
                    measurer = CachingMeasurer(executor.measurer(spec), Database(Path(tmp) / f"ray-{ms}-{n}.db"))
                    started = time.perf_counter()
                    result = tune_joint(FAMILY, problems, space, measurer, profile, options)
                    seconds = time.perf_counter() - started
                    tasks = executor.progress.done - warm_tasks
                ray.shutdown()
                same = "same choice" if result.choice == local.choice else "DIFFERENT choice"
                rows.append(f"search   ray, {n} sim. GPUs  measure={ms:4.0f}ms        {result.trials} measurements in "
                            f"{seconds:6.1f}s  {result.trials / seconds:7.1f} meas/s  ({tasks} tasks, {same})")
                print(rows[-1], flush=True)
    return rows


def concurrent_rows(ray, gpus: int, workloads: int, measure_ms: float, budget: int) -> list[str]:
    """``workloads`` distinct searches (N = 768, 1024, ...) on ``gpus`` simulated GPUs: one after another,
    then as many at once as RayExecutor.searches() says (what optimize does with several workloads)."""
    from concurrent.futures import ThreadPoolExecutor

    from tuner.distributed import RayExecutor, RayOptions

    profile = get_profile("sm_90")
    space = enumerate_space(FAMILY)[::3]
    sets = [[(Problem(16 * t, 768 + 256 * i, 768), 1.0) for t in range(1, 33)] for i in range(workloads)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        table = write_synthetic_table(Path(tmp) / synthetic_table_name(profile, "float16", 12),
                                      simulate_table(space, [p for ps in sets for p, _ in ps], profile, "float16",
                                                     12), profile, 12)
        spec = Slowed(MeasurerSpec("replay", path=str(table)), measure_ms / 1e3)
        options = SearchOptions(max_trials=budget, seed=0, progress=False)
        _init(ray, num_cpus=gpus, num_gpus=gpus, resources={"accelerator_type:H100": 1})
        with RayExecutor(RayOptions(progress=False)) as executor:
            executor.measurer(Slowed(spec.inner, 0.5)).measure(FAMILY, [(space[0], sets[0][0][0])] * gpus)
            executor.measurer(spec).measure(FAMILY, [(space[0], sets[0][0][0])] * (8 * gpus))
            for label, threads in (("one after another", 1), ("at once", executor.searches())):
                def search(i: int, label=label):
                    db = Database(Path(tmp) / f"{label}-{i}.db")
                    return tune_joint(FAMILY, sets[i], space, CachingMeasurer(executor.measurer(spec), db), profile,
                                      options)

                started = time.perf_counter()
                with ThreadPoolExecutor(max_workers=threads) as pool:
                    results = list(pool.map(search, range(workloads)))
                seconds = time.perf_counter() - started
                trials = sum(r.trials for r in results)
                rows.append(f"searches ray, {gpus} sim. GPUs  measure={measure_ms:4.0f}ms  {workloads} workloads "
                            f"{label} ({threads} at a time): {trials} measurements in {seconds:6.1f}s  "
                            f"{trials / seconds:7.1f} meas/s")
                print(rows[-1], flush=True)
        ray.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-jobs", type=int, default=6)
    parser.add_argument("--compile-workers", default="1,2")
    parser.add_argument("--gpus", default="1,2,4,8", help="simulated GPU counts")
    parser.add_argument("--measure-ms", default="0,20", help="simulated milliseconds per measurement")
    parser.add_argument("--budget", type=int, default=512, help="measurements per search")
    parser.add_argument("--workloads", type=int, default=4, help="distinct searches for the concurrency rows")
    parser.add_argument("--out", help="result file (default: benchmarks/results/<this machine>/ray-throughput.txt)")
    args = parser.parse_args(argv)
    try:
        import ray
    except ImportError:
        print("error: this benchmark needs Ray: pip install 'dietcode-ort[distributed]'", file=sys.stderr)
        return 2
    import run_suite

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    command = shlex.join(["python", "benchmarks/ray_throughput.py", *(argv if argv is not None else sys.argv[1:])])
    header = [f"$ {command}", f"# {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the start); "
                              f"ray {ray.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    print("\n".join(header), flush=True)
    rows = compile_rows(ray, args.compile_jobs, [int(w) for w in args.compile_workers.split(",")])
    rows += cluster_rows(ray, [int(n) for n in args.gpus.split(",")],
                         [float(m) for m in args.measure_ms.split(",")], args.budget)
    rows += concurrent_rows(ray, max(int(n) for n in args.gpus.split(",")), args.workloads,
                            max(float(m) for m in args.measure_ms.split(",")), args.budget)
    out = Path(args.out) if args.out else run_suite.results_dir(ROOT / "benchmarks" / "results", "cpu") / "ray-throughput.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header + rows) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
