"""Workload instances: which values the model's symbols take, and how often.

Two sources, both turned into ``Instance`` records (symbol values + weight):

- ``--dim NAME=SPEC`` options, SPEC being ``lo:hi`` (inclusive), ``lo:hi:step`` or a comma list
  ``v1,v2,...`` whose items may carry a weight as ``VALUE@WEIGHT``; the instances are the cartesian
  product over the symbols, each weighted by the product of its values' weights.
- a JSON log of observed input shapes: a list of records ``{input name: shape}`` (or
  ``{"shapes": [...]}``), each record may carry ``"count"``; repeated assignments become weights.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from dietcode_ort.errors import DietcodeError
from tuner.workload import Instance

__all__ = ["DimSpec", "parse_dim_spec", "parse_dim_options", "instances_from_dims", "instances_from_shape_log"]


@dataclass(frozen=True)
class DimSpec:
    """The values one symbol takes, each with a weight."""

    name: str
    values: tuple[tuple[int, float], ...]


def _int(text: str, option: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DietcodeError(f"--dim {option}: {text!r} is not an integer") from None


def parse_dim_spec(option: str) -> DimSpec:
    """Parse one ``NAME=SPEC`` option (see the module docstring)."""
    name, sep, spec = option.partition("=")
    name, spec = name.strip(), spec.strip()
    if not sep or not name or not spec:
        raise DietcodeError(f"--dim {option!r}: expected NAME=SPEC, e.g. seq=1:128, seq=1:128:8 or batch=1,4,8")
    values: list[tuple[int, float]]
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise DietcodeError(f"--dim {option!r}: a range is lo:hi or lo:hi:step")
        lo, hi = _int(parts[0], option), _int(parts[1], option)
        step = _int(parts[2], option) if len(parts) == 3 else 1
        if step <= 0:
            raise DietcodeError(f"--dim {option!r}: the step must be positive, got {step}")
        if hi < lo:
            raise DietcodeError(f"--dim {option!r}: the range is inverted ({lo} > {hi})")
        values = [(v, 1.0) for v in range(lo, hi + 1, step)]
    else:
        values = []
        for item in spec.split(","):
            item = item.strip()
            if not item:
                raise DietcodeError(f"--dim {option!r}: empty item in the list")
            value_text, _, weight_text = item.partition("@")
            weight = 1.0
            if weight_text:
                try:
                    weight = float(weight_text)
                except ValueError:
                    raise DietcodeError(f"--dim {option!r}: weight {weight_text!r} is not a number") from None
                if not weight > 0:
                    raise DietcodeError(f"--dim {option!r}: weights must be positive, got {weight_text}")
            values.append((_int(value_text, option), weight))
    if not values:
        raise DietcodeError(f"--dim {option!r}: the range is empty")
    bad = [v for v, _ in values if v <= 0]
    if bad:
        raise DietcodeError(f"--dim {option!r}: dims must be positive, got {bad[0]}")
    return DimSpec(name, tuple(values))


def parse_dim_options(options: Sequence[str], symbols: Iterable[str]) -> dict[str, DimSpec]:
    """Parse all ``--dim`` options against the model's symbols; unknown or repeated names are errors."""
    known = sorted(set(symbols))
    specs: dict[str, DimSpec] = {}
    for option in options:
        spec = parse_dim_spec(option)
        if spec.name not in known:
            raise DietcodeError(f"--dim names symbol {spec.name!r}, which the model does not have; "
                                f"its symbols are: {', '.join(known) or '(none)'}")
        if spec.name in specs:
            raise DietcodeError(f"--dim gives symbol {spec.name!r} twice")
        specs[spec.name] = spec
    return specs


def instances_from_dims(specs: Mapping[str, DimSpec], symbols: Sequence[str]) -> tuple[Instance, ...]:
    """The cartesian product of the given symbols' values, restricted to ``symbols`` (a workload's)."""
    missing = [s for s in symbols if s not in specs]
    if missing:
        raise DietcodeError(f"no values for symbol(s) {', '.join(missing)}: add --dim "
                            + " ".join(f"{s}=LO:HI" for s in missing))
    names = sorted(symbols)
    out = []
    for combo in itertools.product(*(specs[n].values for n in names)):
        weight = 1.0
        for _, w in combo:
            weight *= w
        out.append(Instance(tuple((n, v) for n, (v, _) in zip(names, combo)), weight))
    return tuple(out)


def instances_from_shape_log(path: str | Path, input_dims: Mapping[str, Sequence[str | None]]
                             ) -> dict[tuple[tuple[str, int], ...], float]:
    """Read a shape log; return each observed assignment of the model's symbols with its count.

    ``input_dims`` maps each graph input to its dims' symbol names (None for a fixed dim).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DietcodeError(f"shape log not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise DietcodeError(f"shape log {path} is not valid JSON: {exc}") from None
    records = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(records, list) or not records:
        raise DietcodeError(f"shape log {path}: expected a non-empty list of {{input name: shape}} records")
    counts: dict[tuple[tuple[str, int], ...], float] = {}
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DietcodeError(f"shape log {path}: record {i} is not an object")
        count = record.get("count", 1)
        if not isinstance(count, (int, float)) or count <= 0:
            raise DietcodeError(f"shape log {path}: record {i} has a bad count {count!r}")
        values: dict[str, int] = {}
        for name, shape in record.items():
            if name == "count":
                continue
            if name not in input_dims:
                raise DietcodeError(f"shape log {path}: record {i} names input {name!r}, which the model does "
                                    f"not have; its inputs are: {', '.join(input_dims)}")
            dims = input_dims[name]
            if not isinstance(shape, list) or len(shape) != len(dims) or \
                    not all(isinstance(d, int) and d > 0 for d in shape):
                raise DietcodeError(f"shape log {path}: record {i}: input {name!r} needs a list of "
                                    f"{len(dims)} positive integers, got {shape!r}")
            for symbol, value in zip(dims, shape):
                if symbol is None:
                    continue
                if values.setdefault(symbol, value) != value:
                    raise DietcodeError(f"shape log {path}: record {i} gives symbol {symbol!r} two values "
                                        f"({values[symbol]} and {value})")
        key = tuple(sorted(values.items()))
        counts[key] = counts.get(key, 0.0) + float(count)
    return counts
