"""Rewrite: workloads + bundles -> a model whose nodes are ``ai.dietcode`` custom ops.

Each scanned node (with the scalar Mul/Div, Add(bias), activation and residual Add it absorbs) becomes one
custom node whose op type names the fused epilogue in its order (``MatMulBiasGelu``, ``ConvBiasRelu``,
``MatMulBiasResidual``, ``ConvBiasResidualRelu``: the residual before the Relu, ``MatMulSiluMul``: LLaMA's
SwiGLU gate times the up-projection's output, ...; the node contract is in
docs/bundle.md); a MatMul's absorbed scale is its
``scale`` attribute (the compiled kernels have it baked in). The custom node takes the place of the last node
it replaces, where every value it reads (the residual included) is made. The node keeps the output name of the
last node it replaces, but for an activation absorbed from behind a Reshape (GPT-2's Gemm -> Reshape -> Gelu):
the node makes the Reshape's input and the Reshape, moved to right after it, that name. Its last input is its
kernel bundle, a uint8 initializer stored once per distinct bundle and shared by the nodes of a workload. For
every op type used, the model also gets a model-local function whose body is the original computation
(it takes the bundle input and ignores it), so stock onnxruntime without the custom-op library still runs
the model; with the library registered, ORT runs the library's kernel instead. The body is the replaced
nodes copied (in the model's opset), so the fallback computes exactly what the original did; nodes whose
absorbed nodes differ (another Gelu form, other constants) get a function overload each.

Nodes are linked by their first output's name (``Workload.nodes``), never by node name: exporters leave
names empty or repeat them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dietcode_ort import bundle as bundle_format
from dietcode_ort.errors import DietcodeError, raise_if_stopped
from dietcode_ort.paths import process_gone
from tuner.layout import ChannelsLast, channels_last, nhwc_body, read_elsewhere
from tuner.model_file import TWO_GB, inline_tensor, is_external, write_model
from tuner.scan import MOVABLE, GraphLinks, node_reads
from tuner.workload import Workload

__all__ = ["DOMAIN", "op_type", "RewriteResult", "plan_rewrite", "rewrite_model", "save_model", "model_to_edit",
           "default_opset", "axes_node"]

DOMAIN = bundle_format.DOMAIN
DOMAIN_VERSION = 3  # 3: no op type is an ONNX op's name (MatMulPlain, ScaledDotProductAttention; 2 had MatMul,
# Gemm, Conv and Attention, which the library still runs); 2: the bundle is the node's last input (1: a per-node
# `bundle` attribute)
_TWO_GB = TWO_GB  # the protobuf size from which save_model puts inline tensors in the data file


def op_type(workload: Workload) -> str:
    """The custom op type for a workload: the ONNX op plus its fused epilogue in the order it is applied
    (``ConvBiasReluResidual``: the residual after the Relu; ``ConvBiasResidualRelu``: before it;
    ``MatMulSiluMul``: the activation's result times the residual, LLaMA's SwiGLU gate)."""
    e = workload.epilogue
    bias = "Bias" if e.bias else ""
    act = bundle_format.ACTIVATION_OP_NAMES[bundle_format.ACTIVATION_CODES.index(e.activation)]
    residual = "Mul" if e.residual_mul else "Residual" if e.residual else ""
    if not (bias or act or residual):  # "MatMulPlain": no ai.dietcode op type is an ONNX op's name (bundle_format.ATTENTION_OP's note)
        return f"{workload.onnx_op}Plain"
    return f"{workload.onnx_op}{bias}{residual}{act}" if e.residual_first else f"{workload.onnx_op}{bias}{act}{residual}"


@dataclass(frozen=True)
class RewriteResult:
    model: onnx.ModelProto
    rewritten: tuple[str, ...]  # the first outputs of the original nodes now run by custom ops
    op_types: tuple[str, ...]


# Attributes each op type forwards to its original op (and to its fallback body), with their defaults.
_FORWARDED: dict[str, dict[str, Any]] = {
    "MatMul": {"scale": 1.0},  # the absorbed Mul/Div's alpha: read by the library, not by the fallback body
    "Gemm": {"transA": 0, "transB": 0, "alpha": 1.0, "beta": 1.0},
    "Conv": {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1},
}


def _bundle_initializer(payload: bytes, taken: set[str]) -> onnx.TensorProto:
    """The bundle as a 1-D uint8 initializer, named by its content so equal bundles get one tensor."""
    base = "dietcode_bundle_" + hashlib.sha256(payload).hexdigest()[:16]
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return numpy_helper.from_array(np.frombuffer(payload, dtype=np.uint8), name=name)


def _ref_attributes(onnx_op: str) -> list[onnx.AttributeProto]:
    """The original op's attributes as references to the custom node's (the body takes the node's values)."""
    refs = []
    for name, default in _FORWARDED[onnx_op].items():
        if name == "scale":  # the body computes the scale with the copied Mul/Div
            continue
        kind = onnx.AttributeProto.INTS if isinstance(default, list) else \
            onnx.AttributeProto.FLOAT if isinstance(default, float) else onnx.AttributeProto.INT
        refs.append(onnx.AttributeProto(name=name, ref_attr_name=name, type=kind))
    return refs


def _function(op: str, onnx_op: str, body: tuple[onnx.NodeProto, ...], opsets: list[onnx.OperatorSetIdProto],
              overload: str) -> onnx.FunctionProto:
    """The fallback function of one op type (and overload): ``body`` over inputs A, B[, bias][, residual],
    output Y; the last input, the kernel bundle, is read by the custom op and ignored here."""
    inputs = ["A", "B"] + (["bias"] if "Bias" in op else []) + (["residual"] if bundle_format.op_takes_residual(op) else []) \
        + ["bundle"]
    layout = ["channels_last"] if onnx_op == "Conv" else []  # a channels-last node's body transposes (tuner.layout)
    return helper.make_function(DOMAIN, op, inputs, ["Y"], list(body), opsets,
                                attributes=["info"] + list(_FORWARDED[onnx_op]) + layout,
                                overload=overload or None)


def _node_attributes(node: onnx.NodeProto) -> dict:
    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out: dict[str, Any] = {}
    for name, default in _FORWARDED[node.op_type].items():
        if name == "scale":  # set from the workload's epilogue, when it has one
            continue
        value = given.get(name, default)
        out[name] = list(value) if isinstance(default, list) else type(default)(value)
    return out


def _label(node: onnx.NodeProto) -> str:
    return repr(node.name) if node.name else f"{node.op_type} node making {node.output[0]!r}"


@dataclass(frozen=True)
class _Site:
    """One custom node to be: the node it replaces and the nodes it absorbs (graph indices), its inputs,
    its output, and its fallback body (the replaced nodes copied, values renamed)."""

    op: str
    index: int
    absorbed: tuple[int, ...]
    inputs: tuple[str, ...]
    output: str
    body: tuple[onnx.NodeProto, ...]
    scale: float = 1.0  # the absorbed Mul/Div's alpha (MatMul)
    # an activation fused from behind a Reshape (GPT-2's Gemm -> Reshape -> Gelu): the Reshape, moved to right
    # after the custom node, which makes the Reshape's input; the Reshape makes ``output``
    reshape: onnx.NodeProto | None = None

    @property
    def place(self) -> int:
        """Where the custom node goes: the last replaced node, after everything it reads is made."""
        return max((self.index, *self.absorbed))


class _Links(GraphLinks):
    """The graph's links (a value made by two nodes refused), its nodes' positions and its initializers."""

    def __init__(self, graph: onnx.GraphProto, base_dir: Path | None = None):
        super().__init__(graph, one_maker=True)
        self.graph = graph
        self.base_dir = base_dir  # where the model's external data is read from (its tensors not loaded)
        self.nodes = list(graph.node)  # held, so each id below stays its node's
        self.position = {id(n): i for i, n in enumerate(self.nodes)}
        self.inits = {t.name: t for t in graph.initializer}

    def node(self, output: str, what: str) -> tuple[int, onnx.NodeProto]:
        """The position and the node making ``output``."""
        node = self.producers.get(output)
        if node is None:
            raise DietcodeError(f"{what} making {output!r} is not in the model")
        return self.position[id(node)], node

    def constant(self, name: str, body_name: str, reader: onnx.NodeProto) -> onnx.NodeProto:
        """A Constant node (for a function body) with the value of ``name``: an initializer or Constant."""
        maker = self.producers.get(name)
        if maker is not None and maker.op_type == "Constant":
            node = onnx.NodeProto()
            node.CopyFrom(maker)
            node.name = ""
            del node.output[:]
            node.output.append(body_name)
            for a in node.attribute:  # a function body carries its values, never a reference to a file
                if a.HasField("t") and is_external(a.t):
                    a.t.CopyFrom(self._value(a.t, name))
            return node
        t = self.inits.get(name)
        if t is None or maker is not None:
            raise DietcodeError(f"cannot rewrite: {_label(reader)} reads {name!r}, which is neither made by "
                                f"the fused nodes nor a constant")
        value = self._value(t, name)
        value.name = ""
        return helper.make_node("Constant", [], [body_name], value=value)

    def _value(self, t: onnx.TensorProto, name: str) -> onnx.TensorProto:
        """A copy of the constant ``t`` holding its value (external data read from its file)."""
        if is_external(t) and self.base_dir is None:
            raise DietcodeError(f"cannot rewrite: constant {name!r} of a fused node is external data that is "
                                f"not loaded")
        return inline_tensor(t, self.base_dir)


def _site(links: _Links, w: Workload, key: str, fused: tuple[str, ...]) -> _Site:
    """Link one workload node and the nodes it absorbs (by their first outputs) and check that removing
    them leaves every other reader intact; build its fallback body."""
    index, node = links.node(key, f"workload node ({w.onnx_op})")
    if node.op_type != w.onnx_op:
        raise DietcodeError(f"workload node making {key!r} is a {node.op_type}, not a {w.onnx_op}")
    absorbed = [links.node(f, "fused node") for f in fused]
    inputs = list(node.input[:2])
    bias = None
    scaled = w.epilogue.alpha != 1.0
    if scaled and (not absorbed or absorbed[0][1].op_type not in ("Mul", "Div")):
        raise DietcodeError(f"workload node making {key!r}: its scale Mul/Div is not the first fused node")
    if w.epilogue.bias:
        if node.op_type == "MatMul":
            first = absorbed[1 if scaled else 0][1] if len(absorbed) > int(scaled) else None
            if first is None or first.op_type != "Add" or len(first.input) != 2:
                raise DietcodeError(f"workload node making {key!r}: its bias Add is not the first fused node "
                                    f"after the scale")
            add = first  # the scanner's bias Add: (value, bias) in either order
            before = absorbed[0][1].output[0] if scaled else node.output[0]
            bias = add.input[1] if add.input[0] == before else add.input[0]
        else:
            bias = node.input[2] if len(node.input) > 2 else ""
        if not bias:
            raise DietcodeError(f"workload node making {key!r} has no bias input")
        inputs.append(bias)
    # where the nodes after the scale and bias start: the activation's, or the residual Add, maybe behind a Reshape
    start = int(scaled) + int(bias is not None and node.op_type == "MatMul")
    moved = next((f for _, f in absorbed if f.op_type in MOVABLE and f.domain in ("", "ai.onnx")), None)
    e = w.epilogue
    if moved is not None and (start >= len(absorbed) or absorbed[start][1] is not moved or e.residual_mul
                              or ((e.activation == "none") != e.residual and not e.residual_first)):
        raise DietcodeError(f"workload node making {key!r}: its Reshape is not right before the activation or "
                            "the residual Add")
    residual, at = None, -1
    if w.epilogue.residual:
        # the residual Add: the last fused node, or with residual_first the one after the scale, the bias and a
        # Reshape (the scanner's order: [scale], [bias Add], [Reshape], residual Add, activation)
        at = start + int(moved is not None) if w.epilogue.residual_first else len(absorbed) - 1
        radd = absorbed[at][1] if 0 <= at < len(absorbed) else None
        before = absorbed[at - 1][1].output[0] if at > 0 else node.output[0]
        kind = "Mul" if w.epilogue.residual_mul else "Add"
        if radd is None or radd.op_type != kind or len(radd.input) != 2 or before not in radd.input:
            where = "right before the activation" if w.epilogue.residual_first else "the last fused node"
            raise DietcodeError(f"workload node making {key!r}: its residual {kind} is not {where}")
        residual = radd.input[1] if radd.input[0] == before else radd.input[0]
        inputs.append(residual)
    members = {index} | {i for i, _ in absorbed}
    output = absorbed[-1][1].output[0] if absorbed else node.output[0]
    for n in [node] + [f for _, f in absorbed]:
        for value in n.output:
            if not value or value == output:
                continue
            outside = [r for r in links.consumers.get(value, []) if links.position[id(r)] not in members]
            if value in links.graph_outputs or outside:
                where = "is a graph output" if value in links.graph_outputs else \
                    f"is also read by {_label(outside[0])}"
                raise DietcodeError(f"cannot rewrite the node making {key!r}: the fused value {value!r} "
                                    f"{where}")
    body = _body(links, node, [f for _, f in absorbed], bias, output, residual, at)
    if moved is None:
        return _Site(op_type(w), index, tuple(i for i, _ in absorbed), tuple(inputs), output, body, w.epilogue.alpha)
    reshape = onnx.NodeProto()
    reshape.CopyFrom(moved)
    del reshape.output[:]
    reshape.output.append(output)
    return _Site(op_type(w), index, tuple(i for i, _ in absorbed), tuple(inputs), moved.input[0], body,
                 w.epilogue.alpha, reshape)


def _body(links: _Links, node: onnx.NodeProto, absorbed: list[onnx.NodeProto], bias: str | None,
          output: str, residual: str | None = None, at: int = -1) -> tuple[onnx.NodeProto, ...]:
    """The fallback body: the original op (its attributes referring to the custom node's), then the
    absorbed nodes copied as they are, with their constants as Constant nodes; values renamed so that
    equal computations give equal bodies. A Reshape or Squeeze among them (an activation or a residual Add fused
    from behind it) is left out: the nodes after it read its input, the body's output has the shape before it,
    and the residual is read in that shape (a Reshape in the body)."""
    names: dict[str, str] = {output: "Y"}
    consts: dict[str, str] = {}

    def made(value: str) -> str:
        return names.setdefault(value, f"t{len(names) - 1}")

    c_input = ["bias"] if node.op_type in ("Gemm", "Conv") and bias else []
    core = helper.make_node(node.op_type, ["A", "B"] + c_input, [made(node.output[0])])
    core.attribute.extend(_ref_attributes(node.op_type))
    body = [core]

    def new_constant(x: str) -> str:
        consts[x] = f"c{len(consts)}"
        return consts[x]

    moved: str | None = None  # the value a moved Reshape's input has in the body
    for j, f in enumerate(absorbed):
        if f.op_type in MOVABLE:  # moved after the custom node: the activation or residual Add reads its input
            names[f.output[0]] = moved = made(f.input[0])
            continue

        def known(x: str, is_add: bool = j == (at if at >= 0 else len(absorbed) - 1)) -> str | None:
            if not x or x in names:
                return names.get(x, "")
            if residual is not None and x == residual and is_add:  # the residual Add's other input
                if moved is None:
                    return "residual"
                body.append(helper.make_node("Shape", [moved], ["residual_shape"]))
                body.append(helper.make_node("Reshape", ["residual", "residual_shape"], ["residual_rows"]))
                return "residual_rows"
            if x == bias and node.op_type == "MatMul":
                return "bias"
            return consts.get(x)

        copy_into_body(links, f, body, known, new_constant, lambda o: made(o) if o else "")
    return tuple(body)


def copy_into_body(links: _Links, node: onnx.NodeProto, body: list[onnx.NodeProto],
                   known: Callable[[str], str | None], new_constant: Callable[[str], str],
                   output: Callable[[str], str]) -> None:
    """Append to ``body`` a copy of the graph's ``node`` (unnamed) whose inputs are renamed by ``known``, and
    where that gives None, by ``new_constant``, after a Constant node with the graph constant's value (the first
    time it is read); its outputs are renamed by ``output``. The callers keep their own naming rules (this
    module's fallback bodies, tuner.attention_graph's)."""
    inputs = []
    for x in node.input:
        name = known(x)
        if name is None:
            name = new_constant(x)
            body.append(links.constant(x, name, node))
        inputs.append(name)
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = ""
    del copy.input[:]
    copy.input.extend(inputs)
    del copy.output[:]
    copy.output.extend(output(o) for o in node.output)
    body.append(copy)


def plan_rewrite(model: onnx.ModelProto, workloads: list[Workload], keys: set[str] | None = None,
                 base_dir: str | Path | None = None) -> dict[str, _Site]:
    """Link the workloads' nodes (``keys``: those to rewrite, default all) to the model and check each can
    be rewritten: run before tuning, so a model the rewrite cannot handle fails before the tuning work.
    ``base_dir``: the folder of the model's external data, for a model loaded without it."""
    links = _Links(model.graph, None if base_dir is None else Path(base_dir))
    sites: dict[str, _Site] = {}
    claimed: dict[int, str] = {}
    for w in workloads:
        for key, fused in zip(w.nodes, w.fused_nodes or ((),) * len(w.nodes)):
            if keys is not None and key not in keys:
                continue
            site = _site(links, w, key, tuple(fused))
            for i in (site.index, *site.absorbed):
                if i in claimed:
                    raise DietcodeError(f"the nodes rewritten for {claimed[i]!r} and {key!r} overlap")
                claimed[i] = key
            sites[key] = site
    return sites


def names_in_use(graph: onnx.GraphProto) -> set[str]:
    """The names a value or node added to ``graph`` must avoid: its initializers, inputs, node outputs and node
    names."""
    return {t.name for t in graph.initializer} | {v.name for v in graph.input} | \
        {o for n in graph.node for o in n.output} | {n.name for n in graph.node if n.name}


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base`` with the smallest number appended, that is not in ``taken``; added to it."""
    name = next(n for n in (f"{base}{i or ''}" for i in range(len(taken) + 1)) if n not in taken)
    taken.add(name)
    return name


def _graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by the graph's nodes, subgraphs (If/Loop bodies) included, and its outputs."""
    names = {o.name for o in graph.output}
    for n in graph.node:
        names |= node_reads(n)
    return names


def _drop_unread(graph: onnx.GraphProto, before: set[str]) -> None:
    """Remove the initializers and Constant nodes the rewrite left unread (with the graph inputs that
    name such an initializer, the layout of IR < 4 models), and the value_info of removed values."""
    after = _graph_reads(graph)
    gone = {t.name for t in graph.initializer if t.name in before and t.name not in after}
    dead = [n for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
            and n.output and n.output[0] in before and n.output[0] not in after]
    gone |= {n.output[0] for n in dead}
    # deleted by index: rebuilding a repeated field copies every message kept (BERT-base's weights: 0.2 s a call)
    for i in reversed([i for i, n in enumerate(graph.node) if any(n is d for d in dead)]):
        del graph.node[i]
    for i in reversed([i for i, t in enumerate(graph.initializer) if t.name in gone]):
        del graph.initializer[i]
    _drop_inputs(graph, gone)
    made = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | \
        {t.name for t in graph.initializer}
    stale = [v for v in graph.value_info if v.name not in made]
    for v in stale:
        graph.value_info.remove(v)


def _drop_inputs(graph: onnx.GraphProto, names: set[str]) -> None:
    kept = [i for i in graph.input if i.name not in names]
    if len(kept) != len(graph.input):
        del graph.input[:]
        graph.input.extend(kept)


def default_opset(model: onnx.ModelProto) -> int:
    """The model's version of the default ONNX domain (1 where it imports none)."""
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def axes_node(op: str, x: str, y: str, axes: list[int], opset: int, axes_name: str | None,
              name: str) -> onnx.NodeProto:
    """An Unsqueeze or Squeeze of ``axes``: from opset 13 on they are the initializer ``axes_name`` (the caller
    adds it), an attribute before."""
    if opset >= 13:
        return helper.make_node(op, [x, axes_name or ""], [y], name=name)
    return helper.make_node(op, [x], [y], name=name, axes=axes)


def _opsets(model: onnx.ModelProto) -> list[onnx.OperatorSetIdProto]:
    """The model's opset imports, for the fallback functions (their bodies are the model's own nodes,
    and their core op is written in the default domain "")."""
    opsets = {o.domain: o.version for o in model.opset_import if o.domain != DOMAIN}
    if "" not in opsets and "ai.onnx" in opsets:
        opsets[""] = opsets["ai.onnx"]
    return [helper.make_opsetid(domain, version) for domain, version in opsets.items()]


def model_to_edit(model: onnx.ModelProto, copy: bool) -> onnx.ModelProto:
    """The model a graph rewrite edits: a copy of ``model``, or ``model`` itself (rewritten in place, which
    spares a copy of its weights) when ``copy`` is False."""
    if not copy:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def rewrite_model(model: onnx.ModelProto, workloads: list[Workload], bundles: Mapping[str, bytes],
                  info: Mapping[str, str] | None = None, base_dir: str | Path | None = None,
                  copy: bool = True) -> RewriteResult:
    """Replace the nodes of ``workloads`` that have a bundle (keyed as ``Workload.nodes``: by first output).

    ``info`` (per node, optional) is a JSON description of the workload and its tuning that
    ``dietcode-ort inspect`` shows; the runtime never reads it. Nodes without a bundle are left as they
    are. The input model is not modified, unless ``copy`` is False: then it is rewritten in place (and
    returned as the result's model), which spares a copy of its weights. ``base_dir``: the folder of the
    model's external data, for a model loaded without it (constants the fallback bodies copy are read
    from there; the weights stay external, for ``save_model`` to write).
    """
    out = model_to_edit(model, copy)
    graph = out.graph
    sites = plan_rewrite(out, workloads, set(bundles), base_dir)
    before = _graph_reads(graph)
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    functions: dict[tuple[str, str], onnx.FunctionProto] = {(f.name, f.overload): f for f in out.functions
                                                             if f.domain == DOMAIN}
    opsets = _opsets(out)
    new_functions: list[onnx.FunctionProto] = []
    used_ops: set[str] = set()
    rewritten = []
    shared: dict[bytes, str] = {}  # payload -> its initializer's name
    new_initializers: list[onnx.TensorProto] = []
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | \
        {o for n in graph.node for o in n.output}
    # a Conv's pads as scan resolved them (auto_pad VALID / SAME made explicit): the node and its body use these
    conv_pads = {name: list(w.conv.pads) for w in workloads if w.conv is not None for name in w.nodes}
    # channels-last conv nodes (tuner.layout): NHWC in and out, Transposes only where NCHW meets NHWC
    nhwc_nodes = {name for w in workloads if channels_last(w) for name in w.nodes} & set(sites)
    layout = ChannelsLast(graph, {sites[n].output for n in nhwc_nodes}, lambda base: unique_name(base, taken),
                          None if base_dir is None else Path(base_dir))
    nhwc_members = {i for n in nhwc_nodes for i in (sites[n].index, *sites[n].absorbed)}
    links = GraphLinks(graph)
    position = {id(n): i for i, n in enumerate(graph.node)}
    for node_name, site in sites.items():
        payload = bundles[node_name]
        node = graph.node[site.index]
        nhwc = node_name in nhwc_nodes
        if nhwc:
            residual = bundle_format.op_takes_residual(site.op)
            inputs = [layout.input(site.inputs[0]), layout.weight(site.inputs[1]), *site.inputs[2:]]
            if residual:
                inputs[-1] = layout.input(site.inputs[-1])
            site = dataclasses.replace(site, inputs=tuple(inputs), body=nhwc_body(site.body, residual))
        overload = _overload(functions, new_functions, site, node.op_type, opsets)
        if payload not in shared:
            new_initializers.append(_bundle_initializer(payload, taken))
            shared[payload] = new_initializers[-1].name
        attributes = _node_attributes(node)
        if node_name in conv_pads:
            attributes["pads"] = conv_pads[node_name]
        output, back = layout.output(site.output) if nhwc else (site.output, None)
        if nhwc:
            attributes["channels_last"] = 1
            # the NCHW value stays where something else still reads it
            if not read_elsewhere(site.output, nhwc_members, links, position):
                back = None
        # unnamed nodes (some exporters name none) take their output's name: node_stats() counts per node name
        custom = helper.make_node(site.op, list(site.inputs) + [shared[payload]], [output],
                                  name=node.name or node_name, domain=DOMAIN, **attributes)
        if site.scale != 1.0:
            custom.attribute.append(helper.make_attribute("scale", site.scale))
        if overload:
            custom.overload = overload
        if info and node_name in info:
            custom.attribute.append(helper.make_attribute("info", info[node_name]))
        replace[site.place] = [custom] + ([site.reshape] if site.reshape is not None else []) + \
            ([back] if back is not None else [])
        drop.update(i for i in (site.index, *site.absorbed) if i != site.place)
        used_ops.add(site.op)
        rewritten.append(node_name)
    head = []  # the NHWC copies of values no node makes (graph inputs), first; the others right after their maker
    for value, transpose in layout.transposes.items():
        maker = links.producers.get(value)
        if maker is None:
            head.append(transpose)
        else:
            at = position[id(maker)]
            replace[at] = replace.get(at, [maker]) + [transpose]
    new_nodes = head + [m for i, n in enumerate(graph.node) if i not in drop for m in replace.get(i, [n])]
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_unread(graph, before)
    graph.initializer.extend(new_initializers)
    graph.initializer.extend(layout.weights.values())
    if new_functions:
        if out.ir_version < 4:  # initializers were constant inputs there; from IR 4 they are overridable
            _drop_inputs(graph, {t.name for t in graph.initializer})
        out.functions.extend(new_functions)
        # model-local functions need IR 8, overloads IR 10
        out.ir_version = max(out.ir_version, 10 if any(f.overload for f in out.functions) else 8)
        if not any(o.domain == DOMAIN for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return RewriteResult(out, tuple(rewritten), tuple(sorted(used_ops)))


def _overload(functions: dict[tuple[str, str], onnx.FunctionProto], new: list[onnx.FunctionProto],
              site: _Site, onnx_op: str, opsets: list[onnx.OperatorSetIdProto]) -> str:
    """The overload whose function body is ``site``'s (made when new): "" for the first body of an op
    type, "1", "2", ... for other bodies of the same op type (e.g. Gelu exported in another form)."""
    body = [n.SerializeToString(deterministic=True) for n in site.body]
    taken = sorted(o for name, o in functions if name == site.op)
    for o in taken:
        if [n.SerializeToString(deterministic=True) for n in functions[(site.op, o)].node] == body:
            return o
    overload = next(str(i) if i else "" for i in range(len(taken) + 1) if (str(i) if i else "") not in taken)
    fn = _function(site.op, onnx_op, site.body, opsets, overload)
    functions[(site.op, overload)] = fn
    new.append(fn)
    return overload


def save_model(model: onnx.ModelProto, path: str | Path, base_dir: str | Path | None = None) -> None:
    """Save atomically (write then rename); tensor data goes to ``NAME.data`` beside it when the model
    has external tensors or is over 2 GB. ``base_dir``: the folder the model's external tensors (a model
    loaded without its external data) are read from; their bytes are streamed into the output's own data
    file, so the output never depends on the input's files (tuner.model_file). Everything is written into
    a fresh temporary folder beside ``path`` first, so an existing ``NAME.data`` is replaced, never
    appended to (or removed, when the output it belonged to is replaced by one without external data), and a
    run stopped half-way leaves the old files intact (a SIGINT or SIGTERM during the data file's and the model's
    renames is acted on after both; only a SIGKILL in the microseconds between them splits the pair). The temporary folders of runs that were killed (their process
    gone) are removed. A write that fails (a full disk, a file size limit) is an error naming the output. The
    model is not modified."""
    import shutil
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_writes(path)
    tmp_dir = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-"))
    try:
        tmp = tmp_dir / path.name
        data = path.with_name(path.name + ".data")
        source = None if base_dir is None else Path(base_dir)
        # the data file of the output this one replaces: stale once the new model has none of its own
        from tuner.optimize import _external_files

        old_data = path.is_file() and data.is_file() and data.resolve() in _external_files(path)
        try:
            with_data = write_model(model, tmp, tmp_dir / data.name, source, _TWO_GB)
        except OSError as exc:
            raise DietcodeError(f"cannot write {path}: {exc.strerror or exc} (nothing was written there; the "
                                "tuning is kept in the --db file, so a rerun with room to write is quick)") from None
        raise_if_stopped()  # a signal whose raise was swallowed (errors.note_stop): the old files stay as they are
        with _signals_held():  # the model and its data change together, or not at all
            if with_data and data.exists():  # moved aside first: replacing it would free its blocks in the window
                os.replace(data, tmp_dir / f"{data.name}.replaced")  # (80 ms for 270 MB), this takes microseconds
            if with_data:
                os.replace(tmp_dir / data.name, data)
            os.replace(tmp, path)
        if old_data and not with_data:  # only now: a run killed before this left the old model with its data
            data.unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside are acted on when it ends (in the main thread, where Python runs
    signal handlers; elsewhere nothing is held): ``save_model`` renames an output's data file and then its model
    file, and a stop between the two left the old model beside the new weights, read without any error."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    previous = {kind: signal.signal(kind, lambda signum, frame: held.append(signum)) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler if handler is not None else signal.SIG_DFL)
        for signum in held:
            signal.raise_signal(signum)  # now, to the handler the command had


def _remove_stale_writes(path: Path) -> None:
    """Remove the temporary folders ``save_model`` left beside ``path`` in runs killed before their cleanup:
    those whose process (the pid in the name) is gone. Another live run's folder is left alone."""
    import shutil

    prefix = f".{path.name}.tmp-"  # save_model's, then the pid and mkdtemp's letters
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*-*"):
        pid = tmp.name.removeprefix(prefix).partition("-")[0]
        if tmp.is_dir() and pid.isdigit() and int(pid) != os.getpid() and process_gone(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
