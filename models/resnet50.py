"""ResNet-50 (v1.5: the stride sits on the 3x3 conv) with symbolic ``batch``, ``height`` and ``width``.

Batch norm is folded into each Conv's weights and bias, as exporters emit an eval-mode model. Convs get
He-like weights; the last conv of each residual branch is scaled down (what a small folded BN gamma
does) so activations stay well inside float16 range through all the residual Adds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from models.graph import GraphBuilder, classifier_model, image_feeds

__all__ = ["ResNetConfig", "PRESETS", "build_graph", "make_feeds"]

EXPANSION = 4
BIAS_STD = 0.01
BRANCH_OUT_SCALE = 0.2
CLASSIFIER_STD = 0.01


@dataclass(frozen=True)
class ResNetConfig:
    """Bottleneck blocks per stage, the first stage's width (doubling per stage), and the classes."""

    stages: tuple[int, ...]
    base_width: int
    classes: int


PRESETS: dict[str, ResNetConfig] = {
    "full": ResNetConfig(stages=(3, 4, 6, 3), base_width=64, classes=1000),
    "tiny": ResNetConfig(stages=(1, 1, 1, 1), base_width=8, classes=10),
}


def _conv(g: GraphBuilder, x: str, c_in: int, c_out: int, k: int, stride: int, name: str,
          relu: bool, gain: float = 1.0) -> str:
    """Conv (BN folded in: weight + bias) with 'same' padding for odd k, then Relu if asked."""
    w = g.normal(f"{name}.weight", (c_out, c_in, k, k), gain * math.sqrt(2.0 / (c_in * k * k)))
    b = g.normal(f"{name}.bias", (c_out,), BIAS_STD)
    scope = "/" + name.replace(".", "/")
    pad = k // 2
    y = g.op("Conv", [x, w, b], f"{scope}/Conv", kernel_shape=[k, k], strides=[stride, stride],
             pads=[pad, pad, pad, pad], dilations=[1, 1], group=1)
    return g.op("Relu", [y], f"{scope}/Relu") if relu else y


def _bottleneck(g: GraphBuilder, x: str, c_in: int, width: int, stride: int, name: str) -> str:
    """1x1 -> 3x3 (stride) -> 1x1 (x4), plus the identity or a projection shortcut, then Relu."""
    c_out = width * EXPANSION
    y = _conv(g, x, c_in, width, 1, 1, f"{name}.conv1", relu=True)
    y = _conv(g, y, width, width, 3, stride, f"{name}.conv2", relu=True)
    y = _conv(g, y, width, c_out, 1, 1, f"{name}.conv3", relu=False, gain=BRANCH_OUT_SCALE)
    short = x
    if stride != 1 or c_in != c_out:
        short = _conv(g, x, c_in, c_out, 1, stride, f"{name}.downsample", relu=False)
    scope = "/" + name.replace(".", "/")
    y = g.op("Add", [y, short], f"{scope}/Add")
    return g.op("Relu", [y], f"{scope}/Relu")


def build_graph(cfg: ResNetConfig, dtype: str, seed: int) -> onnx.ModelProto:
    """ResNet: ``image`` [batch, 3, height, width] -> ``logits`` [batch, classes]."""
    g = GraphBuilder(dtype, seed)
    x = _conv(g, "image", 3, cfg.base_width, 7, 2, "conv1", relu=True)
    x = g.op("MaxPool", [x], "/maxpool/MaxPool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = cfg.base_width
    for s, blocks in enumerate(cfg.stages):
        width = cfg.base_width * 2**s
        for blk in range(blocks):
            stride = 2 if s > 0 and blk == 0 else 1
            x = _bottleneck(g, x, c_in, width, stride, f"layer{s + 1}.{blk}")
            c_in = width * EXPANSION
    return classifier_model(g, x, c_in, cfg.classes, "fc", CLASSIFIER_STD, BIAS_STD, "resnet50")


make_feeds = image_feeds
