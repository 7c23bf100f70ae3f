"""The tuner's GPU path run on the CPU against the stand-in CUDA driver (tests/_fake_libcuda.c).

tests/test_fake_gpu_tuning.py runs this script in a child process whose LD_LIBRARY_PATH puts the stand-in first
as libcuda.so.1 (and whose environment holds its FAKE_CUDA_* settings); the timing process GpuMeasurer spawns
inherits both. Modes:

- ``measure CACHE``: ``tuner.measure.GpuMeasurer`` with its default backend (``tuner.gpu_timing.CudaBackend``
  through ``ChildTimer``) times a batch of sm_90 configs compiled ahead of time as ``optimize`` ships them;
  prints {"device": ..., "results": [[seconds, error, transient], ...], "started": ..., "vendor": ...}.
- ``optimize MODEL OUT DB CACHE DIM...``: ``dietcode-ort optimize MODEL --measure gpu --target sm_90 --budget 6
  --max-kernels 2 --dim DIM ...`` (``dietcode_ort.cli.main``); prints {"rc": ...}.
- ``targets``: what ``optimize`` sees of the device through the driver alone: {"gpu": LocalExecutor's
  gpu_available, "targets": default_targets()}.
- ``record OUT CACHE``: ``benchmarks/record_table.py``'s ``record`` (the device runner's stage 2) on one dense set
  of T = 1..2 and 3 configs, through GpuMeasurer; the vendor rows (cuBLAS through torch with CUDA, which cannot
  run against the stand-in) are recorded as failures; prints {"table": CSV path}.

The stand-in's timings are a made-up function of each launch's size: they exercise code paths, never a GPU.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

# (config fields, what the test expects of it): the batch ``measure`` times, on one problem
CONFIGS: tuple[tuple[dict[str, int], str], ...] = (
    (dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3), "ok"),
    (dict(block_m=64, block_n=64, block_k=32, num_warps=8, num_stages=3), "refused"),  # FAKE_CUDA_MAX_THREADS=128
    (dict(block_m=32, block_n=32, block_k=32, num_warps=2, num_stages=2), "lost"),  # FAKE_CUDA_FAULT_THREADS=64
    (dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=2, split_k=4), "ok"),
    (dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, tma=1), "ok"),
    (dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, tma=1, persistent=2), "ok"),
    (dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4), "too_big"),  # 128 KiB > the opt-in
)
PROBLEM = (100, 96, 256)  # M, N, K: N and K multiples of 16 (TMA)
ENV = {"FAKE_CUDA_MAX_THREADS": "128", "FAKE_CUDA_FAULT_THREADS": "64", "FAKE_CUDA_SMEM_OPTIN": str(100 * 1024),
       "FAKE_CUDA_SM_COUNT": "4"}


def measure(cache: Path) -> dict[str, Any]:
    from dietcode_ort.errors import DietcodeError
    from tuner import aot
    from tuner.measure import GpuMeasurer
    from tuner.space import Family, MicroKernel
    from tuner.workload import Epilogue, Problem

    family = Family("gemm", "float16", "sm_90")
    problem = Problem(*PROBLEM)
    configs = [MicroKernel(**fields) for fields, _ in CONFIGS]
    with GpuMeasurer(warmup=1, repeats=3, flush_bytes=1 << 20, div16=aot.tma_div16("gemm"), cache_dir=cache,
                     epilogue=Epilogue(bias=True, activation="gelu")) as m:
        results = m.measure(family, [(c, problem) for c in configs])
        try:
            vendor: Any = [r.seconds for r in m.measure_vendor(family, [problem])]
        except DietcodeError as exc:
            vendor = str(exc)
        started = m._timer.started
        device = m.device_key()
    return {"device": device, "started": started, "vendor": vendor, "keys": [c.key() for c in configs],
            "results": [[r.seconds if math.isfinite(r.seconds) else None, r.error, r.transient] for r in results]}


def optimize(model: str, out: str, db: str, cache: str, *dims: str) -> dict[str, Any]:
    from dietcode_ort.cli import main as cli

    rc = cli(["optimize", model, "--measure", "gpu", "--target", "sm_90", "--budget", "6", "--max-kernels", "2",
              *[a for dim in dims for a in ("--dim", dim)], "-o", out, "--db", db, "--cache-dir", cache])
    return {"rc": rc}


def record(out: str, cache: str) -> dict[str, Any]:
    from tuner import measure as measure_module
    from tuner.measure import GpuMeasurer, MeasureResult

    caches: list[str] = []  # the kernel cache the recorder gives each set's measurer

    class WithoutVendor(GpuMeasurer):
        def __init__(self, **kw: Any) -> None:
            caches.append(str(kw.get("cache_dir")))
            super().__init__(**kw)

        def measure_vendor(self, family: Any, problems: Any) -> list[MeasureResult]:
            return [MeasureResult(math.inf, "no torch with CUDA against the stand-in driver") for _ in problems]

    measure_module.GpuMeasurer = WithoutVendor  # type: ignore[misc]
    from _scripts import load_script

    record_table = load_script("record_table")
    table = record_table.record(record_table.dense_sets(2)[:2], Path(out), repeats=2, max_configs=3,
                                command="record_table (stand-in driver)")
    return {"table": str(table), "caches": caches}


def targets() -> dict[str, Any]:
    from tuner.executor import LocalExecutor
    from tuner.optimize import default_targets

    return {"gpu": LocalExecutor().gpu_available(), "targets": list(default_targets())}


def main() -> int:
    import ctypes

    fake = ctypes.CDLL("libcuda.so.1")  # the library the core's dlopen finds (LD_LIBRARY_PATH)
    if not hasattr(fake, "fake_cuda_log"):
        print(f"libcuda.so.1 is not the stand-in: {fake}", file=sys.stderr)
        return 2
    mode, *args = sys.argv[1:]
    out = {"measure": lambda: measure(Path(args[0])), "optimize": lambda: optimize(*args),
           "record": lambda: record(*args), "targets": targets}[mode]()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
