"""Rewrite: workloads + bundles -> a model whose nodes are ``ai.dietcode`` custom ops.

Each scanned node (with the Add(bias) and Relu/Gelu it absorbs) becomes one custom node whose op type
names the fused epilogue (``MatMulBiasGelu``, ``ConvBiasRelu``, ...; the node contract is in
docs/bundle.md). The node keeps the output name of the last node it replaces and carries its kernel
bundle as an attribute. For every op type used, the model also gets a model-local function whose body is
the original computation, so stock onnxruntime without the custom-op library still runs the model; with
the library registered, ORT runs the library's kernel instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dietcode_ort.errors import DietcodeError
from tuner.workload import Workload

__all__ = ["DOMAIN", "op_type", "RewriteResult", "rewrite_model", "save_model"]

DOMAIN = "ai.dietcode"
DOMAIN_VERSION = 1
_TWO_GB = 2 * 1024 ** 3


def op_type(workload: Workload) -> str:
    """The custom op type for a workload: the ONNX op plus its fused epilogue."""
    bias = "Bias" if workload.epilogue.bias else ""
    act = {"none": "", "relu": "Relu", "gelu": "Gelu"}[workload.epilogue.activation]
    return f"{workload.onnx_op}{bias}{act}"


@dataclass(frozen=True)
class RewriteResult:
    model: onnx.ModelProto
    rewritten: tuple[str, ...]  # original node names now run by custom ops
    op_types: tuple[str, ...]


# Attributes each op type forwards to its original op (and to its fallback body), with their defaults.
_FORWARDED = {
    "MatMul": {},
    "Gemm": {"transA": 0, "transB": 0, "alpha": 1.0, "beta": 1.0},
    "Conv": {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1},
}


def _bundle_attribute(payload: bytes) -> onnx.AttributeProto:
    """The bundle as a uint8 TENSOR attribute: binary-safe, and read in full by ORT's KernelInfo API."""
    tensor = numpy_helper.from_array(np.frombuffer(payload, dtype=np.uint8), name="bundle")
    return helper.make_attribute("bundle", tensor)


def _function(op: str, onnx_op: str, opset: int) -> onnx.FunctionProto:
    """The fallback body for one op type: the original op, then Add(bias) and the activation."""
    has_bias = "Bias" in op
    act = "relu" if op.endswith("Relu") else "gelu" if op.endswith("Gelu") else "none"
    inputs = ["A", "B"] + (["bias"] if has_bias else [])
    attrs = list(_FORWARDED[onnx_op])
    nodes = []
    core_inputs = inputs if (has_bias and onnx_op in ("Gemm", "Conv")) else ["A", "B"]
    ref_attrs = []
    for name, default in _FORWARDED[onnx_op].items():
        kind = onnx.AttributeProto.INTS if isinstance(default, list) else \
            onnx.AttributeProto.FLOAT if isinstance(default, float) else onnx.AttributeProto.INT
        ref = onnx.AttributeProto(name=name, ref_attr_name=name, type=kind)
        ref_attrs.append(ref)
    core = helper.make_node(onnx_op, core_inputs, ["y0"])
    core.attribute.extend(ref_attrs)
    nodes.append(core)
    y = "y0"
    if has_bias and onnx_op == "MatMul":
        nodes.append(helper.make_node("Add", [y, "bias"], ["y1"]))
        y = "y1"
    if act == "relu":
        nodes.append(helper.make_node("Relu", [y], ["Y"]))
    elif act == "gelu":  # exact Gelu in the Erf form, constants cast to the input's type
        const = {"sqrt2": float(np.sqrt(2.0)), "one": 1.0, "half": 0.5}
        for name, value in const.items():
            nodes.append(helper.make_node("Constant", [], [f"{name}_f"],
                                          value=numpy_helper.from_array(np.array(value, np.float32))))
            nodes.append(helper.make_node("CastLike", [f"{name}_f", y], [name]))
        nodes += [helper.make_node("Div", [y, "sqrt2"], ["g0"]), helper.make_node("Erf", ["g0"], ["g1"]),
                  helper.make_node("Add", ["g1", "one"], ["g2"]), helper.make_node("Mul", [y, "g2"], ["g3"]),
                  helper.make_node("Mul", ["g3", "half"], ["Y"])]
    else:
        nodes.append(helper.make_node("Identity", [y], ["Y"]))
    return helper.make_function(DOMAIN, op, inputs, ["Y"], nodes, [helper.make_opsetid("", opset)],
                                attributes=["bundle", "info"] + attrs)


def _node_attributes(node: onnx.NodeProto) -> dict:
    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out = {}
    for name, default in _FORWARDED[node.op_type].items():
        value = given.get(name, default)
        out[name] = list(value) if isinstance(default, list) else type(default)(value)
    return out


def rewrite_model(model: onnx.ModelProto, workloads: list[Workload], bundles: Mapping[str, bytes],
                  info: Mapping[str, str] | None = None) -> RewriteResult:
    """Replace the nodes of ``workloads`` that have a bundle (keyed by original node name).

    ``info`` (per node, optional) is a JSON description of the workload and its tuning that
    ``dietcode-ort inspect`` shows; the runtime never reads it. Nodes without a bundle are left as they
    are. The input model is not modified.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 15:
        raise DietcodeError(f"the model's opset is {opset}; rewriting needs opset 15 or newer (CastLike)")
    names = {(n.name or f"{n.op_type}_{i}"): n for i, n in enumerate(graph.node)}
    by_name_all = {n.name: n for n in graph.node if n.name}
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    index = {id(n): i for i, n in enumerate(graph.node)}
    used_ops: dict[str, str] = {}
    rewritten = []
    for w in workloads:
        op = op_type(w)
        for node_name, fused in zip(w.nodes, w.fused_nodes or ((),) * len(w.nodes)):
            payload = bundles.get(node_name)
            if payload is None:
                continue
            node = names.get(node_name)
            if node is None:
                raise DietcodeError(f"workload node {node_name!r} is not in the model")
            fused_nodes = [by_name_all[f] for f in fused]
            inputs = list(node.input[:2])
            if w.epilogue.bias:
                if node.op_type == "MatMul":
                    add = fused_nodes[0]  # the scanner's bias Add: (product, bias) in either order
                    inputs.append(add.input[1] if add.input[0] == node.output[0] else add.input[0])
                else:
                    inputs.append(node.input[2])
            output = fused_nodes[-1].output[0] if fused_nodes else node.output[0]
            custom = helper.make_node(op, inputs, [output], name=node_name, domain=DOMAIN,
                                      **_node_attributes(node))
            custom.attribute.append(_bundle_attribute(payload))
            if info and node_name in info:
                custom.attribute.append(helper.make_attribute("info", info[node_name]))
            replace[index[id(node)]] = custom
            drop.update(index[id(f)] for f in fused_nodes)
            used_ops[op] = node.op_type
            rewritten.append(node_name)
    new_nodes = [replace.get(i, n) for i, n in enumerate(graph.node) if i not in drop]
    del graph.node[:]
    graph.node.extend(new_nodes)
    used = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]  # e.g. the absorbed Gelu's constants
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
    if used_ops:
        existing = {(f.domain, f.name) for f in out.functions}
        out.functions.extend(_function(op, onnx_op, opset) for op, onnx_op in sorted(used_ops.items())
                             if (DOMAIN, op) not in existing)
        if not any(o.domain == DOMAIN for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return RewriteResult(out, tuple(rewritten), tuple(sorted(used_ops)))


def save_model(model: onnx.ModelProto, path: str | Path) -> None:
    """Save atomically (write then rename); external data (``NAME.data`` beside it) when the model is
    over 2 GB. Everything is written into a fresh temporary folder beside ``path`` first, so an existing
    ``NAME.data`` is replaced, never appended to, and a run killed half-way leaves the old files intact."""
    import shutil
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    large = _byte_size(model) > _TWO_GB
    tmp_dir = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
    try:
        tmp = tmp_dir / path.name
        data = path.with_name(path.name + ".data")
        if large:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name, size_threshold=1024)
            os.replace(tmp_dir / data.name, data)
        else:
            onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _byte_size(model: onnx.ModelProto) -> int:
    """Serialized size; protobuf refuses to size messages past its 2 GB limit, which counts as large."""
    try:
        return model.ByteSize()
    except Exception:
        return _TWO_GB + 1
