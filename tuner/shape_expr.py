"""Shape expressions: symbolic dims parsed by a small grammar, never evaluated as code.

Dims come from the model (``dim_param`` strings) and from onnxruntime's SymbolicShapeInference, which
writes them as sympy prints them (``2*batch*seq``, ``floor(height/2) + 1``, ``Max(1, seq)``). Text from
a model is untrusted: ``sympy.sympify`` would evaluate it as Python, and would also read dim names such
as ``sequence``, ``E``, ``N``, ``beta`` or ``lambda`` as sympy objects. This module parses that text
with its own grammar into sympy expressions built from explicit ``Symbol`` objects (which never
evaluate their names), and prints expressions back in a form it can parse again:

    expr  := term (('+' | '-') term)*
    term  := unary (('*' | '/' | '//' | '%') unary)*
    unary := '-' unary | power
    power := atom ('**' INT)?
    atom  := INT | NAME | '`' any name without '`' '`' | FUNC '(' expr (',' expr)* ')' | '(' expr ')'
    FUNC  := floor | ceil | ceiling | min | Min | max | Max | mod | Mod

``NAME`` is ``[A-Za-z_][A-Za-z0-9_]*``; any other dim name (dots, dashes, spaces) is printed between
backquotes. Sizes are bounded (text length, nesting, literal digits, exponents), so a crafted dim cannot
make parsing or arithmetic blow up. Anything outside the grammar raises ``ShapeExprError``, which the
scanner turns into a reason for leaving the node alone.
"""
from __future__ import annotations

import functools
import math
import operator
import re
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping, Union

import sympy
from sympy.printing.str import StrPrinter

__all__ = ["ShapeExprError", "parse", "to_text", "symbol", "free_names", "product", "evaluate",
           "is_plain_name", "MAX_TEXT"]

MAX_TEXT = 2000  # characters in one expression
_MAX_DEPTH = 64  # nesting of parentheses, calls and unary minus
_MAX_DIGITS = 18  # an integer literal (dims are int64)
_MAX_POWER = 8  # exponent of '**' (sympy prints x*x as x**2)
_MAX_TOKENS = 400  # bounds the tree's size, and so the recursion of parsing and evaluating it

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|`(?P<quoted>[^`]*)`|"
                    r"(?P<op>\*\*|//|[-+*/%(),]))")
_FUNCS = {"floor": "floor", "ceil": "ceiling", "ceiling": "ceiling", "min": "min", "Min": "min",
          "max": "max", "Max": "max", "mod": "mod", "Mod": "mod"}


class ShapeExprError(ValueError):
    """Text that is not a shape expression of the grammar above."""


def is_plain_name(name: str) -> bool:
    """Whether ``name`` prints without backquotes."""
    return bool(_PLAIN.match(name))


@functools.lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    """The one sympy symbol for a dim name (positive integer, so floor(n) simplifies to n)."""
    return sympy.Symbol(name, integer=True, positive=True)


# A parsed expression: a small tuple tree, evaluated exactly with Python integers and fractions.
Node = Union[int, tuple[Any, ...]]


def _tokens(text: str) -> list[tuple[str, str]]:
    if not isinstance(text, str):
        raise ShapeExprError(f"a shape expression must be text, got {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise ShapeExprError(f"shape expression of {len(text)} characters (at most {MAX_TEXT}): {_show(text)}")
    out, pos, end = [], 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ShapeExprError(f"unexpected {text[pos:].lstrip()[:20]!r} in shape expression {_show(text)}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
        if len(out) > _MAX_TOKENS:
            raise ShapeExprError(f"shape expression of more than {_MAX_TOKENS} tokens: {_show(text)}")
    return out


def _show(text: str) -> str:
    """Text for an error message: quoted, and cut short."""
    return repr(text if len(text) <= 80 else text[:77] + "...")


class _Parser:
    def __init__(self, text: str):
        self.text, self.toks, self.i, self.depth = text, _tokens(text), 0, 0

    def fail(self, what: str) -> ShapeExprError:
        return ShapeExprError(f"{what} in shape expression {_show(self.text)}")

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, op: str) -> bool:
        if self.peek() == ("op", op):
            self.i += 1
            return True
        return False

    def expect(self, op: str) -> None:
        if not self.take(op):
            raise self.fail(f"expected {op!r}, found {self.peek()[1] or 'the end'!r}")

    def nested(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self.fail(f"nesting deeper than {_MAX_DEPTH}")

    def parse(self) -> Node:
        if not self.toks:
            raise ShapeExprError("empty shape expression")
        node = self.expr()
        if self.i != len(self.toks):
            raise self.fail(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.toks[self.i][1]
            self.i += 1
            node = (op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in ("*", "/", "//", "%"):
            op = self.toks[self.i][1]
            self.i += 1
            node = (op, node, self.unary())
        return node

    def unary(self) -> Node:
        if self.take("-"):
            self.nested()
            node: Node = ("neg", self.unary())
            self.depth -= 1
            return node
        return self.power()

    def power(self) -> Node:
        base = self.atom()
        if self.take("**"):
            kind, text = self.peek()
            if kind != "int" or int(text) > _MAX_POWER:
                raise self.fail(f"'**' takes an integer exponent of at most {_MAX_POWER}")
            self.i += 1
            return ("**", base, int(text))
        return base

    def atom(self) -> Node:
        kind, text = self.peek()
        self.i += 1
        if kind == "int":
            if len(text) > _MAX_DIGITS:
                raise self.fail(f"integer literal of more than {_MAX_DIGITS} digits")
            return int(text)
        if kind == "quoted":
            if not text:
                raise self.fail("empty quoted name")
            return ("sym", text)
        if kind == "name":
            if self.peek() == ("op", "("):
                if text not in _FUNCS:
                    raise self.fail(f"unknown function {text!r} (known: floor, ceil, min, max, mod)")
                self.i += 1
                self.nested()
                args = [self.expr()]
                while self.take(","):
                    args.append(self.expr())
                self.expect(")")
                self.depth -= 1
                func = _FUNCS[text]
                if func in ("floor", "ceiling") and len(args) != 1 or func == "mod" and len(args) != 2:
                    raise self.fail(f"{text}() takes {1 if func != 'mod' else 2} argument(s), got {len(args)}")
                return (func, *args)
            return ("sym", text)
        if (kind, text) == ("op", "("):
            self.nested()
            node = self.expr()
            self.expect(")")
            self.depth -= 1
            return node
        raise self.fail(f"unexpected {text or 'end'!r}")


@functools.lru_cache(maxsize=8192)
def _tree(text: str) -> Node:
    return _Parser(text).parse()


# What each operator and function means, applied to either kind of value a tree is folded into: sympy
# expressions (``parse``) or exact fractions (``evaluate``). Both types give // and % their floor meaning.
_OPERATORS: dict[str, Callable[..., Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
    "%": operator.mod, "mod": operator.mod, "neg": operator.neg}
_SYMPY_FUNCS: dict[str, Callable[..., Any]] = {
    "floor": sympy.floor, "ceiling": sympy.ceiling, "min": sympy.Min, "max": sympy.Max}
_EXACT_FUNCS: dict[str, Callable[..., Any]] = {
    "floor": lambda v: Fraction(math.floor(v)), "ceiling": lambda v: Fraction(math.ceil(v)), "min": min, "max": max}


def _fold(node: Node, number: Callable[[int], Any], name: Callable[[str], Any],
          funcs: Mapping[str, Callable[..., Any]]) -> Any:
    """The value of a tree: literals through ``number``, names through ``name``, the rest by meaning."""
    if isinstance(node, int):
        return number(node)
    op, *args = node
    if op == "sym":
        return name(args[0])
    if op == "**":
        return _fold(args[0], number, name, funcs) ** args[1]
    values = [_fold(a, number, name, funcs) for a in args]
    return (_OPERATORS.get(op) or funcs[op])(*values)


def parse(text: str, aliases: Mapping[str, str] | None = None) -> sympy.Expr:
    """The sympy expression of ``text``; ``aliases`` renames names (e.g. safe stand-ins back to dim names)."""
    aliases = aliases or {}
    try:
        return _fold(_tree(text), sympy.Integer, lambda n: symbol(aliases.get(n, n)), _SYMPY_FUNCS)
    except ZeroDivisionError:
        raise ShapeExprError(f"division by zero in shape expression {_show(text)}") from None


class _Printer(StrPrinter):
    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        name = expr.name
        if is_plain_name(name):
            return name
        if "`" in name or not name:
            raise ShapeExprError(f"dim name {name!r} cannot be written in a shape expression")
        return f"`{name}`"

    def _print_Max(self, expr: sympy.Expr) -> str:
        return "max(" + ", ".join(self._print(a) for a in expr.args) + ")"

    def _print_Min(self, expr: sympy.Expr) -> str:
        return "min(" + ", ".join(self._print(a) for a in expr.args) + ")"

    def _print_Mod(self, expr: sympy.Expr) -> str:
        return f"mod({self._print(expr.args[0])}, {self._print(expr.args[1])})"


_PRINTER = _Printer()


def to_text(expr: sympy.Expr) -> str:
    """Canonical text of an expression, which ``parse`` reads back to the same expression."""
    return _PRINTER.doprint(expr)


def product(dims: Iterable[int | str], aliases: Mapping[str, str] | None = None) -> str:
    """The product of dims (ints or expression texts) as canonical text, e.g. ``["batch", "seq"]`` ->
    ``batch*seq``."""
    out: sympy.Expr = sympy.Integer(1)
    for d in dims:
        out *= sympy.Integer(d) if isinstance(d, int) else parse(d, aliases)
    return to_text(out)


def free_names(text: str) -> set[str]:
    """The dim names an expression text uses."""
    return _names(_tree(text))


def _names(node: Node) -> set[str]:
    if isinstance(node, int):
        return set()
    if node[0] == "sym":
        return {node[1]}
    out: set[str] = set()
    for a in node[1:]:
        out |= _names(a)
    return out


def evaluate(text: str, values: Mapping[str, int]) -> int:
    """The integer value of an expression text at ``values`` (exact: integer and fraction arithmetic)."""
    def value(name: str) -> Fraction:
        if name not in values:
            raise ShapeExprError(f"shape expression {_show(text)} needs a value for {name!r}")
        return Fraction(int(values[name]))

    try:
        result = _fold(_tree(text), Fraction, value, _EXACT_FUNCS)
    except ZeroDivisionError:
        raise ShapeExprError(f"division by zero in shape expression {_show(text)} at {dict(values)}") from None
    if result.denominator != 1:
        raise ShapeExprError(f"shape expression {_show(text)} is not an integer at {dict(values)} ({result})")
    return int(result)
