"""Graph pre-pass: a BatchNormalization right after a Conv folded into the Conv's weight and bias.

Models exported without constant folding, or converted from other frameworks (the ONNX Model Zoo's ResNets and
MobileNets), keep ``Conv -> BatchNormalization``. ONNX Runtime folds such a pair when it loads the model, but a
Conv the rewrite has made a custom op is no longer one it folds into: the normalization would run as a kernel
of its own after every tuned conv. So the pair is folded here first, as ORT does it, in float64 then rounded to
the weight's type:

    s = scale / sqrt(var + epsilon);  W' = W * s (per output channel);  B' = (B - mean) * s + bias

(B is 0 where the Conv has none). The Conv then writes the normalization's output, and the scanner fuses what
follows (a Relu, a residual Add) as for any conv. Folded when the normalization is in inference mode
(``training_mode`` 0, one output; ``spatial`` 1 before opset 9), its four parameters and the Conv's weight
(and bias) are constants whose values the model holds, each of C values, and the normalization alone reads the
Conv's output; a weight read by another node is copied. Left as they are otherwise, with the reason in
``BatchNormResult.notes`` (a normalization not after a Conv is not listed). ``optimize`` and ``scan`` run it
before the other pre-passes; running it twice changes nothing more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tuner.model_file import is_external
from tuner.rewrite import _drop_unread, _graph_reads, model_to_edit, names_in_use, unique_name
from tuner.scan import GraphLinks

__all__ = ["BatchNormResult", "fold_batchnorms"]


@dataclass(frozen=True)
class BatchNormResult:
    folded: tuple[str, ...]  # the outputs of the normalizations now computed by their Convs
    notes: tuple[tuple[str, str], ...] = ()  # (a normalization's output, why it stays after its Conv)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _why_not(bn: onnx.NodeProto, conv: onnx.NodeProto, inits: dict[str, onnx.TensorProto], links: GraphLinks,
             opset: int) -> str:
    at = _attrs(bn)
    if at.get("training_mode", 0) or len([o for o in bn.output if o]) != 1:
        return "a normalization in training mode (its running statistics are outputs)"
    if opset < 9 and at.get("spatial", 1) != 1:
        return "spatial=0 (per-element statistics)"
    if len(links.consumers.get(conv.output[0], [])) != 1 or conv.output[0] in links.graph_outputs:
        return "the Conv's output is read by another node too"
    names = list(bn.input[1:5]) + list(conv.input[1:3])
    if len(bn.input) < 5 or not all(n in inits for n in names if n):
        return "its parameters or the Conv's weight and bias are not all constant initializers"
    if any(is_external(inits[n]) for n in names if n):
        return "its parameters or the Conv's weight are in an external file (not loaded here)"
    channels = inits[conv.input[1]].dims[0] if inits[conv.input[1]].dims else 0
    if any(list(inits[n].dims) != [channels] for n in bn.input[1:5]) or \
            (len(conv.input) > 2 and conv.input[2] and list(inits[conv.input[2]].dims) != [channels]):
        return f"parameters that are not {channels} values, one per output channel"
    return ""


def fold_batchnorms(model: onnx.ModelProto, copy: bool = True) -> tuple[onnx.ModelProto, BatchNormResult]:
    """``model`` (a copy unless ``copy`` is False) with each BatchNormalization right after a Conv in its main
    graph folded into that Conv."""
    out = model_to_edit(model, copy)
    graph = out.graph
    bns = [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]
    if not bns:
        return out, BatchNormResult(())
    links = GraphLinks(graph)
    producer = {o: n for n in graph.node for o in n.output if o}
    inits = {t.name: t for t in graph.initializer}
    opset = next((int(o.version) for o in out.opset_import if o.domain in ("", "ai.onnx")), 1)
    before = _graph_reads(graph)
    names = functools.partial(unique_name, taken=names_in_use(graph))
    folded, notes, drop, gone = [], [], set(), set()
    for bn in bns:
        conv = producer.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.input) < 2:
            continue
        why = _why_not(bn, conv, inits, links, opset)
        if why:
            notes.append((bn.output[0], f"BatchNormalization after Conv: {why}"))
            continue
        scale, shift, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in bn.input[1:5])
        weight = numpy_helper.to_array(inits[conv.input[1]])
        bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 and \
            conv.input[2] else np.zeros(weight.shape[0])
        s = scale / np.sqrt(var + float(_attrs(bn).get("epsilon", 1e-5)))
        folded_w = (weight.astype(np.float64) * s.reshape(-1, *([1] * (weight.ndim - 1)))).astype(weight.dtype)
        folded_b = ((bias - mean) * s + shift).astype(weight.dtype)
        w_name, b_name = names(f"{conv.input[1]}_bn"), names(f"{bn.output[0]}_conv_bias")
        graph.initializer.extend([numpy_helper.from_array(folded_w, w_name), numpy_helper.from_array(folded_b, b_name)])
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        gone.add(conv.output[0])
        conv.output[0] = bn.output[0]
        drop.add(id(bn))
        folded.append(bn.output[0])
    if drop:
        kept = [n for n in graph.node if id(n) not in drop]
        del graph.node[:]
        graph.node.extend(kept)
        for vi in [vi for vi in graph.value_info if vi.name in gone]:  # the Convs' old outputs are no more
            graph.value_info.remove(vi)
        _drop_unread(graph, before)
    return out, BatchNormResult(tuple(folded), tuple(notes))
