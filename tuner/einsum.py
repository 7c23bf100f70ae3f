"""Graph pre-pass: a two-operand Einsum that is a (batched) matrix product, written as MatMul.

TorchScript exports ``torch.einsum`` as an Einsum node (attention scores ``bhqd,bhkd->bhqk`` in Longformer, CvT,
SAM's relative positions, Mask2Former's masks, a linear layer ``bsd,hd->bsh``); the scanner tunes MatMul nodes,
so such an Einsum is written as the same product:

    Einsum(A, B) = Transpose(MatMul(Unsqueeze(Transpose(A)), Unsqueeze(Transpose(B))))

with each Transpose and Unsqueeze only where needed. Its subscripts sort into the batch letters (in both
operands and the output), the letters of A alone and of B alone (both in the output) and one contracted letter
(in both operands, not in the output; a linear layer ``...d,de->...e`` has none of A alone: its ellipsis' last
dim is the MatMul's M). A becomes [..., batch, A's letters but its last, ones for B's but its
last, A's last, k], B [..., batch, ones for A's letters but its last, B's letters but its last, k, B's last],
and the MatMul's result is permuted to the output's order: the same sums in another order of the dims. An
ellipsis (``...``) stays where it is, leading every term it is in (MatMul broadcasts it as Einsum does). A
constant operand whose values the model holds is transposed and reshaped once here, so a weight stays a
constant [K, N] operand; one whose values are in an external file gets the nodes.

Left as it is, with the reason in ``EinsumResult.notes``: Einsums of integer operands (the scanner tunes float
products), of one or three operands, a letter repeated in a term (a diagonal or trace), a letter summed out of
one operand alone, more or less than one contracted letter, a product without a letter of A alone or of B alone
(a matrix-vector product, which the scanner does not tune either), and an ellipsis not at the start of a term
or summed out. ``optimize`` and ``scan`` run it before scanning; running it twice changes nothing more.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tuner.model_file import is_external
from tuner.rewrite import (_drop_unread, _graph_reads, axes_node, default_opset, model_to_edit, names_in_use,
                           unique_name)

__all__ = ["EinsumResult", "MatMulForm", "matmul_form", "einsums_as_matmuls"]

_TERM = re.compile(r"^(\.\.\.)?([A-Za-z]*)$")


@dataclass(frozen=True)
class EinsumResult:
    converted: tuple[str, ...]  # the outputs of the Einsums now written as MatMuls
    notes: tuple[tuple[str, str], ...] = ()  # (an Einsum's output, why it stays)


@dataclass(frozen=True)
class MatMulForm:
    """An equation as a matrix product: each operand's letters (after its ellipsis, where the term has one) as
    written and in the order the MatMul reads them, the axes (from the end) where each gets size-1 dims, and the
    permutation from the MatMul's letters to the output's."""

    a_term: str
    b_term: str
    a_order: str
    b_order: str
    a_ones: tuple[int, ...]  # Unsqueeze axes (negative) of A after its transpose
    b_ones: tuple[int, ...]
    out_perm: tuple[int, ...]  # over the MatMul output's letters (after its ellipsis)
    ellipsis: tuple[bool, bool, bool]  # whether A, B and the output have one


def _terms(equation: str) -> tuple[list[str], str]:
    """The input terms and the output term (implicit mode: the letters used once, sorted, after an ellipsis)."""
    eq = equation.replace(" ", "")
    inputs, arrow, output = eq.partition("->")
    terms = inputs.split(",")
    if not arrow:
        letters = "".join(t.replace("...", "") for t in terms)
        output = ("..." if any("..." in t for t in terms) else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, output


def matmul_form(equation: str) -> MatMulForm | str:
    """The equation as a matrix product (``MatMulForm``), or why it is not one."""
    terms, out = _terms(equation)
    if len(terms) != 2:
        return f"{len(terms)} operands (a product of two is written as MatMul)"
    parsed = [_TERM.match(t) for t in (*terms, out)]
    if not all(parsed):
        return "an ellipsis not at the start of a term"
    (ea, a), (eb, b), (ec, c) = [(bool(m.group(1)), m.group(2)) for m in parsed]  # type: ignore[union-attr]
    if any(len(set(t)) != len(t) for t in (a, b, c)):
        return "a letter repeated within a term (a diagonal or a trace)"
    if (ea or eb) != ec:
        return "the ellipsis dims summed out" if ea or eb else "an ellipsis in the output alone"
    if set(c) - set(a) - set(b):
        return "an output letter in neither operand"
    alone = (set(a) ^ set(b)) - set(c)
    if alone:
        return f"letter {sorted(alone)[0]!r} summed out of one operand alone"
    contracted = (set(a) & set(b)) - set(c)
    if len(contracted) != 1:
        return f"{len(contracted)} contracted letters (a MatMul contracts one)"
    (k,) = contracted
    batch = [x for x in c if x in a and x in b]
    m = [x for x in c if x in a and x not in b]
    n = [x for x in c if x in b and x not in a]
    if not m and ea and not eb and not batch and len(n) == 1:  # a linear layer over the ellipsis: its last dim is M
        return MatMulForm(a, b, k, k + n[0], (), (), (0,), (ea, eb, ec))
    if not m or not n:
        return f"no letter of {'A' if not m else 'B'} alone (a matrix-vector or dot product)"
    a_order = "".join(batch + m[:-1] + [m[-1], k])
    b_order = "".join(batch + n[:-1] + [k, n[-1]])
    # size-1 dims where the other operand has letters of its own; none where they would lead the operand (MatMul
    # broadcasts missing leading dims: a weight of a linear layer stays [K, N])
    a_ones = tuple(range(-2 - (len(n) - 1), -2)) if batch or ea or len(m) > 1 else ()
    b_ones = tuple(range(-2 - (len(n) - 1) - (len(m) - 1), -2 - (len(n) - 1))) if batch or eb else ()
    result = batch + m[:-1] + n[:-1] + [m[-1], n[-1]]
    return MatMulForm(a, b, a_order, b_order, a_ones, b_ones, tuple(result.index(x) for x in c), (ea, eb, ec))


def _perm(term: str, order: str, rank: int) -> list[int]:
    """The Transpose perm taking a term's dims (its letters after ``rank - len(term)`` ellipsis dims) to ``order``."""
    lead = rank - len(term)
    return list(range(lead)) + [lead + term.index(x) for x in order]


def _equation(node: onnx.NodeProto) -> str:
    value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "equation"), b"")
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _types_and_ranks(model: onnx.ModelProto, base_dir: Path | None) -> dict[str, tuple[int, int | None]]:
    """Every value's element type and rank (None: unknown), from onnx's shape inference on the scanner's copy
    without weight values; empty where inference fails."""
    from tuner import scan as scan_mod

    try:
        g = onnx.shape_inference.infer_shapes(scan_mod._inference_copy(model, base_dir)).graph
    except Exception:  # noqa: BLE001  (onnx raises several kinds; the Einsums then stay, with the reason)
        return {}
    out: dict[str, tuple[int, int | None]] = {t.name: (t.data_type, len(t.dims)) for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        t = vi.type.tensor_type
        out[vi.name] = (t.elem_type, len(t.shape.dim) if t.HasField("shape") else None)
    return out


def einsums_as_matmuls(model: onnx.ModelProto, base_dir: Path | None = None,
                       copy: bool = True) -> tuple[onnx.ModelProto, EinsumResult]:
    """``model`` (a copy unless ``copy`` is False) with each two-operand Einsum of its main graph that is a matrix
    product written as MatMul (``base_dir``: where external data lives, for shape inference)."""
    out = model_to_edit(model, copy)
    graph = out.graph
    einsums = [n for n in graph.node if n.op_type == "Einsum" and n.domain in ("", "ai.onnx")]
    if not einsums:
        return out, EinsumResult(())
    forms: dict[int, MatMulForm] = {}
    notes: list[tuple[str, str]] = []
    for node in einsums:
        equation = _equation(node)
        form = matmul_form(equation)
        if isinstance(form, str):
            notes.append((node.output[0], f"Einsum {equation!r}: {form}"))
        else:
            forms[id(node)] = form
    if not forms:
        return out, EinsumResult((), tuple(notes))
    known = _types_and_ranks(out, base_dir)
    for node in einsums:  # a MatMul is tuned in the float types only: an integer Einsum stays as it is
        elem = known.get(node.input[0], (0, None))[0]
        if id(node) in forms and elem not in _FLOATS:
            del forms[id(node)]
            what = onnx.TensorProto.DataType.Name(elem) if elem else "an element type shape inference does not give"
            notes.append((node.output[0], f"Einsum {_equation(node)!r} on {what}: only float products are tuned"))
    if not forms:
        return out, EinsumResult((), tuple(notes))
    ranks = {name: rank for name, (_, rank) in known.items() if rank is not None}
    inits = {t.name: t for t in graph.initializer}
    before = _graph_reads(graph)
    names = functools.partial(unique_name, taken=names_in_use(graph))
    opset = default_opset(out)
    converted, rebuilt = [], []
    for node in graph.node:
        mm = forms.get(id(node))
        if mm is None:
            rebuilt.append(node)
            continue
        sides = ((node.input[0], mm.a_term, mm.a_order, mm.a_ones, mm.ellipsis[0]),
                 (node.input[1], mm.b_term, mm.b_order, mm.b_ones, mm.ellipsis[1]))
        ranks_of = [ranks.get(x) if ell else len(term) for x, term, _, _, ell in sides]
        if None in ranks_of:
            notes.append((node.output[0], f"Einsum {_equation(node)!r}: shape inference gives no rank for an "
                                          "operand with an ellipsis"))
            rebuilt.append(node)
            continue
        label = node.name or node.output[0]
        op_ranks = [r for r in ranks_of if r is not None]
        operands = [_operand(graph, rebuilt, names, opset, x, _perm(term, order, rank), ones, inits.get(x), label)
                    for (x, term, order, ones, _), rank in zip(sides, op_ranks)]
        identity = list(mm.out_perm) == sorted(mm.out_perm)
        product = node.output[0] if identity else names(f"{node.output[0]}_matmul")
        rebuilt.append(helper.make_node("MatMul", operands, [product], name=names(f"{label}_matmul")))
        if not identity:
            # the broadcast ellipsis dims lead the MatMul's output too
            lead = max(rank - len(term) for (_, term, _, _, _), rank in zip(sides, op_ranks))
            perm = list(range(lead)) + [lead + p for p in mm.out_perm]
            rebuilt.append(helper.make_node("Transpose", [product], [node.output[0]], name=names(f"{label}_transpose"),
                                            perm=perm))
        converted.append(node.output[0])
    del graph.node[:]
    graph.node.extend(rebuilt)
    _drop_unread(graph, before)
    return out, EinsumResult(tuple(converted), tuple(notes))


def _operand(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], names: Callable[[str], str], opset: int, x: str,
             perm: list[int], ones: tuple[int, ...], init: onnx.TensorProto | None, label: str) -> str:
    """``x`` transposed by ``perm`` with size-1 dims at ``ones``: a new constant where ``x`` is one whose values
    the model holds, else Transpose and Unsqueeze nodes (each only where it changes something)."""
    moved = perm != sorted(perm)
    if not moved and not ones:
        return x
    if init is not None and not is_external(init):
        value = numpy_helper.to_array(init).transpose(perm)
        if ones:
            value = np.expand_dims(value, ones)  # negative axes count from the end of the result, as Unsqueeze's
        name = names(f"{x}_matmul")
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name
    if moved:
        y = names(f"{x}_transposed")
        nodes.append(helper.make_node("Transpose", [x], [y], name=names(f"{label}_transpose_{x}"), perm=perm))
        x = y
    if ones:
        y = names(f"{x}_unsqueezed")
        axes = names(f"{y}_axes") if opset >= 13 else None
        if axes:
            graph.initializer.append(numpy_helper.from_array(np.array(ones, np.int64), axes))
        nodes.append(axes_node("Unsqueeze", x, y, list(ones), opset, axes, names(f"{label}_unsqueeze_{x}")))
        x = y
    return x
