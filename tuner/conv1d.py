"""Graph pre-pass: 1-D convolutions as 2-D ones, so they are tuned like any other Conv.

Audio encoders (Whisper's two front-end convs, wav2vec2's and HuBERT's feature extractors) and 1-D CNNs run
``Conv`` on ``[N, C, L]`` with a ``[OC, C, k]`` weight, L dynamic. The kernels and the custom op are 2-D (NCHW),
and a 1-D conv is the 2-D conv of height 1::

    Y = Conv(X, W, B; strides [s], pads [b, e], dilations [d])
      = Squeeze(Conv(Unsqueeze(X, 2), W[:, :, None, :], B; strides [1, s], pads [0, b, 0, e],
                     dilations [1, d]), 2)

which is what this pass writes, exactly the same values. The weight keeps its bytes: its dims gain the 1 in
place (a copy under a new name where something else reads it too), so external data stays valid. Unsqueeze and
Squeeze only relabel the dims (ORT runs them without a copy). An elementwise activation after the Squeeze
(Whisper's Gelu) is still fused: the scanner looks through the Squeeze as through GPT-2's Reshape, and the
rewrite moves it after the fused node.

A Conv is left as it is, with the reason in ``Conv1dResult.notes``, when its weight is not a constant
initializer or its ``auto_pad`` is SAME at a stride above 1 (the scanner would refuse
the 2-D form for the same reasons; a SAME conv's pads then follow the length, dynamic in such models). ``optimize``
and ``scan`` run it before scanning; running it twice changes nothing more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tuner.rewrite import _drop_unread, _graph_reads, axes_node, default_opset, model_to_edit, names_in_use, unique_name
from tuner.scan import GraphLinks, conv1d_out_of_range, conv_auto_pad, same_pad_total

__all__ = ["Conv1dResult", "convs_as_2d"]


@dataclass(frozen=True)
class Conv1dResult:
    converted: tuple[str, ...]  # the first outputs of the 1-D Convs now written as 2-D ones
    notes: tuple[tuple[str, str], ...] = ()  # (a 1-D Conv's output, why it stays 1-D)


def _weight_2d(graph: onnx.GraphProto, links: GraphLinks, w: onnx.TensorProto, names) -> str:
    """The weight with dims [OC, C, 1, k]: in place where the Conv alone reads it, else a copy."""
    dims = list(w.dims[:2]) + [1, w.dims[2]]
    if len(links.consumers.get(w.name, [])) == 1 and w.name not in links.graph_outputs:
        del w.dims[:]
        w.dims.extend(dims)
        for vi in graph.input:  # IR < 4 models list their initializers as graph inputs too
            if vi.name == w.name and vi.type.tensor_type.HasField("shape"):
                vi.type.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(w.data_type, dims).tensor_type.shape)
        stale = [vi for vi in graph.value_info if vi.name == w.name]  # an exporter's record of the old dims
        for vi in stale:
            graph.value_info.remove(vi)
        return w.name
    copy = onnx.TensorProto()
    copy.CopyFrom(w)
    copy.name = names(f"{w.name}_2d")
    del copy.dims[:]
    copy.dims.extend(dims)
    graph.initializer.append(copy)
    return copy.name


def convs_as_2d(model: onnx.ModelProto, copy: bool = True) -> tuple[onnx.ModelProto, Conv1dResult]:
    """``model`` (a copy unless ``copy`` is False) with each 1-D Conv of its main graph written as a 2-D one
    between an Unsqueeze and a Squeeze of axis 2."""
    out = model_to_edit(model, copy)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    convs = [n for n in graph.node if n.op_type == "Conv" and n.domain in ("", "ai.onnx") and len(n.input) >= 2
             and n.input[1] in inits and len(inits[n.input[1]].dims) == 3]
    if not convs:
        return out, Conv1dResult(())
    links = GraphLinks(graph)
    before = _graph_reads(graph)
    names = functools.partial(unique_name, taken=names_in_use(graph))
    opset = default_opset(out)
    axes = None
    if opset >= 13:
        axes = names("dietcode_axis_2")
        graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), axes))
    converted, notes, rebuilt = [], [], []
    one_d = {id(c) for c in convs}
    for node in graph.node:
        if id(node) not in one_d:
            rebuilt.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        auto_pad = conv_auto_pad(attrs)
        stride, width = attrs.get("strides", [1])[0], inits[node.input[1]].dims[2]
        why = f"auto_pad={auto_pad} at stride {stride} (its pads change with the length)" \
            if auto_pad.startswith("SAME") and same_pad_total(width, stride, "length") is None \
            else conv1d_out_of_range(attrs, inits[node.input[1]].dims)
        if why:  # the scanner would leave the 2-D form alone too: no Unsqueeze/Squeeze around an untuned Conv
            notes.append((node.output[0], f"{why}: stays 1-D, and is not tuned"))
            rebuilt.append(node)
            continue
        label = node.name or node.output[0]
        x4, y4 = names(f"{node.input[0]}_h1"), names(f"{node.output[0]}_h1")
        conv = onnx.NodeProto()
        conv.CopyFrom(node)
        conv.input[0] = x4
        conv.input[1] = _weight_2d(graph, links, inits[node.input[1]], names)
        conv.output[0] = y4
        for a in conv.attribute:
            if a.name in ("strides", "dilations", "kernel_shape"):
                a.ints[:] = [1, *a.ints]
            elif a.name == "pads" and len(a.ints) == 2:
                a.ints[:] = [0, a.ints[0], 0, a.ints[1]]
        rebuilt += [axes_node("Unsqueeze", node.input[0], x4, [2], opset, axes, names(f"{label}_unsqueeze")), conv,
                    axes_node("Squeeze", y4, node.output[0], [2], opset, axes, names(f"{label}_squeeze"))]
        converted.append(node.output[0])
    del graph.node[:]
    graph.node.extend(rebuilt)
    _drop_unread(graph, before | ({axes} if axes else set()))  # a shared 1-D weight now copied; an unused axes
    return out, Conv1dResult(tuple(converted), tuple(notes))

