"""Peak memory of ``dietcode-ort optimize`` on a model whose weights are external data.

Builds a chain of MatMuls with float32 (hidden x hidden) weights and a symbolic batch dim, saved with
``onnx.save_model(save_as_external_data=True)``, then runs optimize (analytic measurer) in a child
process and prints the child's peak RSS (VmHWM) next to the weights' size::

    python -m benchmarks.optimize_memory --hidden 4096 --layers 6 --work /tmp/optmem [--inline]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = ["build_chain", "peak_rss"]

_CHILD = """
import json, sys
from pathlib import Path
from tuner.optimize import OptimizeOptions, optimize
src, out, work, budget = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
options = OptimizeOptions(targets=("sm_90",), measure="analytic", budget=budget, dims=("batch=1:64",),
                          db=work / "tuning.db", cache_dir=work / "kernels", progress=False)
optimize(src, out, options, log=lambda _: None)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it would count the parent's memory
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": peak * 1024}))
"""


def build_chain(path: Path, hidden: int, layers: int, external: bool = True, seed: int = 0) -> int:
    """Write the model (weights external, in ``<file>.data``, or inline); returns the bytes of weights."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((hidden, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        x = f"h{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["batch", hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=data.name)
    return layers * hidden * hidden * 4


def peak_rss(src: Path, out: Path, work: Path, budget: int = 8) -> int:
    """Peak RSS (bytes) of a child process that runs optimize on ``src``."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), str(work), str(budget)],
                          capture_output=True, text=True, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        raise RuntimeError(f"optimize failed:\n{proc.stderr[-3000:]}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--inline", action="store_true", help="weights inside the .onnx file (< 2 GB)")
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    src, out = args.work / "chain.onnx", args.work / "chain.opt.onnx"
    weights = build_chain(src, args.hidden, args.layers, external=not args.inline)
    peak_rss(src, out, args.work, args.budget)  # warm the kernel cache: the second run measures no compile
    peak = peak_rss(src, out, args.work, args.budget)
    mib = 1024 ** 2
    kind = "inline" if args.inline else "external data"
    print(f"weights {weights / mib:.0f} MiB ({args.layers} x {args.hidden}x{args.hidden} float32, {kind}); "
          f"optimize peak RSS {peak / mib:.0f} MiB ({peak / weights:.2f}x the weights)")


if __name__ == "__main__":
    main()
