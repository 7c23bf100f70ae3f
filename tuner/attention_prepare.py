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
- A head-split ``Transpose(x, (0, 2, 1, 3))`` whose output goes through LLaMA's rotary embedding (``y * cos +
  cat(-y2, y1) * sin``, cos and sin ``Unsqueeze``d to [1, 1, S, d]) and, for K and V, the grouped-query head
  repeat (``Unsqueeze`` at 2 -> ``Expand`` [B, KV, H/KV, S, d] -> ``Reshape`` [B, H, S, d]) before the chain moves
  down past them (``_Sink``): the ops run on x [B, S, H, d] instead, each in its form there (elementwise ops with
  their other operand permuted alike: a one-element value as is, a constant transposed, an ``Unsqueeze`` of a
  value with its axes re-placed; Slice and Concat along the permuted axis; the repeat's new axis right after
  the head axis, the Expand's shape gathered by the permutation, the Reshape merging the same axes), and one
  Transpose makes the value the chain reads (K's then one with the Kt Transpose). Shapes of the values in
  between read x's dims, picked by the permutation. It moves only when every op reading what it moves past
  has such a form, none of those values is a graph output, and it ends as one Transpose before the chain's
  MatMul (or the Muls scaling Q and Kt, or Kt's Transpose); else it stays, with the reason in
  ``PrepareResult.notes``.

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
from tuner.rewrite import _drop_unread, _graph_reads, default_opset, model_to_edit, names_in_use, unique_name

__all__ = ["PrepareResult", "prepare_attention"]

Names = Callable[[str], str]  # a fresh name of the graph from a base (rewrite.unique_name over its names)


@dataclass(frozen=True)
class PrepareResult:
    shapes: int  # Shape nodes of a Transpose rewritten to read its input
    kt_transposes: int  # Reshape -> Transpose -> Reshape sequences made one Transpose
    merged_transposes: int  # Transpose pairs made one
    reshapes: int  # no-op Reshapes of an attention output dropped
    scales: int = 0  # Muls of a projection by a constant moved after its head split
    moved: int = 0  # head-split Transposes moved past a rotary embedding / K/V head repeat
    # (a head-split Transpose's output, why it was not moved past the ops between it and the chain)
    notes: tuple[tuple[str, str], ...] = ()


def _is(node: onnx.NodeProto | None, *ops: str) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _perm(node: onnx.NodeProto) -> list[int] | None:
    a = _attr(node, "perm")
    return None if a is None else [int(x) for x in a.ints]


def _const_ints(graph_consts: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    value = graph_consts.get(name)
    if value is None or value.dtype.kind not in "iu" or value.ndim > 1:
        return None
    return value.astype(np.int64)


def _shapes_of_transposes(graph: onnx.GraphProto, g: scan_mod._Graph, names: Names) -> int:
    """Shape(Transpose(x, perm)) -> the same dims read from Shape(x); returns how many Shapes were rewritten."""
    index = scan_mod.GraphLinks(graph)
    consts = scan_mod.small_constants(graph)
    new_nodes: dict[int, list[onnx.NodeProto]] = {}  # position of a replaced Shape -> its replacement
    new_inits: list[onnx.TensorProto] = []
    drop: list[onnx.NodeProto] = []  # the Shapes of Transposes, and the Gathers of them made constants
    x_shapes: dict[str, str] = {}  # x -> the output of the Shape(x) made for it
    count = 0
    for at, node in enumerate(graph.node):
        if not _is(node, "Shape") or len(node.input) != 1:
            continue
        t = index.producers.get(node.input[0])
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

        rest = [r for r in index.consumers.get(out, [])]
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
        if rest or out in index.graph_outputs:  # readers other than constant Gathers: the picked dims, as a Shape gave
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
    index = scan_mod.GraphLinks(graph)
    count = 0
    for second in list(graph.node):
        if not _is(second, "Reshape"):
            continue
        t = index.producers.get(second.input[0])
        if t is None or not _is(t, "Transpose") or _perm(t) != [0, 2, 1] or \
                not index.read_only_by(t.output[0], second):
            continue
        first = index.producers.get(t.input[0])
        if first is None or not _is(first, "Reshape") or not index.read_only_by(t.input[0], t):
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
        index = scan_mod.GraphLinks(graph)
    return count


def _merged_transposes(graph: onnx.GraphProto) -> int:
    """Transpose(Transpose(x, p), q), the inner read by the outer alone -> Transpose(x, p[q])."""
    count = 0
    while True:
        index = scan_mod.GraphLinks(graph)
        for outer in graph.node:
            inner = index.producers.get(outer.input[0]) if _is(outer, "Transpose") else None
            if inner is None or not _is(inner, "Transpose") or not index.read_only_by(outer.input[0], outer):
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
    index = scan_mod.GraphLinks(graph)
    count = 0
    for node in graph.node:
        if not _is(node, "Reshape") or not _is(index.producers.get(node.input[0]), "MatMul"):
            continue
        readers = index.consumers.get(node.output[0], [])
        src, dst = g.shapes.get(node.input[0]), g.shapes.get(node.output[0])
        if (node.output[0] in index.graph_outputs or not any(_is(r, "Transpose") for r in readers)
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
    index = scan_mod.GraphLinks(graph)
    consts = scan_mod.small_constants(graph)
    count = 0
    for t in list(graph.node):
        reader = index.exclusive_consumer(t.output[0]) if _is(t, "Transpose") else None
        if reader is not None and _is(reader, "Mul", "Div"):  # SDPA's own scale of Q between
            reader = reader if _is(index.exclusive_consumer(reader.output[0]), "MatMul") else None
        if reader is None or not _is(reader, "MatMul", "Mul", "Div"):
            continue
        reshape = index.producers.get(t.input[0])
        if reshape is None or not _is(reshape, "Reshape") or reshape.output[0] in index.graph_outputs or not all(
                r is t or _is(r, "Shape") for r in index.consumers.get(reshape.output[0], [])):
            continue
        mul = index.producers.get(reshape.input[0])
        if mul is None or not _is(mul, "Mul", "Div") or len(mul.input) != 2 or \
                not index.read_only_by(reshape.input[0], reshape):
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
        index = scan_mod.GraphLinks(graph)
    return count


# --- head-split Transposes moved past the rotary embedding and the K/V head repeat -------------------------------

_UNARY = ("Neg", "Cast", "Identity")
_BINARY = ("Add", "Sub", "Mul", "Div")


def _inverse(perm: list[int]) -> list[int]:
    out = [0] * len(perm)
    for j, i in enumerate(perm):
        out[i] = j
    return out


class _Refuse(Exception):
    pass


@dataclass
class _Moved:
    """One region: the values made from a head-split Transpose's output by the ops the Transpose moves past, each
    as ``Transpose(x, perm)`` of a value x the rewritten ops make (y -> (x, perm))."""

    values: dict[str, tuple[str, list[int]]]
    nodes: list[tuple[onnx.NodeProto, list[onnx.NodeProto]]]  # (a node moved past, what replaces it)
    inits: list[onnx.TensorProto]


def _head_split_transpose(node: onnx.NodeProto, index: scan_mod.GraphLinks, g: scan_mod._Graph) -> bool:
    """Whether ``node`` is a Transpose (0, 2, 1, 3) of a Reshape [B, S, E] -> [B, S, H, d]."""
    if not _is(node, "Transpose") or _perm(node) != [0, 2, 1, 3] or node.output[0] in index.graph_outputs:
        return False
    reshape = index.producers.get(node.input[0])
    if reshape is None or not _is(reshape, "Reshape"):
        return False
    src, dst = g.shapes.get(reshape.input[0]), g.shapes.get(reshape.output[0])
    return src is not None and dst is not None and len(src) == 3 and len(dst) == 4 and _same(src[0], dst[0]) \
        and _same(src[1], dst[1])


def _one_element_constant(consts: dict[str, np.ndarray], name: str) -> bool:
    value = consts.get(name)
    return value is not None and value.size == 1


def _scale_of_a_matmul(node: onnx.NodeProto | None, index: scan_mod.GraphLinks, consts: dict[str, np.ndarray],
                       depth: int = 0) -> bool:
    """A Mul (Div) by a one-element constant read by a MatMul alone, or by such a Mul (up to three in a row): the
    chain's scale of Q or Kt, which the matcher folds with the Transpose before it absorbed (so the Transpose
    stops there)."""
    if node is None or depth > 2 or not _is(node, "Mul", "Div") or len(node.input) != 2 or \
            not any(_one_element_constant(consts, x) for x in node.input):
        return False
    reader = index.exclusive_consumer(node.output[0])
    return _is(reader, "MatMul") or _scale_of_a_matmul(reader, index, consts, depth + 1)


class _Sink:
    """Moves one head-split Transpose y = Transpose(x, (0, 2, 1, 3)) down past the ops that read y (and what they
    make) when each of them has a form on x: elementwise ops (their other operand, a one-element value, a
    constant or an Unsqueeze of a value, permuted alike), Slice and Concat (their axes permuted), and the K/V
    head repeat Unsqueeze -> Expand -> Reshape (the new axis placed next to the head axis, the Expand's shape
    gathered by the permutation, the Reshape merging the same axes)."""

    def __init__(self, graph: onnx.GraphProto, g: scan_mod._Graph, names: Names):
        self.graph, self.g, self.names = graph, g, names
        self.index = scan_mod.GraphLinks(graph)
        self.consts = scan_mod.small_constants(graph)
        self.unsqueezed: dict[tuple[str, tuple[int, ...]], str] = {}  # (value, axes) -> the Unsqueeze made
        self.pending: dict[tuple[str, tuple[int, ...]], str] = {}  # those of the region being matched

    def _ints(self, name: str, what: str) -> list[int]:
        value = _const_ints(self.consts, name) if name else None
        if value is None:
            raise _Refuse(f"the {what} {name!r} is not a constant")
        return [int(v) for v in value.reshape(-1)]

    def _int_input(self, values: list[int], base: str, new: list[onnx.TensorProto]) -> str:
        tensor = numpy_helper.from_array(np.array(values, np.int64), self.names(base))
        new.append(tensor)
        return tensor.name

    def _side(self, value: str, perm: list[int], made: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> str:
        """The other operand of an elementwise op on the region, broadcast as it was: a value v' with
        Transpose(pad(v'), perm) == pad(v), pad prepending 1s up to the region's rank."""
        rank = len(perm)
        if _one_element_constant(self.consts, value):
            return value
        shape = self.g.shapes.get(value)
        if shape is None or len(shape) > rank:
            raise _Refuse(f"the operand {value!r} has an unknown shape or a rank above {rank}")
        q = _inverse(perm)  # x axis i is y axis q[i]
        if value in self.consts or (value in self.g.inits and value not in {v.name for v in self.graph.input}):
            array = self.consts[value] if value in self.consts else self.g.const(value)
            if array is None:
                raise _Refuse(f"the constant {value!r} is not loaded")
            padded = array.reshape((1,) * (rank - array.ndim) + array.shape)
            tensor = numpy_helper.from_array(np.ascontiguousarray(np.transpose(padded, q)),
                                             self.names(f"{value}_moved"))
            inits.append(tensor)
            return tensor.name
        unsqueeze = self.index.producers.get(value)
        if unsqueeze is None or not _is(unsqueeze, "Unsqueeze"):
            raise _Refuse(f"the operand {value!r} is neither a constant nor made by an Unsqueeze")
        axes_a = _attr(unsqueeze, "axes")
        axes = [int(a) for a in axes_a.ints] if axes_a is not None else \
            self._ints(unsqueeze.input[1] if len(unsqueeze.input) > 1 else "", "Unsqueeze axes")
        axes = [a % len(shape) for a in axes]
        # labels of pad(v): -1 for an axis of 1 made here (padded or unsqueezed), else the axis of the source
        labels, source_axis = [], 0
        for a in range(rank):
            if a < rank - len(shape) or (a - (rank - len(shape))) in axes:
                labels.append(-1)
            else:
                labels.append(source_axis)
                source_axis += 1
        moved = [labels[j] for j in q]
        if [lb for lb in moved if lb >= 0] != sorted(lb for lb in moved if lb >= 0):
            raise _Refuse(f"the Unsqueeze making {value!r} would need its source's axes reordered")
        new_axes = tuple(i for i, lb in enumerate(moved) if lb < 0)
        key = (unsqueeze.input[0], new_axes)
        if key not in self.unsqueezed and key not in self.pending:
            out = self.names(f"{value}_moved")
            axes_name = self._int_input(list(new_axes), f"{out}_axes", inits)
            made.append(helper.make_node("Unsqueeze", [unsqueeze.input[0], axes_name], [out],
                                         name=self.names(f"{unsqueeze.name or value}_moved")))
            self.pending[key] = out
        return self.unsqueezed.get(key) or self.pending[key]

    def _groups(self, src: tuple, dst: tuple) -> list[list[int]]:
        """The source axes each output axis of a Reshape src -> dst merges (consecutive), by the inferred dims."""
        groups: list[list[int]] = []
        i = 0
        for o in dst:
            group: list[int] = []
            if isinstance(o, int):
                acc = 1
                while i < len(src) and isinstance(src[i], int) and (acc < o or (src[i] == 1 and not group)):
                    acc *= src[i]
                    group.append(i)
                    i += 1
                if acc != o or not group:
                    raise _Refuse(f"the Reshape {list(src)} -> {list(dst)} does not merge axes")
            else:
                while i < len(src) and src[i] == 1:
                    group.append(i)
                    i += 1
                if i >= len(src) or not _same(src[i], o):
                    raise _Refuse(f"the Reshape {list(src)} -> {list(dst)} does not merge axes")
                group.append(i)
                i += 1
            groups.append(group)
        while i < len(src) and src[i] == 1 and groups:
            groups[-1].append(i)
            i += 1
        if i != len(src):
            raise _Refuse(f"the Reshape {list(src)} -> {list(dst)} does not merge axes")
        return groups

    def _move(self, node: onnx.NodeProto, values: dict[str, tuple[str, list[int]]],
              inits: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], list[int]]:
        """``node``'s form on the region's x values (new nodes, the last making its output's x) and the perm of its
        output; _Refuse when it has none."""
        ins = [values.get(x) for x in node.input]
        ranked = [v for v in ins if v is not None]
        if not ranked:
            raise _Refuse("it reads the value in a subgraph")
        perm = ranked[0][1]
        made: list[onnx.NodeProto] = []
        out = self.names(f"{node.output[0]}_moved")
        name = self.names(f"{node.name or node.output[0]}_moved")
        if len(node.output) != 1 or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                         for a in node.attribute):
            raise _Refuse("it is not one op of one output")
        if _is(node, *_UNARY) and len(node.input) == 1:
            new = helper.make_node(node.op_type, [ranked[0][0]], [out], name=name)
            new.attribute.extend(node.attribute)
            return [new], perm
        if _is(node, *_BINARY) and len(node.input) == 2:
            if _scale_of_a_matmul(node, self.index, self.consts):
                raise _Refuse("the chain's scale (the Transpose stops before it)")
            if any(v is not None and (len(v[1]) != len(perm) or v[1] != perm) for v in ins):
                raise _Refuse("it combines values of different layouts")
            operands = [v[0] if v is not None else self._side(x, perm, made, inits) for x, v in zip(node.input, ins)]
            return made + [helper.make_node(node.op_type, operands, [out], name=name)], perm
        rank = len(perm)
        if _is(node, "Slice") and ins[0] is not None and not any(ins[1:]):
            if len(node.input) < 4 or not node.input[3]:
                raise _Refuse("a Slice without axes")
            axes = [perm[a % rank] for a in self._ints(node.input[3], "Slice axes")]
            inputs = list(node.input)
            inputs[0] = ranked[0][0]
            inputs[3] = self._int_input(axes, f"{out}_axes", inits)
            return [helper.make_node("Slice", inputs, [out], name=name)], perm
        if _is(node, "Concat"):
            if any(v is None or v[1] != perm for v in ins):
                raise _Refuse("a Concat of values of different layouts")
            axis = _attr(node, "axis")
            return [helper.make_node("Concat", [v[0] for v in ranked], [out], name=name,
                                     axis=perm[(axis.i if axis is not None else 0) % rank])], perm
        if _is(node, "Unsqueeze") and ins[0] is not None and not any(ins[1:]):
            axes_a = _attr(node, "axes")
            axes = sorted(a % (rank + 1) for a in ([int(a) for a in axes_a.ints] if axes_a is not None else
                                                   self._ints(node.input[1] if len(node.input) > 1 else "",
                                                              "Unsqueeze axes")))
            if len(axes) != 1:
                raise _Refuse("an Unsqueeze of more than one axis")
            # y labels: its axes 0..rank-1 and the new one (rank); x keeps them at the positions perm says, the
            # new axis right after the one it follows in y (first when it comes first)
            q = _inverse(perm)
            y_labels = list(range(rank))
            y_labels.insert(axes[0], rank)
            x_labels = [q[i] for i in range(rank)]  # x axis i is y axis q[i]
            at = 0 if axes[0] == 0 else x_labels.index(y_labels[axes[0] - 1]) + 1
            x_labels.insert(at, rank)
            new_perm = [x_labels.index(lb) for lb in y_labels]
            axes_name = self._int_input([at], f"{out}_axes", inits)
            return [helper.make_node("Unsqueeze", [ranked[0][0], axes_name], [out], name=name)], new_perm
        if _is(node, "Expand") and ins[0] is not None and ins[1] is None:
            length = self.g.shapes.get(node.input[1])
            if length is None or list(length) != [rank]:
                raise _Refuse(f"the Expand's shape {node.input[1]!r} is not known to have {rank} elements")
            index_name = self._int_input(_inverse(perm), f"{out}_perm", inits)
            shape = self.names(f"{node.input[1]}_moved")
            return [helper.make_node("Gather", [node.input[1], index_name], [shape], axis=0,
                                     name=self.names(f"{name}_shape")),
                    helper.make_node("Expand", [ranked[0][0], shape], [out], name=name)], perm
        if _is(node, "Reshape") and ins[0] is not None and ins[1] is None:
            src, dst = self.g.shapes.get(node.input[0]), self.g.shapes.get(node.output[0])
            if src is None or dst is None or len(src) != rank:
                raise _Refuse("its shapes are unknown")
            groups = self._groups(src, dst)
            starts = []
            for group in groups:  # each group's axes must be consecutive in x, in the same order
                at_x = [perm[j] for j in group]
                if at_x != list(range(at_x[0], at_x[0] + len(at_x))):
                    raise _Refuse(f"the Reshape {list(src)} -> {list(dst)} merges axes apart in the moved layout")
                starts.append(at_x[0])
            order = sorted(range(len(groups)), key=lambda k: starts[k])  # x axis i of the output is group order[i]
            new_perm = _inverse(order)
            target, free = [], False
            for i, k in enumerate(order):
                dims = [src[j] for j in groups[k]]
                if all(isinstance(d, int) for d in dims):
                    target.append(int(np.prod(dims, dtype=np.int64)))
                elif len(groups[k]) == 1 and perm[groups[k][0]] == i:
                    target.append(0)  # the input's dim at that place (allowzero 0)
                elif not free:
                    target.append(-1)
                    free = True
                else:
                    raise _Refuse(f"the Reshape {list(src)} -> {list(dst)} has no target in the moved layout")
            target_name = self._int_input(target, f"{out}_shape", inits)
            return [helper.make_node("Reshape", [ranked[0][0], target_name], [out], name=name)], new_perm
        raise _Refuse("it has no form in the moved layout")

    def region(self, seed: onnx.NodeProto) -> tuple[_Moved, str]:
        """The ops the seed Transpose moves past and the one value it then makes (read by a MatMul, a Transpose
        or the chain's scale, and Shapes), or _Refuse."""
        values: dict[str, tuple[str, list[int]]] = {seed.output[0]: (seed.input[0], [0, 2, 1, 3])}
        moved: list[tuple[onnx.NodeProto, list[onnx.NodeProto]]] = []
        inits: list[onnx.TensorProto] = []
        shapes: list[onnx.NodeProto] = []  # Shapes of a value in the region: Gather(Shape(x), perm)
        stops: dict[str, list[onnx.NodeProto]] = {}  # region value -> its readers the Transpose stops before
        self.pending = {}
        start = next(i for i, n in enumerate(self.graph.node) if n is seed)
        for node in list(self.graph.node)[start + 1:]:
            reads = [x for x in scan_mod.node_reads(node) if x in values]
            if not reads:
                continue
            if _is(node, "Shape") and len(node.input) == 1:
                shapes.append(node)
                continue
            try:
                new, perm = self._move(node, values, inits)
            except _Refuse as why:
                if not _is(node, "MatMul", "Transpose") and not _scale_of_a_matmul(node, self.index, self.consts):
                    raise _Refuse(f"the {node.op_type} {node.name or node.output[0]!r} after it: {why}") from None
                for x in reads:
                    stops.setdefault(x, []).append(node)
                continue
            if node.output[0] in self.index.graph_outputs:
                raise _Refuse(f"{node.output[0]!r} is a graph output")
            values[node.output[0]] = (new[-1].output[0], perm)
            moved.append((node, new))
        if not moved:
            raise _Refuse("nothing to move past")
        if len(stops) != 1:
            raise _Refuse(f"it would end as {len(stops)} Transposes ({', '.join(sorted(stops))}), not one")
        (end,) = stops
        for r in stops[end]:  # before the chain: its MatMul, its scale, or its Kt Transpose before either
            after = self.index.exclusive_consumer(r.output[0]) if _is(r, "Transpose") else r
            if not _is(after, "MatMul") and not _scale_of_a_matmul(after, self.index, self.consts):
                raise _Refuse(f"the {r.op_type} {r.name or r.output[0]!r} it would end before is not a MatMul's "
                              "operand")
        for shape in shapes:  # the dims a Shape of y gives, picked from Shape(x) by the perm
            x, perm = values[shape.input[0]]
            start_a, end_a = _attr(shape, "start"), _attr(shape, "end")
            picked = perm[(start_a.i if start_a is not None else 0):(end_a.i if end_a is not None else len(perm))]
            made = self.names(f"{x}_shape")
            index = self._int_input(picked, f"{shape.output[0]}_perm", inits)
            moved.append((shape, [helper.make_node("Shape", [x], [made], name=self.names(f"{x}_Shape")),
                                  helper.make_node("Gather", [made, index], [shape.output[0]], axis=0,
                                                   name=self.names(f"{shape.name or shape.output[0]}_perm"))]))
        return _Moved(values, moved, inits), end

    def apply(self, seed: onnx.NodeProto, moved: _Moved, end: str) -> None:
        x, perm = moved.values[end]
        nodes = []
        replacement = {id(n): new for n, new in moved.nodes}
        for n in self.graph.node:
            nodes += replacement.get(id(n), [n])
            if id(n) in replacement and n.output[0] == end:
                nodes.append(helper.make_node("Transpose", [x], [end], perm=perm,
                                              name=self.names(f"{seed.name or seed.output[0]}_moved")))
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self.graph.initializer.extend(moved.inits)
        self.unsqueezed.update(self.pending)
        self.index = scan_mod.GraphLinks(self.graph)


def _transposes_past_rotary(graph: onnx.GraphProto, g: scan_mod._Graph, names: Names, opset: int,
                            notes: list[tuple[str, str]]) -> int:
    """Each head-split Transpose (0, 2, 1, 3) whose output goes through a rotary embedding and/or a K/V head
    repeat before the chain, moved down to the end of them (``_Sink``); returns how many moved, with the reason
    for each that did not in ``notes`` (the Transpose's output, why)."""
    from tuner.attention_graph import _sort_nodes

    sink = _Sink(graph, g, names)
    count = 0
    for key in [n.output[0] for n in graph.node if _is(n, "Transpose")]:
        seed = sink.index.producers.get(key)  # the graph's nodes are new messages after each rewrite
        if seed is None or not _head_split_transpose(seed, sink.index, g) or all(
                _is(r, "MatMul", "Transpose", "Shape") or _scale_of_a_matmul(r, sink.index, sink.consts)
                for r in sink.index.consumers.get(seed.output[0], [])):
            continue  # read by the chain (or nothing to move past): as the matcher takes it
        try:
            if opset < 13:
                raise _Refuse(f"the model's opset {opset} is below 13 (Unsqueeze's axes input)")
            moved, end = sink.region(seed)
        except _Refuse as why:
            notes.append((seed.output[0], f"the head-split Transpose stays: {why}"))
            continue
        sink.apply(seed, moved, end)
        count += 1
    if count:  # an Unsqueeze of cos/sin made for one region is read by the others too
        _sort_nodes(graph)
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
    notes: list[tuple[str, str]] = []
    opset = default_opset(out)
    before |= _graph_reads(graph)
    moved = _transposes_past_rotary(graph, g, names, opset, notes)
    if moved:  # the moved Transposes, then K's moved one and its Kt Transpose, are one
        _drop_unread(graph, before)
        _drop_dead(graph, before)
        merged += _merged_transposes(graph)
        _drop_dead(graph, before)
    return out, PrepareResult(shapes, kts, merged, reshapes, scales, moved, tuple(notes))
