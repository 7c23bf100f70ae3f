"""Proving that an attention chain's additive mask is the causal mask, so that its kernels can use their causal
mode instead of loading the mask.

A value is a *triangle* ``(a, b)`` when, over its last two axes (query i, key j), every element is ``a`` where
``j <= i`` and ``b`` where ``j > i``, the same for every leading index. ``triangle`` proves it by construction,
from the nodes that make the value:

- a constant (initializer or Constant node) whose elements are so, any rectangular shape;
- ``Slice`` of a triangle starting at 0 with step 1 on the last two axes (a buffer cut to the sequence length:
  ``bias[:, :, :T, :T]``; other axes may start anywhere);
- ``Trilu(X)`` of an ``X`` filled with one value v (``ConstantOfShape``, or a constant of equal elements):
  ``upper=0, k=0`` gives ``(v, 0)``, ``upper=1, k=1`` gives ``(0, v)`` (``torch.triu(full(-inf), 1)``);
- ``Where(C, x, y)`` of a triangle C and one-element constants x, y; ``Cast`` of a triangle;
- ``Identity``, ``Unsqueeze``, ``Squeeze``, ``Reshape``, ``Expand`` whose input and output have the same known
  last two dims (they add or broadcast leading axes only).

An additive mask is causal when it is a triangle ``(0, c)`` with c = -inf or float32's lowest value, its last two
dims are the scores' ``seq_q`` and ``seq_k`` and those are one symbol (``seq_q == seq_k`` for every shape): then
``S + mask`` and the kernels' causal mode (keys ``j > i + seq_k - seq_q`` dropped) give the same softmax, exactly
for -inf, and for float32's lowest whenever the scores are below 2^100 in magnitude (``s + lowest`` rounds to
lowest, whose exponential against the row's finite maximum, its diagonal key's, is 0).
"""
from __future__ import annotations

import numpy as np
import onnx

from tuner import scan as scan_mod

__all__ = ["triangle", "is_causal_mask", "CAUSAL_FILLS"]

CAUSAL_FILLS = (float("-inf"), float(np.finfo(np.float32).min))
_SHAPE_OPS = ("Identity", "Unsqueeze", "Squeeze", "Reshape", "Expand")
_DEPTH = 12


def _is(node: onnx.NodeProto | None, *ops: str) -> bool:
    return node is not None and node.op_type in ops and node.domain in ("", "ai.onnx")


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _const(g: scan_mod._Graph, name: str) -> np.ndarray | None:
    return g.const(name) if name and name in g.inits else None


def _scalar(g: scan_mod._Graph, name: str) -> float | None:
    """The value of a one-element constant, or of a constant whose elements are all equal."""
    value = _const(g, name)
    if value is None or value.size == 0:
        return None
    flat = value.astype(np.float64).ravel()
    if not (np.all(flat == flat[0]) or np.all(np.isnan(flat))):
        return None
    return float(flat[0])


def _constant_triangle(value: np.ndarray) -> tuple[float, float] | None:
    if value.ndim < 2 or value.shape[-2] == 0 or value.shape[-1] == 0:
        return None
    x = value.astype(np.float64)
    rows, cols = x.shape[-2:]
    above = np.arange(cols)[None, :] > np.arange(rows)[:, None]
    low, high = x[..., ~above], x[..., above]
    if low.size == 0 or np.isnan(x).any():
        return None
    a = float(low.ravel()[0])
    if not np.all(low == a):
        return None
    if high.size == 0:
        return None  # one column: nothing says what lies above the diagonal
    b = float(high.ravel()[0])
    return (a, b) if np.all(high == b) else None


def _filled(g: scan_mod._Graph, name: str) -> float | None:
    """The one value every element of ``name`` has, by construction (ConstantOfShape, an equal constant, an
    Expand of either), or None."""
    for _ in range(_DEPTH):
        if name in g.inits:
            return _scalar(g, name)
        node = g.producers.get(name)
        if _is(node, "ConstantOfShape"):
            assert node is not None
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            return 0.0 if value is None else float(onnx.numpy_helper.to_array(value).astype(np.float64).ravel()[0])
        if not _is(node, *_SHAPE_OPS):
            return None
        assert node is not None
        name = node.input[0]
    return None


def _starts_at_zero(g: scan_mod._Graph, node: onnx.NodeProto, rank: int) -> bool:
    """Whether the Slice starts at 0 with step 1 on the last two axes of a rank-``rank`` input."""
    starts = _const(g, node.input[1]) if len(node.input) > 1 else None
    if starts is None:
        return False
    axes = _const(g, node.input[3]) if len(node.input) > 3 and node.input[3] else np.arange(starts.size)
    steps = _const(g, node.input[4]) if len(node.input) > 4 and node.input[4] else np.ones(starts.size, np.int64)
    if axes is None or steps is None or axes.size != starts.size or steps.size != starts.size:
        return False
    for axis, start, step in zip(axes.ravel(), starts.ravel(), steps.ravel()):
        axis = int(axis) % rank if rank else int(axis)
        if axis >= rank - 2 and (int(start) != 0 or int(step) != 1):
            return False
    return True


def _same_last_two(g: scan_mod._Graph, a: str, b: str) -> bool:
    sa, sb = g.shapes.get(a), g.shapes.get(b)
    return (sa is not None and sb is not None and len(sa) >= 2 and len(sb) >= 2 and None not in sa[-2:]
            and tuple(sa[-2:]) == tuple(sb[-2:]))


def triangle(g: scan_mod._Graph, name: str, depth: int = 0) -> tuple[float, float] | None:
    """``(a, b)`` when ``name`` is provably a triangle (module docstring), else None."""
    if depth > _DEPTH:
        return None
    if name in g.inits:
        value = _const(g, name)
        return None if value is None else _constant_triangle(value)
    node = g.producers.get(name)
    if node is None:
        return None
    if _is(node, *_SHAPE_OPS):
        return triangle(g, node.input[0], depth + 1) if _same_last_two(g, node.input[0], name) else None
    if _is(node, "Slice"):
        shape = g.shapes.get(node.input[0])
        if shape is None or not _starts_at_zero(g, node, len(shape)):
            return None
        return triangle(g, node.input[0], depth + 1)
    if _is(node, "Cast"):
        inner = triangle(g, node.input[0], depth + 1)
        to = _attr(node, "to", 0)
        if inner is None or to not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                                       onnx.TensorProto.BOOL):
            return None
        if to == onnx.TensorProto.BOOL:
            return float(inner[0] != 0), float(inner[1] != 0)
        if to == onnx.TensorProto.FLOAT16:
            with np.errstate(over="ignore"):
                return tuple(float(np.float16(x)) for x in inner)  # type: ignore[return-value]
        if to == onnx.TensorProto.FLOAT:
            with np.errstate(over="ignore"):
                return tuple(float(np.float32(x)) for x in inner)  # type: ignore[return-value]
        return inner
    if _is(node, "Trilu"):
        fill = _filled(g, node.input[0])
        k = _const(g, node.input[1]) if len(node.input) > 1 and node.input[1] else np.zeros(1, np.int64)
        if fill is None or k is None or k.size != 1:
            return None
        upper, diagonal = _attr(node, "upper", 1), int(k.ravel()[0])
        if upper == 0 and diagonal == 0:
            return fill, 0.0
        if upper == 1 and diagonal == 1:
            return 0.0, fill
        return None
    if _is(node, "Where") and len(node.input) == 3:
        cond = triangle(g, node.input[0], depth + 1)
        x, y = _scalar(g, node.input[1]), _scalar(g, node.input[2])
        if cond is None or x is None or y is None:
            return None
        return (x if cond[0] else y), (x if cond[1] else y)
    return None


def is_causal_mask(g: scan_mod._Graph, mask: str, seq_q: object, seq_k: object) -> bool:
    """Whether adding ``mask`` to scores ``[..., seq_q, seq_k]`` is the causal mask (module docstring)."""
    shape = g.shapes.get(mask)
    if seq_q is None or seq_q != seq_k or shape is None or len(shape) < 2 or tuple(shape[-2:]) != (seq_q, seq_k):
        return False
    found = triangle(g, mask)
    return found is not None and found[0] == 0.0 and found[1] in CAUSAL_FILLS
