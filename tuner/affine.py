"""Graph pre-pass: per-channel affine ops right after a Conv, Gemm or MatMul folded into its weight and bias.

ONNX Runtime folds a BatchNormalization, and a Mul / Add by a per-channel constant, into the Conv before it when
it loads a model (its ConvBNFusion, ConvMulFusion and ConvAddFusion), and a BatchNormalization into the Gemm or
2-D MatMul before it (MatMulBNFusion). A product the rewrite has made a custom op is no longer one it folds into:
those ops would run as kernels of their own after every tuned node. They appear in exports without constant
folding and in converted models (the ONNX Model Zoo's ResNets and MobileNets keep ``BatchNormalization``), as
``Mul`` and ``Add`` in backbones with frozen batch norm (torchvision's and detectron2's detection ResNets:
``x * scale + shift`` with [1, C, 1, 1] constants), as a Linear layer's BatchNorm1d, and as LayerScale after a
transformer's projections (CaiT, DeiT III, DINOv2: ``(x @ W + b) * gamma`` before the residual Add, which a
kernel can fuse only once the Mul is gone). So they are folded here first, in float64 then rounded to the
weight's type, one op at a time down the chain:

- ``BatchNormalization``: s = scale / sqrt(var + epsilon); W' = W * s (per output channel), B' = (B - mean) * s
  + bias;
- ``Mul`` by c (``Div`` by 1 / c): W' = W * c, B' = B * c;
- ``Add`` of c (``Sub`` of -c, the product's output first): B' = B + c;

B is 0 where the product has none (a Gemm's is beta * C, written back with beta 1; a MatMul's is the constant of
the Add after it, which a fold writes as [N] values, making one where it had none); c is a constant of one value,
or of one per output channel laid out along the channel axis: axis 1 of a Conv's output ([C, 1, 1], [1, C, 1,
1]), the last axis of a Gemm's or MatMul's ([N], [1, 1, N]). A Mul, Div, Add or Sub behind a Transpose that alone passes a Gemm's or MatMul's output on
(torchvision's ConvNeXt: Linear, permute back to NCHW, ``layer_scale * x`` with a [C, 1, 1] constant) folds too,
its constant read along the axis the Transpose moved the channels to; the chain stops there (an Add of a constant
behind it, after a MatMul without a bias, stays: its bias Add would go before the Transpose). A BatchNormalization
normalizes axis 1, so it is
folded after a Gemm, and after a MatMul only where its input is known to be 2-D. The product (or a MatMul's bias
Add) then writes the op's output, and the scanner fuses what follows (a Relu, a residual Add) as for any
product. Folded when the op alone reads the output (no graph output), the weight (a Conv's or Gemm's second
input, a MatMul's [K, N] second input), the bias and the op's constants are values the model holds (a weight read
by another node is copied), and a BatchNormalization is in inference mode (``training_mode`` 0, one output;
``spatial`` 1 before opset 9) with C values per parameter, and the weight is of a float type (an integer
product's Div truncates). Left as they are otherwise; a normalization stays
with the reason in ``AffineResult.notes`` (a Mul or Add that is not per channel is no normalization: not listed).
A Transpose of a weight (a TorchScript export without constant folding) is made a constant first, as ORT
makes it at load (``AffineResult.transposed``), and a Gemm's alpha and beta (``alpha * A @ B + beta * C``; the
kernels compute A @ B + C) go into its constant B and C, wherever it is (``AffineResult.scaled``). ``optimize``
and ``scan`` run the pass before the other pre-passes but the Einsum one (whose MatMuls it folds into); running
it twice changes nothing more.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from dietcode_ort.errors import DietcodeError
from tuner.model_file import external_source, inline_tensor, is_external
from tuner.rewrite import _drop_unread, _graph_reads, default_opset, model_to_edit, names_in_use, unique_name
from tuner.scan import GraphLinks, _attrs

__all__ = ["AffineResult", "fold_affines", "FOLDED_OPS", "PRODUCTS"]

FOLDED_OPS = ("BatchNormalization", "Mul", "Div", "Add", "Sub")
PRODUCTS = ("Conv", "Gemm", "MatMul")
# a product of integers is left alone: (x @ W) / c by an integer c truncates, x @ (W / c) is another value
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


@dataclass(frozen=True)
class AffineResult:
    folded: tuple[str, ...]  # the outputs of the ops now computed by their products, in folding order
    notes: tuple[tuple[str, str], ...] = ()  # (a BatchNormalization's output, why it stays after its product)
    scaled: tuple[str, ...] = ()  # the outputs of the Gemms whose alpha and beta were folded into B and C
    transposed: tuple[str, ...] = ()  # the Transposes of weights now constants of their own (by their outputs)


@dataclass
class _Product:
    """A Conv, Gemm or MatMul with a constant weight, as the folds down its chain change it."""
    node: onnx.NodeProto
    weight_axis: int  # the output channels' axis of the weight
    channels: int
    rank: int | None  # the output's rank, where known
    channel_axis: int  # the output channels' axis of the output: 1 (Conv) or -1 (the last)
    bias_add: onnx.NodeProto | None = None  # a MatMul's Add of its bias, once met

    @property
    def tail(self) -> onnx.NodeProto:
        """The node writing the product's output (with its bias, for a MatMul)."""
        return self.bias_add or self.node


class _Constants(dict[str, onnx.TensorProto]):
    """The model's initializers by name, with the folder their external data files are in (None: such values
    are not read)."""

    def __init__(self, tensors: Iterable[onnx.TensorProto], base_dir: Path | None):
        super().__init__((t.name, t) for t in tensors)
        self.base_dir = base_dir

    def readable(self, name: str) -> bool:
        """Whether ``name`` is an initializer whose value can be read: held in the model, or in an external
        data file of the model's folder that is there."""
        t = self.get(name)
        if t is None or not is_external(t):
            return t is not None
        if self.base_dir is None:
            return False
        try:
            external_source(t, self.base_dir)
        except DietcodeError:
            return False
        return True

    def array(self, name: str) -> np.ndarray:
        """The value of a ``readable`` initializer (read from its file when it is external)."""
        t = self[name]
        return numpy_helper.to_array(inline_tensor(t, self.base_dir) if is_external(t) else t)


def _per_channel(value: np.ndarray, channels: int, rank: int | None, axis: int) -> np.ndarray | None:
    """``value`` as one number per output channel, where it broadcasts over an output of ``rank`` dims (None:
    unknown, at least 1) with the channels at ``axis`` (1, or -1: the last) as such (one value, or the channels
    along that axis); None otherwise."""
    if rank is None:  # only a value of at most one dim, along the last axis, cannot make the output's rank grow
        if value.ndim > 1 or axis != -1:
            return None
        rank = 1
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    axis %= rank
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1).astype(np.float64), (channels,))


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """The rank of each value whose shape the model states (inputs, value_info, outputs, initializers)."""
    ranks = {t.name: len(t.dims) for t in graph.initializer}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    return ranks


def _product(node: onnx.NodeProto, inits: _Constants, ranks: dict[str, int]) -> _Product | None:
    """``node`` as a product a fold can change, or None (another op, or a weight that is no constant of the
    product's form)."""
    if node.op_type not in PRODUCTS or node.domain not in ("", "ai.onnx") or len(node.input) < 2 or not node.output:
        return None
    weight = inits.get(node.input[1])
    if weight is None or not node.input[0] or weight.data_type not in _FLOATS or \
            (node.op_type != "Conv" and len(weight.dims) != 2):
        return None
    dims = [int(d) for d in weight.dims]
    if node.op_type == "Conv":
        return _Product(node, 0, dims[0], len(dims), 1) if len(dims) >= 3 else None
    if node.op_type == "Gemm":
        trans_b = int(_attrs(node).get("transB", 0))
        return _Product(node, 0 if trans_b else 1, dims[0 if trans_b else 1], 2, -1)
    return _Product(node, 1, dims[1], ranks.get(node.input[0]), -1)


def _bias(p: _Product, inits: _Constants) -> np.ndarray | str:
    """The product's bias as one number per output channel (zeros where it has none), or why it cannot be
    folded into."""
    if p.node.op_type == "MatMul":
        if p.bias_add is None:
            return np.zeros(p.channels)
        name = next(i for i in p.bias_add.input if i != p.node.output[0])
    else:
        name = p.node.input[2] if len(p.node.input) > 2 else ""
    if not name:
        return np.zeros(p.channels)
    if name not in inits:
        return f"the {p.node.op_type}'s bias is not a constant initializer"
    if not inits.readable(name):
        return f"the {p.node.op_type}'s bias is in an external file that was not read"
    value = inits.array(name)  # a Conv's is [C]; a Gemm's broadcasts to [M, N]
    b = _per_channel(value, p.channels, 1, -1) if p.node.op_type == "Conv" else \
        _per_channel(value, p.channels, p.rank, p.channel_axis)
    if b is None:
        return f"the {p.node.op_type}'s bias is not one value per output channel"
    beta = float(_attrs(p.node).get("beta", 1.0)) if p.node.op_type == "Gemm" else 1.0
    return b * beta


def _batchnorm(bn: onnx.NodeProto, inits: _Constants, p: _Product, opset: int
               ) -> tuple[np.ndarray, np.ndarray] | str:
    """(multiplier, addend) per channel of an inference-mode normalization, or why it is not folded."""
    at = _attrs(bn)
    if p.channel_axis != 1 and p.rank != 2:
        return (f"it normalizes axis 1 of the {p.node.op_type}'s output, whose rank is not known"
                if p.rank is None else
                f"it normalizes axis 1 of the {p.node.op_type}'s {p.rank}-D output, not its output channels")
    if at.get("training_mode", 0) or len([o for o in bn.output if o]) != 1:
        return "a normalization in training mode (its running statistics are outputs)"
    if opset < 9 and at.get("spatial", 1) != 1:
        return "spatial=0 (per-element statistics)"
    if len(bn.input) < 5 or not all(n in inits for n in bn.input[1:5]):
        return "its parameters are not all constant initializers"
    if not all(inits.readable(n) for n in bn.input[1:5]):
        return "its parameters are in an external file that was not read"
    if any(list(inits[n].dims) != [p.channels] for n in bn.input[1:5]):
        return f"parameters that are not {p.channels} values, one per output channel"
    scale, shift, mean, var = (inits.array(n).astype(np.float64) for n in bn.input[1:5])
    s = scale / np.sqrt(var + float(at.get("epsilon", 1e-5)))
    return s, shift - mean * s


def _affine(op: onnx.NodeProto, out: str, inits: _Constants, p: _Product,
            layout: tuple[int | None, int] | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(multiplier, addend) per channel of a Mul, Div, Add or Sub of ``out`` by a loaded per-channel constant,
    else None; ``layout``: (rank, channel axis) of ``out`` where it is not the product's (a Transpose between)."""
    if len(op.input) != 2 or out not in op.input:
        return None
    other = op.input[1] if op.input[0] == out else op.input[0]
    if other == out or not inits.readable(other) or (op.op_type in ("Div", "Sub") and op.input[0] != out):
        return None
    rank, axis = layout or (p.rank, p.channel_axis)
    c = _per_channel(inits.array(other), p.channels, rank, axis)
    if c is None or (op.op_type == "Div" and not np.all(c)):
        return None
    ones, zeros = np.ones(p.channels), np.zeros(p.channels)
    if op.op_type in ("Mul", "Div"):
        return (c if op.op_type == "Mul" else 1.0 / c), zeros
    return ones, (c if op.op_type == "Add" else -c)


def _transposed_op(op: onnx.NodeProto, links: GraphLinks, p: _Product
                   ) -> tuple[onnx.NodeProto | None, tuple[int, int] | None]:
    """Where ``op``, right after a Gemm's or MatMul's output, is a Transpose that alone passes it on to a Mul,
    Div, Add or Sub (torchvision's ConvNeXt: Linear, permute back to NCHW, then ``layer_scale * x`` with a [C, 1,
    1] constant): that op, and (rank, channel axis) of the transposed value; else (None, None)."""
    perm = _attrs(op).get("perm") if op.op_type == "Transpose" and op.domain in ("", "ai.onnx") else None
    if perm is None or p.channel_axis != -1 or len(op.output) != 1:
        return None, None
    after = links.consumers.get(op.output[0], [])
    if len(after) != 1 or op.output[0] in links.graph_outputs or after[0].op_type not in FOLDED_OPS[1:]:
        return None, None
    rank = len(perm)
    return after[0], (rank, list(perm).index(rank - 1))


def _constant_transposes(graph: onnx.GraphProto, inits: _Constants, links: GraphLinks
                         ) -> list[onnx.NodeProto]:
    """The Transposes of a weight a product reads (TorchScript's export without constant folding writes a Linear
    layer as ``MatMul(x, Transpose(W))``, which ORT folds at load) to make constants: of a loaded initializer
    that they alone read (a copy of a shared one, a tied embedding's, would grow the model), read by a Conv,
    Gemm or MatMul as its second input, and not a graph output."""
    found = []
    for t in graph.node:
        if t.op_type != "Transpose" or t.domain not in ("", "ai.onnx") or len(t.input) != 1 or not t.output or \
                not inits.readable(t.input[0]) or t.output[0] in links.graph_outputs:
            continue
        readers = links.consumers.get(t.output[0], [])
        if links.consumers.get(t.input[0], []) == [t] and t.input[0] not in links.graph_outputs and readers and \
                all(r.op_type in PRODUCTS and r.domain in ("", "ai.onnx") and list(r.input).index(t.output[0]) == 1
                    for r in readers):
            found.append(t)
    return found


def _gemm_scales(gemm: onnx.NodeProto, inits: _Constants, keep: Callable[[str, np.ndarray], str],
                 names: Callable[[str], str]) -> bool:
    """Fold a Gemm's alpha into its constant B and its beta into its constant C (alpha * A @ B + beta * C is A @
    (alpha * B) + (beta * C)), dropping both attributes, where either is not 1 (the kernels compute A @ B + C);
    whether it did. Left as it is where B or C is not a loaded constant, or a value would not be finite."""
    at = _attrs(gemm)
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    c = gemm.input[2] if len(gemm.input) > 2 else ""
    if (alpha == 1.0 and (beta == 1.0 or not c)) or not inits.readable(gemm.input[1]) or (c and not inits.readable(c)):
        return False
    values = [inits.array(n) for n in (gemm.input[1], c) if n]
    with np.errstate(all="ignore"):
        scaled = [(v.astype(np.float64) * f).astype(v.dtype) for v, f in zip(values, (alpha, beta))]
    if not all(np.isfinite(v.astype(np.float64)).all() for v in scaled):
        return False
    for i, (name, value) in enumerate(zip((gemm.input[1], c), scaled), start=1):
        gemm.input[i] = keep(names(f"{name}_scaled"), value)
    for i in reversed([i for i, a in enumerate(gemm.attribute) if a.name in ("alpha", "beta")]):
        del gemm.attribute[i]
    return True


def _is_bias(op: onnx.NodeProto, out: str, inits: _Constants, p: _Product) -> bool:
    """Whether ``op``, right after a MatMul without a bias, is already the bias Add the scanner fuses (a loaded
    constant of N values along the last axis, read as it is)."""
    other = next((i for i in op.input if i != out), "")
    if op.op_type != "Add" or len(op.input) != 2 or not inits.readable(other):
        return False
    dims = list(inits[other].dims)
    return len(dims) >= 1 and dims[-1] == p.channels and all(d == 1 for d in dims[:-1]) and \
        (p.rank is not None and len(dims) <= p.rank or len(dims) == 1)


def fold_affines(model: onnx.ModelProto, copy: bool = True, base_dir: Path | None = None
                 ) -> tuple[onnx.ModelProto, AffineResult]:
    """``model`` (a copy unless ``copy`` is False) with the per-channel affine ops right after each Conv, Gemm
    and MatMul of its main graph folded into that product. ``base_dir``: the folder of the model's external data
    files, for a model loaded without them (the values a fold changes are read from there; the new ones are held
    in the model, for ``save_model`` to place)."""
    out = model_to_edit(model, copy)
    graph = out.graph
    if not any(n.op_type in (*FOLDED_OPS, "Gemm", "Transpose") for n in graph.node):
        return out, AffineResult(())
    opset = default_opset(out)
    inits = _Constants(graph.initializer, base_dir)
    ranks = _ranks(graph)
    before = _graph_reads(graph)
    names = functools.partial(unique_name, taken=names_in_use(graph))
    links = GraphLinks(graph)  # stays right: a fold only renames a product's output to the folded op's
    folded: list[str] = []
    notes: dict[str, tuple[str, str]] = {}  # a normalization's output: (the product before it, why it stays)
    gone: set[str] = set()  # the products' old outputs
    created: set[str] = set()
    dropped: set[int] = set()
    scaled: list[str] = []  # the Gemms whose alpha and beta went into B and C
    transposed: list[str] = []  # the Transposes of weights made constants

    def keep(name: str, value: np.ndarray) -> str:
        created.add(name)
        inits[name] = numpy_helper.from_array(value, name)
        graph.initializer.append(inits[name])
        return name

    transposes = _constant_transposes(graph, inits, links)  # held: ``dropped`` compares node wrappers by id
    for t in transposes:
        value = np.transpose(inits.array(t.input[0]), _attrs(t).get("perm"))
        keep(t.output[0], np.ascontiguousarray(value))
        ranks[t.output[0]] = value.ndim
        dropped.add(id(t))
        transposed.append(t.output[0])
    products = [p for n in graph.node if (p := _product(n, inits, ranks)) is not None]
    for p in products:
        if p.node.op_type == "Gemm" and _gemm_scales(p.node, inits, keep, names):
            scaled.append(p.node.output[0])
    for p in products:
        kind = p.node.op_type
        while True:  # down the chain: Conv -> Mul -> Add -> Relu folds the Mul, then the Add
            tail_out = p.tail.output[0]
            readers = links.consumers.get(tail_out, [])
            if len(readers) != 1 or tail_out in links.graph_outputs:
                for r in readers:
                    if r.op_type == "BatchNormalization" and r.output:
                        notes[r.output[0]] = (kind, f"the {kind}'s output is read by another node too")
                break
            op = readers[0]
            moved, layout = _transposed_op(op, links, p)  # torchvision's ConvNeXt: permute, then the layer scale
            if moved is not None:
                op, last = moved, op  # the op after the Transpose; the Transpose writes its result
            if op.op_type not in FOLDED_OPS or op.domain not in ("", "ai.onnx") or not op.output:
                break
            if moved is None and kind == "MatMul" and p.bias_add is None and _is_bias(op, tail_out, inits, p):
                p.bias_add = op  # the bias the scanner fuses: what follows folds into it
                continue
            bias = _bias(p, inits)
            if not inits.readable(p.node.input[1]) or isinstance(bias, str):
                if op.op_type == "BatchNormalization":
                    notes[op.output[0]] = (kind, bias if isinstance(bias, str) else
                                           f"the {kind}'s weight is in an external file that was not read")
                break
            found: tuple[np.ndarray, np.ndarray] | str | None
            if op.op_type == "BatchNormalization":
                found = _batchnorm(op, inits, p, opset)
            else:
                found = _affine(op, last.output[0] if moved is not None else tail_out, inits, p, layout)
            if moved is not None and kind == "MatMul" and p.bias_add is None and found is not None and \
                    op.op_type in ("Add", "Sub"):
                break  # its bias Add would go before the Transpose: left as it is
            if found is None or isinstance(found, str):
                if isinstance(found, str):
                    notes[op.output[0]] = (kind, found)
                break
            mul, add = found
            weight = inits.array(p.node.input[1])
            shape = [1] * weight.ndim
            shape[p.weight_axis] = p.channels
            with np.errstate(all="ignore"):
                new_weight = (weight.astype(np.float64) * mul.reshape(shape)).astype(weight.dtype)
                new_bias = (bias * mul + add).astype(weight.dtype)
            # an infinite factor (0 * inf in the sum), or a value past the weight's type (an fp16 overflow), would
            # give other outputs than the op after the product does
            if not (np.isfinite(new_weight.astype(np.float64)).all() and np.isfinite(new_bias.astype(np.float64)).all()):
                if op.op_type == "BatchNormalization":
                    notes[op.output[0]] = (kind, "the folded weight or bias would not be finite in its type")
                break
            p.node.input[1] = keep(names(f"{p.node.input[1]}_folded"), new_weight)
            if kind == "MatMul" and p.bias_add is None and op.op_type in ("Mul", "Div"):
                pass  # no bias before, none after
            elif kind == "MatMul" and p.bias_add is None:  # the op becomes the MatMul's bias Add
                b_name = keep(names(f"{op.output[0]}_bias"), new_bias)
                del op.input[:], op.attribute[:]
                op.op_type = "Add"
                op.input.extend([tail_out, b_name])
                p.bias_add = op
                folded.append(op.output[0])
                continue
            elif kind == "MatMul":
                assert p.bias_add is not None
                p.bias_add.input[1 if p.bias_add.input[0] == p.node.output[0] else 0] = \
                    keep(names(f"{op.output[0]}_bias"), new_bias)
            else:
                b_name = keep(names(f"{op.output[0]}_{kind.lower()}_bias"), new_bias)
                del p.node.input[2:]
                p.node.input.append(b_name)
                if kind == "Gemm":  # beta * C folded into the values
                    for i in reversed([i for i, a in enumerate(p.node.attribute) if a.name == "beta"]):
                        del p.node.attribute[i]
            writer = last if moved is not None else p.tail  # now writes the op's result
            gone.add(writer.output[0])
            writer.output[0] = op.output[0]
            dropped.add(id(op))
            folded.append(op.output[0])
            if moved is not None:  # what follows reads the transposed value: no more folds into the product
                break
    if folded or scaled or transposed:
        kept = [n for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
        for vi in [vi for vi in graph.value_info if vi.name in gone]:
            graph.value_info.remove(vi)
        # the constants of a chain's earlier folds, which its later ones replaced, and what the ops read
        _drop_unread(graph, before | created)
    return out, AffineResult(tuple(folded), tuple((o, f"BatchNormalization after {kind}: {why}")
                                                   for o, (kind, why) in notes.items() if o not in folded),
                             tuple(scaled), tuple(transposed))
