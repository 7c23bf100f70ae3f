"""Packed QKV projections: BERT-style attention computes Q, K and V with three MatMuls of one input; this merges
them into one MatMul with the weights concatenated on the last axis (and one bias Add), split back into the
three projections by one Split. The model computes exactly what it did (each output column of a MatMul is its
own dot product), with one GEMM of N = 3 * H * d in place of three of N = H * d: what stock ORT's CUDA EP
fuses for BERT too. ``find_attention`` then reads the Split as a packed projection (GPT-2's export has one
already: its c_attn), and the fused node takes the GEMM's output in place (tuner.attention LAYOUT_BITS
"packed"), so the Split and the head-split Reshapes leave the graph.

Run before the workload scan (``optimize`` does), so the merged MatMul is one GEMM workload with its bias
epilogue like any MatMul + Add. A site is packed only when the merge is provably exact::

    Pq = MatMul(X, Wq) [-> Add(bq)] -> Reshape [B, S, H, d] -> Transpose -> the chain's Q      (K and V alike)

with one X, Wq, Wk, Wv constant [K, H*d] initializers of one dtype, no bias or constant biases [H*d] of that
dtype (a projection without one, as Whisper's K, gets zeros in the merged bias: x + 0 == x), and the MatMul
outputs and head splits read by the next node alone (Shapes of a head split aside). The projections keep their
names (as the Split's outputs), so their other readers (the exporters' Shape nodes) read the same values;
``find_attention`` decides whether the node can read the packed tensor past them. Anything else stays as it is,
with the reason in ``PackResult.notes`` (``scan`` reports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tuner.attention_graph import AttentionSite, find_attention
from tuner.model_file import inline_tensor, is_external
from tuner.rewrite import (_drop_unread, _graph_reads, _Links, default_opset, model_to_edit, names_in_use,
                           unique_name)

__all__ = ["PackResult", "pack_projections"]


@dataclass(frozen=True)
class PackResult:
    packed: tuple[str, ...]  # the attention sites (by output) whose three projections became one MatMul
    notes: tuple[tuple[str, str], ...]  # (site output, why its projections stay three)


class _Keep(Exception):
    pass


@dataclass(frozen=True)
class _Projection:
    matmul: onnx.NodeProto
    add: onnx.NodeProto | None
    weight: onnx.TensorProto
    bias: onnx.TensorProto | None
    output: str  # the value the head split's Reshape reads


def _is(node: onnx.NodeProto | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _only_reader(links: _Links, value: str, what: str) -> None:
    if links.exclusive_consumer(value) is None:
        raise _Keep(f"the {what} {value!r} is read by other nodes too"
                    if len(links.consumers.get(value, [])) > 1 or value in links.graph_outputs
                    else f"the {what} {value!r} is not read")


def _initializer(links: _Links, name: str) -> onnx.TensorProto | None:
    """The initializer ``name`` when it is one (and no node makes it, no graph input overrides it)."""
    if name in links.producers or any(i.name == name for i in links.graph.input):
        return None
    return links.inits.get(name)


def _projection(links: _Links, head_split: str, op: str) -> _Projection:
    """The MatMul (and bias Add) making the value that ``head_split``'s Reshape splits into heads."""
    _, reshape = links.node(head_split, "head split")
    if not _is(reshape, "Reshape"):  # LLaMA's Q and K: the rotary embedding; its K and V: the GQA head repeat
        raise _Keep(f"{op} is not a head split of its projection: {reshape.op_type} {head_split!r} sits between "
                    "(a rotary embedding or a K/V head repeat)")
    readers = links.consumers.get(head_split, [])
    if head_split in links.graph_outputs or sum(not _is(r, "Shape") for r in readers) != 1:  # Shapes: find_attention's
        raise _Keep(f"the {op} head split {head_split!r} is read by other nodes too")
    value = reshape.input[0]  # other readers of it (Shape) still read it: the Split makes it under its name
    node = links.producers.get(value)
    add = None
    bias = None
    if _is(node, "Add"):
        assert node is not None
        add = node
        consts = [x for x in node.input if _initializer(links, x) is not None]
        if len(node.input) != 2 or len(consts) != 1:
            raise _Keep(f"the {op} projection's Add does not add one constant bias")
        bias = _initializer(links, consts[0])
        made = node.input[1] if node.input[0] == consts[0] else node.input[0]
        _only_reader(links, made, f"{op} projection's MatMul output")
        node = links.producers.get(made)
    if not _is(node, "MatMul"):
        made_by = f"a {node.op_type}" if node is not None else "no node (a graph input or initializer)"
        raise _Keep(f"the {op} head split is not made by a MatMul (and a bias Add) but {made_by}")
    assert node is not None
    weight = _initializer(links, node.input[1])
    if weight is None:
        raise _Keep(f"the {op} projection's weight {node.input[1]!r} is not a constant initializer")
    return _Projection(node, add, weight, bias, value)


def _check(projections: list[_Projection], head_dim: int) -> int:
    """The projections' width H*d when they merge exactly, else _Keep."""
    q = projections[0]
    if any(p.matmul.input[0] != q.matmul.input[0] for p in projections):
        raise _Keep("Q, K and V are projections of different inputs")
    if any(p.weight.data_type != q.weight.data_type for p in projections):
        raise _Keep("the Q, K and V weights differ in dtype")
    if any(len(p.weight.dims) != 2 or list(p.weight.dims) != list(q.weight.dims) for p in projections):
        raise _Keep(f"the Q, K and V weights are not one shape [K, H*d] ({[list(p.weight.dims) for p in projections]})")
    width = int(q.weight.dims[1])
    if width % head_dim:
        raise _Keep(f"the projections' width {width} is not a multiple of the head dim {head_dim}")
    for p in projections:
        if p.bias is not None and (list(p.bias.dims) != [width] or p.bias.data_type != q.weight.data_type):
            raise _Keep(f"the bias {p.bias.name!r} is not [{width}] of the weights' dtype")
    return width


def _concat(tensors: list[onnx.TensorProto], axis: int, name: str, base_dir: Path | None) -> onnx.TensorProto:
    """The tensors' values concatenated along ``axis`` as one initializer of their dtype (raw data)."""
    if any(is_external(t) for t in tensors) and base_dir is None:
        raise _Keep("the weights are external data that is not loaded")
    arrays = [numpy_helper.to_array(inline_tensor(t, base_dir)) for t in tensors]
    joined = np.ascontiguousarray(np.concatenate(arrays, axis=axis))
    size = onnx.helper.tensor_dtype_to_np_dtype(tensors[0].data_type).itemsize
    if joined.dtype.itemsize != size:  # an element type numpy holds in another width
        raise _Keep(f"the weights' element type {onnx.TensorProto.DataType.Name(tensors[0].data_type)} is not "
                    "concatenated exactly here")
    return helper.make_tensor(name, tensors[0].data_type, list(joined.shape), joined.tobytes(), raw=True)


def _zeros(like: onnx.TensorProto, width: int) -> onnx.TensorProto:
    """[width] zeros of ``like``'s dtype (all bits clear: +0 in every float type)."""
    size = onnx.helper.tensor_dtype_to_np_dtype(like.data_type).itemsize
    return helper.make_tensor(f"{like.name}_zeros", like.data_type, [width], bytes(width * size), raw=True)


def pack_projections(model: onnx.ModelProto, base_dir: str | Path | None = None,
                     sites: tuple[AttentionSite, ...] | None = None,
                     copy: bool = True) -> tuple[onnx.ModelProto, PackResult]:
    """Merge the Q, K, V projections of each attention site of ``sites`` (default: all ``find_attention``
    finds) into one MatMul (+ one bias Add) and a Split, where that is exact; returns the model (a copy unless
    ``copy`` is False) and which sites were packed, with the reason for each that was not."""
    base = None if base_dir is None else Path(base_dir)
    if sites is None:
        sites = find_attention(model, base).sites
    out = model_to_edit(model, copy)
    graph = out.graph
    before = _graph_reads(graph)
    taken = names_in_use(graph)
    packed: list[str] = []
    notes: list[tuple[str, str]] = []
    opset = default_opset(out)
    for site in sites:
        if site.rank != 4 or site.packed:
            continue
        links = _Links(graph, base)  # again per site: the graph changed
        try:
            if site.layout & 7 != 7:
                raise _Keep("the head splits of Q, K and V are not all absorbed (see the kept Transposes)")
            if opset < 11:
                raise _Keep(f"the model's opset {opset} is below 11 (the Split along axis -1)")
            projections = [_projection(links, value, op) for value, op in ((site.q, "Q"), (site.kt, "K"),
                                                                          (site.v, "V"))]
            width = _check(projections, site.head_dim)
            q = projections[0]
            prefix = q.matmul.name or q.matmul.output[0]
            weight = _concat([p.weight for p in projections], 1, unique_name(f"{q.weight.name}_qkv", taken), base)
            bias = None
            biased = next((p for p in projections if p.bias is not None and p.add is not None), None)
            if biased is not None:  # a projection without a bias adds zeros (x + 0 == x)
                assert biased.bias is not None
                bias = _concat([p.bias if p.bias is not None else _zeros(biased.bias, width) for p in projections],
                               0, unique_name(f"{biased.bias.name}_qkv", taken), base)
        except _Keep as why:
            notes.append((site.output, str(why)))
            continue
        product = unique_name(f"{q.matmul.output[0]}_qkv", taken)
        new = [helper.make_node("MatMul", [q.matmul.input[0], weight.name], [product],
                                name=unique_name(f"{prefix}_qkv", taken))]
        joined = product
        if bias is not None and biased is not None and biased.add is not None and biased.bias is not None:
            joined = unique_name(f"{biased.add.output[0]}_qkv", taken)
            operands = [bias.name, product] if biased.add.input[0] == biased.bias.name else [product, bias.name]
            new.append(helper.make_node("Add", operands, [joined],
                                        name=unique_name(f"{biased.add.name or joined}_qkv", taken)))
        outputs = [p.output for p in projections]
        split_name = unique_name(f"{prefix}_qkv_split", taken)
        if opset >= 13:
            sizes = numpy_helper.from_array(np.array([width] * 3, np.int64), unique_name(f"{split_name}_sizes", taken))
            graph.initializer.append(sizes)
            new.append(helper.make_node("Split", [joined, sizes.name], outputs, name=split_name, axis=-1))
        else:
            new.append(helper.make_node("Split", [joined], outputs, name=split_name, axis=-1, split=[width] * 3))
        gone = [p.matmul for p in projections] + [p.add for p in projections if p.add is not None]
        at = min(i for i, n in enumerate(graph.node) if any(n is g for g in gone))
        kept = [n for n in graph.node if not any(n is g for g in gone)]
        kept[at:at] = new
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend([weight] + ([bias] if bias is not None else []))
        packed.append(site.output)
    if packed:
        _drop_unread(graph, before)
    return out, PackResult(tuple(packed), tuple(notes))
