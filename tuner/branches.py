"""The branches of a graph's If nodes, tuned as models of their own and put back.

A merged decoder (optimum's ``decoder_model_merged.onnx``: Whisper, T5, BART, older GPT-2 and LLaMA exports) is one
If whose two branches are the decoder without and with its past: every MatMul is inside a branch. ``branch_models``
makes each If branch of a model's main graph that holds a MatMul, Gemm or Conv a model: its nodes, its own
initializers, and what it reads from outside as the model's inputs (typed, from the graph's inputs or shape
inference) and initializers. The whole pipeline (pre-passes, scan, tuning, rewrite, attention fusion) then runs on
it as on any model, and ``splice`` puts the rewritten branch back into its If:

- initializers the branch read from outside stay outside (and go where no branch or node reads them any more:
  the Q/K/V weights a packed projection replaced); the ones the pipeline made (kernel bundles, packed
  weights) go to the parent's graph, where the other branch finds an equal one (same name, same content) and shares
  it; one that differs from a parent's value of the same name is renamed;
- values the pipeline made in the branch that an outer scope also names are renamed (ONNX forbids shadowing);
- model-local functions (the fallback bodies of ``ai.dietcode`` nodes) join the parent's; a body that differs
  from the parent's of the same op type and overload gets the next free overload.

A branch that reads an outer value of unknown shape, or with a dynamic dim that is not one of the model's input dims
(``seq + 1``), is left as it is, its nodes listed as skipped with the reason. Loop and Scan bodies are not tuned:
their inputs change from one iteration to the next.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import onnx
from onnx import helper

from dietcode_ort.errors import DietcodeError
from tuner.rewrite import _drop_unread, names_in_use, unique_name
from dietcode_ort.bundle import subgraphs
from tuner.scan import (_OPS, ScanResult, Skipped, _inference_copy, _infer, _label, _names, defined_in, model_symbols,
                        outer_reads, scan_model)

__all__ = ["Branch", "Unit", "branch_models", "scan_units", "merge_units", "located", "splice"]

_BRANCHES = ("then_branch", "else_branch")


@dataclass(frozen=True)
class Branch:
    """One If branch of a model's main graph, as a model of its own."""

    node: str  # the If's first output (a rewrite of the parent's graph moves nodes, never an If's outputs)
    attribute: str  # then_branch or else_branch
    where: str  # "the then_branch of If 'name'", for messages
    model: onnx.ModelProto  # the branch: what it reads from outside as inputs and initializers
    local: frozenset[str]  # the names of the branch's own initializers


@dataclass
class Unit:
    """A graph the pipeline tunes: the model's main graph, or one of its If branches as a model of its own."""

    model: onnx.ModelProto  # as prepared and scanned (the rewrite then edits it)
    scanned: ScanResult
    where: str = ""  # "" for the main graph; "the then_branch of If 'x'" (nested: joined by " > ")
    branch: Branch | None = None
    parent: int = -1  # the index (in ``scan_units``' list) of the unit whose model this branch splices into


MAX_DEPTH = 4  # If branches inside If branches: deeper ones are not tuned


def scan_units(model: onnx.ModelProto, base_dir: Path | None,
               prepare: Callable[[onnx.ModelProto], tuple[onnx.ModelProto, tuple[Skipped, ...], tuple[str, ...]]]
               ) -> list[Unit]:
    """The model's main graph and its If branches (and theirs, to ``MAX_DEPTH``) as units, each run through
    ``prepare`` (the graph pre-passes: the model, the nodes they left alone, a line per change) and scanned;
    parents come before their branches."""
    units: list[Unit] = []

    def visit(model: onnx.ModelProto, where: str, branch: Branch | None, parent: int, level: int) -> None:
        model, left, changes = prepare(model)
        found, refused = branch_models(model, base_dir) if level < MAX_DEPTH else ([], [])
        scanned = scan_model(model, base_dir, if_branches=level < MAX_DEPTH)
        if units:  # a branch's inputs are the values it reads; shape logs and messages speak of the model's inputs
            scanned = replace(scanned, input_dims=units[0].scanned.input_dims)
        units.append(Unit(model, replace(scanned, skipped=scanned.skipped + left + tuple(refused), prepared=changes),
                          where, branch, parent))
        index = len(units) - 1
        for b in found:
            visit(b.model, f"{where} > {b.where}" if where else b.where, b, index, level + 1)

    visit(model, "", None, -1, 0)
    return units


def located(where: str, text: str) -> str:
    """A node's name (or a message) prefixed with the If branch it is in; as it is for the main graph's."""
    return f"{where}: {text}" if where else text


def merge_units(results: Sequence[tuple[str, ScanResult]]) -> ScanResult:
    """The scans of a model's main graph (``where`` "") and its If branches as one, for display: a branch's node
    names and pre-pass lines are prefixed with where it is."""
    main = results[0][1]
    return ScanResult(
        tuple(sorted({s for _, r in results for s in r.symbols})),
        tuple(replace(w, nodes=tuple(located(where, n) for n in w.nodes)) for where, r in results for w in r.workloads),
        tuple(replace(s, node=located(where, s.node)) for where, r in results for s in r.skipped),
        main.input_dims,
        tuple(replace(s, node=located(where, s.node)) for where, r in results for s in r.unfused),
        tuple(located(where, line) for where, r in results for line in r.prepared),
        {name: kept for _, r in results for name, kept in r.merged.items()})


def _products(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's MatMul, Gemm and Conv nodes, and its subgraphs'."""
    out = []
    for node in graph.node:
        if node.op_type in _OPS and node.domain in ("", "ai.onnx"):
            out.append(node)
        out.extend(p for g in subgraphs(node) for p in _products(g))
    return out


def branch_models(model: onnx.ModelProto, base_dir: Path | None = None) -> tuple[list[Branch], list[Skipped]]:
    """Each branch of the main graph's If nodes that holds a MatMul, Gemm or Conv, as a model; and the products of
    the branches that cannot be one, with the reason."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in inits}
    symbols = set(_names(model_symbols(model)))
    inferred: dict[str, onnx.ValueInfoProto] | None = None
    branches: list[Branch] = []
    skipped: list[Skipped] = []
    for node in graph.node:
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        for attr in node.attribute:
            if attr.name not in _BRANCHES or attr.type != onnx.AttributeProto.GRAPH or not _products(attr.g):
                continue
            where = f"the {attr.name} of If {_label(node)!r}"
            values, why = [], ""
            for name in sorted(outer_reads(attr.g)):
                if name in inits:
                    continue
                if name not in inputs and inferred is None:
                    inferred = {v.name: v for v in _infer(_inference_copy(model, base_dir)).graph.value_info}
                vi = inputs.get(name) or (inferred or {}).get(name)
                why = _unusable(name, vi, symbols)
                if why or vi is None:
                    break
                values.append(vi)
            if why:
                skipped.extend(Skipped(_label(n), n.op_type, f"inside {where}: not tuned ({why})")
                               for n in _products(attr.g))
                continue
            branches.append(Branch(node.output[0], attr.name, where, _as_model(model, attr.g, values, inits),
                                   frozenset(t.name for t in attr.g.initializer)))
    return branches, skipped


def _unusable(name: str, vi: onnx.ValueInfoProto | None, symbols: set[str]) -> str:
    """Why the outer value ``name`` cannot be a branch model's input ("" when it can)."""
    if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return f"it reads {name!r} from outside, whose shape is unknown"
    for d in vi.type.tensor_type.shape.dim:
        if not d.HasField("dim_value") and d.dim_param not in symbols:
            dim = repr(d.dim_param) if d.dim_param else "an unnamed dim"
            return f"it reads {name!r} from outside, whose shape has {dim}, no input dim of the model"
    return ""


def _as_model(model: onnx.ModelProto, sub: onnx.GraphProto, values: list[onnx.ValueInfoProto],
              inits: dict[str, onnx.TensorProto]) -> onnx.ModelProto:
    reads = outer_reads(sub)
    graph = helper.make_graph(list(sub.node), sub.name or "branch", [_typed(v) for v in values], list(sub.output),
                              list(sub.initializer) + [inits[n] for n in sorted(reads) if n in inits],
                              value_info=list(sub.value_info), sparse_initializer=list(sub.sparse_initializer))
    out = helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions))
    out.ir_version = model.ir_version
    return out


def _typed(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.doc_string = ""
    return out


def _same(a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    return a.ByteSize() == b.ByteSize() and a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def splice(model: onnx.ModelProto, branch: Branch, done: onnx.ModelProto) -> None:
    """Put ``done`` (``branch.model`` rewritten) back into its If of ``model``, in place (see the module's text)."""
    node = next((n for n in model.graph.node if n.op_type == "If" and n.output and n.output[0] == branch.node), None)
    if node is None:
        raise DietcodeError(f"internal error: the If of {branch.where} is gone from the rewritten graph")
    sub = next(a.g for a in node.attribute if a.name == branch.attribute)
    if [o.name for o in done.graph.output] != [o.name for o in sub.output]:
        raise DietcodeError(f"internal error: the rewritten {branch.where} has outputs "
                            f"{[o.name for o in done.graph.output]}, not {[o.name for o in sub.output]}")
    outer = {t.name: t for t in model.graph.initializer}
    was_read = outer_reads(sub) & set(outer)  # weights the branch read: unread by all once packed, say
    inputs = {v.name for v in done.graph.input}
    taken = names_in_use(model.graph)  # the names the parent's scope defines (the branch must not shadow them)
    everywhere = taken | _all_names(model.graph)
    rename: dict[str, str] = {}
    local, moved = [], []
    outputs = {o.name for o in sub.output}
    for t in done.graph.initializer:
        if t.name in branch.local or t.name in outputs:  # a branch returns no outer value (ORT refuses that)
            local.append(t)
        elif t.name in outer and _same(t, outer[t.name]):
            continue  # read from outside, as before (or made equal by the other branch: shared)
        else:
            if t.name in everywhere:
                rename[t.name] = unique_name(t.name, everywhere)
            moved.append(t)
    own = {o for n in done.graph.node for o in n.output if o} - inputs - defined_in(sub)  # the values the pipeline made
    for name in sorted(own & taken):  # a value made here that the parent's scope names too
        rename.setdefault(name, unique_name(name, everywhere))
    for t in moved:
        t.name = rename.get(t.name, t.name)
    nodes = list(done.graph.node)
    _rename(nodes, rename)
    overloads = _merge_functions(model, done)
    for n in nodes:
        if (n.domain, n.op_type, n.overload) in overloads:
            n.overload = overloads[(n.domain, n.op_type, n.overload)]
    del sub.node[:]
    sub.node.extend(nodes)
    del sub.initializer[:]
    sub.initializer.extend(local)
    kept = [v for v in done.graph.value_info if v.name not in inputs and v.name not in rename]
    del sub.value_info[:]
    sub.value_info.extend(kept)
    model.graph.initializer.extend(moved)
    _drop_unread(model.graph, was_read)
    have = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in done.opset_import if o.domain not in have)
    model.ir_version = max(model.ir_version, done.ir_version)


def _all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name of the graph and its subgraphs."""
    return names_in_use(graph).union(*(_all_names(g) for node in graph.node for g in subgraphs(node)))


def _rename(nodes: list[onnx.NodeProto], mapping: dict[str, str]) -> None:
    """Rename values in the nodes' inputs and outputs, and in what their subgraphs read from outside."""
    if not mapping:
        return
    for n in nodes:
        for i, x in enumerate(n.input):
            n.input[i] = mapping.get(x, x)
        for i, x in enumerate(n.output):
            n.output[i] = mapping.get(x, x)
        for g in subgraphs(n):
            inner = {k: v for k, v in mapping.items() if k not in defined_in(g)}
            _rename(list(g.node), inner)
            for o in g.output:
                o.name = inner.get(o.name, o.name)


def _merge_functions(model: onnx.ModelProto, done: onnx.ModelProto) -> dict[tuple[str, str, str], str]:
    """Add ``done``'s model-local functions that ``model`` lacks; returns (domain, name, overload) -> the overload
    its nodes must use instead, for a body that differs from the one ``model`` has under that key."""
    have = {(f.domain, f.name, f.overload): f for f in model.functions}
    moved: dict[tuple[str, str, str], str] = {}
    for f in done.functions:
        key = (f.domain, f.name, f.overload)
        same = [o for (d, n, o), g in have.items() if d == f.domain and n == f.name and _same_function(f, g)]
        if key in have and f.overload in same:
            continue
        if same:  # the parent has this body under another overload
            moved[key] = same[0]
            continue
        overload = f.overload
        if key in have:
            used = {o for d, n, o in have if d == f.domain and n == f.name}
            overload = next(str(i) for i in range(1, len(used) + 2) if str(i) not in used)
            moved[key] = overload
        g = onnx.FunctionProto()
        g.CopyFrom(f)
        g.overload = overload
        model.functions.append(g)
        have[(g.domain, g.name, g.overload)] = g
    if any(f.overload for f in model.functions):
        model.ir_version = max(model.ir_version, 10)
    return moved


def _same_function(a: onnx.FunctionProto, b: onnx.FunctionProto) -> bool:
    """Whether two functions are the same but for their overload."""
    x, y = onnx.FunctionProto(), onnx.FunctionProto()
    x.CopyFrom(a)
    y.CopyFrom(b)
    x.overload = y.overload = ""
    return x.SerializeToString(deterministic=True) == y.SerializeToString(deterministic=True)
