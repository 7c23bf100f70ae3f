"""Conv layout: which conv workloads run channels-last (NHWC), and the graph edits that carry it.

The conv template's NCHW form gathers X element by element: each element of a tile has its own address and
predicate, so large tiles spill and nothing is loaded in vectors. Its channels-last form reads a K slice as a
run of one pixel's channels, in 16-byte vectors (tests/test_conv_nhwc.py). ONNX models are NCHW, so a workload
chosen here (``choose_layouts``) becomes a custom node with ``channels_last = 1`` (docs/abi.md): it reads X and
its residual NHWC and writes Y NHWC, and its weight is a permuted copy [OC, KH, KW, C]. ``ChannelsLast`` makes
the Transposes around such nodes, and none between two of them: a value one channels-last node makes and another
reads is passed on in NHWC, so a chain of convs (ResNet's blocks, the residual included) transposes only where
it starts and ends.

A workload stays NCHW (``nchw_reason`` says why) when it is grouped, when X's channels are not a whole number of
16-byte vectors, or when one of its nodes' weights is no initializer (the permuted copy is made here). Of the
nodes that can, those linked by NHWC values (one's output another's X or residual) form chains, and a chain runs
channels-last only when it needs fewer Transposes than it has convs: a lone conv between NCHW nodes (MobileNetV2's
pointwise convs, each between two depthwise ones) would pay a Transpose of its input and one of its output for
one conv. (A rule of thumb until GPU timings weigh a Transpose against the NCHW gather.) A workload whose nodes
fall on both sides is split in two, each tuned for its layout.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dietcode_ort.errors import DietcodeError
from tuner.model_file import inline_tensor
from tuner.scan import GraphLinks
from tuner.workload import Workload

__all__ = ["LAYOUTS", "TO_NHWC", "TO_NCHW", "NodeValues", "nchw_reason", "choose_layouts", "channels_last",
           "read_elsewhere", "ChannelsLast", "nhwc_body"]

LAYOUTS = ("nhwc", "nchw")  # optimize's --conv-layout: channels-last where a workload allows it, or never
TO_NHWC = (0, 2, 3, 1)  # Transpose perm: NCHW -> NHWC
TO_NCHW = (0, 3, 1, 2)  # NHWC -> NCHW; also W [OC, KH, KW, C] -> [OC, C, KH, KW]
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def channels_last(w: Workload) -> bool:
    return w.conv is not None and w.conv.channels_last


def nchw_reason(w: Workload, initializers: set[str], weights: dict[str, str]) -> str | None:
    """Why conv workload ``w`` stays NCHW, or None when it can run channels-last. ``weights``: each workload
    node's (first output's) weight input."""
    assert w.conv is not None
    if w.conv.groups != 1:
        return f"grouped (group {w.conv.groups}): the channels-last form is ungrouped only"
    if w.conv.in_channels * _BYTES.get(w.dtype, 1) % 16:
        return f"{w.conv.in_channels} input channels of {w.dtype} are not a whole number of 16-byte vectors"
    for node in w.nodes:
        if weights.get(node) not in initializers:
            return f"the weight of the node making {node!r} is no initializer"
    return None


class NodeValues(NamedTuple):
    """What a workload node's custom node will read and make (tuner.rewrite's plan): X, the residual (None
    without one), the output, the graph positions of the nodes it replaces, and its weight."""

    x: str
    residual: str | None
    output: str
    members: frozenset[int]
    weight: str = ""


def read_elsewhere(value: str, members: set[int], links: GraphLinks, position: Mapping[int, int]) -> bool:
    """Whether ``value`` is a graph output or read by a node outside ``members`` (graph positions;
    ``position``: a node's by its id), so that it must exist in NCHW."""
    return value in links.graph_outputs or any(position[id(r)] not in members for r in links.consumers.get(value, []))


def _chains(nodes: Mapping[str, NodeValues]) -> list[set[str]]:
    """``nodes`` grouped into chains: two are linked when one's output is the other's X or residual."""
    made = {v.output: key for key, v in nodes.items()}
    parent = {key: key for key in nodes}

    def root(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for key, v in nodes.items():
        for value in (v.x, v.residual):
            if value in made:
                parent[root(made[value])] = root(key)
    chains: dict[str, set[str]] = {}
    for key in nodes:
        chains.setdefault(root(key), set()).add(key)
    return list(chains.values())


def _transposes(chain: set[str], nodes: Mapping[str, NodeValues], links: GraphLinks,
                position: Mapping[int, int]) -> int:
    """How many Transposes ``chain`` run channels-last needs: one per value it reads that it does not make,
    one per value it makes that something else reads (or the graph outputs). ``position``: graph index by
    node id."""
    members = set().union(*(nodes[key].members for key in chain))
    made = {nodes[key].output for key in chain}
    read = {v for key in chain for v in (nodes[key].x, nodes[key].residual) if v is not None}
    return len(read - made) + sum(read_elsewhere(v, members, links, position) for v in made)


def choose_layouts(graph: onnx.GraphProto, workloads: Sequence[Workload], layout: str,
                   nodes: Mapping[str, NodeValues]) -> tuple[Workload, ...]:
    """``workloads`` with ``conv.channels_last`` set where their nodes run channels-last (module doc), when
    ``layout`` is "nhwc" (as they are for "nchw"). ``nodes``: per workload node (first output), what its custom
    node reads and makes. A workload with nodes of both layouts becomes two: the channels-last ones first."""
    if layout not in LAYOUTS:
        raise ValueError(f"conv layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    if layout == "nchw":
        return tuple(workloads)
    initializers = {t.name for t in graph.initializer}
    weights = {key: v.weight for key, v in nodes.items()}
    able = {key: nodes[key] for w in workloads if w.conv is not None and nchw_reason(w, initializers, weights) is None
            for key in w.nodes if key in nodes}
    links = GraphLinks(graph)
    position = {id(n): i for i, n in enumerate(graph.node)}
    chosen = set().union(*(chain for chain in _chains(able) if _transposes(chain, able, links, position) < len(chain)))
    out: list[Workload] = []
    for w in workloads:
        picked = [k for k, key in enumerate(w.nodes) if key in chosen]
        if not picked or w.conv is None:
            out.append(w)
            continue
        rest = [k for k in range(len(w.nodes)) if k not in picked]
        for ks, last in ((picked, True), (rest, False)):
            if ks:
                out.append(_nodes(w, ks, last))
    return tuple(out)


def _nodes(w: Workload, ks: Sequence[int], nhwc: bool) -> Workload:
    """``w`` for its nodes ``ks`` only, channels-last or not."""
    assert w.conv is not None
    return replace(w, nodes=tuple(w.nodes[k] for k in ks),
                   fused_nodes=tuple(w.fused_nodes[k] for k in ks) if w.fused_nodes else (),
                   ranks=tuple(w.ranks[k] for k in ks) if w.ranks else (),
                   conv=replace(w.conv, channels_last=nhwc))


def nhwc_body(body: Sequence[onnx.NodeProto], residual: bool) -> tuple[onnx.NodeProto, ...]:
    """A conv op type's fallback body (inputs A, B[, bias][, residual], output Y, all NCHW) for a
    channels-last node: A, B and the residual transposed to NCHW first, Y transposed back to NHWC last."""
    rename = {"A": "A_nchw", "B": "B_nchw", "Y": "Y_nchw"} | ({"residual": "residual_nchw"} if residual else {})
    nodes = [helper.make_node("Transpose", [x], [rename[x]], perm=list(TO_NCHW))
             for x in ("A", "B", "residual") if x in rename]
    for node in body:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for values in (copy.input, copy.output):
            for i, v in enumerate(values):
                values[i] = rename.get(v, v)
        nodes.append(copy)
    nodes.append(helper.make_node("Transpose", ["Y_nchw"], ["Y"], perm=list(TO_NHWC)))
    return tuple(nodes)


class ChannelsLast:
    """The values and nodes a rewrite adds for its channels-last custom nodes. ``made``: the (NCHW) outputs
    of the channels-last nodes, each then made NHWC by its node under ``output(value)``; ``names``: a fresh
    name of the graph from a base (tuner.rewrite.unique_name over its names)."""

    def __init__(self, graph: onnx.GraphProto, made: set[str], names: Callable[[str], str], base_dir: Path | None):
        self._name = names
        self.base_dir = base_dir
        self.initializers = {t.name: t for t in graph.initializer}
        self.nhwc: dict[str, str] = {v: names(v + "_nhwc") for v in sorted(made)}
        self.transposes: dict[str, onnx.NodeProto] = {}  # NCHW value -> the Transpose making its NHWC copy
        self.weights: dict[str, onnx.TensorProto] = {}  # weight -> its [OC, KH, KW, C] copy

    def input(self, value: str) -> str:
        """The NHWC form of an activation ``value`` (X or a residual): the name a channels-last node makes it
        under, or the output of a Transpose made once per value (``transposes``, placed by the caller)."""
        if value in self.nhwc:
            return self.nhwc[value]
        node = self.transposes.get(value)
        if node is None:
            node = helper.make_node("Transpose", [value], [self._name(value + "_nhwc")], perm=list(TO_NHWC),
                                    name=self._name(value + "_to_nhwc"))
            self.transposes[value] = node
        return node.output[0]

    def output(self, value: str) -> tuple[str, onnx.NodeProto]:
        """The NHWC name a channels-last node makes ``value`` under, and the Transpose back to ``value``
        (the caller keeps it only where something still reads ``value`` in NCHW)."""
        nhwc = self.nhwc[value]
        return nhwc, helper.make_node("Transpose", [nhwc], [value], perm=list(TO_NCHW),
                                      name=self._name(value + "_to_nchw"))

    def weight(self, name: str) -> str:
        """The name of the [OC, KH, KW, C] copy of the weight initializer ``name`` [OC, C, KH, KW]."""
        if name not in self.weights:
            t = inline_tensor(self.initializers[name], self.base_dir)
            if len(t.dims) != 4:
                raise DietcodeError(f"conv weight {name!r} has rank {len(t.dims)}, not 4")
            array = numpy_helper.to_array(t)
            copy = onnx.TensorProto()
            copy.name = self._name(name + "_ohwi")
            copy.data_type = t.data_type
            copy.dims.extend([t.dims[0], t.dims[2], t.dims[3], t.dims[1]])
            copy.raw_data = np.ascontiguousarray(np.transpose(array, TO_NHWC)).tobytes()
            self.weights[name] = copy
        return self.weights[name].name
