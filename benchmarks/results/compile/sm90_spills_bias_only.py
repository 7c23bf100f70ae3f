"""Recompile with bias only the float16 configs of sm90-mma-space.csv that spill under bias + gelu
(compile_filter's epilogue): ``PYTHONPATH=. python benchmarks/results/compile/sm90_spills_bias_only.py``."""
from __future__ import annotations

import csv

from tuner.aot import CompileJob, aligned_params, compile_many
from tuner.space import Family, MicroKernel
from tuner.workload import Epilogue

with open("benchmarks/results/compile/sm90-mma-space.csv") as handle:
    rows = [r for r in csv.DictReader(line for line in handle if not line.startswith("#"))
            if r["dtype"] == "float16" and int(r["n_spills"] or 0) > 0]
family = Family("gemm", "float16", "sm_90")
jobs = [CompileJob(family, MicroKernel.from_key(r["config"]), Epilogue(bias=True), div16=aligned_params("gemm"))
        for r in rows]
for r, result in zip(rows, compile_many(jobs, 2)):
    k = result.kernel
    print(r["config"], r["mma"], r["n_regs"], r["n_spills"], "|", k.n_regs if k else result.error[:80],
          k.n_spills if k else "")
