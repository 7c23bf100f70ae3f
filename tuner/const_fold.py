"""Graph pre-pass: small nodes whose inputs are all constants evaluated into constants, as ORT folds them at load.

An export without constant folding (``torch.onnx.export(..., do_constant_folding=False)``) computes values such
as the attention scale at run time from constants: torch's scaled_dot_product_attention writes
``Cast(Sqrt(Constant))`` and multiplies Q and K by it. ONNX Runtime folds these when it loads the model, but the
scanner and the attention matcher read constants from initializers: a scale that is a node's output is no
constant to them, so the head-split Transposes stay and the Q/K/V projections are not packed. Such nodes are
evaluated here (``onnx.reference``, at the model's opset) and written as initializers under their output names.

Folded: a node of the default domain whose op is in ``FOLDABLE`` (deterministic, no subgraph), whose inputs are
all constants (loaded initializers that are not graph inputs a caller could override, IR >= 4, or outputs of
Constant nodes, in any of their numeric forms, and of nodes folded before it) and whose outputs hold at most ``MAX_ELEMENTS`` values each and are
no graph outputs (known before it is evaluated: a ``ConstantOfShape``, ``Range``, ``Expand`` or broadcast
whose result would be larger is not built). Larger results (a weight's Transpose) are left to the passes that own them (tuner/affine.py
makes an unshared weight's Transpose a constant); a Transpose is folded over integers only (the pads TorchScript's
``F.pad`` computes by a Transpose), never a weight's. A node the reference evaluator cannot run stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tuner.model_file import is_external
from tuner.rewrite import _drop_unread, _graph_reads, model_to_edit

__all__ = ["ConstFoldResult", "fold_constants", "FOLDABLE", "MAX_ELEMENTS"]

# deterministic ops without subgraphs that constant subgraphs of exports are made of
FOLDABLE = frozenset((
    "Abs", "Add", "And", "Cast", "Ceil", "Concat", "ConstantOfShape", "Cos", "Div", "Equal", "Erf", "Exp",
    "Expand", "Floor", "Gather", "Greater", "GreaterOrEqual", "Identity", "Less", "LessOrEqual", "Log", "Max",
    "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "Range", "Reciprocal", "ReduceProd", "ReduceSum", "Reshape",
    "Shape", "Sign", "Sin", "Size", "Slice", "Sqrt", "Squeeze", "Sub", "Tanh", "Transpose", "Unsqueeze", "Where",
))
# folded only over integers: shape arithmetic (TorchScript's F.pad reverses its pads through a Transpose); a small
# weight's Transpose stays for tuner/affine.py, which owns weights
_INTEGER_ONLY = frozenset(("Transpose",))
MAX_ELEMENTS = 4096  # per output: scalars, shape vectors, small tables, not weights


_BROADCASTING = frozenset(("Add", "And", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
                           "Min", "Mod", "Mul", "Or", "Pow", "Sub", "Where"))


@dataclass(frozen=True)
class ConstFoldResult:
    folded: tuple[str, ...]  # the first outputs of the nodes now constants, in graph order


def _constant_values(graph: onnx.GraphProto, ir_version: int) -> dict[str, onnx.TensorProto]:
    """The values the graph holds as constants: initializers (without the graph inputs that override them,
    from IR 4) and Constant nodes' tensors."""
    overridable = {i.name for i in graph.input} if ir_version >= 4 else set()
    found = {t.name: t for t in graph.initializer if t.name not in overridable and not is_external(t)}
    forms = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.output or \
                len(node.attribute) != 1:
            continue
        a = node.attribute[0]
        if a.name == "value":
            found[node.output[0]] = a.t
        elif a.name in forms:  # opset 12's forms: a scalar or a 1-D list
            value = np.array(helper.get_attribute_value(a), dtype=forms[a.name])
            found[node.output[0]] = numpy_helper.from_array(value, node.output[0])
    return found


def _small(node: onnx.NodeProto, values: list[np.ndarray]) -> bool:
    """Whether ``node``'s result on ``values`` is known to stay within ``MAX_ELEMENTS`` values per output before
    it is evaluated (a crafted ``ConstantOfShape([10**12])`` or broadcast must not be built to be refused)."""
    op = node.op_type
    try:
        if op in ("Shape", "Size"):
            return True
        if op == "ConstantOfShape":
            dims = [int(d) for d in values[0].reshape(-1)]
            return all(d >= 0 for d in dims) and int(np.prod(dims, dtype=object)) <= MAX_ELEMENTS
        if op == "Range":
            start, limit, delta = (float(v.reshape(-1)[0]) for v in values)
            return bool(delta != 0 and np.isfinite([start, limit, delta]).all()
                        and max(np.ceil((limit - start) / delta), 0) <= MAX_ELEMENTS)
        if op == "Expand":
            shape = np.broadcast_shapes(values[0].shape, tuple(int(d) for d in values[1].reshape(-1)))
            return int(np.prod(shape, dtype=object)) <= MAX_ELEMENTS
        if op in _BROADCASTING:
            return int(np.prod(np.broadcast_shapes(*(v.shape for v in values)), dtype=object)) <= MAX_ELEMENTS
    except (ValueError, TypeError, OverflowError, IndexError):  # no valid broadcast or scalar: the evaluator's
        return False
    return True  # the other ops' results are no larger than (the product of) their inputs


def _evaluate(node: onnx.NodeProto, values: list[np.ndarray], opsets: list[onnx.OperatorSetIdProto]
              ) -> list[np.ndarray] | None:
    """``node``'s outputs on ``values`` at the model's opsets, or None where the reference evaluator fails."""
    from onnx.reference import ReferenceEvaluator

    inputs = [f"i{j}" if name else "" for j, name in enumerate(node.input)]  # absent optional inputs stay ""
    outputs = [f"o{j}" if name else "" for j, name in enumerate(node.output)]
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.input[:], copy.output[:]
    copy.input.extend(inputs)
    copy.output.extend(outputs)
    present = [i for i in inputs if i]
    function = helper.make_function("dietcode.fold", "node", present, [o for o in outputs if o], [copy],
                                    list(opsets))
    try:
        return list(ReferenceEvaluator(function).run(None, dict(zip(present, values)), attributes={}))
    except Exception:  # noqa: BLE001 (an op the evaluator does not run, or bad attributes: left to ORT)
        return None


def fold_constants(model: onnx.ModelProto, copy: bool = True) -> tuple[onnx.ModelProto, ConstFoldResult]:
    """``model`` (a copy unless ``copy`` is False) with the small constant nodes of its main graph evaluated."""
    out = model_to_edit(model, copy)
    graph = out.graph
    constants = _constant_values(graph, out.ir_version)
    outputs = {o.name for o in graph.output}
    opsets = [o for o in out.opset_import if o.domain in ("", "ai.onnx")] or [helper.make_opsetid("", 17)]
    before = _graph_reads(graph)
    folded: list[str] = []
    dropped: list[int] = []  # by index (a repeated field's message wrappers do not keep their ids)
    new: list[onnx.TensorProto] = []
    for index, node in enumerate(graph.node):
        if node.op_type not in FOLDABLE or node.domain not in ("", "ai.onnx") or not node.output or \
                any(o in outputs for o in node.output if o) or \
                not all(i in constants for i in node.input if i) or not any(node.input):
            continue
        tensors = [constants[i] for i in node.input if i]
        if node.op_type in _INTEGER_ONLY and not all(
                np.issubdtype(helper.tensor_dtype_to_np_dtype(t.data_type), np.integer) for t in tensors):
            continue
        shape_only = node.op_type in ("Shape", "Size")
        if not shape_only and any(int(np.prod(t.dims, dtype=object)) > MAX_ELEMENTS for t in tensors):
            continue  # no weight is read to be refused
        # Shape and Size read only the dims: a zero-stride view of that shape, never the weight's values
        inputs = [np.broadcast_to(np.zeros((), helper.tensor_dtype_to_np_dtype(t.data_type)), tuple(t.dims))
                  if shape_only else numpy_helper.to_array(t) for t in tensors]
        if not _small(node, inputs):
            continue
        values = _evaluate(node, inputs, opsets)
        if values is None or any(np.asarray(v).size > MAX_ELEMENTS for v in values):
            continue
        for name, value in zip([o for o in node.output if o], values):
            constants[name] = numpy_helper.from_array(np.asarray(value), name)
            new.append(constants[name])
        dropped.append(index)
        folded.append(node.output[0])
    if folded:
        for index in reversed(dropped):
            del graph.node[index]
        graph.initializer.extend(new)
        _drop_unread(graph, before | {t.name for t in new})  # the Constant nodes and values only they read
    return out, ConstFoldResult(tuple(folded))
