"""The benchmark models as PyTorch modules, with the weights of a built ONNX model (for torch.compile).

The ONNX builders (models/bert.py, resnet50.py, mlp.py) emit graphs directly, so the PyTorch side is a
second implementation of the same function. To make the two provably the same model, a module's
``state_dict`` keys are exactly the ONNX model's weight initializer names (the ``const_*`` scalars and
shape pieces aside), in the ONNX layout (MatMul weights are [in, out]), and :func:`from_onnx` loads every
one of them with a strict check: a missing, extra or differently shaped weight is a DietcodeError. The
modules take the ONNX inputs as keyword arguments of the same names and return the single output.

    onnx_model, module = build_pair("bert", "tiny", dtype="float32", seed=0)
    out = module(input_ids=ids, attention_mask=mask)   # == onnxruntime's last_hidden_state

torch is imported by this module only; nothing else under models/ needs it.
"""
from __future__ import annotations

import math
from typing import Any

import onnx
import torch
from onnx import numpy_helper
from torch import nn
from torch.nn import functional as F

from dietcode_ort.errors import DietcodeError
from models import bert, mlp, resnet50
from models.graph import check_dtype

__all__ = ["TORCH_DTYPES", "BertTorch", "ResNetTorch", "MlpTorch", "module_for", "from_onnx", "build_pair"]

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_CONST_PREFIX = "const_"  # the builders' constants (scalars, axes, shape pieces): not weights


class _Dense(nn.Module):
    """``x @ weight + bias`` with the weight in the ONNX MatMul layout [in, out]."""

    def __init__(self, n_in: int, n_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y if self.bias is None else self.bias + y


class _Sub(nn.Module):
    """A named container, so that parameter paths read like the exporter's initializer names."""


class _BertLayer(nn.Module):
    def __init__(self, cfg: bert.BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        attn_self = _Sub()
        for name in ("query", "key", "value"):
            attn_self.add_module(name, _Dense(cfg.hidden, cfg.hidden))
        out = _Sub()
        out.add_module("dense", _Dense(cfg.hidden, cfg.hidden))
        out.add_module("LayerNorm", nn.LayerNorm(cfg.hidden, eps=bert.LN_EPS))
        self.attention = _Sub()
        self.attention.add_module("self", attn_self)
        self.attention.add_module("output", out)
        self.intermediate = _Sub()
        self.intermediate.add_module("dense", _Dense(cfg.hidden, cfg.ffn))
        self.output = _Sub()
        self.output.add_module("dense", _Dense(cfg.ffn, cfg.hidden))
        self.output.add_module("LayerNorm", nn.LayerNorm(cfg.hidden, eps=bert.LN_EPS))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        attn: Any = self.attention
        b, s = x.shape[0], x.shape[1]
        q, k, v = (getattr(attn.self, n)(x).reshape(b, s, cfg.heads, cfg.head_dim)
                   for n in ("query", "key", "value"))
        # softmax(q k^T / sqrt(d) + mask) v, the graph's MatMul -> Div -> Add -> Softmax -> MatMul chain,
        # through scaled_dot_product_attention as a PyTorch BERT runs it (transformers' default)
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=1.0 / math.sqrt(cfg.head_dim))
        ctx = ctx.transpose(1, 2).reshape(b, s, cfg.hidden)
        x = attn.output.LayerNorm(attn.output.dense(ctx) + x)
        inter: Any = self.intermediate
        h: torch.Tensor = inter.dense(x)
        h = h * (torch.erf(h / math.sqrt(2.0)) + 1.0) * 0.5  # Gelu in its Erf form, as the graph has it
        out: Any = self.output
        return out.LayerNorm(out.dense(h) + x)


class BertTorch(nn.Module):
    """models/bert.py's encoder: input_ids, attention_mask [batch, seq] int64 -> last_hidden_state."""

    def __init__(self, cfg: bert.BertConfig) -> None:
        super().__init__()
        self.embeddings = _Sub()
        self.embeddings.add_module("word_embeddings", nn.Embedding(cfg.vocab, cfg.hidden))
        self.embeddings.add_module("position_embeddings", nn.Embedding(cfg.max_positions, cfg.hidden))
        self.embeddings.add_module("LayerNorm", nn.LayerNorm(cfg.hidden, eps=bert.LN_EPS))
        self.encoder = _Sub()
        self.encoder.add_module("layer", nn.ModuleList(_BertLayer(cfg) for _ in range(cfg.layers)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        emb: Any = self.embeddings
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = emb.word_embeddings(input_ids) + emb.position_embeddings(positions).unsqueeze(0)
        x = emb.LayerNorm(x)
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * bert.MASK_VALUE
        for layer in self.encoder.layer:  # type: ignore[union-attr]
            x = layer(x, mask)
        return x


class _Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * resnet50.EXPANSION
        self.conv1 = nn.Conv2d(c_in, width, 1)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1)
        self.conv3 = nn.Conv2d(width, c_out, 1)
        self.downsample = nn.Conv2d(c_in, c_out, 1, stride=stride) if stride != 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNetTorch(nn.Module):
    """models/resnet50.py's ResNet (BN folded into the convs): image [batch, 3, h, w] -> logits."""

    def __init__(self, cfg: resnet50.ResNetConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, cfg.base_width, 7, stride=2, padding=3)
        c_in = cfg.base_width
        for s, blocks in enumerate(cfg.stages):
            width = cfg.base_width * 2**s
            stage = []
            for blk in range(blocks):
                stage.append(_Bottleneck(c_in, width, 2 if s > 0 and blk == 0 else 1))
                c_in = width * resnet50.EXPANSION
            self.add_module(f"layer{s + 1}", nn.Sequential(*stage))
        self.fc = nn.Linear(c_in, cfg.classes)
        self.stages = len(cfg.stages)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(image)), 3, 2, 1)
        for s in range(self.stages):
            x = getattr(self, f"layer{s + 1}")(x)
        return self.fc(torch.flatten(torch.mean(x, dim=(2, 3), keepdim=True), 1))


class MlpTorch(nn.Module):
    """models/mlp.py's gated MLP: hidden [tokens, d_model] -> output."""

    def __init__(self, cfg: mlp.MlpConfig) -> None:
        super().__init__()
        self.mlp = _Sub()
        for name, (n_in, n_out) in (("gate_proj", (cfg.d_model, cfg.ffn)), ("up_proj", (cfg.d_model, cfg.ffn)),
                                    ("down_proj", (cfg.ffn, cfg.d_model))):
            self.mlp.add_module(name, _Dense(n_in, n_out, bias=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        m: Any = self.mlp
        gate = m.gate_proj(hidden)
        return m.down_proj(gate * torch.sigmoid(gate) * m.up_proj(hidden))


def module_for(name: str, preset: str) -> nn.Module:
    """An uninitialised module of model ``name`` at ``preset`` (load its weights with :func:`from_onnx`)."""
    import models

    cfg = models.get(name).config(preset)
    if name == "bert":
        return BertTorch(cfg)
    if name == "resnet50":
        return ResNetTorch(cfg)
    if name == "mlp":
        return MlpTorch(cfg)
    raise DietcodeError(f"model {name!r} has no PyTorch implementation; allowed: bert, resnet50, mlp")


def _weights(model: onnx.ModelProto) -> dict[str, Any]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if not t.name.startswith(_CONST_PREFIX)}


def from_onnx(model: onnx.ModelProto, name: str, preset: str) -> nn.Module:
    """The PyTorch module of ``name``/``preset`` holding exactly the ONNX model's weights, in their dtype,
    in eval mode with gradients off. Every weight must match by name and shape (a DietcodeError names
    the first differences otherwise)."""
    module = module_for(name, preset)
    weights = _weights(model)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if tuple(expected[k].shape) != weights[k].shape)
    if missing or extra or wrong:
        detail = "; ".join(f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                           for what, keys in (("missing", missing), ("unexpected", extra),
                                              ("wrong shape", wrong)) if keys)
        raise DietcodeError(f"the ONNX model's weights are not those of {name} preset {preset!r} ({detail})")
    dtypes = {str(w.dtype) for w in weights.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in TORCH_DTYPES:
        raise DietcodeError(f"the ONNX model's weights have dtypes {sorted(dtypes)}; expected one of "
                            f"{', '.join(TORCH_DTYPES)}")
    module.to(TORCH_DTYPES[next(iter(dtypes))])
    module.load_state_dict({k: torch.from_numpy(w.copy()) for k, w in weights.items()}, strict=True)
    module.eval()
    module.requires_grad_(False)
    return module


def build_pair(name: str, preset: str, dtype: str = "float32", seed: int = 0) -> tuple[onnx.ModelProto, nn.Module]:
    """The ONNX model (``models.build``) and the PyTorch module with its weights."""
    import models

    model = models.build(name, preset, check_dtype(dtype), seed)
    return model, from_onnx(model, name, preset)
