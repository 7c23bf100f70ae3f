"""DietCode against torch.compile, shape by shape: joins a ``dietcode-ort bench --json`` file with a
``benchmarks/torch_compile.py --json`` file of the same sweep.

    python benchmarks/torch_report.py BENCH.json TORCH.json [--json OUT.json]

For every shape in both files (matched on the symbol values) and every PyTorch mode it prints the
steady-state ratio ``torch median / dietcode median`` (above 1: DietCode is faster; the same against stock
ORT is in the JSON), the first calls (torch's includes a recompile where dynamo recompiled: the frames
compiled are shown), and per mode the geometric mean over the shapes both measured, leaving out shapes
where the mode failed or disagreed with eager. Each mode's one-off compile (its first call, on the
warm-up shape) is listed apart. Files from different providers (cpu vs cuda) are refused; a different
device name or dtype is printed as a warning.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dietcode_ort.errors import DietcodeError  # noqa: E402  (the repository root must be on the path first)

__all__ = ["BENCH_SCHEMA", "TORCH_SCHEMA", "load", "join", "print_join", "main"]

BENCH_SCHEMA = "dietcode-ort-bench/1"
TORCH_SCHEMA = "dietcode-ort-torch-compile/1"


def load(path: Path, schema: str) -> dict[str, Any]:
    """A results file of ``schema``; a DietcodeError says what is wrong with it otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise DietcodeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise DietcodeError(f"{path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise DietcodeError(f"{path} is not a {schema} file (schema {got!r})")
    return data


def _key(dims: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((str(k), int(v)) for k, v in dims.items()))


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def join(bench: Mapping[str, Any], torch: Mapping[str, Any]) -> dict[str, Any]:
    """Per shape and mode: torch / dietcode and torch / stock ratios (steady state and first call), and
    per mode the geomean and the compile cost."""
    provider = bench.get("environment", {}).get("provider")
    device = torch.get("settings", {}).get("device")
    if provider != device:
        raise DietcodeError(f"the bench ran on {provider!r} and PyTorch on {device!r}: the files do not compare")
    warnings = []
    names = (bench["environment"].get("device"), torch.get("environment", {}).get("device"))
    if names[0] != names[1]:
        warnings.append(f"different devices: bench on {names[0]!r}, PyTorch on {names[1]!r}")
    dtype = torch["settings"].get("dtype", "")
    if ("fp16" in str(bench.get("settings", {}).get("model", ""))) != (dtype == "float16"):
        warnings.append(f"the bench's model {bench['settings'].get('model')!r} may not be {dtype}")
    modes = [m for m in torch.get("modes", {})]
    ours = {_key(s["dims"]): s for s in bench.get("shapes", [])}
    rows, unmatched = [], []
    for shape in torch.get("shapes", []):
        b = ours.get(_key(shape["dims"]))
        if b is None:
            unmatched.append(shape["dims"])
            continue
        row: dict[str, Any] = {"dims": shape["dims"], "dietcode_ms": b["optimized"]["median_ms"],
                               "stock_ms": b["stock"]["median_ms"],
                               "dietcode_first_call_ms": b["optimized"].get("first_call_ms"),
                               "stock_first_call_ms": b["stock"].get("first_call_ms"), "modes": {}}
        for m in modes:
            t = shape["modes"].get(m) or {}
            usable = t.get("median_ms") is not None and t.get("agrees") is not False and not t.get("error")
            row["modes"][m] = {
                "median_ms": t.get("median_ms"), "first_call_ms": t.get("first_call_ms"),
                "frames_compiled": t.get("frames_compiled", 0), "agrees": t.get("agrees"),
                "note": t.get("error") or t.get("skipped") or ("disagrees with eager" if t.get("agrees") is False
                                                               else None),
                "ratio_vs_dietcode": _ratio(t.get("median_ms"), row["dietcode_ms"]) if usable else None,
                "ratio_vs_stock": _ratio(t.get("median_ms"), row["stock_ms"]) if usable else None,
                "first_call_ratio_vs_dietcode": _ratio(t.get("first_call_ms"), row["dietcode_first_call_ms"])
                if usable else None}
        rows.append(row)
    summary = {}
    for m in modes:
        vs_ours = [r["modes"][m]["ratio_vs_dietcode"] for r in rows if r["modes"][m]["ratio_vs_dietcode"]]
        vs_stock = [r["modes"][m]["ratio_vs_stock"] for r in rows if r["modes"][m]["ratio_vs_stock"]]
        info = torch["modes"][m]
        summary[m] = {"shapes": len(vs_ours), "geomean_ratio_vs_dietcode": _geomean(vs_ours),
                      "geomean_ratio_vs_stock": _geomean(vs_stock),
                      "worst_ratio_vs_dietcode": min(vs_ours) if vs_ours else None,
                      "compile_ms": (info.get("compile") or {}).get("first_call_ms"),
                      "recompiles": info.get("recompiles"), "frames_compiled": info.get("frames_compiled")}
    return {"schema": "dietcode-ort-torch-join/1", "bench_command": bench["environment"].get("command"),
            "torch_command": torch.get("environment", {}).get("command"), "provider": provider,
            "device": names[0], "dtype": dtype, "warnings": warnings, "modes": modes, "rows": rows,
            "unmatched": unmatched, "summary": summary}


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_join(report: Mapping[str, Any], out: Any = sys.stdout) -> None:
    for w in report["warnings"]:
        print(f"warning: {w}", file=out)
    modes = report["modes"]
    print(f"{report['device']} / {report['provider']} / {report['dtype']}: PyTorch median / DietCode median "
          "(above 1: DietCode faster); first calls in ms, torch's recompiles in brackets", file=out)
    head = f"{'shape':<28}{'dietcode':>10}{'stock':>10}" + "".join(f"{m:>16}" for m in modes)
    print(head + "  first: dietcode / " + " / ".join(modes), file=out)
    for r in report["rows"]:
        label = " ".join(f"{k}={v}" for k, v in r["dims"].items())
        cells = "".join(f"{_f(r['modes'][m]['ratio_vs_dietcode'], '.2f') + 'x':>16}"
                        if r["modes"][m]["ratio_vs_dietcode"] is not None
                        else f"{(r['modes'][m]['note'] or '-')[:15]:>16}" for m in modes)
        firsts = " / ".join(f"{_f(r['modes'][m]['first_call_ms'], '.1f')}[{r['modes'][m]['frames_compiled']}]"
                            for m in modes)
        print(f"{label:<28}{_f(r['dietcode_ms'], '.3f'):>10}{_f(r['stock_ms'], '.3f'):>10}{cells}  "
              f"{_f(r['dietcode_first_call_ms'], '.1f')} / {firsts}", file=out)
    for m, s in report["summary"].items():
        print(f"{m}: geomean {_f(s['geomean_ratio_vs_dietcode'], '.3f')}x vs DietCode, "
              f"{_f(s['geomean_ratio_vs_stock'], '.3f')}x vs stock ORT over {s['shapes']} shapes; worst "
              f"{_f(s['worst_ratio_vs_dietcode'], '.3f')}x; compile {_f(s['compile_ms'], '.0f')} ms, "
              f"recompiles {s['recompiles']}", file=out)
    if report["unmatched"]:
        print(f"{len(report['unmatched'])} PyTorch shape(s) not in the bench file: "
              + "; ".join(" ".join(f"{k}={v}" for k, v in d.items()) for d in report["unmatched"]), file=out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", type=Path, help="dietcode-ort bench --json file")
    p.add_argument("torch", type=Path, help="benchmarks/torch_compile.py --json file")
    p.add_argument("--json", type=Path, help="write the joined figures here")
    args = p.parse_args(argv)
    try:
        report = join(load(args.bench, BENCH_SCHEMA), load(args.torch, TORCH_SCHEMA))
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_join(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
