"""Workloads: what the scanner hands the rest of the tuner.

A *workload* is one MatMul/Gemm/Conv computation of a model with symbolic dims, in its GEMM view
(M, N, K as expressions of the model's symbols, in ``tuner.shape_expr``'s grammar), grouped over the
nodes that share it. An *instance* is one assignment of the symbols (with a weight);
``Workload.problem(instance)`` turns it into the concrete GEMM problem the kernels, measurers and cost
model work on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tuner.shape_expr import evaluate

__all__ = ["OPS", "DTYPES", "ACTIVATIONS", "ConvParams", "Epilogue", "Problem", "Instance", "Workload"]

OPS = ("gemm", "bmm", "conv")
DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "relu6")  # dietcode_ort.bundle.ACTIVATION_CODES


@dataclass(frozen=True)
class ConvParams:
    """NCHW Conv2d attributes and the constant channel counts: ``in_channels`` is X's (all groups), the weight
    is [out_channels, in_channels / groups, *kernel]. A grouped conv (``groups`` > 1, depthwise when groups ==
    in_channels) is ``groups`` GEMMs of n = out_channels / groups, k = in_channels / groups * KH * KW: its
    workload's batch.

    ``channels_last``: the layer computed on NHWC tensors (X [N, H, W, C], W [OC, KH, KW, C], Y [N, OH, OW, OC]),
    the conv template's CHANNELS_LAST form, which loads X in 16-byte vectors where NCHW gathers it element by
    element; ungrouped only. ``optimize`` picks the layout per chain of convs (tuner/layout.py)."""

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right (ONNX order)
    dilations: tuple[int, int] = (1, 1)
    groups: int = 1
    channels_last: bool = False

    def geometry(self) -> tuple[int, ...]:
        """What a compiled conv kernel records of the layer, in ``dietcode_ort.bundle.CONV_FIELDS``' order:
        X's channels, the window, strides, top/left pads and dilations (the group is the launch's, not the
        kernel's)."""
        return (self.in_channels, *self.kernel, *self.strides, self.pads[0], self.pads[1], *self.dilations)


@dataclass(frozen=True)
class Epilogue:
    """What the kernel fuses after the product, applied in this order:
    ``out = act(alpha * acc + bias) + residual``, or with ``residual_first``
    ``out = act(alpha * acc + bias + residual)``, or with ``residual_mul``
    ``out = act(alpha * acc + bias) * residual``.

    ``alpha`` is a model constant (a scalar Mul/Div right after the MatMul, e.g. attention scores /
    sqrt(head_dim)), baked into the compiled kernel; ``residual`` adds a second tensor of the output's shape
    (the skip connection before a LayerNorm), after the activation, or before it with ``residual_first``
    (ResNet's Conv -> Add(shortcut) -> Relu). ``residual_first`` is set only with a residual and an activation
    (without an activation both orders are one computation, written as the default). ``residual_mul``
    multiplies by the residual instead of adding it (LLaMA's SwiGLU gate, silu(x @ Wg) * (x @ Wu): the
    up-projection's output is the residual); it is set only with a residual and an activation, never with ``residual_first``."""

    bias: bool = False
    activation: str = "none"
    alpha: float = 1.0
    residual: bool = False
    residual_first: bool = False
    residual_mul: bool = False


@dataclass(frozen=True, order=True)
class Problem:
    """A concrete GEMM problem: ``batch`` independent [m, k] x [k, n] products (batch=1 for gemm).

    For conv, m = N*OH*OW, n = out channels, k = in channels*KH*KW and ``image`` is (N, H, W).
    """

    m: int
    n: int
    k: int
    batch: int = 1
    image: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Instance:
    """One assignment of the workload's symbols, with a weight (how often it occurs)."""

    values: tuple[tuple[str, int], ...]
    weight: float = 1.0

    @classmethod
    def of(cls, values: Mapping[str, int], weight: float = 1.0) -> "Instance":
        return cls(tuple(sorted((str(k), int(v)) for k, v in values.items())), float(weight))

    def as_dict(self) -> dict[str, int]:
        return dict(self.values)


@dataclass(frozen=True)
class Workload:
    """A MatMul/Gemm/Conv computation with symbolic dims, shared by ``nodes``.

    ``m``, ``n``, ``k`` (and ``batch`` for bmm; for conv also ``height``/``width``) are expressions over
    ``symbols``. ``const_operands`` lists the input indices that are constant initializers.
    """

    op: str  # one of OPS
    onnx_op: str  # "MatMul" | "Gemm" | "Conv"
    nodes: tuple[str, ...]  # per node: its first output's name (unique in a graph, unlike node names)
    m: str
    n: str
    k: str
    dtype: str
    symbols: tuple[str, ...]
    batch: str = "1"
    const_operands: tuple[int, ...] = ()
    trans_a: bool = False
    trans_b: bool = False
    epilogue: Epilogue = Epilogue()
    fused_nodes: tuple[tuple[str, ...], ...] = ()  # per node: the first outputs of the nodes it absorbs
    conv: ConvParams | None = None
    conv_input: tuple[str, str, str] | None = None  # (N, H, W) expressions of the conv input
    ranks: tuple[tuple[int, int], ...] = ()  # per node: the ranks of its first two inputs
    instances: tuple[Instance, ...] = field(default=())

    def problem(self, instance: Instance) -> Problem:
        values = instance.as_dict()
        image = None
        if self.conv_input is not None:
            image = tuple(evaluate(e, values) for e in self.conv_input)  # type: ignore[assignment]
        return Problem(m=evaluate(self.m, values), n=evaluate(self.n, values), k=evaluate(self.k, values),
                       batch=evaluate(self.batch, values), image=image)  # type: ignore[arg-type]

    def problems(self) -> list[tuple[Problem, float]]:
        return [(self.problem(i), i.weight) for i in self.instances]
