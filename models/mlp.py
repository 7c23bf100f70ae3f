"""A decoder-style gated MLP (the FFN of a LLaMA layer) over a symbolic number of tokens.

``down(silu(x @ Wg) * (x @ Wu))`` with SiLU as Sigmoid + Mul, the form exporters emit. Its three
MatMuls are the [tokens, d] x [d, f] shapes that dominate decoder inference at every sequence length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx

from models.graph import GraphBuilder, tensor_input

__all__ = ["MlpConfig", "PRESETS", "build_graph", "make_feeds"]


@dataclass(frozen=True)
class MlpConfig:
    """Model width and the gated FFN's inner width."""

    d_model: int
    ffn: int


PRESETS: dict[str, MlpConfig] = {
    "tiny": MlpConfig(d_model=64, ffn=176),
    "llama-7b-layer": MlpConfig(d_model=4096, ffn=11008),
}


def build_graph(cfg: MlpConfig, dtype: str, seed: int) -> onnx.ModelProto:
    """The gated MLP: input ``hidden`` [tokens, d_model] -> output ``output`` [tokens, d_model]."""
    g = GraphBuilder(dtype, seed)
    # std 1/sqrt(fan_in) keeps every product O(1) at any width (0.016 at 4096, close to the usual 0.02),
    # so the tiny preset's outputs are not so small that float16 comparisons pass trivially.
    wg = g.normal("mlp.gate_proj.weight", (cfg.d_model, cfg.ffn), cfg.d_model**-0.5)
    wu = g.normal("mlp.up_proj.weight", (cfg.d_model, cfg.ffn), cfg.d_model**-0.5)
    wd = g.normal("mlp.down_proj.weight", (cfg.ffn, cfg.d_model), cfg.ffn**-0.5)
    gate = g.op("MatMul", ["hidden", wg], "/mlp/gate_proj/MatMul")
    up = g.op("MatMul", ["hidden", wu], "/mlp/up_proj/MatMul")
    sig = g.op("Sigmoid", [gate], "/mlp/act_fn/Sigmoid")
    silu = g.op("Mul", [gate, sig], "/mlp/act_fn/Mul")
    prod = g.op("Mul", [silu, up], "/mlp/Mul")
    g.op("MatMul", [prod, wd], "/mlp/down_proj/MatMul", output="output")
    return g.model("gated_mlp",
                   [tensor_input("hidden", g.elem_type, ["tokens", cfg.d_model])],
                   [tensor_input("output", g.elem_type, ["tokens", cfg.d_model])])


def make_feeds(cfg: MlpConfig, dims: Mapping[str, int], dtype: str,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Standard-normal ``hidden`` of ``dims['tokens']`` rows."""
    hidden = rng.standard_normal((dims["tokens"], cfg.d_model), dtype=np.float32)
    return {"hidden": hidden.astype(dtype)}
