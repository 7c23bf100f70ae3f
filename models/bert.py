"""A BERT-style encoder, laid out as transformer exporters emit it, with symbolic ``batch`` and ``seq``.

The point of the layout is realism for the scanner: dense MatMuls on 3-D activations followed by a
bias Add, heads split by Shape -> Gather -> Unsqueeze -> Concat -> Reshape chains (which onnx's own
shape inference cannot see through), batched attention MatMuls, the (1 - mask) * -10000 additive mask,
and Gelu in its Erf form (opset 17 has no Gelu op).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
from onnx import TensorProto

from models.graph import GraphBuilder, tensor_input

__all__ = ["BertConfig", "PRESETS", "build_graph", "make_feeds"]

LINEAR_STD = 0.02
LN_EPS = 1e-12
MASK_VALUE = -10000.0  # finite in float16 (max 65504), unlike the dtype minimum some exporters use


@dataclass(frozen=True)
class BertConfig:
    """Encoder sizes; ``hidden`` must be a multiple of ``heads``."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head (the K of the QK^T MatMul)."""
        return self.hidden // self.heads


PRESETS: dict[str, BertConfig] = {
    "tiny": BertConfig(layers=2, hidden=128, heads=2, ffn=512, vocab=1000, max_positions=512),
    "base": BertConfig(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, max_positions=512),
}


class _Encoder:
    """Emits the encoder into a GraphBuilder; one method per exporter pattern."""

    def __init__(self, g: GraphBuilder, cfg: BertConfig) -> None:
        self.g = g
        self.cfg = cfg
        self.axis0 = g.ints("const_0", 0)
        self.axis1 = g.ints("const_1", 1)
        self.axes0 = g.ints("const_axes_0", [0])
        self.heads = g.ints("const_heads", [cfg.heads])
        self.head_dim = g.ints("const_head_dim", [cfg.head_dim])
        self.hidden = g.ints("const_hidden", [cfg.hidden])
        self.one = g.scalar("const_one", 1.0)
        self.half = g.scalar("const_half", 0.5)
        self.sqrt2 = g.scalar("const_sqrt2", math.sqrt(2.0))
        self.scale = g.scalar("const_attn_scale", math.sqrt(cfg.head_dim))

    def dim(self, x: str, index: str, scope: str) -> str:
        """Shape -> Gather -> Unsqueeze: one dim of ``x`` as a 1-element int64 tensor."""
        g = self.g
        shape = g.op("Shape", [x], f"{scope}/Shape")
        d = g.op("Gather", [shape, index], f"{scope}/Gather", axis=0)
        return g.op("Unsqueeze", [d, self.axes0], f"{scope}/Unsqueeze")

    def reshape(self, x: str, tail: list[str], scope: str) -> str:
        """Reshape ``x`` to [batch, seq, *tail], with batch and seq read from ``x`` at run time."""
        g = self.g
        b = self.dim(x, self.axis0, f"{scope}/batch")
        s = self.dim(x, self.axis1, f"{scope}/seq")
        shape = g.op("Concat", [b, s, *tail], f"{scope}/Concat", axis=0)
        return g.op("Reshape", [x, shape], f"{scope}/Reshape")

    def linear(self, x: str, n_in: int, n_out: int, param: str, scope: str) -> str:
        """MatMul on [batch, seq, n_in] x [n_in, n_out] followed by Add(bias)."""
        g = self.g
        w = g.normal(f"{param}.weight", (n_in, n_out), LINEAR_STD)
        b = g.normal(f"{param}.bias", (n_out,), LINEAR_STD)
        y = g.op("MatMul", [x, w], f"{scope}/MatMul")
        return g.op("Add", [b, y], f"{scope}/Add")

    def layer_norm(self, x: str, param: str, scope: str, output: str | None = None) -> str:
        g = self.g
        scale = g.fill(f"{param}.weight", (self.cfg.hidden,), 1.0)
        bias = g.fill(f"{param}.bias", (self.cfg.hidden,), 0.0)
        return g.op("LayerNormalization", [x, scale, bias], f"{scope}/LayerNormalization",
                    output=output, axis=-1, epsilon=LN_EPS)

    def embeddings(self) -> str:
        g, cfg = self.g, self.cfg
        words = g.normal("embeddings.word_embeddings.weight", (cfg.vocab, cfg.hidden), LINEAR_STD)
        table = g.normal("embeddings.position_embeddings.weight", (cfg.max_positions, cfg.hidden), LINEAR_STD)
        w = g.op("Gather", [words, "input_ids"], "/embeddings/word_embeddings/Gather", axis=0)
        shape = g.op("Shape", ["input_ids"], "/embeddings/Shape")
        seq = g.op("Gather", [shape, self.axis1], "/embeddings/Gather", axis=0)
        pos = g.op("Range", [self.axis0, seq, self.axis1], "/embeddings/Range")
        pos = g.op("Unsqueeze", [pos, self.axes0], "/embeddings/Unsqueeze")
        p = g.op("Gather", [table, pos], "/embeddings/position_embeddings/Gather", axis=0)
        x = g.op("Add", [w, p], "/embeddings/Add")
        return self.layer_norm(x, "embeddings.LayerNorm", "/embeddings/LayerNorm")

    def extended_mask(self) -> str:
        """[batch, seq] int64 mask -> [batch, 1, 1, seq] additive mask (0 keep, -10000 drop)."""
        g = self.g
        m = g.op("Unsqueeze", ["attention_mask", g.ints("const_axes_1_2", [1, 2])], "/mask/Unsqueeze")
        m = g.op("Cast", [m], "/mask/Cast", to=g.elem_type)
        m = g.op("Sub", [self.one, m], "/mask/Sub")
        return g.op("Mul", [m, g.scalar("const_mask_value", MASK_VALUE)], "/mask/Mul")

    def attention(self, x: str, mask: str, i: int) -> str:
        g, cfg = self.g, self.cfg
        scope, param = f"/encoder/layer.{i}/attention", f"encoder.layer.{i}.attention"
        heads = [self.heads, self.head_dim]
        split = {}
        for name, perm in (("query", [0, 2, 1, 3]), ("key", [0, 2, 3, 1]), ("value", [0, 2, 1, 3])):
            y = self.linear(x, cfg.hidden, cfg.hidden, f"{param}.self.{name}", f"{scope}/self/{name}")
            y = self.reshape(y, heads, f"{scope}/self/{name}")
            split[name] = g.op("Transpose", [y], f"{scope}/self/{name}/Transpose", perm=perm)
        scores = g.op("MatMul", [split["query"], split["key"]], f"{scope}/self/MatMul")
        scores = g.op("Div", [scores, self.scale], f"{scope}/self/Div")
        scores = g.op("Add", [scores, mask], f"{scope}/self/Add")
        probs = g.op("Softmax", [scores], f"{scope}/self/Softmax", axis=-1)
        ctx = g.op("MatMul", [probs, split["value"]], f"{scope}/self/MatMul_1")
        ctx = g.op("Transpose", [ctx], f"{scope}/self/Transpose", perm=[0, 2, 1, 3])
        ctx = self.reshape(ctx, [self.hidden], f"{scope}/self/merge")
        out = self.linear(ctx, cfg.hidden, cfg.hidden, f"{param}.output.dense", f"{scope}/output/dense")
        out = g.op("Add", [out, x], f"{scope}/output/Add")
        return self.layer_norm(out, f"{param}.output.LayerNorm", f"{scope}/output/LayerNorm")

    def feed_forward(self, x: str, i: int, output: str | None) -> str:
        g, cfg = self.g, self.cfg
        scope, param = f"/encoder/layer.{i}", f"encoder.layer.{i}"
        h = self.linear(x, cfg.hidden, cfg.ffn, f"{param}.intermediate.dense", f"{scope}/intermediate/dense")
        act = f"{scope}/intermediate/intermediate_act_fn"
        e = g.op("Div", [h, self.sqrt2], f"{act}/Div")
        e = g.op("Erf", [e], f"{act}/Erf")
        e = g.op("Add", [e, self.one], f"{act}/Add")
        e = g.op("Mul", [h, e], f"{act}/Mul")
        h = g.op("Mul", [e, self.half], f"{act}/Mul_1")
        y = self.linear(h, cfg.ffn, cfg.hidden, f"{param}.output.dense", f"{scope}/output/dense")
        y = g.op("Add", [y, x], f"{scope}/output/Add")
        return self.layer_norm(y, f"{param}.output.LayerNorm", f"{scope}/output/LayerNorm", output=output)


def build_graph(cfg: BertConfig, dtype: str, seed: int) -> onnx.ModelProto:
    """The encoder: inputs input_ids, attention_mask [batch, seq] int64 -> last_hidden_state."""
    g = GraphBuilder(dtype, seed)
    enc = _Encoder(g, cfg)
    x = enc.embeddings()
    mask = enc.extended_mask()
    for i in range(cfg.layers):
        x = enc.attention(x, mask, i)
        x = enc.feed_forward(x, i, output="last_hidden_state" if i == cfg.layers - 1 else None)
    return g.model("bert_encoder",
                   [tensor_input("input_ids", TensorProto.INT64, ["batch", "seq"]),
                    tensor_input("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                   [tensor_input("last_hidden_state", g.elem_type, ["batch", "seq", cfg.hidden])])


def make_feeds(cfg: BertConfig, dims: Mapping[str, int], dtype: str,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random token ids, and a mask that drops the tail of every row but the first (padding)."""
    batch, seq = dims["batch"], dims["seq"]
    ids = rng.integers(0, cfg.vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(1, batch):
        mask[row, max(1, seq - row):] = 0
    return {"input_ids": ids, "attention_mask": mask}
