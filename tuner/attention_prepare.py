"""Graph pre-pass before attention matching: rewrites that compute exactly the same values and leave the head-split
Transposes of exported attention with the chain as their only reader, so ``find_attention`` can absorb them (and
``pack_projections`` pack Q, K and V). ``optimize`` (unless ``--no-fuse-attention``) and ``scan`` run it first.

What real exporters write around the chain, and what this does with it:

- ``Shape(Transpose(x, perm))`` (TorchScript exports of Hugging Face attention compute Reshape targets from the
  transposed Q and V; the dynamo export of scaled_dot_product_attention from the transposed K): the Shape reads x,
  and the dims are picked by ``perm`` (``Gather(Shape(x), perm[start:end])``; ``start``/``end`` of opset 15
  included). A Gather of that shape by a constant index reads ``Shape(x)`` at the composed index directly, and one
  whose dim shape inference knows as an integer (the head dim, the head count) becomes that constant.
- ``Reshape(Transpose(Reshape(K, [B*H, S, d]), (0, 2, 1)), [B, H, d, S])`` (the dynamo export's Kt, K [B, H, S,
  d]) is ``Transpose(K, (0, 1, 3, 2))``, provided by the inferred shapes (the first Reshape keeps the last two dims,
  the second restores the first two); two Transposes in a row, the first read by the second alone, are one.
- ``Mul(y, c) -> Reshape -> Transpose -> MatMul`` with c a one-element constant (Whisper's and BART's attention
  scale the Q projection so) becomes ``Reshape(y) -> Transpose -> Mul(., c) -> MatMul``: the same values, and the
  Mul then folds into the chain's scale, so the Q projection can be packed with K's and V's.
- A Reshape of an attention output (a MatMul's) to its own shape, read by a Transpose and Shapes alone (the
  TorchScript export of scaled_dot_product_attention reshapes [B, H, S, d] to [B, -1, S, d] before the head
  merge), is dropped.

Every rewrite rests on shapes from the scanner's symbolic shape inference, the same the matcher trusts; nodes
left without readers go (``attention_graph._drop_dead``). Running it twice changes nothing more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tuner import scan as scan_mod
from tuner.rewrite import _drop_unread, _graph_reads, model_to_edit, names_in_use, unique_name

__all__ = ["PrepareResult", "prepare_attention"]

Names = Callable[[str], str]  # a fresh name of the graph from a base (rewrite.unique_name over its names)


@dataclass(frozen=True)
class PrepareResult:
    shapes: int  # Shape nodes of a Transpose rewritten to read its input
    kt_transposes: int  # Reshape -> Transpose -> Reshape sequences made one Transpose
    merged_transposes: int  # Transpose pairs made one
    reshapes: int  # no-op Reshapes of an attention output dropped
    scales: int = 0  # Muls of a projection by a constant moved after its head split


def _is(node: onnx.NodeProto | None, *ops: str) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _perm(node: onnx.NodeProto) -> list[int] | None:
    a = _attr(node, "perm")
    return None if a is None else [int(x) for x in a.ints]


class _Index:
    """Producers and readers of the graph being edited (rebuilt after each rewrite: the graphs are small)."""

    def __init__(self, graph: onnx.GraphProto):
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for x in scan_mod.node_reads(n):
                self.readers.setdefault(x, []).append(n)
        self.outputs = {o.name for o in graph.output}

    def only_reader(self, value: str) -> onnx.NodeProto | None:
        readers = self.readers.get(value, [])
        return readers[0] if len(readers) == 1 and value not in self.outputs else None

    def read_by(self, value: str, node: onnx.NodeProto) -> bool:
        """Whether ``node`` alone reads ``value`` (and it is no graph output)."""
        return id(self.only_reader(value)) == id(node)


def _const_ints(graph_consts: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    value = graph_consts.get(name)
    if value is None or value.dtype.kind not in "iu" or value.ndim > 1:
        return None
    return value.astype(np.int64)


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    out = {t.name: numpy_helper.to_array(t) for t in graph.initializer
           if t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims, dtype=np.int64)) <= 64}
    for n in graph.node:
        if _is(n, "Constant") and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    for v in graph.input:  # an initializer a graph input overrides is no constant
        out.pop(v.name, None)
    return out


def _shapes_of_transposes(graph: onnx.GraphProto, g: scan_mod._Graph, names: Names) -> int:
    """Shape(Transpose(x, perm)) -> the same dims read from Shape(x); returns how many Shapes were rewritten."""
    index = _Index(graph)
    consts = _constants(graph)
    new_nodes: dict[int, list[onnx.NodeProto]] = {}  # position of a replaced Shape -> its replacement
    new_inits: list[onnx.TensorProto] = []
    drop: list[onnx.NodeProto] = []  # the Shapes of Transposes, and the Gathers of them made constants
    x_shapes: dict[str, str] = {}  # x -> the output of the Shape(x) made for it
    count = 0
    for at, node in enumerate(graph.node):
        if not _is(node, "Shape") or len(node.input) != 1:
            continue
        t = index.producer.get(node.input[0])
        if not _is(t, "Transpose"):
            continue
        assert t is not None
        perm = _perm(t)
        if perm is None:
            rank = len(g.shapes.get(t.input[0], ()) or ())
            if not rank:
                continue
            perm = list(reversed(range(rank)))
        start, end = _attr(node, "start"), _attr(node, "end")
        picked = perm[(start.i if start is not None else 0):(end.i if end is not None else len(perm))]
        x = t.input[0]
        known = g.shapes.get(x)
        out = node.output[0]
        replacement: list[onnx.NodeProto] = []

        def x_shape() -> str:
            if x not in x_shapes:
                x_shapes[x] = names(f"{x}_shape")
                replacement.append(helper.make_node("Shape", [x], [x_shapes[x]], name=names(f"{x}_Shape")))
            return x_shapes[x]

        rest = [r for r in index.readers.get(out, [])]
        for r in list(rest):
            axis = _attr(r, "axis")
            idx = _const_ints(consts, r.input[1]) if _is(r, "Gather") and len(r.input) == 2 and \
                r.input[0] == out and r.input[1] != out else None
            if idx is None or (axis is not None and axis.i not in (0, -1)):
                continue
            if not all(-len(picked) <= int(i) < len(picked) for i in idx.reshape(-1)):
                continue
            dims = np.array([picked[int(i)] for i in idx.reshape(-1)], np.int64).reshape(idx.shape)
            values = [known[d] if known is not None and d < len(known) else None for d in dims.reshape(-1)]
            if values and all(isinstance(v, int) and v >= 0 for v in values):  # dims inference knows: constants
                new_inits.append(numpy_helper.from_array(np.array(values, np.int64).reshape(idx.shape), r.output[0]))
                drop.append(r)
            else:
                composed = numpy_helper.from_array(dims, names(f"{r.input[1]}_of_{x}"))
                new_inits.append(composed)
                r.input[0] = x_shape()
                r.input[1] = composed.name
            rest.remove(r)
        if rest or out in index.outputs:  # readers other than constant Gathers: the picked dims, as a Shape gave
            picked_init = numpy_helper.from_array(np.array(picked, np.int64), names(f"{out}_perm"))
            new_inits.append(picked_init)
            replacement.append(helper.make_node("Gather", [x_shape(), picked_init.name], [out], axis=0,
                                                name=names(f"{node.name or out}_perm")))
        drop.append(node)
        new_nodes[at] = replacement
        count += 1
    if count:
        kept = [m for i, n in enumerate(graph.node) for m in ([] if any(n is d for d in drop) else [n])
                + new_nodes.get(i, [])]
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(new_inits)
    return count


def _same(a: object, b: object) -> bool:
    return a is not None and a == b


def _kt_transposes(graph: onnx.GraphProto, g: scan_mod._Graph, names: Names) -> int:
    """Reshape(Transpose(Reshape(k, [X, c, d]), (0, 2, 1)), [a, b, d, c]) with k [a, b, c, d] ->
    Transpose(k, (0, 1, 3, 2)); returns how many."""
    index = _Index(graph)
    count = 0
    for second in list(graph.node):
        if not _is(second, "Reshape"):
            continue
        t = index.producer.get(second.input[0])
        if t is None or not _is(t, "Transpose") or _perm(t) != [0, 2, 1] or \
                not index.read_by(t.output[0], second):
            continue
        first = index.producer.get(t.input[0])
        if first is None or not _is(first, "Reshape") or not index.read_by(t.input[0], t):
            continue
        k = first.input[0]
        sk, s1, s2 = g.shapes.get(k), g.shapes.get(first.output[0]), g.shapes.get(second.output[0])
        if sk is None or s1 is None or s2 is None or len(sk) != 4 or len(s1) != 3 or len(s2) != 4:
            continue
        # the first keeps the last two dims (so it merges the first two), the second restores them
        if not (_same(s1[1], sk[2]) and _same(s1[2], sk[3]) and _same(s2[0], sk[0]) and _same(s2[1], sk[1])
                and _same(s2[2], sk[3]) and _same(s2[3], sk[2])):
            continue
        new = helper.make_node("Transpose", [k], [second.output[0]], perm=[0, 1, 3, 2],
                               name=names(f"{second.name or second.output[0]}_kt"))
        at = next(i for i, n in enumerate(graph.node) if n is second)
        graph.node.insert(at, new)
        graph.node.remove(second)  # the Transpose and Reshape before it are left unread: _drop_dead's
        count += 1
        index = _Index(graph)
    return count


def _merged_transposes(graph: onnx.GraphProto) -> int:
    """Transpose(Transpose(x, p), q), the inner read by the outer alone -> Transpose(x, p[q])."""
    count = 0
    while True:
        index = _Index(graph)
        for outer in graph.node:
            inner = index.producer.get(outer.input[0]) if _is(outer, "Transpose") else None
            if inner is None or not _is(inner, "Transpose") or not index.read_by(outer.input[0], outer):
                continue
            p, q = _perm(inner), _perm(outer)
            if p is None or q is None or len(p) != len(q):
                continue
            del outer.attribute[:]
            outer.attribute.append(helper.make_attribute("perm", [p[i] for i in q]))
            outer.input[0] = inner.input[0]
            count += 1
            break
        else:
            return count


def _noop_reshapes(graph: onnx.GraphProto, g: scan_mod._Graph) -> int:
    """Drop a Reshape of a MatMul's output to its own (fully known) shape read by a Transpose (and Shapes)."""
    index = _Index(graph)
    count = 0
    for node in graph.node:
        if not _is(node, "Reshape") or not _is(index.producer.get(node.input[0]), "MatMul"):
            continue
        readers = index.readers.get(node.output[0], [])
        src, dst = g.shapes.get(node.input[0]), g.shapes.get(node.output[0])
        if (node.output[0] in index.outputs or not any(_is(r, "Transpose") for r in readers)
                or not all(_is(r, "Transpose", "Shape") for r in readers)
                or src is None or src != dst or any(d is None for d in src)):
            continue
        for r in readers:
            r.input[0] = node.input[0]
        count += 1
    return count


def _scales_after_head_splits(graph: onnx.GraphProto, g: scan_mod._Graph, names: Names) -> int:
    """Mul(y, c) (or Div(y, c)) -> Reshape -> Transpose -> [Mul | Div] -> MatMul, c a one-element constant, each
    value read by the next alone (Shapes of the Reshape's output aside) -> Reshape(y) -> Transpose -> Mul(., c) ->
    ...: the same values (each element times c, moved), and the matcher folds the Muls into the chain's scale."""
    index = _Index(graph)
    consts = _constants(graph)
    count = 0
    for t in list(graph.node):
        reader = index.only_reader(t.output[0]) if _is(t, "Transpose") else None
        if reader is not None and _is(reader, "Mul", "Div"):  # SDPA's own scale of Q between
            reader = reader if _is(index.only_reader(reader.output[0]), "MatMul") else None
        if reader is None or not _is(reader, "MatMul", "Mul", "Div"):
            continue
        reshape = index.producer.get(t.input[0])
        if reshape is None or not _is(reshape, "Reshape") or reshape.output[0] in index.outputs or not all(
                r is t or _is(r, "Shape") for r in index.readers.get(reshape.output[0], [])):
            continue
        mul = index.producer.get(reshape.input[0])
        if mul is None or not _is(mul, "Mul", "Div") or len(mul.input) != 2 or \
                not index.read_by(reshape.input[0], reshape):
            continue
        at_c = [i for i, x in enumerate(mul.input) if x in consts]
        if len(at_c) != 1 or (mul.op_type == "Div" and at_c[0] != 1):
            continue
        c = consts[mul.input[at_c[0]]]
        y = mul.input[1 - at_c[0]]
        shape = g.shapes.get(y)
        if c.size != 1 or c.dtype.kind != "f" or shape is None or c.ndim > len(shape):
            continue
        scaled = names(f"{t.output[0]}_scaled")
        inputs = list(mul.input)
        inputs[1 - at_c[0]] = t.output[0]
        moved = helper.make_node(mul.op_type, inputs, [scaled], name=names(f"{mul.name or mul.output[0]}_moved"))
        for i, x in enumerate(reader.input):
            if x == t.output[0]:
                reader.input[i] = scaled
        reshape.input[0] = y  # the Mul, left unread, goes with _drop_dead
        at = next(i for i, n in enumerate(graph.node) if n is t)
        graph.node.insert(at + 1, moved)
        count += 1
        index = _Index(graph)
    return count


def prepare_attention(model: onnx.ModelProto, base_dir: str | Path | None = None,
                      copy: bool = True) -> tuple[onnx.ModelProto, PrepareResult]:
    """``model`` (a copy unless ``copy`` is False) with the rewrites above applied, and how many of each."""
    from tuner.attention_graph import _drop_dead

    base = None if base_dir is None else Path(base_dir)
    out = model_to_edit(model, copy)
    graph = out.graph
    if not any(_is(n, "Softmax") for n in graph.node):
        return out, PrepareResult(0, 0, 0, 0, 0)
    inferred = scan_mod._infer(scan_mod._inference_copy(out, base))
    g = scan_mod._Graph(inferred, list(inferred.graph.initializer))
    before = _graph_reads(graph)
    names: Names = functools.partial(unique_name, taken=names_in_use(graph))
    counts = []
    for step in (lambda: _shapes_of_transposes(graph, g, names), lambda: _kt_transposes(graph, g, names),
                 lambda: _noop_reshapes(graph, g), lambda: _merged_transposes(graph),
                 lambda: _scales_after_head_splits(graph, g, names)):
        counts.append(step())
        if counts[-1]:  # what the step left unread goes before the next looks at the readers
            _drop_unread(graph, before)
            _drop_dead(graph, before)
            before |= _graph_reads(graph)  # values this step made, which a later one may leave unread
    shapes, kts, reshapes, merged, scales = counts
    return out, PrepareResult(shapes, kts, merged, reshapes, scales)
