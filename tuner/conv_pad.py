"""Graph pre-pass: a zero ``Pad`` right before a ``Conv`` folded into the Conv's pads.

Keras writes ``ZeroPadding2D`` then a 'valid' conv before each stride-2 conv of MobileNetV2 and ResNet-50
(tf2onnx keeps the Pad), PyTorch models ``nn.ZeroPad2d`` or ``F.pad``. onnxruntime folds such a Pad into the
Conv when it loads the model (its PadFusion), so stock ORT runs no Pad there; a custom node in the Conv's place
takes no such fold, and the optimized model would run a copy of the activation the original does not. This
pass makes the fold before scanning::

    Conv(Pad(X, pads, 0), W; pads p)  ==  Conv(X, W; pads p + the Pad's spatial pads)

exactly the same values (the padded border is zeros either way). A Pad is folded when it is a default-domain
Pad of mode ``constant`` whose value is 0 (absent, or a constant 0) and whose pads are a constant, not negative
and 0 on the batch and channel axes (no ``axes`` input), read by one default-domain Conv alone, as its X, whose
``auto_pad`` is NOTSET or VALID (a SAME conv's pads are computed from the padded size). Any other Pad stays as
it is. ``optimize`` and ``scan`` run this pass first among the conv passes; running it twice changes nothing
more.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from tuner.rewrite import _drop_unread, _graph_reads, default_opset, model_to_edit
from tuner.scan import GraphLinks, conv_auto_pad, small_constants

__all__ = ["PadFoldResult", "fold_pads"]


@dataclass(frozen=True)
class PadFoldResult:
    folded: tuple[str, ...]  # the first outputs of the Convs whose Pad was folded into their pads


def _spatial_pads(pad: onnx.NodeProto, opset: int, consts: dict[str, np.ndarray]) -> list[int] | None:
    """A zero constant Pad's pads on the spatial axes (begins then ends), or None when it is not one to fold."""
    attrs = {a.name: helper.get_attribute_value(a) for a in pad.attribute}
    mode = attrs.get("mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return None
    if opset < 11:  # pads and value are attributes
        pads, value = list(attrs.get("pads", [])), float(attrs.get("value", 0.0))
    else:
        if len(pad.input) > 3 and pad.input[3]:  # axes (opset 18)
            return None
        read = consts.get(pad.input[1]) if len(pad.input) > 1 and pad.input[1] else None
        if read is None or read.ndim != 1:
            return None
        pads = [int(p) for p in read]
        given = pad.input[2] if len(pad.input) > 2 else ""
        fill = consts.get(given) if given else np.zeros(1)
        if fill is None or fill.size > 1:
            return None
        value = float(fill.reshape(-1)[0]) if fill.size else 0.0
    rank = len(pads) // 2
    if value != 0.0 or len(pads) % 2 or rank < 3 or any(p < 0 for p in pads) \
            or pads[0] or pads[1] or pads[rank] or pads[rank + 1]:
        return None
    return pads[2:rank] + pads[rank + 2:]


def fold_pads(model: onnx.ModelProto, copy: bool = True) -> tuple[onnx.ModelProto, PadFoldResult]:
    """``model`` (a copy unless ``copy`` is False) with each zero Pad that alone feeds a Conv's input folded
    into that Conv's pads."""
    out = model_to_edit(model, copy)
    graph = out.graph
    if not any(n.op_type == "Pad" for n in graph.node):
        return out, PadFoldResult(())
    links = GraphLinks(graph)
    consts = small_constants(graph)
    opset = default_opset(out)
    before = _graph_reads(graph)
    folded, gone = [], []
    for conv in graph.node:
        if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or not conv.input:
            continue
        pad = links.producers.get(conv.input[0])
        if pad is None or pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx") \
                or not links.read_only_by(conv.input[0], conv) or conv.input[1] == conv.input[0]:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
        if conv_auto_pad(attrs) not in ("NOTSET", "VALID"):
            continue
        spatial = _spatial_pads(pad, opset, consts)
        if spatial is None:
            continue
        own = list(attrs.get("pads", [0] * len(spatial))) if conv_auto_pad(attrs) == "NOTSET" else [0] * len(spatial)
        if len(own) != len(spatial):
            continue
        keep = [a for a in conv.attribute if a.name not in ("pads", "auto_pad")]
        del conv.attribute[:]
        conv.attribute.extend(keep)
        conv.attribute.append(helper.make_attribute("pads", [a + b for a, b in zip(own, spatial)]))
        conv.input[0] = pad.input[0]
        folded.append(conv.output[0])
        gone.append(pad)
    if gone:
        # deleted by index: a repeated field's messages are compared by identity
        for i in reversed([i for i, n in enumerate(graph.node) if any(n is g for g in gone)]):
            del graph.node[i]
        _drop_unread(graph, before)
    return out, PadFoldResult(tuple(folded))
