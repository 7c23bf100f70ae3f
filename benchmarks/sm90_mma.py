"""Which MMA the compiled sm_90 kernels use: AOT-compile a family's space (or a seeded sample of it) and
record, per config (gemm, bmm or conv: ``--op``), the tensor-core instruction in its PTX (wgmma / mma.sync / none), registers, spills and
shared memory, next to what ``tuner.space.wgmma_eligible`` predicts.

    python benchmarks/sm90_mma.py --out benchmarks/results/compile/sm90-mma.csv \\
        [--dtypes float16,bfloat16,float32,tf32] [--sample float32=40,tf32=150] [--seed 0] [--workers 2]

Each config is compiled as ``tuner.space.compile_filter`` compiles it (heaviest epilogue: bias + gelu; every
pointer and N, K assumed divisible by 16, which is what lets Triton pipeline the loads). ``tf32`` is the
float32 space compiled with ``allow_tf32`` (tl.dot in tf32 precision); ``float32`` is how the project ships
float32 today (ieee). Rows are appended to the CSV, after ``#`` lines naming the command, the Triton and
ptxas versions and the compile time; ``--sample DTYPE=N`` compiles N configs of that space drawn with
``random.Random(seed)``. Compiled kernels land in the kernel cache (``--cache-dir``), so a rerun is quick.
"""
from __future__ import annotations

import argparse
import csv
import random
import shlex
import sys
import time
from pathlib import Path

from tuner.aot import CompileJob, aligned_params, compile_many, ptx_mma, ptx_mma_shapes
from tuner.space import REFERENCE_CONV, Family, enumerate_space, representative_epilogue, wgmma_eligible

COLUMNS = ("target", "op", "dtype", "precision", "config", "block_m", "block_n", "block_k", "num_warps",
           "num_stages", "split_k", "mma", "mma_shapes", "predicted_wgmma", "n_regs", "n_spills", "shared",
           "error")


def _samples(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        out[name] = int(count)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default="sm_90")
    parser.add_argument("--op", default="gemm")
    parser.add_argument("--dtypes", default="float16,bfloat16,float32,tf32")
    parser.add_argument("--sample", default="", help="DTYPE=N,...: compile a seeded sample of N configs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    import triton

    samples = _samples(args.sample)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = not args.out.exists()
    with args.out.open("a", newline="") as handle:
        if new:
            handle.write(f"# command: python {' '.join(map(shlex.quote, sys.argv))}\n")
        writer = csv.writer(handle)
        for name in filter(None, args.dtypes.split(",")):
            tf32 = name == "tf32"
            dtype = "float32" if tf32 else name
            family = Family(args.op, dtype, args.target)
            space = enumerate_space(family)
            configs = space
            if name in samples and samples[name] < len(space):
                configs = sorted(random.Random(args.seed).sample(space, samples[name]))
            conv = REFERENCE_CONV if args.op == "conv" else None  # as compile_filter: a 3x3 64->64 layer
            jobs = [CompileJob(family, c, representative_epilogue(c), conv=conv, div16=aligned_params(args.op),
                               allow_tf32=tf32, cache_dir=args.cache_dir) for c in configs]
            start = time.perf_counter()
            results = compile_many(jobs, args.workers)
            seconds = time.perf_counter() - start
            ptxas = next((r.kernel.ptxas_version for r in results if r.kernel is not None), "?")
            handle.write(f"# {name}: {len(configs)} of {len(space)} configs (seed {args.seed}), "
                         f"{seconds:.0f} s with {args.workers} workers, triton {triton.__version__}, "
                         f"ptxas {ptxas}\n")
            if new:
                writer.writerow(COLUMNS)
                new = False
            for config, result in zip(configs, results):
                k = result.kernel
                writer.writerow([args.target, args.op, dtype, "tf32" if tf32 else ("ieee" if dtype == "float32"
                                 else dtype), config.key(), config.block_m, config.block_n, config.block_k,
                                 config.num_warps, config.num_stages, config.split_k,
                                 ptx_mma(k.ptx) if k else "", " ".join(ptx_mma_shapes(k.ptx)) if k else "",
                                 int(wgmma_eligible(config, dtype, family.profile, tf32)),
                                 k.n_regs if k else "", k.n_spills if k else "", k.shared if k else "",
                                 result.error.splitlines()[0][:200] if not k else ""])
            handle.flush()
            print(f"{name}: {len(configs)} compiled in {seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
