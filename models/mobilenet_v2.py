"""MobileNetV2 (torchvision's layer structure) with symbolic ``batch``, ``height`` and ``width``.

Inverted residual blocks: a 1x1 expansion (ReLU6), a 3x3 depthwise conv (group = channels, the stride, ReLU6),
a 1x1 linear projection, and the identity added where the block keeps its size. Batch norm is folded into each
Conv's weights and bias, as exporters emit an eval-mode model; ReLU6 is ``Clip(x, 0, 6)`` with its bounds as
inputs (opset 11 on, TorchScript's export). Convs get He-like weights (a depthwise conv's fan-in is its 3x3
window); each projection is scaled down (what a small folded BN gamma does) so activations stay well inside
float16 range through the residual Adds. The benchmark model for grouped (depthwise) convs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from models.graph import GraphBuilder, classifier_model, image_feeds

__all__ = ["MobileNetConfig", "PRESETS", "SETTINGS", "build_graph", "make_feeds"]

# (expansion t, output channels c, blocks n, first block's stride s), torchvision's inverted_residual_setting
SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
BIAS_STD = 0.01
PROJECTION_SCALE = 0.5
CLASSIFIER_STD = 0.01


@dataclass(frozen=True)
class MobileNetConfig:
    """The width multiplier (channels rounded to multiples of 8), blocks per stage (None: torchvision's), the
    last conv's channels before the multiplier, and the classes."""

    width: float
    classes: int
    blocks: tuple[int, ...] | None = None
    last_channels: int = 1280


PRESETS: dict[str, MobileNetConfig] = {
    "full": MobileNetConfig(width=1.0, classes=1000),
    "tiny": MobileNetConfig(width=0.25, classes=10, blocks=(1, 1, 1, 1, 1, 1, 1), last_channels=64),
}


def _divisible(v: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: v rounded to the nearest multiple of divisor, not below 90% of v."""
    out = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * v else out


def _conv(g: GraphBuilder, x: str, c_in: int, c_out: int, k: int, stride: int, name: str, relu6: bool,
          group: int = 1, gain: float = 1.0) -> str:
    """Conv (BN folded in: weight + bias) with 'same' padding for odd k, then ReLU6 if asked."""
    fan_in = c_in // group * k * k
    w = g.normal(f"{name}.weight", (c_out, c_in // group, k, k), gain * math.sqrt(2.0 / fan_in))
    b = g.normal(f"{name}.bias", (c_out,), BIAS_STD)
    scope = "/" + name.replace(".", "/")
    pad = k // 2
    y = g.op("Conv", [x, w, b], f"{scope}/Conv", kernel_shape=[k, k], strides=[stride, stride],
             pads=[pad, pad, pad, pad], dilations=[1, 1], group=group)
    return g.op("Clip", [y, "relu6_min", "relu6_max"], f"{scope}/Clip") if relu6 else y


def _inverted_residual(g: GraphBuilder, x: str, c_in: int, c_out: int, stride: int, expand: int, name: str) -> str:
    hidden = c_in * expand
    y = x
    if expand != 1:
        y = _conv(g, y, c_in, hidden, 1, 1, f"{name}.expand", relu6=True)
    y = _conv(g, y, hidden, hidden, 3, stride, f"{name}.depthwise", relu6=True, group=hidden)
    y = _conv(g, y, hidden, c_out, 1, 1, f"{name}.project", relu6=False, gain=PROJECTION_SCALE)
    if stride == 1 and c_in == c_out:
        y = g.op("Add", [x, y], "/" + name.replace(".", "/") + "/Add")
    return y


def build_graph(cfg: MobileNetConfig, dtype: str, seed: int) -> onnx.ModelProto:
    """MobileNetV2: ``image`` [batch, 3, height, width] -> ``logits`` [batch, classes]."""
    g = GraphBuilder(dtype, seed)
    g.scalar("relu6_min", 0.0)
    g.scalar("relu6_max", 6.0)
    c_in = _divisible(32 * cfg.width)
    x = _conv(g, "image", 3, c_in, 3, 2, "features.0", relu6=True)
    index = 1
    for s, (t, c, n, stride) in enumerate(SETTINGS):
        c_out = _divisible(c * cfg.width)
        for blk in range(cfg.blocks[s] if cfg.blocks is not None else n):
            x = _inverted_residual(g, x, c_in, c_out, stride if blk == 0 else 1, t, f"features.{index}")
            c_in, index = c_out, index + 1
    last = _divisible(cfg.last_channels * max(1.0, cfg.width))
    x = _conv(g, x, c_in, last, 1, 1, f"features.{index}", relu6=True)
    return classifier_model(g, x, last, cfg.classes, "classifier", CLASSIFIER_STD, BIAS_STD, "mobilenet_v2")


make_feeds = image_feeds
