"""End-to-end latency of an optimized model against the original, shape by shape.

``dietcode-ort bench MODEL --optimized OPT`` answers the question the project exists for: is the
``ai.dietcode`` model faster than stock ONNX Runtime on the shapes that matter, and by how much. The
protocol is built so the comparison is fair:

- both models run on the same provider; the optimized one has the custom-op library registered;
- every shape's outputs are checked against the original's (dtype-aware tolerance) before any
  steady-state timing, so a fast but wrong kernel never gets a speedup figure (the check reads the
  first calls' outputs: no extra runs, and no shape is seen before its first call is timed);
- first-call latency is measured on a shape each session has not seen, after one warm-up run on a
  different shape (that is where ORT's CUDA EP runs its cuDNN search and a tuned model should not);
- steady-state repetitions alternate ABBA between the two models so machine drift hits both alike;
- on CUDA, inputs are copied to the device once and outputs are bound on the device (I/O binding),
  so host copies are not timed;
- intra-op thread spinning is off in both sessions: with two sessions alternating, an idle session's
  spinning threads would steal cores from the one being timed.

Symbols not swept with ``--dim`` take a default from :data:`DEFAULT_DIMS` (first matching pattern).
"""
from __future__ import annotations

import functools
import logging
import math
import re
import time
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Protocol, Sequence

import numpy as np

from dietcode_ort.bench_report import environment, print_report, write_json, write_plot
from dietcode_ort.errors import DietcodeError, check_model_file

__all__ = ["DEFAULT_DIMS", "PROVIDERS", "TOLERANCES", "BenchOptions", "InputSpec", "ModelInfo", "Timing",
           "ShapeResult", "BenchReport", "parse_dims", "merged_ties", "model_ties", "sweep", "unnamed_dim", "dim_names_taken",
           "warmup_shape", "make_feeds", "load_model_info", "model_info", "check_compatible", "check_agreement",
           "OrtRunner", "measure", "run_bench", "bench_command"]

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
# (regex on the symbol name, default value): batch-like dims 1, sequence-like 128, image sides 224.
DEFAULT_DIMS: tuple[tuple[str, int], ...] = (
    (r"batch|^n$|^b$", 1), (r"seq|len|token", 128), (r"height|width|size|^h$|^w$", 224))
FALLBACK_DIM = 1
# dtype name -> (rtol, atol) for the agreement check; integer and bool outputs must match exactly.
TOLERANCES = {"float32": (1e-3, 1e-3), "float64": (1e-3, 1e-3), "float16": (2e-2, 2e-2), "bfloat16": (6e-2, 6e-2)}
# ONNX element types of the narrow floats a model may compute in behind float32 inputs and outputs (a model made
# float16 with keep_io_types, onnxconverter-common's and onnxruntime.transformers' float16 conversion)
_NARROW = {10: "float16", 16: "bfloat16"}
_SMALL_VOCAB = 2  # index range for int inputs whose embedding table cannot be found
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchOptions:
    """Everything ``bench`` needs, read at the CLI edge."""

    model: Path
    optimized: Path
    dims: tuple[str, ...] = ()         # NAME=SPEC strings
    ties: tuple[str, ...] = ()         # NAME=OTHER or NAME=A+B: NAME takes OTHER's value (the sum) in every shape
    provider: str = "cpu"
    repeat: int = 20
    warmup: int = 3
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None
    command: str = ""
    with_library: bool = False  # register the library even on the CPU EP (see runtime.library_needed)


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype name and dims (int, or a symbol name)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What bench reads from a model file without its weights."""

    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    vocab: tuple[tuple[str, int], ...]  # int input -> rows of the embedding table it indexes
    custom_nodes: int                   # nodes in the ai.dietcode domain
    # the narrowest float the graph holds or casts to ("float16", "bfloat16"; "" for none): the agreement check
    # allows that dtype's error on every float output (a float16 model with float32 inputs and outputs)
    computes_in: str = ""

    @property
    def symbols(self) -> list[str]:
        return sorted({d for spec in self.inputs for d in spec.dims if isinstance(d, str)})


@dataclass(frozen=True)
class Timing:
    """One model's latencies at one shape, in seconds."""

    times: tuple[float, ...]
    first_call: float | None  # None when the shape served as the session's warm-up

    @property
    def median(self) -> float:
        return float(np.median(self.times))

    @property
    def p90(self) -> float:
        return float(np.percentile(self.times, 90))

    def as_json(self) -> dict[str, Any]:
        return {"times_ms": [t * 1e3 for t in self.times], "median_ms": self.median * 1e3,
                "p90_ms": self.p90 * 1e3,
                "first_call_ms": None if self.first_call is None else self.first_call * 1e3}


@dataclass(frozen=True)
class ShapeResult:
    """Both models at one assignment of the symbols."""

    dims: tuple[tuple[str, int], ...]
    stock: Timing
    optimized: Timing
    max_abs_error: tuple[tuple[str, float], ...]

    @property
    def speedup(self) -> float:
        """The median of the per-iteration ratios stock / optimized: ``measure`` times both models in each
        iteration (ABBA), so each ratio compares calls made under the same load. On a CPU whose calls fall
        into two latency modes (ORT's intra-op threads on shared cores) the ratio of the two medians jumps
        by the ratio of the modes when the medians land in different ones; the paired median does not.
        Unpaired timings (different counts) give the ratio of the medians."""
        stock, optimized = np.asarray(self.stock.times), np.asarray(self.optimized.times)
        if len(stock) != len(optimized) or not len(stock) or not np.all(optimized > 0):
            return self.speedup_of_medians
        return float(np.median(stock / optimized))

    @property
    def speedup_of_medians(self) -> float:
        return self.stock.median / self.optimized.median if self.optimized.median > 0 else math.inf

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dims)


@dataclass(frozen=True)
class BenchReport:
    """The results plus what is needed to reproduce and compare them."""

    environment: dict[str, str]
    settings: dict[str, Any]
    shapes: tuple[ShapeResult, ...]
    custom_nodes: int = 0

    @property
    def geomean_speedup(self) -> float:
        return float(np.exp(np.mean(np.log([s.speedup for s in self.shapes]))))

    @property
    def worst(self) -> ShapeResult:
        return min(self.shapes, key=lambda s: s.speedup)

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": "dietcode-ort-bench/1", "environment": self.environment, "settings": self.settings,
            "optimized_custom_nodes": self.custom_nodes,
            "shapes": [{"dims": dict(s.dims), "stock": s.stock.as_json(), "optimized": s.optimized.as_json(),
                        "speedup": s.speedup, "speedup_of_medians": s.speedup_of_medians,
                        "max_abs_error": dict(s.max_abs_error)} for s in self.shapes],
            "summary": {"geomean_speedup": self.geomean_speedup,
                        "worst": {"dims": dict(self.worst.dims), "speedup": self.worst.speedup}},
        }


# --- shapes -------------------------------------------------------------------------------------------

def parse_dims(options: Sequence[str], symbols: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``--dim NAME=SPEC`` options -> values per symbol, with the tuner's parser (same syntax everywhere:
    lo:hi inclusive, lo:hi:step, or v1,v2,... whose VALUE@WEIGHT weights bench ignores), and its cap: past
    MAX_INSTANCES shapes, evenly spaced values (its notes say how many shapes bench runs)."""
    from tuner.instances import parse_dim_options

    return {name: tuple(dict.fromkeys(v for v, _ in spec.values))
            for name, spec in parse_dim_options(options, symbols, purpose="bench").items()}


def _default_dim(symbol: str) -> int:
    for pattern, value in DEFAULT_DIMS:
        if re.search(pattern, symbol, re.IGNORECASE):
            return value
    return FALLBACK_DIM


def parse_ties(ties: Sequence[str], symbols: Sequence[str]) -> dict[str, tuple[str | int, ...]]:
    """``--tie NAME=OTHER`` options: NAME takes OTHER's value, or the sum of several terms, symbols or sizes
    (``attention_mask_sequence_length=past_sequence_length+sequence_length``: a merged decoder's mask spans the past
    and the new tokens)."""
    tied: dict[str, tuple[str | int, ...]] = {}
    for t in ties:
        name, _, other = (p.strip() for p in t.partition("="))
        terms = tuple(int(x) if x.isdigit() else x for x in (p.strip() for p in other.split("+")))
        if not name or not other or "" in terms:
            raise DietcodeError(f"bad --tie {t!r}: expected NAME=OTHER or NAME=A+B+... (symbols or sizes)")
        for symbol in (name, *(x for x in terms if isinstance(x, str))):
            if symbol not in symbols:
                raise DietcodeError(f"symbol {symbol!r} is not a dim of the model's inputs; its symbols are: "
                                    f"{', '.join(symbols) or '(none)'}")
        tied[name] = terms
    return tied


def merged_ties(merged: Mapping[str, str | int], dims: Sequence[str], ties: Sequence[str]) -> tuple[str, ...]:
    """``--tie`` options for the input dims the graph makes equal (``x[batch, n] + y[batch, m]``: ``merged`` =
    ``{"m": "n"}``, tuner.scan ``ScanResult.merged``), so that a sweep of one never feeds the model shapes it
    refuses: each set of equal dims follows the one of them ``--dim`` sweeps (else the one shape inference kept),
    and a dim found equal to a size takes that size unless swept. A set of which ``--dim`` sweeps two is an
    error; a set one of whose dims a ``--tie`` names is left as the options say."""
    def name(option: str) -> str:
        return option.partition("=")[0].strip()

    swept = {name(o) for o in dims}
    tied = {x.strip() for t in ties for x in re.split(r"[=+]", t)}  # tied or followed
    sets: dict[str | int, list[str]] = {}
    for alias, kept in merged.items():
        sets.setdefault(kept, [kept] if isinstance(kept, str) else []).append(alias)
    out: list[str] = []
    for kept, members in sets.items():
        if tied.intersection(members):
            continue
        lead = [m for m in members if m in swept]
        if len(lead) > 1:
            raise DietcodeError(f"--dim gives both {lead[0]!r} and {lead[1]!r}, which the graph makes equal (shape "
                                f"inference finds {', '.join(members)} the same dim): give one and the others "
                                "follow it, or give the others a size with --tie NAME=SIZE")
        target = lead[0] if lead else kept
        out += [f"{m}={target}" for m in members if m != target and m not in swept]
    return tuple(out)


def model_ties(path: Path, dims: Sequence[str], ties: Sequence[str]) -> tuple[tuple[str, ...], dict[str, str | int]]:
    """``ties`` and the :func:`merged_ties` of the model's input dims that ``scan`` finds the graph makes equal
    (``ScanResult.merged``, also returned); no more than ``ties``, with a note, where the tuner cannot scan it."""
    from tuner.scan import scan

    try:
        merged = scan(path).merged
    except DietcodeError as exc:
        _log.warning("the sweep does not tie the input dims the graph makes equal: scan fails on %s (%s); give "
                     "--tie where two inputs share a dim under different names", path, exc)
        return tuple(ties), {}
    return (*ties, *merged_ties(merged, dims, ties)), merged


def _tied_value(terms: tuple[str | int, ...], shape: Mapping[str, int]) -> int:
    return sum(shape[x] if isinstance(x, str) else x for x in terms)


def sweep(symbols: Sequence[str], dims: Sequence[str], ties: Sequence[str] = ()) -> list[dict[str, int]]:
    """The cartesian product over the ``--dim`` symbols; the others take defaults or follow a tie."""
    return _sweep(symbols, dims, ties)[0]


def _sweep(symbols: Sequence[str], dims: Sequence[str], ties: Sequence[str]) -> tuple[list[dict[str, int]], list[str]]:
    """``sweep``'s shapes, and the symbols whose values the ``--dim`` options gave (``warmup_shape``'s ``bounded``)."""
    swept = parse_dims(dims, symbols)
    tied = parse_ties(ties, symbols)
    for name, terms in tied.items():
        if name in swept or any(x in tied for x in terms):
            raise DietcodeError(f"--tie {name}={'+'.join(map(str, terms))}: {name} must not be swept and what it "
                                "follows must not be tied itself")
    free = [s for s in symbols if s not in swept and s not in tied]
    names = list(swept)
    shapes = []
    for values in product(*swept.values()):
        shape = dict(zip(names, values)) | {s: _default_dim(s) for s in free}
        shape |= {name: _tied_value(terms, shape) for name, terms in tied.items()}
        shapes.append({s: shape[s] for s in symbols})
    return shapes, names


def warmup_shape(shapes: Sequence[Mapping[str, int]], ties: Sequence[str] = (),
                 bounded: Collection[str] | None = None) -> dict[str, int]:
    """The shape each session runs once before the sweep (``measure``); per symbol, the first that applies:

    1. one below the smallest swept value, when that is above 1;
    2. the smallest value between the swept ones that none takes (a list, a step or a bucketed range leaves
       such gaps), 1 or more;
    3. one above the largest, for a symbol not in ``bounded`` (None: every symbol is bounded);
    4. else the smallest swept value above 0 (0 where there is none).

    Tied symbols follow their terms."""
    # Why this shape: the warm-up run pays what a session pays once (arena growth, lazy initialisation, loading
    # kernels), so that each swept shape's timed first call shows what a shape new to the session costs (the CUDA
    # EP's per-shape cuDNN algorithm search, which a tuned model should not need). For that the warm-up must not
    # pre-warm any swept shape: in each symbol it takes a value no swept shape takes, so that no node whose shape
    # follows one symbol has met its value. Below the sweep is the cheapest such value (1). A batch of 1 or an
    # empty past has none below; a gap inside the sweep (2) keeps the warm-up within the values asked for. Past
    # the largest value (3) only for a symbol bench gave a default (``run_bench`` bounds those given with --dim):
    # the largest value the user gave is where the model may stop working (memory, a position table's rows), so
    # bench never runs past it, not even untimed. A bounded symbol with no unseen value shares one with some swept
    # shapes (4), and ``measure`` leaves out the first call of a swept shape the warm-up shape equals. Never 0
    # where a size is swept: an empty tensor warms nothing.
    tied = parse_ties(ties, list(shapes[0]))
    warm: dict[str, int] = {}
    for sym in shapes[0]:
        seen = sorted({s[sym] for s in shapes})
        gap = next((max(a + 1, 1) for a, b in zip(seen, seen[1:]) if max(a + 1, 1) < b), None)
        if seen[0] > 1:
            warm[sym] = seen[0] - 1
        elif gap is not None:
            warm[sym] = gap
        elif bounded is not None and sym not in bounded:
            warm[sym] = seen[-1] + 1
        else:
            warm[sym] = next((v for v in seen if v > 0), 0)
    return warm | {name: _tied_value(terms, warm) for name, terms in tied.items()}


# --- inputs -------------------------------------------------------------------------------------------

def _nodes(graph: Any) -> list[Any]:
    """The graph's nodes and those of its subgraphs (If branches: a merged decoder's embedding is in both)."""
    from dietcode_ort.bundle import subgraphs

    return [m for node in graph.node for m in [node, *(n for g in subgraphs(node) for n in _nodes(g))]]


def _find_vocab(graph: Any, name: str, initializers: Mapping[str, Any]) -> int | None:
    """Rows of the initializer a Gather indexes with ``name`` (following Cast/Reshape/... on the way), in the graph
    or its subgraphs."""
    frontier, seen = [name], set()
    nodes = _nodes(graph)
    while frontier:
        cur = frontier.pop()
        seen.add(cur)
        for node in nodes:
            if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == cur \
                    and node.input[0] in initializers and initializers[node.input[0]].dims:
                return int(initializers[node.input[0]].dims[0])
            if node.op_type in _PASS_THROUGH and node.input and node.input[0] == cur:
                frontier.extend(o for o in node.output if o not in seen)
    return None


def unnamed_dim(input_name: str, axis: int, taken: "set[str] | None" = None) -> str:
    """The name a dynamic input dim without one goes by (skl2onnx writes such dims): ``<input>_dim<axis>``, in bench
    as in ``scan`` and ``optimize`` (tuner.scan.prepare_graph names them so), with "_" appended while it is a name
    in ``taken`` (the model's own dim names and those given before it: the graph's inputs in order, axes in order;
    the name is added), so that no dim takes another's name."""
    name = f"{input_name}_dim{axis}"
    while taken is not None and name in taken:
        name += "_"
    if taken is not None:
        taken.add(name)
    return name


def dim_names_taken(graph: Any) -> set[str]:
    """The dim names of the graph's inputs (not those that are initializers): what ``unnamed_dim`` must not give."""
    inits = {t.name for t in graph.initializer}
    return {d.dim_param for vi in graph.input if vi.name not in inits and vi.type.HasField("tensor_type")
            for d in vi.type.tensor_type.shape.dim if d.dim_param}


def load_model_info(path: Path) -> ModelInfo:
    """Inputs, outputs, embedding sizes and custom-node count, read without external weights."""
    import onnx

    check_model_file(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types on a bad file
        raise DietcodeError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise DietcodeError(f"{path} is not a readable ONNX model (its graph has no nodes)")
    return model_info(model)


def model_info(model: Any) -> ModelInfo:
    """:func:`load_model_info` of a model already in memory (an ``onnx.ModelProto``)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = []
    taken = dim_names_taken(graph)
    for value in graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        dtype = np.dtype(tensor_dtype_to_np_dtype(tensor.elem_type)).name
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or unnamed_dim(value.name, i, taken))
                     for i, d in enumerate(tensor.shape.dim))
        inputs.append(InputSpec(value.name, dtype, dims))
    vocab = tuple((s.name, v) for s in inputs if s.dtype.startswith("int")
                  for v in [_find_vocab(graph, s.name, inits)] if v)
    from dietcode_ort.bundle import dietcode_nodes

    return ModelInfo(tuple(inputs), tuple(o.name for o in graph.output), vocab, len(dietcode_nodes(model)),
                     _computes_in(graph))


def _computes_in(graph: Any) -> str:
    """The narrowest float of the main graph's weights, values and Casts (``_NARROW``), "" when none is."""
    types = {t.data_type for t in graph.initializer}
    types |= {v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types |= {a.i for n in graph.node if n.op_type == "Cast" and n.domain in ("", "ai.onnx")
              for a in n.attribute if a.name == "to"}
    narrow = [_NARROW[t] for t in sorted(types) if t in _NARROW]
    return max(narrow, key=lambda name: TOLERANCES[name], default="")


def check_compatible(stock: ModelInfo, optimized: ModelInfo) -> None:
    """The optimized model must take and return exactly what the original does (names, dtypes, ranks)."""
    a = {s.name: s for s in stock.inputs}
    b = {s.name: s for s in optimized.inputs}
    if set(a) != set(b):
        raise DietcodeError(f"optimized model's inputs {sorted(b)} do not match the original's {sorted(a)}")
    for name, spec in a.items():
        other = b[name]
        if (spec.dtype, len(spec.dims)) != (other.dtype, len(other.dims)):
            raise DietcodeError(f"input {name!r}: original is {spec.dtype} rank {len(spec.dims)}, "
                                f"optimized is {other.dtype} rank {len(other.dims)}")
    if set(stock.outputs) != set(optimized.outputs):
        raise DietcodeError(f"optimized model's outputs {sorted(optimized.outputs)} do not match the "
                            f"original's {sorted(stock.outputs)}")


def make_feeds(info: ModelInfo, shape: Mapping[str, int], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs for one shape: ids in [0, vocab), masks ones with a few trailing zeros, floats N(0, 1).

    The seed combines ``seed`` and the shape, so a shape gets the same data whatever else is swept."""
    rng = np.random.default_rng([seed, *shape.values()])
    vocab = dict(info.vocab)
    feeds = {}
    for spec in info.inputs:
        dims = tuple(d if isinstance(d, int) else shape[d] for d in spec.dims)
        if "mask" in spec.name.lower():
            arr = np.ones(dims, dtype=spec.dtype)
            if arr.ndim:
                last = dims[-1]
                rows = arr.reshape(-1, last)
                for i, row in enumerate(rows):
                    zeros = min(1 + i % 3, last // 4)
                    if zeros:
                        row[last - zeros:] = 0
        elif spec.dtype.startswith(("int", "uint")):
            arr = rng.integers(0, vocab.get(spec.name, _SMALL_VOCAB), size=dims).astype(spec.dtype)
        elif spec.dtype == "bool":
            arr = np.ones(dims, dtype=bool)
        else:
            arr = rng.standard_normal(dims).astype(spec.dtype)
        feeds[spec.name] = arr
    return feeds


def _as_array(value: Any) -> tuple[str, np.ndarray]:
    """An output as (its structure, its values as one array): a tensor as itself; a sequence or map (skl2onnx's
    ZipMap writes a list of {label: probability}) as its items in order, keys included in the structure."""
    if isinstance(value, np.ndarray):
        return "", value
    if isinstance(value, dict):
        items = [(repr(k), *_as_array(value[k])) for k in sorted(value)]
    elif isinstance(value, (list, tuple)):
        items = [("", *_as_array(v)) for v in value]
    else:
        return "", np.asarray(value)
    structure = "[" + ",".join(f"{k}:{s}{a.dtype}{list(a.shape)}" for k, s, a in items) + "]"
    arrays = [a.reshape(-1) for _, _, a in items]
    return structure, (np.concatenate(arrays) if arrays else np.zeros(0, np.float32))


def check_agreement(shape_label: str, reference: Mapping[str, Any],
                    candidate: Mapping[str, Any], computes_in: str = "") -> dict[str, float]:
    """Max abs error per output; raises DietcodeError when any output is outside its dtype's tolerance, or for a
    float output of a model that computes in a narrower float (``computes_in``, ``ModelInfo.computes_in``), that
    float's: the two models round differently where the optimized one fuses an epilogue the original rounds
    between nodes. A sequence or map output is compared item by item (``_as_array``)."""
    errors = {}
    for name, ref_value in reference.items():
        (ref_structure, ref), (structure, got) = _as_array(ref_value), _as_array(candidate[name])
        if structure != ref_structure:
            raise DietcodeError(f"shape {shape_label}: output {name!r} has another structure in the optimized "
                                f"model than in the original (its sequence or map items)")
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise DietcodeError(f"shape {shape_label}: output {name!r} is {got.dtype}{list(got.shape)} in "
                                f"the optimized model, {ref.dtype}{list(ref.shape)} in the original")
        kind = ref.dtype.name
        if ref.dtype.kind in "fc" and TOLERANCES.get(computes_in, (0.0, 0.0)) > TOLERANCES.get(kind, (0.0, 0.0)):
            kind = computes_in
        rtol, atol = TOLERANCES.get(kind, (0.0, 0.0))
        if ref.dtype.kind in "fc":
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            bad = ~np.isclose(got, ref, rtol=rtol, atol=atol, equal_nan=True)
            err = float(np.nanmax(diff)) if diff.size else 0.0
        else:
            bad = got != ref
            err = float(np.abs(got.astype(np.int64) - ref.astype(np.int64)).max()) if ref.size else 0.0
        if bad.any():
            raise DietcodeError(f"optimized model disagrees with the original at shape {shape_label}: output "
                                f"{name!r} max abs error {err:.4g} at {int(bad.sum())} of {bad.size} "
                                f"elements (tolerance for {kind}: rtol={rtol:g}, atol={atol:g})")
        errors[name] = err
    return errors


# --- running ------------------------------------------------------------------------------------------

class Prepared(Protocol):
    """One model bound to one shape's inputs: ``run`` is what gets timed, ``outputs`` copies to host."""

    def run(self) -> None: ...

    def outputs(self) -> dict[str, np.ndarray]: ...


class Runner(Protocol):
    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Prepared: ...


@dataclass
class _HostCall:
    session: Any
    feeds: dict[str, np.ndarray]
    names: list[str]
    result: list[np.ndarray] = field(default_factory=list)

    def run(self) -> None:  # timed: nothing here but the session call
        self.result = self.session.run(self.names, self.feeds)

    def outputs(self) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.result))


@dataclass
class _DeviceCall:
    session: Any
    binding: Any

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def outputs(self) -> dict[str, np.ndarray]:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.binding.copy_outputs_to_cpu()))


class OrtRunner:
    """An InferenceSession on one provider; ``register`` adds the custom-op library to its options; with
    ``profile`` (a file prefix) ORT's own profiler records every run until ``session.end_profiling()``."""

    def __init__(self, path: Path, provider: str, register: Callable[[Any], Any] | None = None, *,
                 profile: str | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # Two sessions alternate: an idle one's spinning intra-op threads would steal cores from the other.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if profile is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile
        if register is not None:
            register(options)
        try:
            self.session = ort.InferenceSession(str(path), options, providers=PROVIDERS[provider])
        except Exception as exc:  # ORT's pybind errors share no useful base class
            raise DietcodeError(f"onnxruntime cannot load {path} on {provider}: {exc}") from exc
        wanted = PROVIDERS[provider][0]
        if wanted not in self.session.get_providers():
            raise DietcodeError(f"{wanted} could not be initialised for {path} (no GPU or CUDA libraries "
                                f"missing?); the session runs on {self.session.get_providers()}")
        self.device = "cuda" if provider == "cuda" else "cpu"

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Prepared:
        # an output that is no tensor (skl2onnx's ZipMap: a sequence of maps) cannot be bound on the device nor
        # read back from a binding: such a model runs through session.run on either provider (copies included,
        # for both models alike)
        tensors = all(o.type.startswith("tensor(") for o in self.session.get_outputs())
        if self.device == "cpu" or not tensors:
            return _HostCall(self.session, dict(feeds), [o.name for o in self.session.get_outputs()])
        import onnxruntime as ort

        binding = self.session.io_binding()
        for name, arr in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
        for out in self.session.get_outputs():
            binding.bind_output(out.name, "cuda", 0)
        return _DeviceCall(self.session, binding)


def _label(shape: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _guarded(which: str, shape: Mapping[str, int], fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except DietcodeError:
        raise
    except Exception as exc:  # ORT's pybind errors (Fail, InvalidArgument, ...) share no useful base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DietcodeError(f"the {which} model rejects shape {_label(shape)}: {first}") from exc


def _timed(clock: Callable[[], float], call: Prepared) -> float:
    start = clock()
    call.run()
    return clock() - start


def measure(stock: Runner, optimized: Runner, shapes: Sequence[Mapping[str, int]],
            feeds_for: Callable[[Mapping[str, int]], Mapping[str, np.ndarray]], *, repeat: int, warmup: int,
            warm_shape: Mapping[str, int] | None = None, computes_in: str = "",
            clock: Callable[[], float] = time.perf_counter) -> list[ShapeResult]:
    """Warm up, then first call + agreement check for every shape (``check_agreement``, ``computes_in``), then
    interleaved steady state."""
    runners = {"stock": stock, "optimized": optimized}
    skip_first = None  # index of a swept shape that had to serve as the warm-up (first call not fresh)
    try:
        if warm_shape is None:  # a model without symbols has only one shape
            raise DietcodeError("no warm-up shape")
        warm_feeds = feeds_for(warm_shape)
        for which, runner in runners.items():
            _guarded(which, warm_shape, runner.prepare(warm_feeds).run)
        # a warm-up shape bounded to the user's values may be one of the swept shapes (warmup_shape, rule 4)
        skip_first = next((i for i, shape in enumerate(shapes) if dict(shape) == dict(warm_shape)), None)
    except DietcodeError:  # the model rejects the extra shape: warm up on the first swept one instead
        skip_first = 0
        for which, runner in runners.items():
            _guarded(which, shapes[0], runner.prepare(feeds_for(shapes[0])).run)
    first: list[dict[str, float | None]] = []
    errors: list[dict[str, float]] = []
    for i, shape in enumerate(shapes):
        feeds = feeds_for(shape)
        calls = {which: r.prepare(feeds) for which, r in runners.items()}
        order = ["stock", "optimized"] if i % 2 == 0 else ["optimized", "stock"]
        times: dict[str, float] = {}
        for w in order:
            try:
                times[w] = _guarded(w, shape, functools.partial(_timed, clock, calls[w]))
            except DietcodeError:
                if w == "optimized" and "stock" not in times:  # blame the original when it fails too
                    _guarded("stock", shape, calls["stock"].run)
                raise
        first.append({w: None if i == skip_first else times[w] for w in runners})
        errors.append(check_agreement(_label(shape), calls["stock"].outputs(), calls["optimized"].outputs(),
                                      computes_in))
    results = []
    for shape, fc, err in zip(shapes, first, errors):
        feeds = feeds_for(shape)
        calls = {which: r.prepare(feeds) for which, r in runners.items()}
        samples: dict[str, list[float]] = {"stock": [], "optimized": []}
        for i in range(warmup + repeat):  # ABBA: each pair of iterations runs both models in both orders
            for w in (("stock", "optimized") if i % 2 == 0 else ("optimized", "stock")):
                t = _guarded(w, shape, functools.partial(_timed, clock, calls[w]))
                if i >= warmup:
                    samples[w].append(t)
        results.append(ShapeResult(tuple(shape.items()),
                                   Timing(tuple(samples["stock"]), fc["stock"]),
                                   Timing(tuple(samples["optimized"]), fc["optimized"]), tuple(err.items())))
    return results


# --- entry points -------------------------------------------------------------------------------------

def _library_register() -> Callable[[Any], Any]:
    try:
        from dietcode_ort.runtime import register
    except ImportError as exc:
        raise DietcodeError("the custom-op runtime (dietcode_ort.runtime.register) is not available: "
                            f"{exc}") from exc
    return register


def run_bench(options: BenchOptions, *, register: Callable[[Any], Any] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> BenchReport:
    """Validate, build both sessions, measure every shape. ``register`` defaults to the project's
    custom-op library; tests pass their own."""
    import onnxruntime as ort

    if options.provider not in PROVIDERS:
        raise DietcodeError(f"unknown provider {options.provider!r}; choose one of {', '.join(PROVIDERS)}")
    available = ort.get_available_providers()
    if PROVIDERS[options.provider][0] not in available:
        raise DietcodeError(f"provider {options.provider!r} is not available in this onnxruntime build; "
                            f"available: {', '.join(available)}")
    if options.repeat < 1 or options.warmup < 0 or options.seed < 0:
        raise DietcodeError(f"--repeat must be >= 1, --warmup and --seed >= 0 (got {options.repeat}, "
                            f"{options.warmup}, {options.seed})")
    stock_info, opt_info = load_model_info(options.model), load_model_info(options.optimized)
    check_compatible(stock_info, opt_info)
    ties, merged = model_ties(options.model, options.dims, options.ties) if stock_info.symbols else (options.ties, {})
    shapes, given = _sweep(stock_info.symbols, options.dims, ties)
    warm = warmup_shape(shapes, ties, bounded=given) if stock_info.symbols else None
    stock = OrtRunner(options.model, options.provider)
    from dietcode_ort.runtime import library_needed

    with_library = register is not None or options.with_library or library_needed([PROVIDERS[options.provider][0]])
    optimized = OrtRunner(options.optimized, options.provider,
                          (register or _library_register()) if with_library else None)
    results = measure(stock, optimized, shapes, lambda s: make_feeds(stock_info, s, options.seed),
                      repeat=options.repeat, warmup=options.warmup, warm_shape=warm,
                      computes_in=stock_info.computes_in, clock=clock)
    settings = {"model": str(options.model), "optimized": str(options.optimized), "repeat": options.repeat,
                "warmup": options.warmup, "seed": options.seed, "dims": list(options.dims),
                "ties": list(ties), "merged_dims": merged, "warmup_shape": warm, "tolerances": TOLERANCES,
                "computes_in": stock_info.computes_in or None,
                "interleaving": "ABBA", "speedup": "median of per-iteration stock/optimized ratios",
                "intra_op_spinning": False, "library_registered": with_library}
    return BenchReport(environment(options.provider, options.command), settings, tuple(results),
                       opt_info.custom_nodes)


def check_output_paths(options: BenchOptions) -> None:
    """``--json`` and ``--plot`` must name files in a folder that can be written (created if missing)."""
    from dietcode_ort.paths import writable_dir

    for option, path in (("--json", options.json_path), ("--plot", options.plot_path)):
        if path is None:
            continue
        if Path(path).is_dir():
            raise DietcodeError(f"{option} {path} is a folder; give the path of the file to write")
        writable_dir(Path(path).parent, f"{option} output", option)


def bench_command(options: BenchOptions) -> int:
    """The CLI's ``bench``: run, print the table, write the JSON and the plot when asked (their paths are
    checked first, so a bad one fails before the measurements, not after)."""
    check_output_paths(options)
    report = run_bench(options)
    print_report(report)
    if options.json_path:
        write_json(report, options.json_path)
    if options.plot_path:
        write_plot(report, options.plot_path)
    return 0

