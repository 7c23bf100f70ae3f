"""Scan: model -> workloads.

Loads an ONNX model, runs onnxruntime's SymbolicShapeInference (auto_merge recovers dims such as
``batch*seq`` through exporters' Shape -> Gather -> Concat -> Reshape chains, which onnx's own shape
inference loses), and describes every MatMul, Gemm and Conv node whose shapes depend on a symbolic dim as
a ``Workload`` in GEMM view. Nodes that will not be handled are returned with the reason, as small
match-or-refuse rules do: a refusal is data that ``scan`` shows, not an exception.
"""
from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AbstractSet, Any, Mapping, NamedTuple, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from dietcode_ort.bundle import CONV_FIELDS, CONV_RANGES, DOMAIN, subgraphs
from dietcode_ort.errors import DietcodeError, check_model_file
from tuner import shape_expr
from tuner.instances import (DimSpec, cap_product, instances_from_dims, instances_from_shape_log, merged_dims,
                             parse_dim_options)
from tuner.model_file import copy_without, inline_tensor, is_external
from tuner.workload import ConvParams, Epilogue, Instance, Workload

_log = logging.getLogger(__name__)

__all__ = ["Skipped", "ScanResult", "load_model", "model_symbols", "symbol_axes", "small_constants", "scan_model", "scan", "attach_instances",
           "scan_command", "attention_report", "node_reads", "outer_reads", "defined_in", "GraphLinks", "MOVABLE", "conv_auto_pad",
           "same_pad_total"]

_DTYPES: dict[int, str] = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.BFLOAT16: "bfloat16"}
_OPS = ("MatMul", "Gemm", "Conv")
# Integer and low-bit products (ONNX's and com.microsoft's) scan lists as left out, with the reason.
_QUANTIZED_OPS = ("MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv", "DynamicQuantizeMatMul",
                  "MatMulIntegerToFloat", "QGemm", "QAttention", "MatMulNBits", "MatMulBnb4")

Dim = "int | str"  # a dim is an int or an expression text over the model's symbols (tuner.shape_expr)


@dataclass(frozen=True)
class Skipped:
    """A node left as it is, and why: a MatMul/Gemm/Conv node, or an Add/activation left unfused."""

    node: str  # the node's name, or its first output when it has none
    op: str
    reason: str


@dataclass(frozen=True)
class ScanResult:
    symbols: tuple[str, ...]
    workloads: tuple[Workload, ...]
    skipped: tuple[Skipped, ...]
    input_dims: dict[str, tuple[str | int | None, ...]] = field(default_factory=dict)  # model_symbols
    unfused: tuple[Skipped, ...] = ()  # Add/activation nodes after a workload node that stay unfused, and why
    prepared: tuple[str, ...] = ()  # what the graph pre-passes changed (``prepare_graph``), a line each
    # input dims the graph makes equal to another input dim or to a size (``_infer``): {"m": "n"}, {"k": 16}
    merged: dict[str, str | int] = field(default_factory=dict)


class _Refuse(Exception):
    """Raised inside a rule to refuse a node with a reason."""


def load_model(path: str | Path, load_external_data: bool = True) -> onnx.ModelProto:
    """Load an ONNX model file, with a clear error for a missing or corrupt file."""
    path = Path(path)
    check_model_file(path)
    try:
        if load_external_data or onnx.serialization.registry.get_format_from_file_extension(path.suffix) \
                not in (None, "protobuf"):
            model = onnx.load(str(path), load_external_data=load_external_data)
        else:  # field by field: no copy of the file in memory beside the model
            from tuner.model_file import read_model

            model = read_model(path)
    except Exception as exc:  # protobuf raises DecodeError, onnx raises several kinds
        raise DietcodeError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise DietcodeError(f"{path} is not a readable ONNX model (its graph has no nodes)")
    return model


def model_symbols(model: onnx.ModelProto) -> dict[str, tuple[str | int | None, ...]]:
    """Each graph input (that is not an initializer) and its dims: the symbol's name, the size where fixed,
    None where neither is given."""
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        out[vi.name] = tuple(d.dim_param if d.dim_param else d.dim_value if d.HasField("dim_value") else None
                             for d in vi.type.tensor_type.shape.dim)
    return out


def symbol_axes(input_dims: dict[str, tuple[str | int | None, ...]]) -> dict[str, list[str]]:
    """Where each symbol of ``model_symbols``' answer sits: ``{"s33": ["input_ids[0]"], ...}``, sorted by symbol
    (an exporter's names, ``s33`` or ``unk__793``, say nothing of which dim is the batch)."""
    axes: dict[str, list[str]] = {}
    for name, dims in input_dims.items():
        for i, d in enumerate(dims):
            if isinstance(d, str) and d:
                axes.setdefault(d, []).append(f"{name}[{i}]")
    return dict(sorted(axes.items()))


def _names(input_dims: dict[str, tuple[str | int | None, ...]]) -> tuple[str, ...]:
    """The symbol names of ``model_symbols``' answer, sorted."""
    return tuple(sorted({s for dims in input_dims.values() for s in dims if isinstance(s, str) and s}))


def _check_input_dims(model: onnx.ModelProto) -> None:
    """Refuse a graph input with a negative dim (no shape) or, in a model without named dims, a dynamic dim
    without a name: --dim and shape logs give values by name, so such a model cannot be tuned as it is."""
    inits = {i.name for i in model.graph.initializer}
    unnamed = []
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value < 0:
                raise DietcodeError(f"input {vi.name!r} has dim {d.dim_value} at axis {axis}: dims are sizes >= 0, "
                                    "or names for dynamic ones")
            if not d.HasField("dim_value") and not d.dim_param:
                unnamed.append(f"input {vi.name!r} axis {axis}")
    if unnamed and not _names(model_symbols(model)):
        raise DietcodeError(f"the model's dynamic dims have no name ({', '.join(unnamed[:4])}"
                            f"{', ...' if len(unnamed) > 4 else ''}): --dim and --shapes give values by name; "
                            "name them (dim_param: the exporter's dynamic axes names, or "
                            "onnx.tools.update_model_dims.update_inputs_outputs_dims)")


_SMALL_TENSOR = 1 << 20  # external tensors below this are read for shape inference (shape constants)


def _inference_copy(model: onnx.ModelProto, base_dir: Path | None) -> onnx.ModelProto:
    """A copy that shape inference can read: small tensors (external ones loaded) as initializers, large
    ones (inline or external) as graph inputs.

    Weights are not needed to infer shapes, only their dims; keeping them out also keeps models over
    2 GB under protobuf's limit, and the copy (and inference's own copies) small: the weights are never
    copied.
    """
    copy = copy_without(model, "graph")
    copy.graph.CopyFrom(copy_without(model.graph, "initializer"))
    inputs = {i.name for i in copy.graph.input}
    keep, as_inputs = [], []
    for t in model.graph.initializer:
        size = int(np.prod(t.dims, dtype=np.int64)) * max(1, onnx.helper.tensor_dtype_to_np_dtype(
            t.data_type).itemsize)
        if size > _SMALL_TENSOR or (is_external(t) and base_dir is None):
            if t.name not in inputs:  # IR < 4 models list their initializers as inputs already
                as_inputs.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
            continue
        keep.append(inline_tensor(t, base_dir))
    # sparse initializers and Constants (ORT makes them dense at load) as inputs of their dims:
    # SymbolicShapeInference knows neither ('Invalid model with cyclic graph', 'NoneType' has no 'HasField')
    sparse = [(t.values.name, t) for t in model.graph.sparse_initializer]
    nodes = list(copy.graph.node)
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1 and \
                [a.name for a in node.attribute] == ["sparse_value"]:
            sparse.append((node.output[0], node.attribute[0].sparse_tensor))
            copy.graph.node.remove(node)
    for name, t in sparse:
        if name and name not in inputs:
            as_inputs.append(onnx.helper.make_tensor_value_info(name, t.values.data_type, list(t.dims)))
    copy.graph.initializer.extend(keep)
    copy.graph.input.extend(as_inputs)
    for node in copy.graph.node:
        _constant_as_tensor(node)
    _name_loop_optionals(copy)
    return copy


def _name_loop_optionals(model: onnx.ModelProto) -> None:
    """Give the Loops (of the graph and its subgraphs) whose trip count or condition is left out (``""``) an
    unbounded count and a true condition, in place, as the spec reads a missing one: SymbolicShapeInference
    looks every Loop input up by name (KeyError: '' otherwise)."""
    names = {"M": "dietcode_loop_unbounded", "cond": "dietcode_loop_true"}
    used = False

    def walk(graph: onnx.GraphProto) -> None:
        nonlocal used
        for node in graph.node:
            if node.op_type == "Loop" and node.domain in ("", "ai.onnx") and len(node.input) >= 2:
                for i, key in enumerate(("M", "cond")):
                    if not node.input[i]:
                        node.input[i] = names[key]
                        used = True
            for attr in node.attribute:
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                    walk(sub)

    walk(model.graph)
    if used:
        model.graph.initializer.extend([numpy_helper.from_array(np.array(np.iinfo(np.int64).max), names["M"]),
                                        numpy_helper.from_array(np.array(True), names["cond"])])


def _alias_dims(model: onnx.ModelProto) -> dict[str, str]:
    """Give each dim name that is not a plain identifier a plain stand-in, in place; returns stand-in ->
    name.

    Shape inference prints its results as sympy does, so a name such as ``input-ids.1`` would come back
    inside texts like ``2*input-ids.1`` that no grammar can read; stand-ins come back intact.
    """
    dims = [d for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
            if vi.type.HasField("tensor_type") for d in vi.type.tensor_type.shape.dim if d.dim_param]
    names = {d.dim_param for d in dims}
    aliases: dict[str, str] = {}
    for name in sorted(names):
        if shape_expr.is_plain_name(name):
            continue
        alias = f"dim_alias_{len(aliases)}"
        while alias in names:
            alias += "_"
        aliases[name] = alias
    for d in dims:
        if d.dim_param in aliases:
            d.dim_param = aliases[d.dim_param]
    return {alias: name for name, alias in aliases.items()}


@dataclass(frozen=True)
class _Unreadable:
    """A dim whose text is outside tuner.shape_expr's grammar: nodes that need it are refused."""

    reason: str


def _dim_text(text: str, aliases: dict[str, str]) -> str | _Unreadable:
    try:
        return shape_expr.to_text(shape_expr.parse(text, aliases))
    except shape_expr.ShapeExprError as exc:
        return _Unreadable(str(exc))


_CONSTANT_FORMS = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
                   "value_ints": np.int64}


def _constant_as_tensor(node: onnx.NodeProto) -> None:
    """Rewrite a Constant's ``value_float(s)``/``value_int(s)`` as ``value`` (a tensor), the one form
    SymbolicShapeInference reads (it fails on the others) and the fusion rules match."""
    attr = node.attribute[0] if node.op_type == "Constant" and len(node.attribute) == 1 else None
    if attr is None or attr.name not in _CONSTANT_FORMS:
        return
    value = np.array(onnx.helper.get_attribute_value(attr), dtype=_CONSTANT_FORMS[attr.name])
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(value)))


# Reduce ops whose axes became an input at opset 18, and which the tool has no rule for (it has ReduceSum's, whose
# axes moved at 13, ReduceMean's and ReduceProd's for the attribute): F.normalize's ReduceL2, torch.amax's ReduceMax
_AXES_INPUT_REDUCES = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMin",
                       "ReduceSumSquare")


# ai.onnx.ml ops whose output has their input's shape, which the tool has no rule for (scikit-learn's StandardScaler
# and Normalizer before an MLP, through skl2onnx): inference stopped there and the whole model was refused
_ML_ELEMENTWISE = ("Scaler", "Normalizer", "Binarizer", "Imputer")


@functools.cache
def _symbolic_shape_inference() -> type:
    """onnxruntime's SymbolicShapeInference, with these gaps filled:

    - ONNX's own Attention (opset 23, torch's dynamo exporter writes it for scaled_dot_product_attention from
      ``opset_version=23``): the tool picks its handlers by op type alone and reads that node as com.microsoft's
      Attention (an AssertionError on a bias shape it does not have);
    - a subgraph's own values: the tool hands a subgraph the outer values of the same names (below);
    - the product of a shape's dims by a ReduceProd over all of a 1-D shape vector, kept as a 1-element vector
      (tf2onnx's Einsum writes ``Reshape(x, Concat(ReduceProd(Gather(Shape(x), batch axes)), ...))``): the tool
      computes only ``axes=[0], keepdims=0``, and every shape behind such a Reshape became data-dependent;
    - the dim kept when two are found equal (``x[batch, n] + y[batch, m]``): the tool keeps one in the order of a
      set of names, which follows the strings' hashes (``PYTHONHASHSEED``), so one run named the merged dim ``n``
      and the next ``m``. Here a size wins, then the input dim the graph's inputs list first, then the first
      name in sorted order, the same on every run;
    - ConvTranspose, DepthToSpace and SpaceToDepth (a UNet's decoder, a super-resolution's PixelShuffle): the
      tool has no rule for them and every shape after them became data-dependent;
    - Resize by scales: the tool keeps a float scale in the dim (``floor(1.0*batch)``, ``floor(1.5*h)``), which
      the shape grammar refuses; a scale that is a small fraction (2, 1.5, 0.5) is kept exact (``floor(3*h/2)``);
    - Pad with ``axes`` (opset 18): the tool asserts one pad per dim at each end;
    - the ai.onnx.ml ops that keep their input's shape (``_ML_ELEMENTWISE``: skl2onnx's Scaler, Normalizer);
    - Reduce ops other than ReduceSum and ReduceMean with their axes as an input (opset 18: ReduceL2 from
      F.normalize, ReduceMax from torch.amax, wav2vec2's weight norm): no rule, and ONNX's inference of the node
      alone gave no shape, so the tool failed on the next node (``_AXES_INPUT_REDUCES``);
    - the node being inferred, for the message of a failure (``current``)."""
    from fractions import Fraction

    import sympy
    from onnx import helper
    from onnxruntime.tools.symbolic_shape_infer import (SymbolicShapeInference, get_attribute, get_opset,
                                                        get_shape_from_sympy_shape, is_literal,
                                                        sympy_reduce_product)

    class Inference(SymbolicShapeInference):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.dispatcher_.update({"ConvTranspose": self._infer_ConvTranspose,
                                     "DepthToSpace": self._infer_DepthToSpace,
                                     "SpaceToDepth": self._infer_SpaceToDepth})
            self.dispatcher_.update({op: self._infer_reduce_by_axes_input for op in _AXES_INPUT_REDUCES})
            self.dispatcher_.update({op: self._infer_ml_elementwise for op in _ML_ELEMENTWISE})
            self.current: onnx.NodeProto | None = None

        def _onnx_infer_single_node(self, node: onnx.NodeProto) -> None:
            self.current = node  # every node passes here first
            super()._onnx_infer_single_node(node)

        def _add_suggested_merge(self, symbols: Sequence[Any], apply: bool = False) -> None:
            order: dict[str, int] = {}  # each input dim name at its first place in the graph's inputs
            for vi in self.out_mp_.graph.input:
                for d in vi.type.tensor_type.shape.dim:
                    order.setdefault(d.dim_param, len(order))
            found = {self.suggested_merge_.get(s, s) if isinstance(s, str) else s for s in symbols}

            def rank(s: Any) -> tuple:
                if is_literal(s):
                    return (0, 0, "")
                if s in self.input_symbols_:
                    return (1, order.get(s, len(order)), s)
                return (2 if type(self.symbolic_dims_.get(s)) is sympy.Symbol else 3, len(s), s)

            keep = min(found, key=rank)
            for s in sorted((s for s in found if s != keep), key=rank):
                if is_literal(keep) and is_literal(s):
                    if int(keep) != int(s):
                        raise ValueError(f"two different sizes found equal: {keep} and {s}")
                    continue
                self.suggested_merge_[s] = int(keep) if is_literal(keep) else keep
                for k, v in list(self.suggested_merge_.items()):
                    if v == s:
                        self.suggested_merge_[k] = self.suggested_merge_[s]
            if apply and self.auto_merge_:
                self._apply_suggested_merge()

        def _set_shape(self, node: onnx.NodeProto, shape: list) -> None:
            self._update_computed_dims(shape)
            self.known_vi_[node.output[0]].CopyFrom(helper.make_tensor_value_info(
                node.output[0], self.known_vi_[node.input[0]].type.tensor_type.elem_type,
                get_shape_from_sympy_shape(shape)))

        def _infer_ConvTranspose(self, node: onnx.NodeProto) -> None:  # noqa: N802
            # X [N, C, D1..Dn], W [C, OC / group, k1..kn]: out_i = stride (in_i - 1) + output_padding
            # + dilation (k_i - 1) + 1 - pads at both ends, or in_i x stride under auto_pad SAME_*, or output_shape
            x, w = self._get_sympy_shape(node, 0), self._get_sympy_shape(node, 1)
            rank = len(x) - 2
            if rank < 1 or len(w) != rank + 2:
                raise ValueError(f"ConvTranspose: input rank {len(x)} and weight rank {len(w)}")
            kernel = get_attribute(node, "kernel_shape") or w[2:]
            strides = get_attribute(node, "strides", [1] * rank)
            dilations = get_attribute(node, "dilations", [1] * rank)
            extra = get_attribute(node, "output_padding", [0] * rank)
            pads = get_attribute(node, "pads", [0] * (2 * rank))
            auto_pad = get_attribute(node, "auto_pad", b"NOTSET").decode()
            given = get_attribute(node, "output_shape")
            if given is not None:
                spatial = [sympy.Integer(v) for v in list(given)[-rank:]]
            elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
                spatial = [d * s for d, s in zip(x[2:], strides)]
            else:
                if auto_pad == "VALID":
                    pads = [0] * (2 * rank)
                spatial = [s * (d - 1) + e + (k - 1) * dl + 1 - pads[i] - pads[i + rank]
                           for i, (d, s, e, k, dl) in enumerate(zip(x[2:], strides, extra, kernel, dilations))]
            self._set_shape(node, [x[0], w[1] * get_attribute(node, "group", 1), *spatial])

        def _infer_DepthToSpace(self, node: onnx.NodeProto) -> None:  # noqa: N802
            n, c, h, w = self._get_sympy_shape(node, 0)  # [N, C, H, W] -> [N, C / b^2, H b, W b]
            b = get_attribute(node, "blocksize")
            self._set_shape(node, [n, c // (b * b), h * b, w * b])

        def _infer_SpaceToDepth(self, node: onnx.NodeProto) -> None:  # noqa: N802
            n, c, h, w = self._get_sympy_shape(node, 0)  # [N, C, H, W] -> [N, C b^2, H / b, W / b]
            b = get_attribute(node, "blocksize")
            self._set_shape(node, [n, c * b * b, h // b, w // b])

        def _infer_Resize(self, node: onnx.NodeProto) -> None:  # noqa: N802
            super()._infer_Resize(node)
            opset = get_opset(self.out_mp_)
            if opset > 10 and ((len(node.input) > 3 and node.input[3]) or get_attribute(
                    node, "coordinate_transformation_mode") == b"tf_crop_and_resize"):
                return  # sizes (the tool's dims are exact), or a region of interest: as the tool says
            scales = self._try_get_value(node, 1 if opset <= 10 else 2)
            x = self._get_sympy_shape(node, 0)
            if scales is None:
                return
            full: list[Fraction] = []
            for s in np.asarray(scales, dtype=np.float64).reshape(-1):
                exact = Fraction(float(s))
                if exact <= 0 or exact.limit_denominator(16) != exact:
                    return  # no small fraction (4/3 in float): the tool's dim, which the grammar refuses
                full.append(exact)
            axes = get_attribute(node, "axes")
            if axes is not None:
                if len(axes) != len(full):
                    return
                by_axis = dict(zip((a % len(x) for a in axes), full))
                full = [by_axis.get(i, Fraction(1)) for i in range(len(x))]
            if len(full) != len(x):
                return
            self._set_shape(node, [sympy.floor(d * sympy.Rational(f.numerator, f.denominator))
                                   for d, f in zip(x, full)])

        def _infer_Pad(self, node: onnx.NodeProto) -> None:  # noqa: N802
            if get_opset(self.out_mp_) < 18 or len(node.input) < 4 or not node.input[3]:
                super()._infer_Pad(node)
                return
            x = self._get_sympy_shape(node, 0)
            pads, axes = self._try_get_value(node, 1), self._try_get_value(node, 3)
            if pads is None or axes is None:
                self._set_shape(node, self._new_symbolic_shape(len(x), node))
                return
            axes = [int(a) % len(x) for a in np.asarray(axes).reshape(-1)]
            pads = [int(p) for p in np.asarray(pads).reshape(-1)]
            if len(pads) != 2 * len(axes):
                raise ValueError(f"Pad: {len(pads)} pads for {len(axes)} axes")
            out = list(x)
            for i, a in enumerate(axes):
                out[a] = out[a] + pads[i] + pads[i + len(axes)]
            self._set_shape(node, out)

        def _onnx_infer_subgraph(self, node: onnx.NodeProto, subgraph: onnx.GraphProto, *args: Any,
                                 **kwargs: Any) -> Any:
            # The tool gives a subgraph every value it knows as an outer one, also those the subgraph makes
            # itself. optimum's merged decoders name the If's outputs as its branches' (``logits``): the If's
            # still untyped outputs then reached the branch, and the Add/Mul/MatMul making one failed the tool's
            # rank check on them (an AssertionError). A subgraph's own values shadow the outer ones.
            made = {o for n in subgraph.node for o in n.output if o}
            hidden = {name: self.known_vi_.pop(name) for name in list(self.known_vi_) if name in made}
            try:
                return super()._onnx_infer_subgraph(node, subgraph, *args, **kwargs)
            finally:
                self.known_vi_.update(hidden)

        def _infer_ml_elementwise(self, node: onnx.NodeProto) -> None:
            """An ai.onnx.ml op that keeps its input's shape (``_ML_ELEMENTWISE``), with its output's element
            type: float for Scaler and Normalizer, the input's for the others."""
            if node.domain != "ai.onnx.ml":
                return
            dtype = (onnx.TensorProto.FLOAT if node.op_type in ("Scaler", "Normalizer")
                     else self.known_vi_[node.input[0]].type.tensor_type.elem_type)
            self.known_vi_[node.output[0]].CopyFrom(helper.make_tensor_value_info(
                node.output[0], dtype, get_shape_from_sympy_shape(self._get_sympy_shape(node, 0))))

        def _infer_reduce_by_axes_input(self, node: onnx.NodeProto) -> None:
            """A Reduce op's output shape where its axes are an input (opset 18; ReduceSum's from 13): the tool's
            ReduceSum rule, for the axes' values where the tool knows them (a Constant, an initializer). ONNX's
            single-node inference, which the tool leaves the others to, does not see them and gives no shape."""
            if len(node.input) > 1 and node.input[1]:
                axes = self._try_get_value(node, 1)
                if axes is not None and len(axes) > 0:
                    self._infer_ReduceSum(node)

        def _infer_ReduceProd(self, node: onnx.NodeProto) -> None:  # noqa: N802
            super()._infer_ReduceProd(node)
            self._infer_reduce_by_axes_input(node)
            if node.output[0] in self.sympy_data_ or (len(node.input) > 1 and node.input[1]):
                return
            axes = get_attribute(node, "axes")
            data = self._try_get_value(node, 0)
            if (axes is not None and list(axes) not in ([0], [-1])) or not isinstance(data, list):
                return  # the values of a 1-D shape vector (the tool keeps shapes as lists)
            product = sympy_reduce_product(data)
            self.sympy_data_[node.output[0]] = [product] if get_attribute(node, "keepdims", 1) else product

        def _infer_Attention(self, node: onnx.NodeProto) -> None:  # noqa: N802
            if node.domain not in ("", "ai.onnx"):
                super()._infer_Attention(node)
                return
            # Q [batch, q_heads, q_seq, head] or [batch, q_seq, q_heads * head]; K and V alike with kv_heads
            q, k, v = (self._get_sympy_shape(node, i) for i in range(3))
            if len(q) == 4 and len(k) == 4 and len(v) == 4:
                batch, q_heads, q_seq = q[:3]
                kv_heads, kv_seq, k_head, v_head = k[1], k[2], k[3], v[3]
                y = [batch, q_heads, q_seq, v_head]
            elif len(q) == 3 and len(k) == 3 and len(v) == 3:
                q_heads, kv_heads = get_attribute(node, "q_num_heads"), get_attribute(node, "kv_num_heads")
                if not q_heads or not kv_heads:
                    raise ValueError(f"Attention {node.name!r}: 3-D inputs need q_num_heads and kv_num_heads")
                batch, q_seq, kv_seq = q[0], q[1], k[1]
                k_head, v_head = k[2] // sympy.Integer(kv_heads), v[2] // sympy.Integer(kv_heads)
                y = [batch, q_seq, v_head * q_heads]
            else:
                raise ValueError(f"Attention {node.name!r}: Q, K and V of ranks {len(q)}, {len(k)}, {len(v)}")
            past = node.input[4] if len(node.input) > 4 else ""
            total = kv_seq + self._get_sympy_shape(node, 4)[2] if past else kv_seq
            dtype = self.known_vi_[node.input[0]].type.tensor_type.elem_type
            shapes = [y, [batch, kv_heads, total, k_head], [batch, kv_heads, total, v_head],
                      [batch, q_heads, q_seq, total]]  # Y, present_key, present_value, qk_matmul_output
            for out, shape in zip(node.output, shapes):
                if out:
                    self._update_computed_dims(shape)
                    self.known_vi_[out].CopyFrom(helper.make_tensor_value_info(
                        out, dtype, get_shape_from_sympy_shape(shape)))

    return Inference


def _infer(model: onnx.ModelProto, merged: dict[str, str | int] | None = None) -> onnx.ModelProto:
    """SymbolicShapeInference (``_symbolic_shape_inference``) driven as its ``infer_shapes`` drives it, except
    that a model it cannot finish is an error here (naming the node it failed at), never a partial model saved
    into the current folder (which ``infer_shapes`` does: ``sym_shape_infer_temp.onnx``).

    ``merged`` (when given) receives the graph-input dims the inference found equal to another input dim or to
    a size (``x[batch, n] + y[batch, m]``: ``{"m": "n"}``): only the dim kept appears in the shapes inferred."""
    from onnxruntime.tools.symbolic_shape_infer import get_opset

    opset = get_opset(model)
    if not opset or opset < 7:
        raise DietcodeError(f"the model imports ONNX opset {opset}: symbolic shape inference needs 7 or newer")
    inference: Any = None
    try:
        inference = _symbolic_shape_inference()(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess, verbose
        complete = False
        inference._preprocess(model)
        while inference.run_:
            complete = inference._infer_impl()
        inference._update_output_from_vi()
        inferred = inference.out_mp_ if complete else None
    except Exception as exc:
        inits = {t.name for t in model.graph.initializer}
        shapeless = [vi.name for vi in model.graph.input if vi.name not in inits and vi.type.HasField("tensor_type")
                     and not vi.type.tensor_type.HasField("shape")]
        hint = (f"; input {shapeless[0]!r} has no shape (not even a rank): give every graph input its rank, "
                "with names for the dynamic dims" if shapeless else "")
        node = getattr(inference, "current", None)
        at = f" at {node.op_type} node {_label(node)!r}" if node is not None else ""
        detail = str(exc) or "a check of onnxruntime's tool failed"  # its asserts say nothing
        raise DietcodeError(f"symbolic shape inference failed on this model{at} ({type(exc).__name__}: {detail})"
                            f"{hint}") from None
    if inferred is None:
        known = inference.known_vi_
        stuck = [n for n in model.graph.node
                 if any(o and (o not in known or not known[o].type.tensor_type.HasField("shape")) for o in n.output)]
        at = "" if not stuck else (f": no output shape for {stuck[0].op_type} node {_label(stuck[0])!r}"
                                   + (f" (domain {stuck[0].domain})" if stuck[0].domain else "")
                                   + " (onnxruntime's tool has no rule for it)")
        raise DietcodeError(f"symbolic shape inference could not complete on this model{at}")
    if merged is not None:
        inputs = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
        for name, kept in sorted(inference.suggested_merge_.items()):
            if name in inputs and (not isinstance(kept, str) or kept in inputs):
                merged[name] = kept if isinstance(kept, str) else int(kept)
    return inferred


def node_reads(node: onnx.NodeProto) -> set[str]:
    """The values a node reads: its inputs and what its subgraphs (If/Loop/Scan bodies) read from outside."""
    return {x for x in node.input if x}.union(*(outer_reads(sub) for sub in subgraphs(node)))


def defined_in(graph: onnx.GraphProto) -> set[str]:
    """The values a graph defines itself: its inputs, initializers and node outputs."""
    return {i.name for i in graph.input} | {t.name for t in graph.initializer} | \
        {t.values.name for t in graph.sparse_initializer} | {o for n in graph.node for o in n.output if o}


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """The values a subgraph reads from its outer scopes: what its nodes read and it returns, less what it
    defines (``defined_in``)."""
    reads = set().union(*(node_reads(n) for n in graph.node)) | {o.name for o in graph.output}
    return reads - defined_in(graph)


class GraphLinks:
    """A graph indexed by value: the node making each value, the nodes reading it (a node reads what its
    subgraphs read from outside, ``node_reads``; one reading a value twice is one reader), and the graph's
    outputs. Nodes are the graph's own messages, compared by identity; empty names (absent optional inputs
    and outputs) are no values. ``one_maker``: refuse a graph where two nodes make one value (otherwise the
    last one counts)."""

    def __init__(self, graph: onnx.GraphProto, one_maker: bool = False):
        self.producers: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node_reads(node):
                self.consumers.setdefault(name, []).append(node)
            for name in node.output:
                if name and one_maker and name in self.producers:
                    raise DietcodeError(f"invalid model: value {name!r} is made by two nodes")
                if name:
                    self.producers[name] = node
        self.graph_outputs = {o.name for o in graph.output}

    def exclusive_consumer(self, name: str) -> onnx.NodeProto | None:
        """The one node reading ``name``; None when none or several do, or it is a graph output."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.graph_outputs:
            return None
        return users[0]

    def read_only_by(self, name: str, node: onnx.NodeProto) -> bool:
        """Whether ``node`` alone reads ``name`` (and it is no graph output)."""
        return self.exclusive_consumer(name) is node


def small_constants(graph: onnx.GraphProto, limit: int = 64) -> dict[str, np.ndarray]:
    """The values of the graph's constants: its small initializers held in the model (at most ``limit``
    elements: pads, axes, scales) and its Constant nodes' tensors; an initializer a graph input overrides is no
    constant."""
    out = {t.name: numpy_helper.to_array(t) for t in graph.initializer
           if not is_external(t) and int(np.prod(t.dims, dtype=np.int64)) <= limit}
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    for v in graph.input:
        out.pop(v.name, None)
    return out


class _Graph(GraphLinks):
    """Index of an inferred graph: its links, and the shapes, dtypes and constants of its values."""

    def __init__(self, model: onnx.ModelProto, initializers: Sequence[onnx.TensorProto],
                 aliases: dict[str, str] | None = None):
        g = model.graph
        super().__init__(g)
        self.inits = {i.name: i for i in initializers}
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, int] = {}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            t = vi.type.tensor_type
            if not vi.type.HasField("tensor_type"):
                continue
            self.dtypes[vi.name] = t.elem_type
            if t.HasField("shape"):
                self.shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else
                                             (_dim_text(d.dim_param, aliases or {}) if d.dim_param else None)
                                             for d in t.shape.dim)
        for i in initializers:
            self.shapes[i.name] = tuple(i.dims)
            self.dtypes[i.name] = i.data_type
        for node in g.node:  # Constant nodes act as initializers for matching purposes
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                t = node.attribute[0].t
                self.inits[node.output[0]] = t
                self.shapes[node.output[0]] = tuple(t.dims)
                self.dtypes[node.output[0]] = t.data_type

    def const(self, name: str) -> np.ndarray | None:
        t = self.inits.get(name)
        if t is None:
            return None
        if is_external(t):
            return None  # weights not loaded: shape known, value not needed for matching
        return numpy_helper.to_array(t)

    def constant_source(self, name: str) -> str | None:
        """The constant behind ``name``, looking through Identity nodes (exporters deduplicate equal
        constants, such as zero biases, behind one Identity each), or None when it is not constant."""
        for _ in range(16):
            if name in self.inits:
                return name
            node = self.producers.get(name)
            if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
                return None
            name = node.input[0]
        return None


def _shape(g: _Graph, name: str, what: str) -> tuple:
    shape = g.shapes.get(name)
    if shape is None or any(d is None for d in shape):
        raise _Refuse(f"the shape of {what} {name!r} is unknown after shape inference")
    bad = next((d for d in shape if isinstance(d, _Unreadable)), None)
    if bad is not None:
        raise _Refuse(f"the shape of {what} {name!r} has a dim outside the supported grammar: {bad.reason}")
    return shape


def _expr(dims: Sequence) -> str:
    """The product of dims as a canonical expression text (ints folded)."""
    return shape_expr.product(dims)


def _is_dynamic(*dims: str) -> bool:
    return any(not d.lstrip("-").isdigit() for d in dims)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _close(value: np.ndarray | None, target: float, rel: float = 1e-3) -> bool:
    return value is not None and value.size == 1 and math.isclose(float(value.reshape(())), target, rel_tol=rel)


def _label(node: onnx.NodeProto) -> str:
    """How messages name a node: its name, else its first output (names may be empty or repeated)."""
    return node.name or (node.output[0] if node.output else node.op_type)


def _other_input(node: onnx.NodeProto, x: str) -> str | None:
    """The input of a two-input ``node`` that is not ``x`` (None unless ``x`` is exactly one of them)."""
    if len(node.input) != 2 or list(node.input).count(x) != 1:
        return None
    return node.input[1] if node.input[0] == x else node.input[0]


def _bias_of(g: _Graph, add: onnx.NodeProto, x: str, n: int) -> str | None:
    """The bias input when ``add`` adds a constant of N elements along the last axis to ``x``, else None.

    The bias may be either input, and may reach the Add through Identity nodes."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None
    other = _other_input(add, x)
    source = g.constant_source(other) if other else None
    if source is None:
        return None
    shape = g.shapes.get(source, ())
    return other if len(shape) >= 1 and shape[-1] == n and all(d == 1 for d in shape[:-1]) else None


def _consumer(g: _Graph, name: str, op: str) -> onnx.NodeProto | None:
    readers = g.consumers.get(name, [])
    return next((u for u in readers if u.op_type == op and u.domain in ("", "ai.onnx")), None)


def _const_input(g: _Graph, node: onnx.NodeProto | None, x: str, target: float, ops: tuple[str, ...],
                 commutes: bool = True) -> str | None:
    """The constant input of ``node`` (an op of ``ops`` on ``x`` and a scalar close to ``target``)."""
    if node is None or node.op_type not in ops:
        return None
    other = _other_input(node, x)
    if other is None or (not commutes and node.input[0] != x):
        return None
    return other if _close(g.const(other), target) else None


def _match_gelu(g: _Graph, x: str) -> tuple[list[onnx.NodeProto], list[str]] | None:
    """The Erf form of Gelu exporters emit, x*0.5*(1+Erf(x/sqrt2)), as (nodes in order, constants).

    Two orderings: Mul(x, 0.5) -> Mul(., 1+erf), and Mul(x, 1+erf) -> Mul(., 0.5); the scale is Div by
    sqrt2 or Mul by 1/sqrt2. This matches the structure only; ``_absorbable`` decides whether it may fuse.
    """
    consts: list[str] = []
    scale = None
    for u in g.consumers.get(x, []):
        c = (_const_input(g, u, x, math.sqrt(2), ("Div",), commutes=False)
             or _const_input(g, u, x, 1 / math.sqrt(2), ("Mul",)))
        if c is not None:
            scale, consts = u, [c]
            break
    if scale is None:
        return None
    erf = _consumer(g, scale.output[0], "Erf")
    add = erf and _consumer(g, erf.output[0], "Add")
    one = _const_input(g, add, erf.output[0], 1.0, ("Add",)) if erf else None
    if erf is None or add is None or one is None:
        return None
    consts.append(one)
    half = _half_product(g, x, add.output[0], skip=scale)  # Mul(x, 0.5) -> Mul(., 1+erf) or the other order
    if half is None:
        return None
    first, last, c_half = half
    return [scale, erf, add, first, last], consts + [c_half]


def _half_product(g: _Graph, x: str, factor: str, skip: onnx.NodeProto | None = None
                  ) -> tuple[onnx.NodeProto, onnx.NodeProto, str] | None:
    """0.5 * x * ``factor`` in the two orders exporters write it, as (first Mul, last Mul, the 0.5 constant):
    Mul(x, 0.5) -> Mul(., factor), or Mul(x, factor) -> Mul(., 0.5). ``skip``: a Mul reading ``x`` that is
    part of the pattern already (not the product)."""
    for first in g.consumers.get(x, []):
        if first is skip or not _default_domain(first, "Mul"):
            continue
        half = _const_input(g, first, x, 0.5, ("Mul",))
        if half is not None:  # Mul(x, 0.5) -> Mul(., factor)
            last = _consumer(g, first.output[0], "Mul")
            if last is not None and _other_input(last, first.output[0]) == factor:
                return first, last, half
        elif _other_input(first, x) == factor:  # Mul(x, factor) -> Mul(., 0.5)
            last = _consumer(g, first.output[0], "Mul")
            half = _const_input(g, last, first.output[0], 0.5, ("Mul",)) if last is not None else None
            if last is not None and half is not None:
                return first, last, half
    return None


def _match_gelu_tanh(g: _Graph, x: str) -> tuple[list[onnx.NodeProto], list[str]] | None:
    """The tanh approximation of Gelu as GPT-2's exports write it (TorchScript and dynamo),
    0.5*x*(1+Tanh(sqrt(2/pi)*(x+0.044715*Pow(x,3)))), as (nodes in order, constants); the cube may also be
    Mul(Mul(x, x), x), and the 0.5 product either order ``_half_product`` reads. Structure only, as
    ``_match_gelu``."""
    for cube in g.consumers.get(x, []):
        nodes: list[onnx.NodeProto] = []
        consts: list[str] = []
        if _default_domain(cube, "Pow") and len(cube.input) == 2 and cube.input[0] == x \
                and _close(g.const(cube.input[1]), 3.0):
            nodes, consts = [cube], [cube.input[1]]
        elif _default_domain(cube, "Mul") and list(cube.input) == [x, x]:
            cubed = _consumer(g, cube.output[0], "Mul")
            if cubed is None or _other_input(cubed, cube.output[0]) != x:
                continue
            nodes, cube = [cube, cubed], cubed
        else:
            continue
        scaled = _consumer(g, cube.output[0], "Mul")
        c1 = _const_input(g, scaled, cube.output[0], 0.044715, ("Mul",))
        inner = _consumer(g, scaled.output[0], "Add") if scaled is not None and c1 is not None else None
        if inner is None or _other_input(inner, scaled.output[0]) != x:  # type: ignore[union-attr]
            continue
        arg = _consumer(g, inner.output[0], "Mul")
        c2 = _const_input(g, arg, inner.output[0], math.sqrt(2 / math.pi), ("Mul",))
        tanh = _consumer(g, arg.output[0], "Tanh") if arg is not None and c2 is not None else None
        add = _consumer(g, tanh.output[0], "Add") if tanh is not None else None
        one = _const_input(g, add, tanh.output[0], 1.0, ("Add",)) if add is not None and tanh is not None else None
        if arg is None or tanh is None or add is None or one is None:
            continue
        half = _half_product(g, x, add.output[0], skip=nodes[0])
        if half is None:
            continue
        first, last, c_half = half
        assert scaled is not None and c1 is not None and c2 is not None
        return nodes + [scaled, inner, arg, tanh, add, first, last], consts + [c1, c2, one, c_half]
    return None


def _match_silu(g: _Graph, x: str) -> tuple[list[onnx.NodeProto] | None, onnx.NodeProto | None]:
    """SiLU as exporters write it (LLaMA's MLP gate), x * Sigmoid(x): ([Sigmoid, Mul], Sigmoid), or
    (None, the Sigmoid) when a Sigmoid reads ``x`` but its product is not with ``x`` itself, (None, None)
    when no Sigmoid reads ``x``."""
    sigmoid = _consumer(g, x, "Sigmoid")
    if sigmoid is None:
        return None, None
    for mul in g.consumers.get(sigmoid.output[0], []):
        if _default_domain(mul, "Mul") and _other_input(mul, sigmoid.output[0]) == x:
            return [sigmoid, mul], sigmoid
    return None, sigmoid


def _clip_bounds(g: _Graph, clip: onnx.NodeProto) -> tuple[float, float] | str:
    """A Clip's (min, max), from its inputs (opset 11 on; an empty or absent input: no bound) or its
    attributes (before); why not when a bound is not a constant scalar."""
    if len(clip.input) > 1:
        bounds = []
        for name, default in zip(list(clip.input[1:3]) + [""] * (3 - len(clip.input)), (-math.inf, math.inf)):
            if not name:
                bounds.append(default)
                continue
            source = g.constant_source(name)
            value = g.const(source) if source is not None else None
            if value is None or value.size != 1:
                return f"its bound {name!r} is not a constant scalar"
            bounds.append(float(value.reshape(())))
        return bounds[0], bounds[1]
    attrs = _attrs(clip)
    return float(attrs.get("min", -math.inf)), float(attrs.get("max", math.inf))


def _absorbable(g: _Graph, nodes: Sequence[onnx.NodeProto], x: str) -> str | None:
    """Why a kernel cannot absorb ``nodes`` (a pattern reading ``x``), or None when it can: ``x`` and
    every value the pattern makes, but the last node's output, must be read only inside the pattern and be
    no graph output (the absorbed nodes are removed)."""
    inside = {id(n) for n in nodes}
    for name in [x] + [o for n in nodes[:-1] for o in n.output] + list(nodes[-1].output[1:]):
        if name in g.graph_outputs:
            return f"its intermediate {name!r} is a graph output"
        outside = [u for u in g.consumers.get(name, []) if id(u) not in inside]
        if outside:
            return f"its intermediate {name!r} is also used by {_label(outside[0])!r}"
    return None


def _rank_grows(g: _Graph, x: str, consts: Sequence[str]) -> str | None:
    """Why adding or multiplying ``consts`` would give a result of higher rank than ``x``, or None."""
    rank = len(g.shapes[x]) if x in g.shapes else None
    for c in consts:
        source = g.constant_source(c) or c
        crank = len(g.shapes.get(source, ()))
        if crank > (rank if rank is not None else 1):
            have = f"rank {rank}" if rank is not None else "unknown rank"
            return (f"constant {c!r} has rank {crank}, more than the {have} of {x!r}: the fused output would "
                    f"lose the broadcast dims")
    return None


def _default_domain(node: onnx.NodeProto | None, *ops: str) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _scale(g: _Graph, x: str) -> tuple[onnx.NodeProto | None, float, str | None]:
    """A Mul or Div of ``x`` by a constant scalar, read only by it (attention's scores / sqrt(head_dim)), as
    (node, alpha, None); (node, 1.0, why) for such a node a kernel cannot absorb; (None, 1.0, None) when
    ``x`` is not scaled by a constant (a Mul by another tensor is no candidate)."""
    node = g.exclusive_consumer(x)  # a product read elsewhere too (Gelu's x / sqrt2) is no candidate
    if node is None or not _default_domain(node, "Mul", "Div"):
        return None, 1.0, None
    other = _other_input(node, x)
    source = g.constant_source(other) if other else None
    if other is None or source is None or (node.op_type == "Div" and node.input[0] != x):
        return None, 1.0, None
    value = g.const(source)
    if value is None:
        return node, 1.0, f"the value of constant {other!r} is not loaded"
    if value.size != 1:
        return node, 1.0, f"constant {other!r} has {value.size} elements, not one scalar"
    why = _rank_grows(g, x, [other])
    if why:
        return node, 1.0, why
    c = float(value.reshape(()))
    alpha = c if node.op_type == "Mul" else (1.0 / c if c != 0.0 else math.nan)
    if not math.isfinite(alpha) or alpha == 0.0:
        return node, 1.0, f"the scale {c!r} would make the fused alpha {alpha!r}"
    return node, alpha, None


def _depends_on(g: _Graph, value: str, x: str, limit: int = 64) -> bool:
    """Whether ``value`` is computed from ``x`` within ``limit`` nodes up its producers."""
    todo, seen = [value], set[int]()
    while todo and len(seen) < limit:
        name = todo.pop()
        if name == x:
            return True
        node = g.producers.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(i for i in node.input if i)
    return False


def _residual(g: _Graph, x: str, claimed: AbstractSet[int] = frozenset(), op: str = "Add"
              ) -> tuple[onnx.NodeProto | None, str | None]:
    """An Add (``op``; "Mul": LLaMA's SwiGLU gate times the up-projection) of ``x`` and a second tensor of
    exactly ``x``'s shape and dtype (the skip connection before a LayerNorm, ResNet's shortcut), as (node, None);
    (node, why) when a kernel cannot absorb it; (None, None) when no such node of a tensor follows or it is in
    ``claimed`` (node ids another workload already absorbed: ResNet's projection shortcut adds two conv outputs,
    and only one conv can take the Add)."""
    users = g.consumers.get(x, [])
    add = next((u for u in users if _default_domain(u, op) and _other_input(u, x)), None)
    if add is None or id(add) in claimed:
        return None, None
    other = _other_input(add, x)
    assert other is not None
    if _depends_on(g, other, x):  # x + f(x) (the tanh Gelu's x + 0.044715 x^3): no residual
        return None, None
    sx, so, sy = g.shapes.get(x), g.shapes.get(other), g.shapes.get(add.output[0])
    source = g.constant_source(other)
    if source is not None and (sx is None or [str(d) for d in g.shapes.get(source, ())] != [str(d) for d in sx]):
        return None, None  # a constant that broadcasts is a bias (fused or refused as one), no residual
    if len(users) > 1 or x in g.graph_outputs:
        where = "is a graph output" if x in g.graph_outputs else \
            f"is also read by {_label(next(u for u in users if u is not add))!r}"
        return add, f"the value before it, {x!r}, {where}"
    if sx is None or so is None or any(d is None or isinstance(d, _Unreadable) for d in sx + so):
        return add, f"the shape of {x!r} or {other!r} is unknown after shape inference"
    if [str(d) for d in so] != [str(d) for d in sx] or (sy is not None and [str(d) for d in sy] != [str(d) for d in sx]):
        text = lambda dims: "[" + ", ".join(str(d) for d in dims) + "]"  # noqa: E731
        return add, f"{other!r} has shape {text(so)}, not the output's {text(sx)} (a broadcast {op} is no residual)"
    if g.dtypes.get(other) != g.dtypes.get(x):
        return add, f"{other!r} has another dtype than the product"
    return add, None


def _activation(g: _Graph, x: str, refused: list[Skipped]) -> tuple[str, list[onnx.NodeProto]]:
    """The activation right after ``x`` that a kernel can absorb, as (activation, its nodes); ("none", [])
    when there is none. Relu; Gelu in the Erf form exporters write up to opset 19 or as opset 20's ``Gelu`` op
    (approximate "none" is the kernels' erf form, "tanh" their tanh form); the tanh Gelu formula of GPT-2's
    exports; SiLU as x * Sigmoid(x) (LLaMA's MLP gate); ReLU6 as Clip(0, 6) (MobileNetV2), and a Clip with
    min 0 and no max as Relu. A candidate that cannot be absorbed (an intermediate read elsewhere, a Clip with
    other bounds, a Sigmoid whose product is not with ``x``) goes to ``refused`` with the reason."""
    nxt = g.exclusive_consumer(x)
    if _default_domain(nxt, "Relu"):
        assert nxt is not None
        return "relu", [nxt]
    if _default_domain(nxt, "Gelu"):
        assert nxt is not None
        approximate = next((a.s.decode() for a in nxt.attribute if a.name == "approximate"), "none")
        if approximate in ("none", "tanh"):
            return "gelu" if approximate == "none" else "gelu_tanh", [nxt]
        refused.append(Skipped(_label(nxt), "Gelu", f"Gelu not fused: approximate={approximate!r} (the kernels "
                                                    "compute the erf and the tanh forms)"))
        return "none", []
    if _default_domain(nxt, "Clip"):
        assert nxt is not None
        bounds = _clip_bounds(g, nxt)
        if bounds == (0.0, 6.0):
            return "relu6", [nxt]
        if bounds == (0.0, math.inf):
            return "relu", [nxt]
        text = bounds if isinstance(bounds, str) else f"bounds ({bounds[0]:g}, {bounds[1]:g})"
        refused.append(Skipped(_label(nxt), "Clip", f"Clip not fused: {text} (the kernels fuse Clip(0, 6) as "
                                                    "ReLU6 and Clip(0) as Relu)"))
        return "none", []
    for activation, match in (("gelu", _match_gelu), ("gelu_tanh", _match_gelu_tanh)):
        found = match(g, x)
        if found is not None:
            nodes, consts = found
            why = _absorbable(g, nodes, x) or _rank_grows(g, x, consts)
            if why:
                refused.append(Skipped(_label(nodes[-1]), "Gelu", f"Gelu not fused: {why}"))
                return "none", []
            return activation, nodes
    silu, sigmoid = _match_silu(g, x)
    if silu is not None:
        why = _absorbable(g, silu, x)
        if why:
            refused.append(Skipped(_label(silu[-1]), "Mul", f"SiLU not fused: {why}"))
            return "none", []
        return "silu", silu
    if sigmoid is not None:
        refused.append(Skipped(_label(sigmoid), "Sigmoid", f"Sigmoid not fused: no Mul of its output by {x!r} "
                                                           "itself (the kernels fuse Sigmoid only as SiLU, "
                                                           "x * Sigmoid(x))"))
    return "none", []


# the shape-only ops an activation is fused from behind (_activation_after_reshape); the rewrite moves them after
# the fused node
MOVABLE = ("Reshape", "Squeeze")


def conv_out_of_range(params: ConvParams) -> str:
    """Why a compiled kernel cannot record this conv's geometry (a value outside the bundle's CONV_RANGES, e.g.
    wav2vec2's 128-wide positional conv), or "" when it can."""
    for name, value, (lo, hi) in zip(CONV_FIELDS, params.geometry(), CONV_RANGES):
        if not lo <= value <= hi:
            return f"Conv {name}={value} is outside {lo}..{hi}, the range a compiled conv kernel records"
    return ""


def conv1d_out_of_range(at: Mapping[str, Any], weight: Sequence[int]) -> str:
    """``conv_out_of_range`` for the 2-D form (kernel 1 x k) of a 1-D conv with these attributes (``_attrs``) and
    weight dims [OC, C / group, k]; its SAME pads are not resolved here (taken as 0)."""
    oc, c, k = (int(d) for d in weight)
    pads = list(at.get("pads", (0, 0)))
    return conv_out_of_range(ConvParams(
        in_channels=c * int(at.get("group", 1)), out_channels=oc, kernel=(1, int(at.get("kernel_shape", [k])[0])),
        strides=(1, int(at.get("strides", [1])[0])), pads=(0, pads[0], 0, pads[1]) if len(pads) == 2 else (0, 0, 0, 0),
        dilations=(1, int(at.get("dilations", [1])[0]))))


def conv_auto_pad(at: Mapping[str, Any]) -> str:
    """A Conv's auto_pad attribute (from ``_attrs``, which gives a STRING as bytes) as text."""
    auto = at.get("auto_pad", "NOTSET")
    return auto.decode() if isinstance(auto, bytes) else str(auto)


def _activation_after_reshape(g: _Graph, x: str, refused: list[Skipped]) -> tuple[str, list[onnx.NodeProto]]:
    """An activation after a Reshape or Squeeze that alone reads ``x`` (GPT-2's Conv1D exports as Reshape ->
    Gemm -> Reshape, the FFN's Gelu after the second Reshape; a 1-D conv written as a 2-D one, tuner/conv1d.py,
    is followed by a Squeeze), as (activation, [the Reshape, the activation's nodes]): an elementwise activation
    commutes with it, so the kernel applies it and the rewrite moves the Reshape after the fused node. Its
    constants must keep ``x``'s rank too (the fused node computes on ``x``)."""
    reshape = g.exclusive_consumer(x)
    if not _default_domain(reshape, *MOVABLE):
        return "none", []
    assert reshape is not None
    seen: list[Skipped] = []
    activation, nodes = _activation(g, reshape.output[0], seen)
    refused.extend(seen)
    inside = {o for n in nodes for o in n.output} | {reshape.output[0]}
    consts = [i for n in nodes for i in n.input if i and i not in inside and g.constant_source(i) is not None]
    why = _rank_grows(g, x, consts) if nodes else None
    if why:
        refused.append(Skipped(_label(nodes[-1]), nodes[-1].op_type, f"activation after a Reshape not fused: {why}"))
        return "none", []
    return (activation, [reshape] + nodes) if nodes else ("none", [])


def _epilogue(g: _Graph, node: onnx.NodeProto, n: int, allow_bias: bool, allow_scale: bool = False,
              allow_residual: bool = False, claimed: AbstractSet[int] = frozenset()
              ) -> tuple[Epilogue, tuple[onnx.NodeProto, ...], list[Skipped]]:
    """The scalar Mul/Div (``allow_scale``), Add(bias), activation (``_activation``) and residual Add
    (``allow_residual``) after ``node`` that a kernel can absorb, in one of the kernel's orders:
    act(alpha * acc + bias) + residual (the activation right after the product or bias), or
    act(alpha * acc + bias + residual) (an Add of a tensor right after them, then the activation:
    residual_first), or act(alpha * acc + bias) * residual (a Mul of the activation's result by a tensor of its
    shape: residual_mul, LLaMA's SwiGLU gate; after an activation only), as (epilogue, the absorbed nodes in
    graph order, the candidates refused with the reason).
    An activation behind a Reshape (``_activation_after_reshape``) is absorbed with the Reshape as its first
    node, and then no residual; so is a residual Add behind one (no activation before it): the Reshape keeps the
    elements' order, so the kernel adds the residual's elements in its own output's order. A node the orders do
    not fit (a bias Add after the Relu, a Mul after the bias)
    is left as it is; so is a residual Add in ``claimed`` (absorbed by another node)."""
    out, chain, bias, refused = node.output[0], [], False, []
    alpha = 1.0
    if allow_scale:
        scale, value, why = _scale(g, out)
        if scale is not None and why:
            refused.append(Skipped(_label(scale), scale.op_type, f"scale not fused: {why}"))
        elif scale is not None:
            alpha, out, chain = value, scale.output[0], [scale]
    add = g.exclusive_consumer(out)
    b = _bias_of(g, add, out, n) if allow_bias and add is not None else None
    if b is not None and add is not None:
        why = _rank_grows(g, out, [b])
        if why:
            refused.append(Skipped(_label(add), "Add", f"bias not fused: {why}"))
        else:
            bias, out, chain = True, add.output[0], chain + [add]
    activation, act_nodes = _activation(g, out, refused)
    if not act_nodes:  # GPT-2's Conv1D: Gemm -> Reshape (back to [batch, seq, n]) -> the activation; Squeeze
        activation, act_nodes = _activation_after_reshape(g, out, refused)
    residual = residual_first = residual_mul = False
    if allow_residual and not (act_nodes and act_nodes[0].op_type in MOVABLE):
        last = act_nodes[-1].output[0] if act_nodes else out
        add, why = _residual(g, last, claimed)
        moved = g.exclusive_consumer(out) if add is None and not act_nodes else None
        if _default_domain(moved, *MOVABLE):  # GPT-2's Conv1D: Gemm -> Reshape (to [batch, seq, n]) -> Add(residual)
            assert moved is not None
            add, why = _residual(g, moved.output[0], claimed)
        else:
            moved = None
        if add is None and act_nodes:  # silu(x @ Wg) * (x @ Wu): the up-projection's output multiplies
            add, why = _residual(g, last, claimed, "Mul")
            residual_mul = add is not None and not why
        if add is not None and why:
            refused.append(Skipped(_label(add), add.op_type, f"residual not fused: {why}"))
        elif add is not None:
            residual, chain = True, chain + act_nodes + ([moved] if moved is not None else []) + [add]
            if not act_nodes:  # Add then (maybe) the activation: the residual goes in before it
                activation, act_nodes = _activation(g, add.output[0], refused)
                residual_first = activation != "none"
            else:
                act_nodes = []
    chain = chain + act_nodes
    return Epilogue(bias, activation, alpha, residual, residual_first, residual_mul), tuple(chain), refused


def _dtype(g: _Graph, name: str) -> str:
    elem = g.dtypes.get(name)
    if elem not in _DTYPES:
        label = onnx.TensorProto.DataType.Name(elem) if elem is not None else "unknown"
        raise _Refuse(f"unsupported dtype {label} (supported: {', '.join(_DTYPES.values())})")
    return _DTYPES[elem]


def _matmul(g: _Graph, node: onnx.NodeProto) -> dict:
    a, b = node.input[0], node.input[1]
    sa, sb = _shape(g, a, "input"), _shape(g, b, "input")
    if len(sa) < 2 or len(sb) < 2:
        raise _Refuse("1-D MatMul operands are not supported")
    k, k2 = sa[-1], sb[-2]
    if str(k) != str(k2):
        raise _Refuse(f"inner dims differ ({k} vs {k2})")
    ba, bb = sa[:-2], sb[:-2]
    if all(d == 1 for d in bb):  # B is a (possibly broadcast) matrix: one GEMM over A's rows
        return dict(op="gemm", m=_expr(sa[:-1]), n=_expr([sb[-1]]), k=_expr([k]), batch="1")
    if len(ba) != len(bb) or any(str(x) != str(y) for x, y in zip(ba, bb)):
        if all(d == 1 for d in ba):
            return dict(op="bmm", m=_expr([sa[-2]]), n=_expr([sb[-1]]), k=_expr([k]), batch=_expr(bb))
        raise _Refuse(f"batch dims {list(ba)} and {list(bb)} need a partial broadcast, which is not supported")
    return dict(op="bmm", m=_expr([sa[-2]]), n=_expr([sb[-1]]), k=_expr([k]), batch=_expr(ba))


def _gemm(g: _Graph, node: onnx.NodeProto) -> dict:
    at = _attrs(node)
    if at.get("transA", 0):
        raise _Refuse("Gemm with transA=1 is not supported")
    c = node.input[2] if len(node.input) > 2 else ""
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    if not math.isclose(alpha, 1.0) or (c and not math.isclose(beta, 1.0)):
        # the graph pre-pass (tuner/affine.py) folds them into a constant B and C where every product is finite
        dynamic = [f"{operand} {name!r} is no constant to fold {what} into" for operand, what, name, factor in
                   (("B", "alpha", node.input[1], alpha), ("C", "beta", c, beta))
                   if name and not math.isclose(factor, 1.0) and g.const(name) is None]
        raise _Refuse(f"Gemm with alpha {alpha:g} and beta {beta:g} (the kernels compute A @ B + C): "
                      + ("; ".join(dynamic) or "alpha * B or beta * C is not finite, so neither is folded"))
    sa, sb = _shape(g, node.input[0], "input"), _shape(g, node.input[1], "input")
    trans_b = bool(at.get("transB", 0))
    n = sb[0] if trans_b else sb[1]
    info = dict(op="gemm", m=_expr([sa[0]]), n=_expr([n]), k=_expr([sa[1]]), batch="1", trans_b=trans_b)
    if len(node.input) > 2 and node.input[2]:
        source = g.constant_source(node.input[2])  # through Identity, as exporters write shared constants
        shape = g.shapes.get(source, ()) if source else ()
        if source is None or not (len(shape) >= 1 and shape[-1] == n and all(d == 1 for d in shape[:-1])):
            raise _Refuse("Gemm's C input is not a constant bias of N elements")
        info["bias"] = True
    return info


def same_pad_total(kernel: int, stride: int, size: str | int) -> int | None:
    """The pad an auto_pad SAME conv adds along one axis in all: (ceil(in / stride) - 1) * stride + kernel - in, at
    least 0, which is kernel - stride + r for r = (-in) mod stride. A fixed size fixes it; over a dynamic size it
    is the same for every size only where no r changes it (stride 1: kernel - 1; a 1-wide kernel: 0), else None."""
    if isinstance(size, int):
        return max(kernel - stride + (-size) % stride, 0)
    totals = {max(kernel - stride + r, 0) for r in range(stride)}
    return totals.pop() if len(totals) == 1 else None


def _conv_pads(at: Mapping[str, Any], kernel: tuple[int, int], strides: tuple[int, ...],
               dilations: tuple[int, ...], spatial: Sequence[str | int]) -> tuple[int, int, int, int]:
    """A 2-D Conv's explicit pads (top, left, bottom, right), its auto_pad resolved: VALID pads nothing; SAME_UPPER and
    SAME_LOWER pad ``same_pad_total`` in all, the odd one at the end (UPPER) or the start (LOWER). That total
    depends on the input size unless the stride is 1, the kernel 1 wide or the size fixed: a SAME conv over a
    dynamic dim otherwise is refused, and so is one with dilations (onnxruntime's Conv refuses it)."""
    auto = conv_auto_pad(at)
    if auto == "NOTSET":
        pads = list(at.get("pads", (0, 0, 0, 0)))
        if len(pads) != 4:
            raise _Refuse(f"invalid node: a 2-D Conv's pads {pads} are not 4 values")
        return pads[0], pads[1], pads[2], pads[3]
    if auto == "VALID":
        return 0, 0, 0, 0
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise _Refuse(f"Conv auto_pad={auto!r} is not one ONNX defines (NOTSET, VALID, SAME_UPPER, SAME_LOWER)")
    if any(d != 1 for d in dilations):  # ORT's Conv refuses them ('Dilation not supported for AutoPadType')
        raise _Refuse(f"Conv auto_pad={auto} with dilations {list(dilations)}: onnxruntime does not run it either")
    begins, ends = [], []
    for axis, (k, s, size) in enumerate(zip(kernel, strides, spatial)):
        total = same_pad_total(k, s, size)
        if total is None:
            raise _Refuse(f"Conv auto_pad={auto} with stride {s} over the dynamic dim {size!r} (axis {axis + 2}): its "
                          "pads change with the input size (export with explicit pads)")
        small = total // 2
        begins.append(small if auto == "SAME_UPPER" else total - small)
        ends.append(total - begins[-1])
    return begins[0], begins[1], ends[0], ends[1]


def _conv(g: _Graph, node: onnx.NodeProto) -> dict:
    at = _attrs(node)
    group = at.get("group", 1)
    if not isinstance(group, int) or group < 1:
        raise _Refuse(f"Conv group={group!r} is not a positive integer")
    x, w = node.input[0], node.input[1]
    sx, sw = _shape(g, x, "input"), _shape(g, w, "weight")
    if len(sx) == 3:  # tuner/conv1d.py writes the others as 2-D ones
        outside = conv1d_out_of_range(at, sw) if w in g.inits and len(sw) == 3 else ""
        if outside:
            raise _Refuse(f"{outside} (a 1-D conv, tuned as a 2-D one)")
        raise _Refuse("a 1-D convolution is tuned (as a 2-D one) only with a constant weight and, at a stride "
                      "above 1, pads that do not change with the length (not auto_pad SAME with a kernel over 1 wide)")
    if len(sx) != 4:
        raise _Refuse(f"only 1-D and 2-D convolutions (NCL, NCHW) are supported, input has rank {len(sx)}")
    if w not in g.inits:
        raise _Refuse("Conv weight is not a constant initializer")
    sy = _shape(g, node.output[0], "output")
    oc, c, kh, kw = sw
    if oc % group or (isinstance(sx[1], int) and sx[1] != c * group):
        raise _Refuse(f"Conv group={group}: weight {list(sw)} and input channels {sx[1]!r} do not split into "
                      f"{group} groups")
    strides, dilations = tuple(at.get("strides", (1, 1))), tuple(at.get("dilations", (1, 1)))
    params = ConvParams(in_channels=int(c) * group, out_channels=int(oc), kernel=(int(kh), int(kw)),
                        strides=strides, pads=_conv_pads(at, (int(kh), int(kw)), strides, dilations, sx[2:]),
                        dilations=dilations, groups=group)
    outside = conv_out_of_range(params)
    if outside:
        raise _Refuse(outside)
    # a grouped conv is `group` GEMMs of one group's channels each: the workload's batch
    return dict(op="conv", m=_expr([sy[0], sy[2], sy[3]]), n=_expr([oc // group]), k=_expr([c * kh * kw]),
                batch=str(group),
                conv=params, conv_input=(_expr([sx[0]]), _expr([sx[2]]), _expr([sx[3]])),
                bias=len(node.input) > 2 and bool(node.input[2]))


_RULES = {"MatMul": _matmul, "Gemm": _gemm, "Conv": _conv}


def _free_symbols(*exprs: str) -> set[str]:
    out: set[str] = set()
    for e in exprs:
        out |= shape_expr.free_names(e)
    return out


def scan_model(model: onnx.ModelProto, base_dir: str | Path | None = None, if_branches: bool = False) -> ScanResult:
    """Describe the main graph's MatMul/Gemm/Conv nodes as workloads (no instances yet); the ones in subgraphs are
    listed as skipped, but with ``if_branches`` those of the main graph's If branches, which the caller scans as
    models of their own (tuner/branches.py).

    ``base_dir`` is where the model's external data lives, when its tensors were not loaded.
    """
    ours = [_label(n) for n in model.graph.node if n.domain == DOMAIN]
    if ours:  # before shape inference, which fails on op types it does not know the way they are used here
        raise DietcodeError(f"the model was optimized by dietcode-ort already ({len(ours)} ai.dietcode node(s): "
                            f"{', '.join(ours[:3])}{', ...' if len(ours) > 3 else ''}): optimize the original model")
    input_dims = model_symbols(model)
    _check_input_dims(model)
    symbols = _names(input_dims)
    if not symbols:
        return ScanResult((), (), (), input_dims)
    copy = _inference_copy(model, Path(base_dir) if base_dir is not None else None)
    aliases = _alias_dims(copy)
    loaded = {t.name: t for t in copy.graph.initializer}  # small external constants read (Gelu's 0.5, ...)
    merged: dict[str, str | int] = {}
    g = _Graph(_infer(copy, merged), [loaded.get(t.name, t) for t in model.graph.initializer], aliases)
    merged = {aliases.get(k, k): aliases.get(v, v) if isinstance(v, str) else v for k, v in merged.items()}
    groups: dict[tuple, list[tuple[str, tuple[str, ...], tuple[int, int]]]] = defaultdict(list)
    protos: dict[tuple, Workload] = {}
    skipped, unfused = [], []
    claimed: set[int] = set()  # ids of the nodes absorbed so far (a shortcut Add between two convs: one takes it)
    for node in model.graph.node:
        if node.op_type in _QUANTIZED_OPS:
            skipped.append(Skipped(_label(node), node.op_type, "a quantized op: dietcode-ort tunes float MatMul, "
                                                               "Gemm and Conv nodes (optimize the float model)"))
        if node.op_type not in _OPS or node.domain not in ("", "ai.onnx"):
            continue
        name = _label(node)
        try:
            dequantized = [x for x in node.input[:2] if getattr(g.producers.get(x), "op_type", "") == "DequantizeLinear"]
            if dequantized:  # a QDQ model: ORT fuses DequantizeLinear -> MatMul -> QuantizeLinear into a quantized op
                raise _Refuse(f"a quantized (QDQ) model: {dequantized[0]!r} comes from a DequantizeLinear, and "
                              "onnxruntime runs such a node as a quantized kernel; dietcode-ort tunes float ones "
                              "(optimize the float model)")
            info = _RULES[node.op_type](g, node)
            dtype = _dtype(g, node.input[0])
            other = node.input[1]  # B / W: ONNX gives both operands one type (ORT refuses the model otherwise)
            if other in g.dtypes and g.dtypes[other] != g.dtypes[node.input[0]]:
                b_type = _DTYPES.get(g.dtypes[other]) or onnx.TensorProto.DataType.Name(g.dtypes[other])
                raise _Refuse(f"invalid node: its operands have different dtypes ({dtype} and {b_type})")
            exprs = [info["m"], info["n"], info["k"], info["batch"], *info.get("conv_input", ())]
            if not _is_dynamic(*exprs):
                raise _Refuse("static shapes: no symbolic dim to tune over")
            empty = [f"{label} = {e}" for label, e in zip(("M", "N", "K", "batch"), exprs)
                     if e.lstrip("-").isdigit() and int(e) <= 0]
            if empty:
                raise _Refuse(f"a zero-size dim ({', '.join(empty)}): an empty product, nothing to tune")
            unknown = _free_symbols(*exprs) - set(symbols)
            if unknown:
                raise _Refuse(f"shape depends on data-dependent dim(s) {', '.join(sorted(unknown))}")
        except _Refuse as refusal:
            skipped.append(Skipped(name, node.op_type, str(refusal)))
            continue
        n_const = int(info["n"]) if info["n"].isdigit() else -1
        matmul = node.op_type == "MatMul"
        # a residual Add: gemm-view MatMuls, Gemms and Convs (ResNet's Conv -> Add(shortcut) -> Relu)
        allow_residual = info["op"] in ("gemm", "conv")
        if info.get("bias"):  # Gemm's C / Conv's bias: the op carries it; an activation and a residual can follow
            epilogue, absorbed, refused = _epilogue(g, node, n_const, allow_bias=False,
                                                    allow_residual=allow_residual, claimed=claimed)
            epilogue = replace(epilogue, bias=True)
        else:
            epilogue, absorbed, refused = _epilogue(g, node, n_const,
                                                    allow_bias=info["op"] != "conv" and n_const > 0,
                                                    allow_scale=matmul, allow_residual=allow_residual,
                                                    claimed=claimed)
        claimed.update(id(f) for f in absorbed)
        fused = tuple(f.output[0] for f in absorbed)
        unfused.extend(refused)
        const = tuple(j for j, inp in enumerate(node.input) if inp and inp in g.inits)
        wl = Workload(op=info["op"], onnx_op=node.op_type, nodes=(), m=info["m"], n=info["n"], k=info["k"],
                      dtype=dtype, symbols=tuple(sorted(_free_symbols(*exprs))), batch=info["batch"],
                      const_operands=const, trans_b=info.get("trans_b", False), epilogue=epilogue,
                      conv=info.get("conv"), conv_input=info.get("conv_input"))
        ranks = (len(g.shapes.get(node.input[0], ())), len(g.shapes.get(node.input[1], ())))
        groups[_group_key(wl)].append((node.output[0], fused, ranks))
        protos.setdefault(_group_key(wl), wl)
    workloads = tuple(replace(protos[key], nodes=tuple(m[0] for m in members),
                              fused_nodes=tuple(m[1] for m in members), ranks=tuple(m[2] for m in members))
                      for key, members in groups.items())
    skipped.extend(_nested(model, if_branches))
    return ScanResult(symbols, workloads, tuple(skipped), input_dims, tuple(unfused), merged=merged)


def _nested(model: onnx.ModelProto, if_branches: bool = False) -> list[Skipped]:
    """The MatMul/Gemm/Conv nodes outside the main graph, which are not tuned here: in a control-flow node's
    subgraphs (If branches, Loop and Scan bodies; with ``if_branches``, not the main graph's If branches, which
    are tuned as models of their own) and in model-local functions (but the fallback functions of ai.dietcode
    nodes), each with where it is."""
    out: list[Skipped] = []

    def walk(nodes: Sequence[onnx.NodeProto], where: str) -> None:
        for node in nodes:
            if where and node.op_type in _OPS and node.domain in ("", "ai.onnx"):
                reason = "only the main graph's and its If branches' nodes are" if if_branches else \
                    "only the main graph's nodes are"
                out.append(Skipped(_label(node), node.op_type, f"inside {where}: not tuned ({reason})"))
            for attr in node.attribute:
                if if_branches and not where and node.op_type == "If" and node.domain in ("", "ai.onnx") and \
                        attr.name in ("then_branch", "else_branch"):
                    continue
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                    walk(sub.node, f"the {attr.name} of {node.op_type} {_label(node)!r}")

    walk(model.graph.node, "")
    for function in model.functions:
        if function.domain != DOMAIN:
            walk(function.node, f"the model-local function {function.domain}.{function.name}")
    return out


def _group_key(w: Workload) -> tuple:
    return (w.op, w.onnx_op, w.m, w.n, w.k, w.batch, w.dtype, w.trans_b, w.epilogue, w.conv, w.conv_input,
            w.const_operands)


def attach_instances(result: ScanResult, dims: Sequence[str] = (), shapes_file: str | Path | None = None
                     ) -> ScanResult:
    """Give every workload its instances, from ``--dim`` options or a shape log (not both)."""
    if dims and shapes_file:
        raise DietcodeError("give either --dim options or --shapes, not both")
    if shapes_file:
        observed = instances_from_shape_log(shapes_file, result.input_dims)
        workloads = []
        for w in result.workloads:
            counts: dict[tuple[tuple[str, int], ...], float] = defaultdict(float)
            for assignment, count in observed.items():
                values = dict(assignment)
                missing = [s for s in w.symbols if s not in values]
                if missing:
                    raise DietcodeError(f"shape log {shapes_file}: a record gives no value for symbol(s) "
                                        f"{', '.join(missing)}")
                counts[tuple((s, values[s]) for s in w.symbols)] += count
            workloads.append(_nonempty(replace(w, instances=tuple(Instance(k, v)
                                                                  for k, v in sorted(counts.items())))))
        return replace(result, workloads=tuple(workloads))
    specs = parse_dim_options(merged_dims(dims, result.merged), result.symbols, cap=False)
    if not specs:
        return result
    # MAX_INSTANCES over each workload's own symbols: values given for dims a workload does not use must not thin
    # out its shapes (a dense layer over u kept 2 of 4096 values when five other dims had values of their own)
    capped: dict[tuple[str, ...], dict[str, DimSpec]] = {}
    workloads = []
    for w in result.workloads:
        own = tuple(sorted(s for s in w.symbols if s in specs))
        if own not in capped:
            capped[own] = cap_product({s: specs[s] for s in own})
        workloads.append(_nonempty(replace(w, instances=instances_from_dims({**specs, **capped[own]}, w.symbols))))
    return replace(result, workloads=tuple(workloads))


def _nonempty(w: Workload) -> Workload:
    """The workload without the instances whose product is empty (M, N, K or the batch <= 0: a conv's input
    smaller than its kernel window, say), with a note; an error when no instance is left."""
    kept, empty = [], []
    for instance in w.instances:
        problem = w.problem(instance)
        sizes = {"M": problem.m, "N": problem.n, "K": problem.k, "batch": problem.batch}
        zero = [f"{label} = {value}" for label, value in sizes.items() if value <= 0]
        (empty.append((instance, zero)) if zero else kept.append(instance))
    if not empty:
        return w
    instance, zero = empty[0]
    example = f"{', '.join(zero)} at {', '.join(f'{k}={v}' for k, v in instance.values)}"
    what = (f"{w.onnx_op} workload M={w.m} N={w.n} K={w.k} (output {', '.join(repr(n) for n in w.nodes[:3])}"
            f"{', ...' if len(w.nodes) > 3 else ''})")
    if not kept:
        raise DietcodeError(f"{what}: every shape given has no output ({example}; M, N, K must be positive): "
                            f"give larger --dim values")
    _log.warning("%s: left out %d of %d shapes with no output (%s; M, N, K must be positive)", what, len(empty),
                 len(w.instances), example)
    return replace(w, instances=tuple(kept))


class Prepared(NamedTuple):
    """What ``prepare_graph`` gives: the model, the nodes its passes left alone (and why), and a line per pass
    that changed the graph (for ``scan`` and ``optimize`` to say what was rewritten besides the tuned nodes)."""
    model: onnx.ModelProto
    skipped: tuple[Skipped, ...]
    changes: tuple[str, ...]


def _name_dynamic_dims(model: onnx.ModelProto) -> list[str]:
    """Give each dynamic graph-input dim that has no name (neither size nor name: skl2onnx's batch) the name bench
    gives it (``dietcode_ort.bench.unnamed_dim``), in place, so --dim can give it values; returns the names given.
    A name the model already uses for another dim is not taken twice (the dims would become one): ``unnamed_dim``
    then appends "_" (``x_dim0_``), as bench does."""
    from dietcode_ort.bench import dim_names_taken, unnamed_dim

    inits = {t.name for t in model.graph.initializer}
    taken = dim_names_taken(model.graph)
    given = []
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if not d.HasField("dim_value") and not d.dim_param:
                d.dim_param = unnamed_dim(vi.name, axis, taken)
                given.append(d.dim_param)
    return given


def prepare_graph(model: onnx.ModelProto, base_dir: Path | None) -> Prepared:
    """The graph pre-passes ``scan`` and ``optimize`` run first, in place: small nodes of constants evaluated
    (tuner/const_fold.py), matrix-product Einsums as MatMuls (tuner/einsum.py), a zero Pad before a Conv folded
    into its pads (tuner/conv_pad.py, as ORT's PadFusion does at load), a BatchNormalization and
    per-channel Mul / Add after a Conv, Gemm or MatMul folded into it (tuner/affine.py, with a weight's Transpose
    made a constant and a Gemm's alpha and beta folded; the weights it changes are read from ``base_dir`` where
    they are external) and 1-D convs as 2-D ones (tuner/conv1d.py); with the normalizations and Einsums left
    alone, as skipped nodes and why."""
    from tuner.affine import fold_affines
    from tuner.const_fold import fold_constants
    from tuner.conv1d import convs_as_2d
    from tuner.conv_pad import fold_pads
    from tuner.einsum import einsums_as_matmuls

    named = _name_dynamic_dims(model)
    model, constants = fold_constants(model, copy=False)
    model, einsums = einsums_as_matmuls(model, base_dir, copy=False)
    model, pads = fold_pads(model, copy=False)
    model, affine = fold_affines(model, copy=False, base_dir=base_dir)
    model, convs = convs_as_2d(model, copy=False)
    counts = ((len(named), f"dynamic input dim(s) without a name named as bench names them ({', '.join(named[:4])}"
                           f"{', ...' if len(named) > 4 else ''})"),
              (len(constants.folded), "constant node(s) evaluated, as ORT folds them at load"),
              (len(einsums.converted), "Einsum(s) written as MatMul"),
              (len(pads.folded), "zero Pad(s) folded into the Conv after them, as ORT folds them at load"),
              (len(affine.transposed), "weight Transpose(s) made constants"),
              (len(affine.scaled), "Gemm alpha/beta folded into B and C"),
              (len(affine.folded), "BatchNormalization / per-channel Mul, Div, Add, Sub folded into the Conv, Gemm "
                                   "or MatMul before them"),
              (len(convs.converted), "1-D Conv(s) written as 2-D"))
    return Prepared(model, tuple(Skipped(out, "BatchNormalization", why) for out, why in affine.notes)
                    + tuple(Skipped(out, "Einsum", why) for out, why in einsums.notes),
                    tuple(f"{n} {what}" for n, what in counts if n))


def scan(path: str | Path, dims: Sequence[str] = (), shapes_file: str | Path | None = None) -> ScanResult:
    """Load and scan a model file as ``optimize`` sees it (after ``prepare_graph``); weights stored as external
    data are read only where a pre-pass folds into them (otherwise only their shapes)."""
    from tuner.branches import merge_units, scan_units

    base_dir = Path(path).parent
    units = scan_units(load_model(path, load_external_data=False), base_dir,
                       lambda model: prepare_graph(model, base_dir))
    return attach_instances(merge_units([(u.where, u.scanned) for u in units]), dims, shapes_file)


def to_json(result: ScanResult) -> dict:
    def workload(w: Workload) -> dict:
        return {
            "op": w.op, "onnx_op": w.onnx_op, "nodes": list(w.nodes), "m": w.m, "n": w.n, "k": w.k,
            "batch": w.batch, "dtype": w.dtype, "symbols": list(w.symbols),
            "const_operands": list(w.const_operands), "trans_b": w.trans_b,
            "epilogue": {"bias": w.epilogue.bias, "activation": w.epilogue.activation,
                         "alpha": w.epilogue.alpha, "residual": w.epilogue.residual,
                         "residual_first": w.epilogue.residual_first, "residual_mul": w.epilogue.residual_mul},
            "fused_nodes": [list(f) for f in w.fused_nodes],
            "conv": None if w.conv is None else {
                "in_channels": w.conv.in_channels, "out_channels": w.conv.out_channels,
                "kernel": list(w.conv.kernel), "strides": list(w.conv.strides), "pads": list(w.conv.pads),
                "dilations": list(w.conv.dilations), "groups": w.conv.groups, "input": list(w.conv_input or ())},
            "instances": [{"values": i.as_dict(), "weight": i.weight} for i in w.instances],
        }
    return {"symbols": list(result.symbols), "symbol_axes": symbol_axes(result.input_dims),
            "workloads": [workload(w) for w in result.workloads],
            "skipped": [{"node": s.node, "op": s.op, "reason": s.reason} for s in result.skipped],
            "unfused": [{"node": s.node, "op": s.op, "reason": s.reason} for s in result.unfused],
            "prepared": list(result.prepared), "merged_symbols": dict(result.merged)}


def _print_table(result: ScanResult) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=max(Console().width, 140))
    table = Table(title=Text(f"{len(result.workloads)} workloads over symbols {', '.join(result.symbols)}"))
    for col in ("#", "op", "M", "N", "K", "batch", "dtype", "epilogue", "nodes", "instances"):
        table.add_column(col, overflow="fold")
    for i, w in enumerate(result.workloads):
        e = w.epilogue
        act = e.activation if e.activation != "none" else ""
        steps = ("residual", act) if e.residual_first else (act, "residual" if e.residual and not e.residual_mul else "")
        epi = "+".join(p for p in (f"alpha={e.alpha:.6g}" if e.alpha != 1.0 else "", "bias" if e.bias else "",
                                   *steps) if p) or "-"
        epi += "*residual" if e.residual_mul else ""  # the SwiGLU gate: silu*residual
        strides = "x".join(map(str, sorted(set(w.conv.strides), key=w.conv.strides.index))) if w.conv else ""
        op = w.op + (f" {w.conv.kernel[0]}x{w.conv.kernel[1]}/s{strides}" if w.conv else "")
        if w.conv and w.conv.groups > 1:
            op += " depthwise" if w.conv.groups == w.conv.in_channels else f" g{w.conv.groups}"
        nodes = ", ".join(w.nodes[:3]) + (f" (+{len(w.nodes) - 3})" if len(w.nodes) > 3 else "")
        cells = (str(i), op, w.m, w.n, w.k, w.batch, w.dtype, epi, nodes,
                 str(len(w.instances)) if w.instances else "-")
        table.add_row(*(Text(c) for c in cells))  # names come from the model: never read as markup
    console.print(table)
    console.print(Text("symbols: " + "; ".join(f"{sym} = {', '.join(where)}"
                                                for sym, where in symbol_axes(result.input_dims).items())))
    if result.merged:
        console.print(Text("dims the graph makes equal (a --dim for either gives both): " + "; ".join(
            f"{name} = {kept}" for name, kept in result.merged.items())))
    if result.prepared:
        console.print(Text("graph pre-passes: " + "; ".join(result.prepared)))
    _print_rows(console, "nodes left as they are", ("node", "op", "reason"),
                [(s.node, s.op, s.reason) for s in result.skipped])
    _print_rows(console, "epilogue nodes left unfused", ("node", "op", "reason"),
                [(s.node, s.op, s.reason) for s in result.unfused])


def _print_rows(console: Any, what: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table titled "<count> <what>" of ``rows`` (nothing when there are none); every cell is plain text:
    names come from the model and are never read as rich markup."""
    from rich.table import Table
    from rich.text import Text

    if not rows:
        return
    table = Table(title=f"{len(rows)} {what}")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(Text(c) for c in row))
    console.print(table)


def attention_report(path: str | Path) -> dict:
    """The attention chains ``optimize`` fuses by default (tuner/attention_graph.py), each with its mask kind
    (``causal``: the kernels' causal mode replaces a provably causal mask), and the Softmaxes left unfused with
    the reason."""
    from tuner.attention import layout_text
    from tuner.attention_graph import find_attention
    from tuner.attention_pack import pack_projections
    from tuner.attention_prepare import prepare_attention

    from tuner.branches import MAX_DEPTH, branch_models, located

    base_dir = Path(path).parent
    out: dict[str, list] = {"fused": [], "unfused": [], "transposes_not_moved": []}

    def visit(model: onnx.ModelProto, where: str, level: int) -> None:
        # as optimize sees them: after prepare_graph (Einsums as MatMuls), the exporters' Shape(Transpose) and Kt
        # forms rewritten, Q/K/V projections merged where exact (then read packed), or why not; in the main graph
        # and in its If branches (their chains named with where they are)
        model = prepare_graph(model, base_dir)[0]
        prepared, prep = prepare_attention(model, base_dir, copy=False)
        packed, pack = pack_projections(prepared, base_dir, copy=False)
        found = find_attention(packed, base_dir)
        pack_notes = dict(pack.notes)
        out["fused"].extend(
            {"output": located(where, s.output), "dtype": s.dtype, "head_dim": s.head_dim, "scale": s.scale,
             "mask": "causal" if s.causal else "none" if s.mask is None else "additive",
             # the operands the node reads/writes as [B, S, H, d] (their Transposes absorbed) and why a Transpose
             # next to the chain stays
             "layout": layout_text(s.layout), "transposes_kept": list(s.layout_notes),
             # Q, K and V read in place from one projection [B, S, 3*H*d], and why not
             "packed_qkv": bool(s.packed), "merged_projections": s.output in pack.packed,
             "pack_notes": list(s.pack_notes) + ([pack_notes[s.output]] if s.output in pack_notes else [])}
            for s in found.sites)
        out["unfused"].extend({"softmax": located(where, o), "reason": why} for o, why in found.skipped)
        # head-split Transposes the pre-pass did not move past the ops between them and a chain (LLaMA's rotary
        # embedding, its K/V head repeat), and why
        out["transposes_not_moved"].extend({"transpose": located(where, o), "reason": why} for o, why in prep.notes)
        if level < MAX_DEPTH:
            for b in branch_models(packed, base_dir)[0]:
                visit(b.model, f"{where} > {b.where}" if where else b.where, level + 1)

    visit(load_model(path, load_external_data=False), "", 0)
    return out


def _print_attention(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=max(Console().width, 140))
    if report["fused"]:
        fused = Table(title=f"{len(report['fused'])} attention chains fused (ai.dietcode::ScaledDotProductAttention)")
        for col in ("output", "dtype", "head_dim", "scale", "mask", "layout", "transposes kept", "qkv not packed"):
            fused.add_column(col, overflow="fold")
        for f in report["fused"]:
            fused.add_row(Text(f["output"]), f["dtype"], str(f["head_dim"]), f"{f['scale']:.6g}", f["mask"],
                          f["layout"], Text("; ".join(f["transposes_kept"]) or "-"),
                          Text("; ".join(f["pack_notes"]) or "-"))
        console.print(fused)
    _print_rows(console, "attention chains left unfused", ("softmax", "reason"),
                [(u["softmax"], u["reason"]) for u in report["unfused"]])
    _print_rows(console, "head-split Transposes not moved to their chain", ("transpose", "reason"),
                [(k["transpose"], k["reason"]) for k in report.get("transposes_not_moved", [])])


def scan_command(model: str, dims: Sequence[str], shapes_file: str | None, as_json: bool) -> int:
    import json

    result = scan(model, dims, shapes_file)
    if not result.symbols:
        raise DietcodeError(f"{model} has no symbolic dims: nothing to scan (dietcode-ort tunes MatMul/Gemm/Conv "
                            "nodes whose shapes depend on symbolic dims; export the model with dynamic axes)")
    attention = attention_report(model)
    if as_json:
        print(json.dumps({**to_json(result), "attention": attention}, indent=2))
    else:
        _print_table(result)
        _print_attention(attention)
    return 0
