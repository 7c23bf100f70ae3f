"""Attention in a graph: find the ``MatMul -> [scale] -> [Add mask] -> Softmax -> MatMul`` chains and fuse each
into one ``ai.dietcode::ScaledDotProductAttention`` node.

The chain, as the project's BERT builder and torch.onnx write it::

    Q = Mul(Q, a), Kt = Mul(Kt, b)   optional; a, b one-element float constants (or Div by them)
    S = MatMul(Q, Kt)                Q [..., T_q, d], Kt [..., d, T_k] (equal leading dims)
    S = Div(S, c) | Mul(S, c)        optional; c a one-element float constant (scale 1/c or c)
    S = Add(S, mask)                 optional; mask any value (BERT's [batch, 1, 1, T_k] extended mask)
    P = Softmax(S, axis=-1)
    P = Where(IsNaN(P), 0, P)        optional (torch's scaled_dot_product_attention export)
    Y = MatMul(P, V)                 V [..., T_k, d]

Cast nodes may sit anywhere between the two MatMuls (float16 / bfloat16 exports compute the mask Add and the
softmax in float32) when they keep the chain within the fused kernel's arithmetic: scores, mask and softmax in
float32, the probabilities rounded to V's dtype for the AV product, the output in Q's dtype. So each Cast goes
to float32 or to the chain's dtype, V has Q's dtype, and a float32 mask in a float16 / bfloat16 chain must be
exact in that dtype by construction (``_exact_in``: constants, Where, a Cast from that dtype or bool, reshaping
ops), since the node takes it in Q's dtype: ``fuse_attention`` casts it before the node and the fallback body
casts it back, which changes no value. A Cast elsewhere (to float64, probabilities kept in float32 against a V
Cast up) leaves the chain unfused, with the reason.

A chain is fused only when each intermediate value (S, the scaled and masked S, P) is read by the next node of
the chain alone (no other node, subgraph or graph output reads it), Q, Kt and V have one rank (3 or 4), the
head dim d is one known integer for Q, Kt and V, and the mask, when its rank is known, has at most Q's rank.
Anything else (scores replaced by a Where, Softmax over another axis) stays as it is, with the reason in
``AttentionScan.skipped``. A Mul of Q or Kt by a one-element constant (or a Div by one) right before the first
MatMul and read by it alone (torch's scaled_dot_product_attention export scales both by the root of the scale,
after their head-split Transposes) is part of the chain: its factor goes into the node's scale, the node reads
the Mul's input (so the Transpose before it is absorbed like any other), and the fallback body keeps the Mul.

Head-split layouts: at rank 4, a Transpose making Q or V with perm (0, 2, 1, 3), or Kt with perm (0, 2, 3, 1),
of a value [B, S, H, d] (H and d known integers: a Reshape splitting the last dim into heads x d, or LLaMA's
rotary embedding and K/V head repeat after it, which tuner/attention_prepare.py moves the Transposes past) and
read by the chain alone, is absorbed: the node takes that value ([B, S, H, d]; for K the keys, which the
kernel reads transposed). A Transpose (0, 2, 1, 3) of the output read by a Reshape merging the heads ([B, S, H, d] ->
[B, S, H*d], or [B*S, H*d] as GPT-2's dynamo export has it) is absorbed too: the node writes the Transpose's output. The node's ``layout`` attribute says which
(tuner.attention.LAYOUT_BITS: q 1, k 2, v 4, out 8; docs/abi.md "attention layouts"), and its fallback function
keeps the absorbed Transposes, so stock onnxruntime still computes exactly what the original did. A Transpose
with any other perm, or read by other nodes as well, stays in the graph (nothing absorbed for that operand),
with the reason in ``AttentionSite.layout_notes``. On a GPU each absorbed Transpose is one copy kernel less.
Shapes of an absorbed head-split input or of the output may read them too: those of an input only when Q, K
and V are read packed, and only their leading dims (rewired to the projection, ``packed_shapes``); those of the
output are rewired to the node's output, their dims picked back by the perm (``out_shapes``). The exporters'
other forms around the chain (``Shape(Transpose(x))``, the dynamo export's Kt as Reshape -> Transpose ->
Reshape, the rotary embedding and the K/V repeat after the head splits) are rewritten beforehand by
tuner/attention_prepare.py.

The fused node ``Attention(Q, Kt, V[, mask])`` keeps the output name of the last MatMul and carries the
effective scale (``scale``: 1/c for Div, c for Mul, 1 without, times a * b of Q's and Kt's Muls), the head
dim (``head_dim``) and whether NaN probabilities become 0 (``nan_to_zero``) as attributes.
Its model-local function (domain ``ai.dietcode``, one overload per distinct body) is the chain's nodes copied
verbatim, constants included, so stock onnxruntime without the custom-op library computes exactly what the
original graph did; the library's CPU kernel runs ORT's MatMul and Softmax with the scale and mask in between
(custom_ops/attention.cc).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import helper

from dietcode_ort import bundle as bundle_format
from dietcode_ort.errors import DietcodeError
from tuner import scan as scan_mod
from tuner.attention import LAYOUT_BITS
from tuner.causal_mask import is_causal_mask
from tuner.rewrite import (DOMAIN, DOMAIN_VERSION, _bundle_initializer, _drop_unread, _graph_reads, _Links, _opsets, default_opset,
                           copy_into_body, model_to_edit, unique_name)
from tuner.workload import Workload

__all__ = ["OP_TYPE", "AttentionSite", "AttentionScan", "find_attention", "fuse_attention", "without_attention"]

OP_TYPE = bundle_format.ATTENTION_OP
_DTYPES: dict[int, str] = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                          onnx.TensorProto.BFLOAT16: "bfloat16"}
_CODES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class AttentionSite:
    """One fusable chain: its nodes (by first output, in chain order), its inputs and its output."""

    # [Transposes], [Mul of Q], [Mul of Kt], MatMul, [Div|Mul], [Add], Softmax, [IsNaN, Where], MatMul, [Transpose]
    nodes: tuple[str, ...]
    q: str
    kt: str
    v: str
    mask: str | None
    output: str
    scale: float
    head_dim: int
    dtype: str
    rank: int
    nan_to_zero: bool = False  # Where(IsNaN(P), 0, P) after the Softmax
    # the attention view's sizes as expressions of the model's symbols (tuner.shape_expr's grammar): what a
    # dispatch tree over the symbolic dims would split on
    seq_q: str = ""
    seq_k: str = ""
    batch: str = ""  # z = the product of Q's leading dims (batch x heads)
    mask_rows: bool = True  # the mask may vary along the queries (False: its query dim is known to be 1)
    # "float32" when the chain adds a float32 mask to float32 scores of a float16/bfloat16 chain: the mask is
    # provably exact in ``dtype`` (_exact_in), so the node takes it cast to ``dtype`` and the fallback body
    # casts it back; "" when the mask already has the chain's dtype
    mask_dtype: str = ""
    # the mask is provably the causal mask (tuner/causal_mask.py, seq_q == seq_k): the kernels run in causal
    # mode without loading it; the node still takes it for the CPU kernel and the fallback body
    causal: bool = False
    # the operands the node takes (writes) as [batch, seq, heads, d], their Transposes absorbed
    # (tuner.attention.LAYOUT_BITS); 0: Q, Kt, V and the output as the chain's MatMuls have them
    layout: int = 0
    layout_notes: tuple[str, ...] = ()  # why a Transpose next to the chain was not absorbed
    # Shape nodes (by output) of the chain's output [B, H, S, d] when the head merge is absorbed: each reads the
    # node's output [B, S, H, d] instead, its dims picked back by a Gather (perm (0, 2, 1, 3))
    out_shapes: tuple[str, ...] = ()
    # the packed layout (LAYOUT_BITS["packed"]): (the packed projection [B, S, 3 * H * d] the node takes as Q, Kt
    # and V, Q's, K's and V's head-split values [B, S, H, d] the absorbed Transposes read); () otherwise
    packed: tuple[str, ...] = ()
    packed_heads: int = 0  # H of the packed projection
    # the nodes between the packed projection and the head-split Transposes (one Split or three Slices, three
    # Reshapes), by first output: left out of the main graph, rebuilt as Slice + Reshape in the fallback body
    packed_nodes: tuple[str, ...] = ()
    # Shape nodes (by output) reading a third whose readers use its batch and seq dims alone (the exporters'
    # Shape -> Gather -> Concat head-split shapes): rewired to read the packed projection, whose dims 0, 1 they are
    packed_shapes: tuple[str, ...] = ()
    pack_notes: tuple[str, ...] = ()  # why Q, K and V are not read packed from one projection


@dataclass(frozen=True)
class AttentionScan:
    sites: tuple[AttentionSite, ...]
    skipped: tuple[tuple[str, str], ...]  # (Softmax output, why its chain is not fused)


class _Skip(Exception):
    pass


def _only_reader(g: scan_mod._Graph, value: str, what: str) -> onnx.NodeProto:
    reader = g.exclusive_consumer(value)
    if reader is None:
        raise _Skip(f"the {what} {value!r} is read by {len(g.consumers.get(value, []))} nodes"
                    + (" and is a graph output" if value in g.graph_outputs else ""))
    return reader


def _is(node: onnx.NodeProto | None, *ops: str) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _const(g: scan_mod._Graph, name: str) -> np.ndarray | None:
    """The value of an initializer or Constant output (not one behind an Identity: the fallback body copies
    the constant the chain's node reads, so that node must read it directly)."""
    return g.const(name) if name in g.inits else None


def _scores(g: scan_mod._Graph, value: str) -> bool:
    """Whether ``value`` is made by a MatMul, directly or through Casts and one Div/Mul by a one-element
    constant."""
    node = g.producers.get(value)
    scaled = False
    for _ in range(8):
        if _is(node, "Cast"):
            assert node is not None
            node = g.producers.get(node.input[0])
            continue
        if _is(node, "Div", "Mul") and not scaled:
            assert node is not None
            dynamic = [v for v in node.input if v not in g.inits]
            if len(dynamic) != 1 or len(node.input) != 2:
                return False
            const = _const(g, node.input[1] if node.input[0] == dynamic[0] else node.input[0])
            if const is None or const.size != 1:
                return False
            node, scaled = g.producers.get(dynamic[0]), True
            continue
        break
    return _is(node, "MatMul")


def _cast_to(node: onnx.NodeProto) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "to"), 0)


def _type_name(code: int) -> str:
    if code in _DTYPES:
        return _DTYPES[code]
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(code).name
    except Exception:  # an unknown or unset element type
        return "an unknown type"


def _representable(values: np.ndarray, dtype: str) -> bool:
    """Whether every float32 value is exactly a ``dtype`` value (infinities included, NaN never)."""
    x = np.asarray(values, dtype=np.float32)
    if np.isnan(x).any():
        return False
    if dtype == "float16":
        with np.errstate(over="ignore"):  # past float16's range: inf, which the comparison refuses
            return bool((x.astype(np.float16).astype(np.float32) == x).all())
    if dtype == "bfloat16":  # bfloat16 is the high half of a float32
        return bool((x.view(np.uint32) & 0xFFFF == 0).all())
    return dtype == "float32"


# ops whose output values are values of their first input (moved, repeated, reshaped): they keep exactness
_VALUE_MOVES = ("Expand", "Reshape", "Unsqueeze", "Squeeze", "Slice", "Transpose", "Identity", "Tile")


def _exact_in(g: scan_mod._Graph, value: str, dtype: str, depth: int = 0) -> bool:
    """Whether every element ``value`` (float32) can take is exactly a ``dtype`` value, by construction: a
    constant whose values are, a Where choosing between such values, a Cast from ``dtype`` or from bool, or such
    a value moved by Expand/Reshape/Slice/... (what the LLaMA export's additive causal mask is)."""
    code = _CODES[dtype]
    for _ in range(32):
        if value in g.inits:
            const = g.const(value)
            return const is not None and _representable(const, dtype)
        node = g.producers.get(value)
        if node is None or depth > 8:
            return False
        if _is(node, "Cast"):
            return g.dtypes.get(node.input[0]) in (code, onnx.TensorProto.BOOL)
        if _is(node, "Where") and len(node.input) == 3:
            return all(_exact_in(g, x, dtype, depth + 1) for x in node.input[1:])
        if not _is(node, *_VALUE_MOVES):
            return False
        value = node.input[0]
    return False


def _nan_to_zero(g: scan_mod._Graph, probs: str) -> list[onnx.NodeProto]:
    """``[IsNaN, Where]`` when ``probs`` is read by exactly ``Where(IsNaN(probs), 0, probs)`` (torch's
    scaled_dot_product_attention export: rows whose keys are all masked give 0, not NaN), else []."""
    readers = g.consumers.get(probs, [])
    if len(readers) != 2 or probs in g.graph_outputs:
        return []
    isnan = next((n for n in readers if _is(n, "IsNaN")), None)
    where = next((n for n in readers if _is(n, "Where")), None)
    if isnan is None or where is None or g.exclusive_consumer(isnan.output[0]) is not where:
        return []
    if list(where.input)[0] != isnan.output[0] or where.input[2] != probs:
        return []
    zero = _const(g, where.input[1])
    if zero is None or zero.size != 1 or float(zero.reshape(())) != 0.0:
        return []
    return [isnan, where]


def _over_last_axis(node: onnx.NodeProto, opset: int, rank: int | None) -> bool:
    """Whether a Softmax normalizes its input's last axis: its ``axis`` -1, or rank - 1 (tf2onnx writes 3 for a
    4-D input); absent, the default, -1 from opset 13 and 1 before (then the input is flattened to 2-D at that
    axis, which is the last axis only for a 2-D input)."""
    axis = next((int(a.i) for a in node.attribute if a.name == "axis"), -1 if opset >= 13 else 1)
    return axis == -1 or (rank is not None and axis == rank - 1)


def _match(g: scan_mod._Graph, softmax: onnx.NodeProto, opset: int) -> AttentionSite:
    shape = g.shapes.get(softmax.input[0])
    if not _over_last_axis(softmax, opset, len(shape) if shape is not None else None):
        raise _Skip("Softmax is not over axis=-1")
    chain = [softmax]
    casts: list[onnx.NodeProto] = []
    probs = softmax.output[0]
    tail: list[onnx.NodeProto] = []
    for _ in range(4):  # after the Softmax: Casts and at most one Where(IsNaN(P), 0, P), in any order
        found = [] if tail else _nan_to_zero(g, probs)
        if found:
            tail = found
            chain += found
            probs = found[-1].output[0]
            continue
        reader = g.exclusive_consumer(probs)
        if not _is(reader, "Cast"):
            break
        assert reader is not None
        casts.append(reader)
        chain.append(reader)
        probs = reader.output[0]
    second = _only_reader(g, probs, "Softmax output")
    if not _is(second, "MatMul") or second.input[0] != probs:
        raise _Skip(f"the Softmax output is not the first operand of a MatMul: {second.op_type} reads it"
                    + (" (a view of the probabilities, as tf2onnx writes an Einsum, is not followed)"
                       if _is(second, "Reshape", "Squeeze", "Unsqueeze") else ""))
    x = softmax.input[0]
    mask = None
    scale = 1.0
    added = scaled = False
    node = g.producers.get(x)
    while True:  # back from the Softmax: Casts anywhere, then [Add mask], then [Div|Mul], then the MatMul
        if _is(node, "Cast"):
            assert node is not None
            _only_reader(g, x, "scores")
            chain.insert(0, node)
            casts.append(node)
            x = node.input[0]
        elif _is(node, "Add") and not added and not scaled:
            assert node is not None
            _only_reader(g, x, "masked scores")
            chain.insert(0, node)
            # the chain continues through the operand made by the MatMul (or its scale); the other is the mask
            sides = [v for v in node.input if _scores(g, v)]
            if len(node.input) != 2 or len(sides) != 1:
                raise _Skip("the Add after the scores does not add one mask to them")
            x = sides[0]
            mask = node.input[1] if node.input[0] == x else node.input[0]
            added = True
        elif _is(node, "Div", "Mul") and not scaled:
            assert node is not None
            _only_reader(g, x, "scaled scores")
            consts = [(i, _const(g, v)) for i, v in enumerate(node.input) if v in g.inits]
            if len(consts) != 1 or consts[0][1] is None or consts[0][1].size != 1:
                raise _Skip(f"the {node.op_type} after the first MatMul is not by a one-element constant")
            index, value = consts[0]
            if node.op_type == "Div" and index != 1:
                raise _Skip("the Div divides a constant by the scores")
            c = float(np.asarray(value, dtype=np.float64).reshape(()))
            scale = 1.0 / c if node.op_type == "Div" else c
            if not math.isfinite(scale) or c == 0.0:
                raise _Skip(f"the scale constant {c} is not usable")
            chain.insert(0, node)
            x = node.input[1 - index]
            scaled = True
        elif _is(node, "Where"):
            raise _Skip("the scores pass through a Where (a mask applied by replacing scores, as GPT-2's eager "
                        "attention writes its causal mask): only an added mask fuses")
        else:
            break
        node = g.producers.get(x)
    if not _is(node, "MatMul"):
        raise _Skip("the scores are not made by a MatMul")
    assert node is not None
    _only_reader(g, x, "scores")
    chain.insert(0, node)
    chain.append(second)
    q, kt, v = node.input[0], node.input[1], second.input[1]
    # a Mul (Div) of Q or Kt by a one-element constant (torch's SDPA export scales both by the root of the
    # scale) is folded into the node's scale: the node reads the Mul's input, the fallback body keeps the Mul
    readers = {"q": node, "k": node, "v": second}
    unfolded: list[str] = []
    for op in ("k", "q"):
        for _ in range(3):  # Muls in a row (a projection's scale moved after its head split, then SDPA's)
            scaling = _operand_scale(g, kt if op == "k" else q, readers[op])
            maker = g.producers.get(kt if op == "k" else q)
            if scaling is None and maker is not None and _is(maker, "Mul", "Div"):
                t_out = next((x for x in maker.input if _is(g.producers.get(x), "Transpose")), None)
                if t_out is not None:
                    unfolded.append(f"{_NAMES[op]}'s Transpose {t_out!r} kept: the {maker.op_type} between it and "
                                    "the chain is not one by a one-element constant read by the chain alone")
            if scaling is None:
                break
            mul, factor = scaling
            chain.insert(0, mul)
            readers[op] = mul
            scale *= factor
            source = mul.input[1] if mul.input[0] in g.inits else mul.input[0]
            q, kt = (source, kt) if op == "q" else (q, source)
    if not math.isfinite(scale) or scale == 0.0:
        raise _Skip(f"the scale {scale} of the chain with the Muls of Q and Kt folded in is not usable")
    shapes = [g.shapes.get(n) for n in (q, kt, v)]
    if any(s is None or any(d is None for d in s) for s in shapes):
        raise _Skip("the shapes of Q, Kt or V are unknown after shape inference")
    sq, sk, sv = shapes  # type: ignore[misc]
    assert sq is not None and sk is not None and sv is not None
    if not len(sq) == len(sk) == len(sv) or len(sq) not in (3, 4):
        raise _Skip(f"Q, Kt, V ranks {len(sq)}, {len(sk)}, {len(sv)} are not one rank of 3 or 4")
    d = sq[-1]
    if not isinstance(d, int) or d <= 0 or sk[-2] != d or sv[-1] != d:
        raise _Skip(f"the head dim is not one known integer (Q {sq[-1]}, Kt {sk[-2]}, V {sv[-1]})")
    if tuple(sq[:-2]) != tuple(sk[:-2]) or tuple(sq[:-2]) != tuple(sv[:-2]) or sk[-1] != sv[-2]:
        raise _Skip("Q, Kt and V do not share their leading dims and key count")
    mask_rows = True
    if mask is not None:
        ms = g.shapes.get(mask)
        if ms is not None and len(ms) > len(sq):
            raise _Skip(f"the mask has rank {len(ms)}, above the scores' {len(sq)}")
        mask_rows = ms is None or (len(ms) >= 2 and ms[-2] != 1)
    dtype = _DTYPES.get(g.dtypes.get(q, 0))
    if dtype is None:
        raise _Skip("Q is not float32, float16 or bfloat16")
    mask_dtype = _check_casts(g, casts, q, v, mask, dtype)
    causal = mask is not None and is_causal_mask(g, mask, sq[-2], sk[-1])
    try:
        sizes = [scan_mod._expr([x]) for x in (sq[-2], sk[-1])] + [scan_mod._expr(list(sq[:-2]) or [1])]
    except Exception as exc:  # a dim outside tuner.shape_expr's grammar
        raise _Skip(f"a dim of Q or Kt is outside the supported grammar ({exc})") from None
    output = second.output[0]
    layout = 0
    notes: list[str] = list(reversed(unfolded)) if len(sq) == 4 else []
    before: list[onnx.NodeProto] = []
    after: list[onnx.NodeProto] = []
    transposes: dict[str, onnx.NodeProto] = {}
    out_shapes: tuple[str, ...] = ()
    if len(sq) == 4:
        operands = (("q", q, (0, 2, 1, 3)), ("k", kt, (0, 2, 3, 1)), ("v", v, (0, 2, 1, 3)))
        ins = {"q": q, "k": kt, "v": v}
        for op, value, perm in operands:
            split_node = _head_split(g, op, value, readers[op], perm, notes)
            if split_node is not None:
                before.append(split_node)
                transposes[op] = split_node
                ins[op] = split_node.input[0]
                layout |= LAYOUT_BITS[op]
        q, kt, v = ins["q"], ins["k"], ins["v"]
        merge = _head_merge(g, output, notes)
        if merge is not None:
            after.append(merge)
            out_shapes = tuple(r.output[0] for r in g.consumers.get(output, []) if r is not merge)
            output = merge.output[0]
            layout |= LAYOUT_BITS["out"]
    chain = before + chain + after
    packed: tuple[str, ...] = ()
    packed_nodes: tuple[str, ...] = ()
    packed_shapes: tuple[str, ...] = ()
    pack_notes: list[str] = []
    heads = 0
    if len(transposes) == 3:
        splits = tuple(transposes[op].input[0] for op in ("q", "k", "v"))
        packed_from = _packed_source(g, splits, tuple(transposes[op] for op in ("q", "k", "v")), opset,
                                     pack_notes)
        if packed_from is not None:
            source, packed_nodes, heads, packed_shapes = packed_from
            packed = (source, *splits)
            q = kt = v = source
            layout |= LAYOUT_BITS["packed"]
    return AttentionSite(tuple(n.output[0] for n in chain), q, kt, v, mask, output, scale, d, dtype,
                         len(sq), bool(tail), seq_q=sizes[0], seq_k=sizes[1], batch=sizes[2], mask_rows=mask_rows,
                         mask_dtype=mask_dtype, causal=causal, layout=layout, layout_notes=tuple(notes),
                         out_shapes=out_shapes, packed=packed, packed_heads=heads, packed_nodes=packed_nodes,
                         packed_shapes=packed_shapes, pack_notes=tuple(pack_notes))


_NAMES = {"q": "Q", "k": "Kt", "v": "V"}


def _operand_scale(g: scan_mod._Graph, value: str, reader: onnx.NodeProto) -> tuple[onnx.NodeProto, float] | None:
    """The Mul (or Div by) a one-element constant making the first MatMul's operand ``value``, read by that
    MatMul alone, and the factor it scales by; None when there is none (or the constant would broadcast the
    operand to a higher rank, or is not a usable factor)."""
    mul = g.producers.get(value)
    if not _is(mul, "Mul", "Div") or g.exclusive_consumer(value) is not reader:
        return None
    assert mul is not None
    consts = [i for i, x in enumerate(mul.input) if x in g.inits]
    if len(mul.input) != 2 or len(consts) != 1 or (mul.op_type == "Div" and consts[0] != 1):
        return None
    c = _const(g, mul.input[consts[0]])
    shape = g.shapes.get(value)
    if c is None or c.size != 1 or shape is None or c.ndim > len(shape):
        return None
    factor = float(np.asarray(c, dtype=np.float64).reshape(()))
    if mul.op_type == "Div":
        factor = 1.0 / factor if factor != 0.0 else math.inf
    if not math.isfinite(factor) or factor == 0.0:
        return None
    return mul, factor


def _perm(node: onnx.NodeProto) -> tuple[int, ...] | None:
    for a in node.attribute:
        if a.name == "perm":
            return tuple(int(x) for x in a.ints)
    return None


def _splits_heads(g: scan_mod._Graph, value: str) -> str | None:
    """Why ``value`` is not made by a Reshape splitting the last dim into heads x d ([B, S, H*d] -> [B, S, H,
    d]), or None when it is (what a packed projection's thirds go through)."""
    reshape = g.producers.get(value)
    if not _is(reshape, "Reshape"):
        return "its input is not made by a Reshape"
    assert reshape is not None
    src, dst = g.shapes.get(reshape.input[0]), g.shapes.get(value)
    if src is None or dst is None or len(src) != 3 or len(dst) != 4:
        return "its Reshape is not known to go from rank 3 to rank 4"
    heads, d = dst[2], dst[3]
    if (src[0] != dst[0] or src[1] != dst[1] or not isinstance(heads, int) or not isinstance(d, int)
            or src[2] != heads * d):
        return f"its Reshape {list(src)} -> {list(dst)} does not split the last dim into heads x d"
    return None


def _bshd(g: scan_mod._Graph, value: str) -> str | None:
    """Why the node cannot read ``value`` as [B, S, H, d] (the input of a Transpose making its operand), or None:
    its shape is known, of rank 4 with H and d known integers. Whatever makes it (the head split's Reshape, the
    rotary embedding or the K/V head repeat after it, tuner/attention_prepare.py's moved Transposes), the node
    reads it in place as the Transpose would have."""
    shape = g.shapes.get(value)
    if shape is None or len(shape) != 4:
        return "its input is not known to be of rank 4"
    if not isinstance(shape[2], int) or not isinstance(shape[3], int):
        return f"its input {list(shape)} has no known heads x d"
    return None


def _head_split(g: scan_mod._Graph, op: str, value: str, reader: onnx.NodeProto, perm: tuple[int, ...],
                notes: list[str]) -> onnx.NodeProto | None:
    """The Transpose making operand ``value`` when the node can read its input instead (the head split), else
    None, with a note when a Transpose is there but stays."""
    t = g.producers.get(value)
    if not _is(t, "Transpose"):
        return None
    assert t is not None
    what = f"{_NAMES[op]}'s Transpose {value!r}"
    got = _perm(t)
    why = None
    if got != perm:
        why = f"has perm {list(got) if got is not None else None}, not the head split {list(perm)}"
    elif g.exclusive_consumer(value) is not reader:
        why = "is read by other nodes too"
    else:
        why = _bshd(g, t.input[0])
    if why is not None:
        notes.append(f"{what} kept: {why}")
        return None
    return t


def _head_merge(g: scan_mod._Graph, output: str, notes: list[str]) -> onnx.NodeProto | None:
    """The Transpose (0, 2, 1, 3) of the output before a Reshape merging the heads, when the node can write
    its output instead, else None (with a note when a Transpose is there but stays). Shapes of the output may
    read it too (the TorchScript export's): ``fuse_attention`` makes each read the Transpose's output, its dims
    picked back by the perm."""
    readers = g.consumers.get(output, [])
    t = next((r for r in readers if _is(r, "Transpose")), None)
    if t is None or output in g.graph_outputs or not all(r is t or _is(r, "Shape") for r in readers):
        return None
    what = f"the output's Transpose {t.output[0]!r}"
    if _perm(t) != (0, 2, 1, 3):
        notes.append(f"{what} kept: perm {_perm(t)} is not the head merge [0, 2, 1, 3]")
        return None
    merged = t.output[0]
    for r in g.consumers.get(merged, []):
        src, dst = g.shapes.get(merged), g.shapes.get(r.output[0]) if r.output else None
        if (_is(r, "Reshape") and r.input[0] == merged and src is not None and dst is not None and len(src) == 4
                and len(dst) in (2, 3) and isinstance(src[2], int) and isinstance(src[3], int)
                and dst[-1] == src[2] * src[3]):
            return t
    notes.append(f"{what} kept: no Reshape merging its heads ([B, S, H, d] -> [B, S, H*d] or [B*S, H*d]) reads it")
    return None


# (the packed projection, the absorbed nodes, heads, the Shape nodes rewired to the projection)
_PackedSource = tuple[str, tuple[str, ...], int, tuple[str, ...]]
_PACK_OPSET = 10  # the packed fallback body splits with Slice's starts/ends/axes inputs (opset 10)


def _ints(g: scan_mod._Graph, name: str) -> list[int] | None:
    value = _const(g, name) if name else None
    return None if value is None or value.ndim > 1 else [int(x) for x in value.reshape(-1)]


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _thirds(g: scan_mod._Graph, makers: list[onnx.NodeProto], parts: tuple[str, ...], width: int) -> str | None:
    """Why ``makers`` (the producers of ``parts``, Q's, K's and V's [B, S, H*d] values) are not one Split or three
    Slices of one tensor along its last axis (rank 3) in equal thirds of ``width`` = H*d, Q first, or None."""
    if all(_is(m, "Split") for m in makers):
        split = makers[0]
        if any(m is not split for m in makers) or list(split.output) != list(parts):
            return "the Split's outputs are not Q, K and V in this order"
        axis = _attr(split, "axis")
        if (axis.i if axis is not None else 0) not in (-1, 2):
            return "the Split is not along the last axis"
        sizes = _attr(split, "split")
        given = list(sizes.ints) if sizes is not None else (
            _ints(g, split.input[1]) if len(split.input) > 1 and split.input[1] else [])
        if given is None:
            return "the Split's sizes are not a constant"
        if given and given != [width] * 3:
            return f"the Split's sizes {given} are not three equal thirds of {3 * width}"
        return None
    if all(_is(m, "Slice") for m in makers):
        if len({id(m) for m in makers}) != 3:
            return "the Slices are not three"
        for part, m in enumerate(makers):
            if len(m.input) < 4:
                return "a Slice has no constant axes"
            starts, ends, axes = (_ints(g, x) for x in m.input[1:4])
            steps = _ints(g, m.input[4]) if len(m.input) > 4 and m.input[4] else [1]
            if starts is None or ends is None or axes is None or steps is None:
                return "a Slice's starts, ends, axes or steps are not constants"
            if axes not in ([-1], [2]) or steps != [1]:
                return "a Slice is not one step-1 slice along the last axis"
            end = ends[0] if ends else 0
            if starts != [part * width] or not (end == (part + 1) * width or (part == 2 and end >= 3 * width)):
                return (f"the Slice making {'QKV'[part]}'s part takes [{starts}, {ends}), not third {part} "
                        f"[{part * width}, {(part + 1) * width}) of the projection")
        return None
    return "Q, K and V are not split from one tensor by one Split or three Slices"


def _packed_source(g: scan_mod._Graph, splits: tuple[str, ...], transposes: tuple[onnx.NodeProto, ...], opset: int,
                   notes: list[str]) -> _PackedSource | None:
    """The packed projection [B, S, 3*H*d] that Q's, K's and V's head splits (``splits``: Reshape outputs [B, S,
    H, d], each read by its absorbed Transpose and Shapes of dims 0, 1 alone) come from through one Split or three Slices along the last axis
    in equal thirds, Q's first, with the nodes the node absorbs (the Split or Slices, the Reshapes) and H; None,
    with a note in ``notes`` when such a Split or Slices is there but the node cannot read the projection (a
    value between read by other nodes, unequal thirds)."""
    if not all(_is(g.producers.get(s), "Reshape") for s in splits):
        return None  # not three Reshapes of the projection's thirds (a rotary embedding, a K/V repeat between)
    reshapes = [g.producers[s] for s in splits]
    parts = tuple(r.input[0] for r in reshapes)
    makers = [g.producers.get(p) for p in parts]
    if not all(_is(m, "Split", "Slice") for m in makers):
        return None  # not split from one tensor (BERT's three MatMuls: pack_projections merges them first)
    makers_ = [m for m in makers if m is not None]

    def keep(why: str) -> _PackedSource | None:
        notes.append(f"Q, K and V not read packed: {why}")
        return None

    if opset < _PACK_OPSET:
        return keep(f"the model's opset {opset} is below {_PACK_OPSET} (the fallback body's Slice)")
    shape_reads: list[onnx.NodeProto] = []
    for value, t in zip(splits, transposes):  # [B, S, H, d]: a Shape taking B or S reads the projection's
        others = [r for r in g.consumers.get(value, []) if r is not t]
        if value in g.graph_outputs or not all(_leading_dims_only(g, r, 4) for r in others):
            return keep(f"the head split {value!r} is read by other nodes too")
        shape_reads += others
    for value, reshape in zip(parts, reshapes):
        others = [r for r in g.consumers.get(value, []) if r is not reshape]
        if value in g.graph_outputs or not all(_leading_dims_only(g, r, 3) for r in others):
            return keep(f"the third {value!r} is read by other nodes too")
        shape_reads += others
    sources = {m.input[0] for m in makers_}
    if len(sources) != 1:
        return keep("Q, K and V are not split from one tensor")
    source = sources.pop()
    dst = g.shapes.get(splits[0])
    assert dst is not None and isinstance(dst[2], int) and isinstance(dst[3], int)  # _bshd checked the Transposes'
    heads, d = int(dst[2]), int(dst[3])
    width = heads * d
    shape = g.shapes.get(source)
    if shape is None or len(shape) != 3 or shape[-1] != 3 * width:
        return keep(f"the projection {source!r} of shape {list(shape) if shape is not None else None} is not "
                    f"[batch, seq, {3 * width}]")
    why = _thirds(g, makers_, parts, width)
    if why is not None:
        return keep(why)
    why = next((f"{value!r}: {w}" for value in splits for w in [_splits_heads(g, value)] if w is not None), None)
    if why is not None:
        return keep(f"a head split does not split its third's last dim ({why})")
    nodes = list({id(m): m for m in makers_}.values()) + reshapes
    return source, tuple(n.output[0] for n in nodes), heads, tuple(n.output[0] for n in shape_reads)


def _leading_dims_only(g: scan_mod._Graph, node: onnx.NodeProto, rank: int) -> bool:
    """Whether ``node`` is a Shape (of the whole shape) whose readers are all Gathers of dim 0 or 1 (from the
    front or the back of a shape of ``rank``): what it gives them is the same for the packed projection."""
    if not _is(node, "Shape") or any(a.name in ("start", "end") for a in node.attribute):
        return False
    if node.output[0] in g.graph_outputs:
        return False
    for r in g.consumers.get(node.output[0], []):
        axis = _attr(r, "axis")
        index = _ints(g, r.input[1]) if _is(r, "Gather") and len(r.input) == 2 and r.input[0] == node.output[0] \
            else None
        if index is None or len(index) != 1 or index[0] not in (0, 1, -rank, 1 - rank) or \
                (axis is not None and axis.i != 0):
            return False
    return True


def _check_casts(g: scan_mod._Graph, casts: list[onnx.NodeProto], q: str, v: str, mask: str | None,
                 dtype: str) -> str:
    """Whether the chain's Casts keep it within the fused kernel's arithmetic (scores, mask and softmax in
    float32, the probabilities rounded to V's dtype before the AV product, the output in Q's dtype), which it
    computes at least as precisely as a chain that rounds the scores to float16 on the way: each Cast goes to
    float32 or to the chain's dtype, V has Q's dtype, and a float32 mask of a float16/bfloat16 chain is exactly
    representable in that dtype (the kernel reads the mask in it). Returns the mask's dtype when it needs the
    exact conversion ("float32"), else ""; raises _Skip with the reason."""
    code = g.dtypes.get(q, 0)
    for cast in casts:
        to = _cast_to(cast)
        if to not in (onnx.TensorProto.FLOAT, code):
            raise _Skip(f"a Cast to {_type_name(to)} inside the chain: the fused kernel keeps the scores and the "
                        f"softmax in float32 and rounds the probabilities to {dtype}")
    v_code = g.dtypes.get(v, 0)
    if v_code != code:
        raise _Skip(f"the probabilities multiply V of {_type_name(v_code)} while Q is {dtype} (the AV product "
                    f"and the output are {_type_name(v_code)}): the fused kernel rounds the probabilities to "
                    f"{dtype} and writes {dtype}")
    if mask is None:
        return ""
    m_code = g.dtypes.get(mask, 0)
    if m_code == code or (not m_code and not casts):  # no Cast: ONNX typing makes the mask the chain's dtype
        return ""
    if m_code != onnx.TensorProto.FLOAT:
        raise _Skip(f"the mask is {_type_name(m_code)} in a {dtype} chain")
    if not _exact_in(g, mask, dtype):
        raise _Skip(f"the float32 mask is not provably exact in {dtype}, which the fused kernel reads it in (it "
                    f"is not built from constants exact in {dtype}, Where, a Cast from {dtype} or bool, and "
                    "reshaping ops)")
    return "float32"


def _of_two_computed_operands(g: scan_mod._Graph, x: str, limit: int = 16) -> bool:
    """Whether ``x`` comes, through elementwise or view ops (at most ``limit`` of them, any of their computed
    inputs followed), from a MatMul or Einsum of two computed operands (attention's Q Kt), not from a product by
    a constant weight only (a classifier's logits)."""
    passing = ("Cast", "Add", "Sub", "Mul", "Div", "Where", "Reshape", "Squeeze", "Unsqueeze", "Transpose")
    todo, seen = [x], 0
    while todo and seen < limit:
        node = g.producers.get(todo.pop())
        seen += 1
        if node is not None and _is(node, "MatMul", "Einsum"):
            if len(node.input) == 2 and not any(g.constant_source(i) is not None for i in node.input):
                return True
        elif node is not None and _is(node, *passing):
            todo.extend(i for i in node.input if i and g.constant_source(i) is None)
    return False


def find_attention(model: onnx.ModelProto, base_dir: str | Path | None = None) -> AttentionScan:
    """The fusable attention chains of ``model`` (shapes from the scanner's symbolic shape inference) and,
    for every other Softmax, why its chain is not fused."""
    base = None if base_dir is None else Path(base_dir)
    inferred = scan_mod._infer(scan_mod._inference_copy(model, base))
    g = scan_mod._Graph(inferred, list(inferred.graph.initializer))
    opset = default_opset(model)
    sites, skipped = [], []
    for node in model.graph.node:
        if not _is(node, "Softmax") or not _of_two_computed_operands(g, node.input[0]):
            continue  # a classifier's Softmax over logits x @ W is no attention chain: not listed either
        try:
            sites.append(_match(g, node, opset))
        except _Skip as why:
            skipped.append((node.output[0], str(why)))
    return AttentionScan(tuple(sites), tuple(skipped))


def _int64s(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(values, np.int64)))


def _unpack_body(site: AttentionSite, names: dict[str, str]) -> list[onnx.NodeProto]:
    """The packed layout's part of the fallback body: part i of input i (Q, Kt, V: each the packed projection)
    sliced along the last axis and reshaped to [B, S, H, d] under the name the chain's Transpose reads."""
    heads, d = site.packed_heads, site.head_dim
    width = heads * d
    body = [_int64s("pk_axes", [-1]), _int64s("pk_shape", [0, 0, heads, d])]
    for part, (formal, value) in enumerate(zip(("Q", "Kt", "V"), site.packed[1:])):
        body += [_int64s(f"pk_start{part}", [part * width]), _int64s(f"pk_end{part}", [(part + 1) * width]),
                 helper.make_node("Slice", [formal, f"pk_start{part}", f"pk_end{part}", "pk_axes"], [f"pk{part}"]),
                 helper.make_node("Reshape", [f"pk{part}", "pk_shape"], [f"pk_split{part}"])]
        names[value] = f"pk_split{part}"
    return body


def _body(links: _Links, site: AttentionSite) -> list[onnx.NodeProto]:
    """The chain's nodes copied, values renamed (Q, Kt, V, mask in; Y out), constants as Constant nodes."""
    names = {site.q: "Q", site.kt: "Kt", site.v: "V", site.output: "Y"}
    body: list[onnx.NodeProto] = []
    if site.packed:
        names = {site.output: "Y"}
        body = _unpack_body(site, names)
    if site.mask is not None:
        names[site.mask] = "mask"
        if site.mask_dtype:  # the node takes the mask in the chain's dtype; the chain adds it as it was (exact)
            names[site.mask] = "mask_f"
            body.append(helper.make_node("Cast", ["mask"], ["mask_f"], to=_CODES[site.mask_dtype]))
    def new_constant(x: str) -> str:
        names[x] = f"c{len(names)}"
        return names[x]

    for key in site.nodes:
        copy_into_body(links, links.node(key, "attention node")[1], body, names.get, new_constant,
                       lambda o: names.setdefault(o, f"t{len(names)}") if o else "")
    return body


def fuse_attention(model: onnx.ModelProto, sites: tuple[AttentionSite, ...] | None = None, *,
                   base_dir: str | Path | None = None, copy: bool = True,
                   bundles: Mapping[str, tuple[bytes, str]] | None = None) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """Replace each chain of ``sites`` (default: all ``find_attention`` finds) by one ``Attention`` node
    with its fallback function. Returns the model (a copy unless ``copy`` is False) and the fused outputs.

    With ``bundles`` (keyed by the chain's output: bundle bytes, ``info`` JSON for inspect) each node is ``Attention(Q, Kt, V, mask, bundle)``, the mask
    an empty name when the chain adds none and the bundle a uint8 initializer shared by equal bundles (what
    the CUDA EP runs). Without, the node is ``Attention(Q, Kt, V[, mask])``, which only the CPU EP's kernel and
    the fallback function run."""
    if sites is None:
        sites = find_attention(model, base_dir).sites
    out = model_to_edit(model, copy)
    graph = out.graph
    links = _Links(graph, None if base_dir is None else Path(base_dir))
    before = _graph_reads(graph)
    claimed: set[int] = set()
    replace: dict[int, list[onnx.NodeProto]] = {}
    inserted: dict[int, list[onnx.NodeProto]] = {}  # after the node at that index
    opsets = _opsets(out)
    bodies: dict[tuple[int, bytes], str] = {}
    functions = [f for f in out.functions if f.domain == DOMAIN and f.name == OP_TYPE]
    for f in functions:
        bodies[(len(f.input), b"".join(n.SerializeToString(deterministic=True) for n in f.node))] = f.overload
    taken = {f.overload for f in functions}
    shared: dict[bytes, str] = {}
    taken_names = {t.name for t in graph.initializer} | {v.name for v in graph.input} | \
        {o for n in graph.node for o in n.output}
    new_initializers: list[onnx.TensorProto] = []
    mask_casts: dict[tuple[str, str], str] = {}  # (mask, dtype) -> the mask cast to the chain's dtype
    for site in sites:
        if bundles is not None and site.output not in bundles:
            raise DietcodeError(f"attention chain making {site.output!r} has no kernel bundle")
        members = [links.node(key, "attention node")[0] for key in site.nodes]
        absorbed = [links.node(key, "attention node")[0] for key in site.packed_nodes]  # not in the body
        if claimed & (set(members) | set(absorbed)):
            raise DietcodeError(f"attention chains making {site.output!r} and another overlap")
        claimed |= set(members) | set(absorbed)
        body = _body(links, site)
        before_node: list[onnx.NodeProto] = []
        mask = site.mask
        if mask is not None and site.mask_dtype:
            if (mask, site.dtype) not in mask_casts:
                name = unique_name(f"{mask}_{site.dtype}", taken_names)
                mask_casts[(mask, site.dtype)] = name
                before_node.append(helper.make_node("Cast", [mask], [name], name=name, to=_CODES[site.dtype]))
            mask = mask_casts[(mask, site.dtype)]
        inputs = [site.q, site.kt, site.v] + ([mask] if mask is not None else [])
        formal = ["Q", "Kt", "V"] + (["mask"] if site.mask is not None else [])
        if bundles is not None:
            payload = bundles[site.output][0]
            if payload not in shared:
                new_initializers.append(_bundle_initializer(payload, taken_names))
                shared[payload] = new_initializers[-1].name
            inputs = [site.q, site.kt, site.v, mask or "", shared[payload]]
            formal = ["Q", "Kt", "V", "mask", "bundle"]
        key = (len(inputs), b"".join(n.SerializeToString(deterministic=True) for n in body))
        if key not in bodies:
            overload = next(str(i) if i else "" for i in range(len(taken) + 1) if (str(i) if i else "") not in taken)
            taken.add(overload)
            bodies[key] = overload
            out.functions.append(helper.make_function(DOMAIN, OP_TYPE, formal, ["Y"], body, opsets,
                                                      attributes=["scale", "head_dim", "nan_to_zero", "layout"]
                                                      + (["mask_rows", "causal", "info"] if bundles is not None
                                                         else []),
                                                      overload=overload or None))
        # named as the chain's second MatMul (the last member may be an absorbed Transpose), placed at the last
        named = next(graph.node[m] for m in reversed(members) if graph.node[m].op_type == "MatMul")
        node = helper.make_node(OP_TYPE, inputs, [site.output], name=named.name or site.output, domain=DOMAIN,
                                scale=float(site.scale), head_dim=int(site.head_dim),
                                nan_to_zero=int(site.nan_to_zero), layout=int(site.layout))
        if bundles is not None:
            node.attribute.extend([helper.make_attribute("mask_rows", int(site.mask_rows)),
                                   helper.make_attribute("causal", int(site.causal)),
                                   helper.make_attribute("info", bundles[site.output][1])])
        if bodies[key]:
            node.overload = bodies[key]
        replace[members[-1]] = [*before_node, node]
        for shape_key in site.out_shapes:  # Shape(Y) -> Gather(Shape(Y transposed), perm[start:end])
            at, shape = links.node(shape_key, "attention node")
            dims = [0, 2, 1, 3][slice(*(next((int(a.i) for a in shape.attribute if a.name == k), None)
                                         for k in ("start", "end")))]
            picked = unique_name(f"{shape_key}_perm", taken_names)
            made = unique_name(f"{shape_key}_transposed", taken_names)
            new_initializers.append(onnx.numpy_helper.from_array(np.array(dims, np.int64), picked))
            gather = helper.make_node("Gather", [made, picked], [shape_key], axis=0, name=made)
            shape.input[0], shape.output[0] = site.output, made
            del shape.attribute[:]
            inserted.setdefault(at, []).append(gather)
        for shape_key in site.packed_shapes:  # Shape(third) -> Shape(projection): dims 0 and 1 are the same
            graph.node[links.node(shape_key, "attention node")[0]].input[0] = site.packed[0]
    if not replace:
        return out, ()
    drop = claimed - set(replace)
    kept = [m for i, n in enumerate(graph.node) if i not in drop for m in replace.get(i, [n]) + inserted.get(i, [])]
    del graph.node[:]
    graph.node.extend(kept)
    if inserted:  # Shapes of a chain's output may sit before the node now making what they read
        _sort_nodes(graph)
    _drop_unread(graph, before)
    _drop_dead(graph, before)
    graph.initializer.extend(new_initializers)
    out.ir_version = max(out.ir_version, 10 if any(f.overload for f in out.functions) else 8)
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return out, tuple(s.output for s in sites)


def _sort_nodes(graph: onnx.GraphProto) -> None:
    """Order the nodes so each comes after the makers of what it reads (subgraphs' outer reads included),
    keeping the current order wherever it already is one."""
    import heapq

    nodes = list(graph.node)
    maker = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    needs = [{maker[x] for x in scan_mod.node_reads(n) if x in maker and maker[x] != i} for i, n in enumerate(nodes)]
    waiting = [len(d) for d in needs]
    readers: dict[int, list[int]] = {}
    for i, d in enumerate(needs):
        for j in d:
            readers.setdefault(j, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers.get(i, []):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise DietcodeError("the fused graph has a cycle")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def _drop_dead(graph: onnx.GraphProto, before: set[str]) -> None:
    """Remove the standard-domain nodes the rewrite left without a reader (a packed site's head-split shape
    computations: Shape, Gather, Concat), transitively: nodes none of whose outputs is read any more by a node,
    a subgraph or the graph's outputs, and one of which was read before."""
    while True:
        after = _graph_reads(graph)
        dead = [i for i, n in enumerate(graph.node) if n.domain in ("", "ai.onnx") and n.output
                and not any(o in after for o in n.output if o) and any(o in before for o in n.output if o)]
        if not dead:
            return
        gone = set(dead)
        kept = [n for i, n in enumerate(graph.node) if i not in gone]
        del graph.node[:]
        graph.node.extend(kept)
        _drop_unread(graph, before)


def without_attention(workloads: tuple[Workload, ...], sites: tuple[AttentionSite, ...]) -> tuple[Workload, ...]:
    """The workloads less the nodes the attention chains of ``sites`` fuse (their two MatMuls), so that the
    GEMM rewrite leaves those MatMuls for ``fuse_attention``; a workload left without nodes is dropped."""
    taken = {key for site in sites for key in site.nodes}
    out = []
    for w in workloads:
        fused = w.fused_nodes or ((),) * len(w.nodes)
        keep = [i for i, key in enumerate(w.nodes) if key not in taken]
        if len(keep) == len(w.nodes):
            out.append(w)
        elif keep:
            out.append(replace(w, nodes=tuple(w.nodes[i] for i in keep),
                               fused_nodes=tuple(fused[i] for i in keep) if w.fused_nodes else (),
                               ranks=tuple(w.ranks[i] for i in keep) if w.ranks else ()))
    return tuple(out)
