"""Builders of the benchmark models (seeded weights, symbolic dims).

``MODELS`` is the explicit list of models; each entry holds its presets and builds an
``onnx.ModelProto`` (opset 17, IR version 10) from a preset, a dtype and a seed::

    model = models.build("bert", "tiny", dtype="float16", seed=0)
    feeds = models.MODELS["bert"].example_inputs("tiny", {"batch": 2, "seq": 7})

``python -m models --list`` prints the models and presets; ``python -m models NAME --preset P -o FILE``
writes one (see ``models/__main__.py``).
"""
from __future__ import annotations

import onnx

from dietcode_ort.errors import DietcodeError
from models import bert, mlp, mobilenet_v2, resnet50
from models.graph import DTYPES, ModelBuilder, save_model

__all__ = ["MODELS", "DTYPES", "ModelBuilder", "build", "get", "presets", "save_model"]

MODELS: dict[str, ModelBuilder] = {
    "bert": ModelBuilder(
        name="bert", summary="BERT-style encoder (exporter layout), input_ids/attention_mask [batch, seq]",
        symbols=("batch", "seq"), presets=bert.PRESETS, graph=bert.build_graph, feeds=bert.make_feeds),
    "resnet50": ModelBuilder(
        name="resnet50", summary="ResNet-50 v1.5, BN folded, image [batch, 3, height, width]",
        symbols=("batch", "height", "width"), presets=resnet50.PRESETS, graph=resnet50.build_graph,
        feeds=resnet50.make_feeds),
    "mlp": ModelBuilder(
        name="mlp", summary="decoder gated MLP (SiLU as Sigmoid*x), hidden [tokens, d_model]",
        symbols=("tokens",), presets=mlp.PRESETS, graph=mlp.build_graph, feeds=mlp.make_feeds),
    "mobilenet_v2": ModelBuilder(
        name="mobilenet_v2", summary="MobileNetV2, depthwise convs, BN folded, image [batch, 3, height, width]",
        symbols=("batch", "height", "width"), presets=mobilenet_v2.PRESETS, graph=mobilenet_v2.build_graph,
        feeds=mobilenet_v2.make_feeds),
}


def get(name: str) -> ModelBuilder:
    """The builder of model ``name``; a DietcodeError names the known models otherwise."""
    if name not in MODELS:
        raise DietcodeError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    return MODELS[name]


def presets(name: str) -> tuple[str, ...]:
    """The preset names of model ``name``."""
    return tuple(get(name).presets)


def build(name: str, preset: str, dtype: str = "float32", seed: int = 0) -> onnx.ModelProto:
    """Build model ``name`` at ``preset``: same arguments, same weights (bit for bit)."""
    return get(name)(preset, dtype, seed)
