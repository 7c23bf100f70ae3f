"""Output of ``dietcode-ort bench``: the environment record, the table, the JSON file and the plot.

Kept apart from the measurement (dietcode_ort/bench.py) so each reads in one sitting; matplotlib and rich
are imported only when a plot or a table is made.
"""
from __future__ import annotations

import ctypes
import datetime
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dietcode_ort import __version__

if TYPE_CHECKING:
    from dietcode_ort.bench import BenchReport, ShapeResult

__all__ = ["cuda_device", "device_name", "environment", "write_json", "write_plot", "print_report"]


def cuda_device(device: int = 0) -> tuple[str, int, int] | None:
    """(name, major, minor) of CUDA device ``device`` as the driver (libcuda.so.1) reports them, or None
    without a driver or that device. It needs neither torch nor the custom-op library: the tuner asks it
    whether a GPU is there to time kernels on (``tuner.executor``), the benchmarks for the device's name."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    name = ctypes.create_string_buffer(256)
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    try:
        ok = (cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), device) == 0
              and cuda.cuDeviceGetName(name, 256, dev) == 0
              and cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0  # COMPUTE_CAPABILITY_MAJOR
              and cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0)  # COMPUTE_CAPABILITY_MINOR
    except AttributeError:  # a libcuda.so.1 without these entry points
        return None
    return (name.value.decode(errors="replace"), major.value, minor.value) if ok else None


def device_name(provider: str) -> str:
    """The GPU's name for cuda, the CPU model (from /proc/cpuinfo) for cpu."""
    if provider == "cuda":
        found = cuda_device()
        return found[0] if found else "unknown CUDA GPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def environment(provider: str, command: str) -> dict[str, str]:
    import onnxruntime as ort

    return {"device": device_name(provider), "provider": provider, "onnxruntime": ort.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "dietcode_ort": __version__,
            "platform": platform.platform(), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_json(report: BenchReport, path: Path) -> None:
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report.as_json(), indent=2) + "\n")


def write_plot(report: BenchReport, path: Path) -> None:
    """Latency (both models) and speedup against the swept symbol with the most values, one line per
    combination of the other symbols."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    symbols = [k for k, _ in report.shapes[0].dims]
    counts = {s: len({dict(r.dims)[s] for r in report.shapes}) for s in symbols}
    x_sym = max(symbols, key=lambda s: counts[s]) if symbols and max(counts.values()) > 1 else None
    groups: dict[str, list[ShapeResult]] = {}
    for r in report.shapes:
        rest = " ".join(f"{k}={v}" for k, v in r.dims if k != x_sym and counts[k] > 1)
        groups.setdefault(rest, []).append(r)
    fig, (lat, spd) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for i, (key, rows) in enumerate(groups.items()):  # one colour per group: stock dashed, dietcode solid
        xs = [dict(r.dims)[x_sym] for r in rows] if x_sym else list(range(len(rows)))
        suffix, colour = (f" ({key})" if key else ""), f"C{i % 10}"
        lat.plot(xs, [r.stock.median * 1e3 for r in rows], "o--", color=colour, label=f"stock{suffix}")
        lat.plot(xs, [r.optimized.median * 1e3 for r in rows], "o-", color=colour, label=f"dietcode{suffix}")
        spd.plot(xs, [r.speedup for r in rows], "o-", color=colour, label=key or "speedup")
    if not x_sym:
        spd.set_xticks(range(len(report.shapes)), [r.label for r in report.shapes], rotation=30, ha="right")
    spd.axhline(1.0, color="grey", lw=0.8)
    lat.set_ylabel("median latency (ms)")
    medians = [t.median for r in report.shapes for t in (r.stock, r.optimized)]
    if max(medians) > 10 * min(medians) > 0:  # wide sweeps: log scale, plain tick labels
        lat.set_yscale("log")
        lat.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        lat.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
        lat.set_ylim(0, max(medians) * 1e3 * 1.1)
    if len(groups) > 1:
        spd.legend(fontsize="small")
    spd.set_ylabel("speedup (stock / dietcode)")
    spd.set_xlabel(x_sym or "shape")
    lat.legend(fontsize="small")
    env = report.environment
    lat.set_title(f"{env.get('device', '')} / {env.get('provider', '')}  "
                  f"geomean speedup {report.geomean_speedup:.2f}x")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png", dpi=110)
    plt.close(fig)


def print_report(report: BenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e3:.3f}"

    table = Table(title=f"{report.environment['device']} / {report.environment['provider']} "
                        f"(median of {report.settings['repeat']}, ms)")
    table.add_column("shape", no_wrap=True)
    for col in ("stock", "dietcode", "speedup", "1st stock", "1st dietcode"):  # p90s are in the JSON
        table.add_column(col, justify="right")
    for s in report.shapes:
        table.add_row(s.label, ms(s.stock.median), ms(s.optimized.median), f"{s.speedup:.2f}x",
                      ms(s.stock.first_call), ms(s.optimized.first_call))
    console = Console()
    console.print(table)
    console.print("speedup: the median of the per-iteration ratios stock / dietcode")
    console.print(f"geometric-mean speedup {report.geomean_speedup:.3f}x over {len(report.shapes)} shapes; "
                  f"worst {report.worst.speedup:.3f}x at {report.worst.label}")
    if report.custom_nodes == 0:
        console.print("[yellow]note: the optimized model has no ai.dietcode nodes[/yellow]")
