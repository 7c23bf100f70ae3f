"""Graph pre-pass: per-channel affine ops right after a Conv folded into the Conv's weight and bias.

ONNX Runtime folds a BatchNormalization, and a Mul / Add by a per-channel constant, into the Conv before it when
it loads a model (its ConvBNFusion, ConvMulFusion and ConvAddFusion). A Conv the rewrite has made a custom op is
no longer one it folds into: those ops would run as kernels of their own after every tuned conv. They appear in
exports without constant folding and in converted models (the ONNX Model Zoo's ResNets and MobileNets keep
``BatchNormalization``), and as ``Mul`` and ``Add`` in backbones with frozen batch norm (torchvision's and
detectron2's detection ResNets: ``x * scale + shift`` with [1, C, 1, 1] constants). So they are folded here
first, as ORT does it, in float64 then rounded to the weight's type, one op at a time down the chain:

- ``BatchNormalization``: s = scale / sqrt(var + epsilon); W' = W * s (per output channel), B' = (B - mean) * s
  + bias;
- ``Mul`` by c (``Div`` by 1 / c): W' = W * c, B' = B * c;
- ``Add`` of c (``Sub`` of -c, the Conv's output first): B' = B + c;

B is 0 where the Conv has none; c is a constant of one value, or of one per output channel laid out along the
channel axis ([C, 1, 1], [1, C, 1, 1]). The Conv then writes the op's output, and the scanner fuses what follows
(a Relu, a residual Add) as for any conv. Folded when the op alone reads the Conv's output (no graph output),
the Conv's weight (and bias) and the op's constants are values the model holds (a weight read by another node
is copied), and a BatchNormalization is in inference mode (``training_mode`` 0, one output; ``spatial`` 1 before
opset 9) with C values per parameter. Left as they are otherwise; a normalization stays with the reason in
``AffineResult.notes`` (a Mul or Add that is not per channel is no normalization: not listed). ``optimize`` and
``scan`` run it before the other pre-passes; running it twice changes nothing more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from tuner.model_file import is_external
from tuner.rewrite import _drop_unread, _graph_reads, default_opset, model_to_edit, names_in_use, unique_name
from tuner.scan import GraphLinks, _attrs

__all__ = ["AffineResult", "fold_conv_affines", "FOLDED_OPS"]

FOLDED_OPS = ("BatchNormalization", "Mul", "Div", "Add", "Sub")


@dataclass(frozen=True)
class AffineResult:
    folded: tuple[str, ...]  # the outputs of the ops now computed by their Convs, in folding order
    notes: tuple[tuple[str, str], ...] = ()  # (a BatchNormalization's output, why it stays after its Conv)


def _loaded(name: str, inits: dict[str, onnx.TensorProto]) -> bool:
    return name in inits and not is_external(inits[name])


def _per_channel(value: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """``value`` as one number per output channel, where it broadcasts over a Conv output of ``rank`` dims
    [N, C, spatial...] as such (one value, or C along the channel axis); None otherwise."""
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1).astype(np.float64), (channels,))


def _batchnorm(bn: onnx.NodeProto, inits: dict[str, onnx.TensorProto], channels: int, opset: int
               ) -> tuple[np.ndarray, np.ndarray] | str:
    """(multiplier, addend) per channel of an inference-mode normalization, or why it is not folded."""
    at = _attrs(bn)
    if at.get("training_mode", 0) or len([o for o in bn.output if o]) != 1:
        return "a normalization in training mode (its running statistics are outputs)"
    if opset < 9 and at.get("spatial", 1) != 1:
        return "spatial=0 (per-element statistics)"
    if len(bn.input) < 5 or not all(n in inits for n in bn.input[1:5]):
        return "its parameters are not all constant initializers"
    if not all(_loaded(n, inits) for n in bn.input[1:5]):
        return "its parameters are in an external file (not loaded here)"
    if any(list(inits[n].dims) != [channels] for n in bn.input[1:5]):
        return f"parameters that are not {channels} values, one per output channel"
    scale, shift, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in bn.input[1:5])
    s = scale / np.sqrt(var + float(at.get("epsilon", 1e-5)))
    return s, shift - mean * s


def _affine(op: onnx.NodeProto, conv_out: str, inits: dict[str, onnx.TensorProto], channels: int, rank: int
            ) -> tuple[np.ndarray, np.ndarray] | None:
    """(multiplier, addend) per channel of a Mul, Div, Add or Sub by a loaded per-channel constant, else None."""
    if len(op.input) != 2 or conv_out not in op.input:
        return None
    other = op.input[1] if op.input[0] == conv_out else op.input[0]
    if other == conv_out or not _loaded(other, inits) or (op.op_type in ("Div", "Sub") and op.input[0] != conv_out):
        return None
    c = _per_channel(numpy_helper.to_array(inits[other]), channels, rank)
    if c is None or (op.op_type == "Div" and not np.all(c)):
        return None
    ones, zeros = np.ones(channels), np.zeros(channels)
    return {"Mul": (c, zeros), "Div": (1.0 / c, zeros), "Add": (ones, c), "Sub": (ones, -c)}[op.op_type]


def fold_conv_affines(model: onnx.ModelProto, copy: bool = True) -> tuple[onnx.ModelProto, AffineResult]:
    """``model`` (a copy unless ``copy`` is False) with the per-channel affine ops right after each Conv of its
    main graph folded into that Conv."""
    out = model_to_edit(model, copy)
    graph = out.graph
    if not any(n.op_type in FOLDED_OPS for n in graph.node):
        return out, AffineResult(())
    opset = default_opset(out)
    inits = {t.name: t for t in graph.initializer}
    before = _graph_reads(graph)
    names = functools.partial(unique_name, taken=names_in_use(graph))
    links = GraphLinks(graph)  # stays right: a fold only renames a Conv's output to the folded op's
    folded: list[str] = []
    notes: dict[str, str] = {}
    gone: set[str] = set()  # the Convs' old outputs
    created: set[str] = set()
    dropped: set[int] = set()
    for conv in [n for n in graph.node if n.op_type == "Conv" and n.domain in ("", "ai.onnx") and len(n.input) >= 2]:
        while True:  # down the chain: Conv -> Mul -> Add -> Relu folds the Mul, then the Add
            readers = links.consumers.get(conv.output[0], [])
            if len(readers) != 1 or conv.output[0] in links.graph_outputs:
                for r in readers:
                    if r.op_type == "BatchNormalization" and r.output:
                        notes[r.output[0]] = "the Conv's output is read by another node too"
                break
            op = readers[0]
            if op.op_type not in FOLDED_OPS or op.domain not in ("", "ai.onnx") or not op.output:
                break
            has_bias = len(conv.input) > 2 and bool(conv.input[2])
            params = conv.input[1:3] if has_bias else conv.input[1:2]
            if not all(_loaded(n, inits) for n in params):
                if op.op_type == "BatchNormalization":
                    notes[op.output[0]] = ("the Conv's weight or bias is in an external file (not loaded here)"
                                           if all(n in inits for n in params) else
                                           "the Conv's weight or bias is not a constant initializer")
                break
            weight = numpy_helper.to_array(inits[conv.input[1]])
            channels = weight.shape[0]
            found: tuple[np.ndarray, np.ndarray] | str | None
            if op.op_type == "BatchNormalization":
                found = _batchnorm(op, inits, channels, opset)
            else:
                found = _affine(op, conv.output[0], inits, channels, weight.ndim)
            if found is None or isinstance(found, str):
                if isinstance(found, str):
                    notes[op.output[0]] = found
                break
            mul, add = found
            bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if has_bias else np.zeros(channels)
            new_w = (weight.astype(np.float64) * mul.reshape(-1, *([1] * (weight.ndim - 1)))).astype(weight.dtype)
            new_b = (bias * mul + add).astype(weight.dtype)
            w_name, b_name = names(f"{conv.input[1]}_folded"), names(f"{op.output[0]}_conv_bias")
            for name, value in ((w_name, new_w), (b_name, new_b)):
                inits[name] = numpy_helper.from_array(value, name)
                graph.initializer.append(inits[name])
                created.add(name)
            del conv.input[1:]
            conv.input.extend([w_name, b_name])
            gone.add(conv.output[0])
            conv.output[0] = op.output[0]
            dropped.add(id(op))
            folded.append(op.output[0])
    if folded:
        kept = [n for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
        for vi in [vi for vi in graph.value_info if vi.name in gone]:
            graph.value_info.remove(vi)
        # the constants of a chain's earlier folds, which its later ones replaced, and what the ops read
        _drop_unread(graph, before | created)
    return out, AffineResult(tuple(folded), tuple((o, f"BatchNormalization after Conv: {why}")
                                                   for o, why in notes.items() if o not in folded))
