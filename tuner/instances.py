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
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping, Sequence

from dietcode_ort.errors import DietcodeError
from tuner.workload import Instance

__all__ = ["DimSpec", "cap_product", "MAX_INSTANCES", "MAX_DIM", "MAX_SHAPE_LOG_BYTES", "MAX_WEIGHT", "parse_dim_spec", "parse_dim_options",
           "merged_dims", "instances_from_dims", "instances_from_shape_log", "representative_shapes"]

_log = logging.getLogger(__name__)

# Bounds that keep tuning time and memory finite whatever the options say. Past MAX_INSTANCES a symbol's
# values (and the product over the symbols) are bucketed: evenly spaced representatives, ends included,
# each weighted by the values nearest to it, so the total weight is kept. A value past MAX_DIM is refused
# (kernels index with 32-bit ints: M*K of such a dim would overflow).
MAX_INSTANCES = 1024
MAX_DIM = 1 << 24
MAX_SHAPE_LOG_BYTES = 64 << 20  # parsed JSON takes about 10x its size in memory
MAX_WEIGHT = 1e12  # a weight or count past this is a typo, and products of such overflow to inf

# What the values are for, which words the bucketing notes: the tuner tunes for the representatives, each weighted
# by the values it stands for; bench (dietcode_ort.bench.parse_dims, which ignores weights) runs them only.
Purpose = Literal["tune", "bench"]
_NOTES: dict[str, tuple[str, str]] = {  # purpose -> (one symbol's values bucketed, the product bucketed)
    "tune": ("--dim %s: %d values; tuning for %d evenly spaced representatives, each weighted by the values nearest "
             "to it (at most %d instances are tuned)",
             "--dim: %d combinations of %s; tuning for %d (%s), each weighted by the values it stands for"),
    "bench": ("--dim %s: %d values; benchmarking %d evenly spaced ones, the ends included (at most %d shapes are "
              "benchmarked)",
              "--dim: %d combinations of %s; benchmarking %d of them (%s), evenly spaced over each symbol's values"),
}


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


def _check_value(value: int, option: str) -> int:
    """A dim's value: 0 is one (a KV-cache decoder's empty past at the first step); a workload whose product it
    empties leaves that shape out (``tuner.scan``'s ``_nonempty``)."""
    if value < 0:
        raise DietcodeError(f"--dim {option!r}: dims must be 0 or more, got {value}")
    if value > MAX_DIM:
        raise DietcodeError(f"--dim {option!r}: dims must be at most {MAX_DIM}, got {value}")
    return value


def _bucket(values: Sequence[int], weights: Sequence[float] | None, n: int) -> tuple[tuple[int, float], ...]:
    """``n`` evenly spaced representatives of sorted ``values`` (first and last included), each weighted
    by the summed weight of the values nearest to it (``weights`` None: weight 1 each). ``values`` may be
    a ``range``: nothing is materialized, so a range of any length costs O(n)."""
    count = len(values)
    if count <= n:
        return tuple(zip(values, weights if weights is not None else [1.0] * count))
    picks = [round(i * (count - 1) / (n - 1)) for i in range(n)] if n > 1 else [count // 2]
    prefix = list(itertools.accumulate(weights, initial=0.0)) if weights is not None else None
    out, lower = [], 0
    for i, idx in enumerate(picks):
        upper = (idx + picks[i + 1]) // 2 if i + 1 < len(picks) else count - 1
        weight = (prefix[upper + 1] - prefix[lower]) if prefix is not None else float(upper - lower + 1)
        out.append((values[idx], weight))
        lower = upper + 1
    return tuple(out)


def parse_dim_spec(option: str, purpose: Purpose = "tune") -> DimSpec:
    """Parse one ``NAME=SPEC`` option (see the module docstring); more than MAX_INSTANCES values are
    bucketed (and the output says so, in the words of ``purpose``)."""
    name, sep, spec = option.rpartition("=")  # a dim name may hold '=' (an exporter's text), SPEC never does
    name, spec = name.strip(), spec.strip()
    if not sep or not name or not spec:
        raise DietcodeError(f"--dim {option!r}: expected NAME=SPEC, e.g. seq=1:128, seq=1:128:8 or batch=1,4,8")
    values: tuple[tuple[int, float], ...]
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
        _check_value(lo, option)
        _check_value(hi, option)
        span = range(lo, hi + 1, step)
        values = _bucket(span, None, MAX_INSTANCES)
        _note_bucketed(name, len(span), len(values), purpose)
    else:
        merged: dict[int, float] = {}
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
                if not 1 / MAX_WEIGHT <= weight <= MAX_WEIGHT:  # a product of tiny ones would underflow to 0
                    raise DietcodeError(f"--dim {option!r}: weights must be positive and finite, at least "
                                        f"{1 / MAX_WEIGHT:g} and at most {MAX_WEIGHT:g}, got {weight_text}")
            value = _check_value(_int(value_text, option), option)
            merged[value] = merged.get(value, 0.0) + weight
        ordered = sorted(merged)
        values = _bucket(ordered, [merged[v] for v in ordered], MAX_INSTANCES)
        _note_bucketed(name, len(ordered), len(values), purpose)
    if not values:
        raise DietcodeError(f"--dim {option!r}: the range is empty")
    return DimSpec(name, values)


def _note_bucketed(name: str, given: int, kept: int, purpose: Purpose = "tune") -> None:
    if kept < given:
        _log.warning(_NOTES[purpose][0], name, given, kept, MAX_INSTANCES)


def cap_product(specs: dict[str, DimSpec], purpose: Purpose = "tune") -> dict[str, DimSpec]:
    """Bucket the symbols with the most values until the product over all symbols is <= MAX_INSTANCES."""
    counts = {n: len(s.values) for n, s in specs.items()}
    if math.prod(counts.values()) <= MAX_INSTANCES:
        return specs
    product = math.prod(counts.values())
    while math.prod(counts.values()) > MAX_INSTANCES:  # the widest symbol loses values, down to the next widest
        widest = max(counts, key=lambda n: (counts[n], n))  # at most: the product ends as close under the cap as
        rest = math.prod(counts.values()) // counts[widest]  # it can (halving the widest left 528 of 33 x 33)
        second = max((c for n, c in counts.items() if n != widest), default=1)
        counts[widest] = max(1, MAX_INSTANCES // rest, min(second, counts[widest] - 1))
    out = {}
    for n, spec in specs.items():
        if counts[n] < len(spec.values):
            values = [v for v, _ in spec.values]
            spec = DimSpec(n, _bucket(values, [w for _, w in spec.values], counts[n]))
        out[n] = spec
    _log.warning(_NOTES[purpose][1], product, ", ".join(specs), math.prod(counts.values()),
                 ", ".join(f"{n}: {c} values" for n, c in counts.items()))
    return out


def parse_dim_options(options: Sequence[str], symbols: Iterable[str], purpose: Purpose = "tune",
                      cap: bool = True) -> dict[str, DimSpec]:
    """Parse all ``--dim`` options against the model's symbols; unknown or repeated names are errors. ``purpose``
    words the notes of bucketed values: "tune" (the tuner's instances) or "bench" (the shapes bench runs).
    ``cap``: bucket the product over all the symbols to MAX_INSTANCES (``cap_product``); the tuner caps each
    workload's own symbols instead."""
    known = sorted(set(symbols))
    specs: dict[str, DimSpec] = {}
    for option in options:
        spec = parse_dim_spec(option, purpose)
        padded = [s for s in known if s.strip() == spec.name]
        if spec.name not in known and len(padded) == 1:  # a model's name with spaces around it
            spec = DimSpec(padded[0], spec.values)
        if spec.name not in known:
            raise DietcodeError(f"--dim names symbol {spec.name!r}, which the model does not have; "
                                f"its symbols are: {', '.join(known) or '(none)'}")
        if spec.name in specs:
            raise DietcodeError(f"--dim gives symbol {spec.name!r} twice")
        specs[spec.name] = spec
    return cap_product(specs, purpose) if cap else specs


def merged_dims(options: Sequence[str], merged: Mapping[str, str | int]) -> list[str]:
    """``--dim`` options with the values of each input dim that the graph makes equal to another
    (``x[batch, n] + y[batch, m]``: ``merged`` = ``{"m": "n"}``, tuner.scan ``ScanResult.merged``) given to the
    name shape inference kept, which the workloads' shapes name: ``m=16,32`` becomes ``n=16,32``. Both given with
    different values is an error; a dim found equal to a size (``{"k": 16}``) keeps that size, with a warning
    where its values differ (where the graph broadcasts, 1 is a value it may also take)."""
    def name(option: str) -> str:
        return option.rpartition("=")[0].strip()

    kept_of = {option: merged.get(name(option)) for option in options}
    relevant = {name(o): parse_dim_spec(o) for o, kept in kept_of.items() if kept is not None or name(o) in
                merged.values()}

    def values(spec: DimSpec) -> list[int]:
        return sorted({v for v, _ in spec.values})

    out: list[str] = []
    given: set[str] = set()
    for option in options:
        alias, kept = name(option), kept_of[option]
        if kept is None:
            out.append(option)
            continue
        spec = relevant[alias]
        if isinstance(kept, int):
            if values(spec) != [kept]:
                _log.warning("--dim %s: shape inference finds %r equal to %d where the graph combines it with that "
                             "size, so the tuned nodes see %d, not %s", alias, alias, kept, kept,
                             _show(values(spec)))
            continue
        others = [(n, s) for n, s in relevant.items() if n != alias and (n == kept or merged.get(n) == kept)]
        for other, other_spec in others:
            if values(other_spec) != values(spec):
                raise DietcodeError(f"--dim gives {alias!r} and {other!r} different values, but the model's graph "
                                    f"makes them one dim (kept as {kept!r}): give the values once (where one of "
                                    "them is 1 and the graph broadcasts it, give only the other)")
        if kept not in relevant and kept not in given:
            out.append(f"{kept}={option.rpartition('=')[2]}")
            given.add(kept)
    return out


def _show(values: Sequence[int]) -> str:
    return ", ".join(map(str, values[:6])) + (", ..." if len(values) > 6 else "")


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


def instances_from_shape_log(path: str | Path, input_dims: Mapping[str, Sequence[str | int | None]]
                             ) -> dict[tuple[tuple[str, int], ...], float]:
    """Read a shape log; return each observed assignment of the model's symbols with its count.

    ``input_dims`` maps each graph input to its dims: symbol names, sizes where fixed (a record must agree),
    None where neither is known.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DietcodeError(f"shape log not found: {path}") from None
    except OSError as exc:
        raise DietcodeError(f"shape log {path} cannot be read: {exc.strerror or exc}") from None
    if size > MAX_SHAPE_LOG_BYTES:
        raise DietcodeError(f"shape log {path} is {size >> 20} MiB, over the {MAX_SHAPE_LOG_BYTES >> 20} MiB "
                            "limit: aggregate repeated shapes into records with a \"count\"")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DietcodeError(f"shape log not found: {path}") from None
    except OSError as exc:
        raise DietcodeError(f"shape log {path} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise DietcodeError(f"shape log {path} is not valid JSON: {exc}") from None
    records = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(records, list) or not records:
        raise DietcodeError(f"shape log {path}: expected a non-empty list of {{input name: shape}} records")
    counts: dict[tuple[tuple[str, int], ...], float] = {}
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DietcodeError(f"shape log {path}: record {i} is not an object")
        count = record.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not 0 < count <= MAX_WEIGHT:
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
                    not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_DIM for d in shape):
                raise DietcodeError(f"shape log {path}: record {i}: input {name!r} needs a list of "
                                    f"{len(dims)} integers in 1..{MAX_DIM}, got {shape!r}")
            for axis, (symbol, value) in enumerate(zip(dims, shape)):
                if isinstance(symbol, int) and value != symbol:
                    raise DietcodeError(f"shape log {path}: record {i}: input {name!r} has {value} at axis {axis}, "
                                        f"where the model's size is {symbol} (a log of another model?)")
                if not isinstance(symbol, str):
                    continue
                if values.setdefault(symbol, value) != value:
                    raise DietcodeError(f"shape log {path}: record {i} gives symbol {symbol!r} two values "
                                        f"({values[symbol]} and {value})")
        key = tuple(sorted(values.items()))
        counts[key] = counts.get(key, 0.0) + float(count)
    if len(counts) > MAX_INSTANCES:
        frequent = MAX_INSTANCES // 4
        _log.warning("shape log %s: %d distinct shapes; tuning for %d representatives (the %d most frequent, the "
                     "others spread over the rest), each weighted by the calls of the shapes nearest to it",
                     path, len(counts), MAX_INSTANCES, frequent)
        counts = representative_shapes(counts, MAX_INSTANCES, frequent)
    return counts


Shape = tuple[tuple[str, int], ...]  # a symbol assignment, sorted by symbol


def representative_shapes(counts: Mapping[Shape, float], n: int, frequent: int) -> dict[Shape, float]:
    """``n`` of the shapes of ``counts`` (all of them when there are no more), each weighted by the summed counts
    of the shapes nearest to it, so the total is kept: the ``frequent`` most frequent first, then a shape with each
    symbol's smallest and largest value (the range tuned for is the log's), then, one at a time, the shape farthest
    from every one chosen (distance: Euclidean over the symbols' log2 values; a symbol a shape
    does not give counts as -1), so the ends and the gaps of the observed range are tuned for too, as --dim's
    evenly spaced representatives are. (Keeping the n most frequent alone tuned a log of 4096 equally frequent
    token counts for 1..1024 only.) Ties go to the smaller shape; the result is the same for the same counts."""
    import numpy as np

    keys = sorted(counts)
    if len(keys) <= n:
        return {k: counts[k] for k in keys}
    symbols = sorted({name for key in keys for name, _ in key})
    points = np.full((len(keys), len(symbols)), -1.0)
    for row, key in enumerate(keys):
        for name, value in key:
            points[row, symbols.index(name)] = math.log2(max(value, 1))
    weights = np.array([counts[k] for k in keys])
    order = sorted(range(len(keys)), key=lambda i: (-weights[i], i))
    chosen: list[int] = []
    distance = np.full(len(keys), np.inf)
    nearest = np.zeros(len(keys), dtype=np.int64)

    columns = [np.ascontiguousarray(points[:, c]) for c in range(len(symbols))]
    here, step = np.empty(len(keys)), np.empty(len(keys))

    def choose(row: int) -> None:  # squared distances suffice to compare; in place: a million shapes, 1024 times
        here.fill(0.0)
        for column in columns:
            np.subtract(column, column[row], out=step)
            np.multiply(step, step, out=step)
            np.add(here, step, out=here)
        closer = here < distance
        nearest[closer] = len(chosen)
        distance[closer] = here[closer]
        chosen.append(row)

    for row in order[:min(frequent, n)]:
        choose(row)
    for column in range(len(symbols)):  # each symbol's smallest and largest value: the range tuned for is the log's
        for row in (int(np.argmin(points[:, column])), int(np.argmax(points[:, column]))):
            if len(chosen) < n and row not in chosen:
                choose(row)
    while len(chosen) < n:
        choose(int(np.argmax(distance)))  # the first of equals: the smaller shape
    totals = np.bincount(nearest, weights=weights, minlength=len(chosen))
    return {keys[row]: float(total) for row, total in sorted(zip(chosen, totals), key=lambda rt: keys[rt[0]])}
