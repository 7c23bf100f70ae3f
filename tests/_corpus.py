"""A corpus of ONNX models written by other projects' exporters, built at test time (random weights, no
downloads), and the table of cases ``tests/test_corpus.py`` runs.

The project's own builders (``models/``) write the graphs the tuner was written against; these are the
graphs users bring: Hugging Face transformers models from tiny configs through both torch.onnx exporters
(TorchScript and dynamo), two CNNs, a BERT after onnxruntime's transformer optimizer (com.microsoft fused
ops), and the ONNX package's own backend node tests for MatMul, Gemm and Conv.

One plain function per architecture builds a ``TorchModel`` (module, example inputs, which input axis
plays which role); ``export_torchscript`` / ``export_dynamo`` write it; ``CASES`` is the table. A case
names the dims by role (``batch``, ``sequence``, ``height``, ``width``); ``Built.symbols`` maps each role to
the symbol names the exporter actually wrote (dynamo names them ``s0``-style, TorchScript takes the names
given, here those of ``transformers.onnx``'s OnnxConfig: ``batch`` and ``sequence``).
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["TorchModel", "Built", "Case", "CASES", "CASES_BY_NAME", "MODEL_BUILDERS", "NODE_TESTS",
           "build_case", "export_torchscript", "export_dynamo", "ort_optimized_bert", "onnx_node_case",
           "make_dynamic", "role_dims", "feeds", "node_test_tuned", "gemm_view_nodes"]

VOCAB = 100
TINY_TEXT = dict(hidden=32, layers=2, heads=2, ffn=64, positions=64)


# --- the torch side: a module, example inputs, and which axis of which input is which role ---------------

@dataclass
class TorchModel:
    module: object  # torch.nn.Module
    inputs: tuple[str, ...]
    example: tuple  # torch tensors, in ``inputs`` order
    axes: dict[str, dict[int, str]]  # input name -> axis -> role
    output: str
    output_axes: dict[int, str]
    kinds: dict[str, str]  # input name -> "ids" | "mask" | "float"


def _wrap(model, names: tuple[str, ...], key: str):
    """One calling convention for both exporters: positional tensors in, one tensor out (HF models take
    keyword arguments and return output records; ``key`` picks the output, "" for a plain module)."""
    import torch

    class Positional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            if not key:
                return self.model(*args)
            return self.model(**dict(zip(names, args)))[key]

    return Positional().eval()


def _randomize(module, seed: int = 0) -> None:
    """Seeded random weights everywhere: from_config leaves biases at zero and norm scales at one, which
    would hide a dropped bias, and identical zero tensors that the TorchScript exporter de-duplicates."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("weight") and p.dim() == 1 else 0.0  # norm scales around one
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + base)
        for m in module.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


def _text(model, dtype: str, seq_example: int = 8) -> TorchModel:
    import torch

    _randomize(model)
    if dtype == "float16":
        model = model.half()
    names = ("input_ids", "attention_mask")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq_example), generator=g)
    mask = torch.ones(2, seq_example, dtype=torch.int64)
    roles = {0: "batch", 1: "sequence"}
    return TorchModel(_wrap(model.eval(), names, "last_hidden_state"), names, (ids, mask),
                      {n: roles for n in names}, "last_hidden_state", roles, {"input_ids": "ids",
                                                                               "attention_mask": "mask"})


def _tokens() -> dict:
    return dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def bert(dtype: str = "float32", attn: str | None = None) -> TorchModel:
    from transformers import BertConfig, BertModel

    t = TINY_TEXT
    extra = {"attn_implementation": attn} if attn else {}
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=t["hidden"], num_hidden_layers=t["layers"],
                     num_attention_heads=t["heads"], intermediate_size=t["ffn"],
                     max_position_embeddings=t["positions"], pad_token_id=0, **extra)
    return _text(BertModel(cfg, add_pooling_layer=False), dtype)


def distilbert(dtype: str = "float32") -> TorchModel:
    from transformers import DistilBertConfig, DistilBertModel

    t = TINY_TEXT
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=t["hidden"], n_layers=t["layers"], n_heads=t["heads"],
                           hidden_dim=t["ffn"], max_position_embeddings=t["positions"], pad_token_id=0)
    return _text(DistilBertModel(cfg), dtype)


def gpt2(dtype: str = "float32") -> TorchModel:
    from transformers import GPT2Config, GPT2Model

    t = TINY_TEXT
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=t["hidden"], n_layer=t["layers"], n_head=t["heads"],
                     n_inner=t["ffn"], n_positions=t["positions"], use_cache=False, **_tokens())
    return _text(GPT2Model(cfg), dtype)


def llama(dtype: str = "float32") -> TorchModel:
    """A LLaMA-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP."""
    from transformers import LlamaConfig, LlamaModel

    t = TINY_TEXT
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=t["hidden"], intermediate_size=t["ffn"],
                      num_hidden_layers=t["layers"], num_attention_heads=t["heads"], num_key_value_heads=1,
                      max_position_embeddings=t["positions"], use_cache=False, **_tokens())
    return _text(LlamaModel(cfg), dtype)


def t5_encoder(dtype: str = "float32") -> TorchModel:
    from transformers import T5Config, T5EncoderModel

    t = TINY_TEXT
    cfg = T5Config(vocab_size=VOCAB, d_model=t["hidden"], d_kv=t["hidden"] // t["heads"], d_ff=t["ffn"],
                   num_layers=t["layers"], num_heads=t["heads"], relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, use_cache=False, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0)
    return _text(T5EncoderModel(cfg), dtype)


def _decoder(model, dtype: str) -> TorchModel:
    """A decoder with cross-attention, as the decoder half of an encoder-decoder model is exported: token ids
    [batch, sequence] and the encoder's output [batch, source, hidden] (the source length its own dim)."""
    import torch

    _randomize(model)
    if dtype == "float16":
        model = model.half()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    states = torch.randn(2, 11, TINY_TEXT["hidden"], generator=g)
    states = states.half() if dtype == "float16" else states
    names = ("input_ids", "encoder_hidden_states")
    roles = {0: "batch", 1: "sequence"}
    return TorchModel(_wrap(model.eval(), names, "last_hidden_state"), names, (ids, states),
                      {"input_ids": roles, "encoder_hidden_states": {0: "batch", 1: "source"}}, "last_hidden_state",
                      roles, {"input_ids": "ids", "encoder_hidden_states": "float"})


def bart_decoder(dtype: str = "float32") -> TorchModel:
    """BART's decoder: causal self-attention, cross-attention over the encoder's output, post-LN."""
    from transformers import BartConfig
    from transformers.models.bart.modeling_bart import BartDecoder

    t = TINY_TEXT
    cfg = BartConfig(vocab_size=VOCAB, d_model=t["hidden"], encoder_layers=t["layers"], decoder_layers=t["layers"],
                     encoder_attention_heads=t["heads"], decoder_attention_heads=t["heads"], encoder_ffn_dim=t["ffn"],
                     decoder_ffn_dim=t["ffn"], max_position_embeddings=t["positions"], use_cache=False,
                     decoder_start_token_id=2, **_tokens())
    return _decoder(BartDecoder(cfg), dtype)


def t5_decoder(dtype: str = "float32") -> TorchModel:
    """T5's decoder: relative position bias in self-attention, cross-attention, RMS norms, no biases."""
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Stack

    t = TINY_TEXT
    cfg = T5Config(vocab_size=VOCAB, d_model=t["hidden"], d_kv=t["hidden"] // t["heads"], d_ff=t["ffn"],
                   num_layers=t["layers"], num_decoder_layers=t["layers"], num_heads=t["heads"],
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, use_cache=False,
                   is_decoder=True, is_encoder_decoder=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return _decoder(T5Stack(cfg), dtype)


def vit(dtype: str = "float32") -> TorchModel:
    """ViT: a 8x8/stride-8 Conv patch embedding on a fixed 32x32 image, then a transformer encoder."""
    from transformers import ViTConfig, ViTModel

    t = TINY_TEXT
    cfg = ViTConfig(hidden_size=t["hidden"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                    intermediate_size=t["ffn"], image_size=32, patch_size=8, num_channels=3)
    model = ViTModel(cfg, add_pooling_layer=False)
    return _tensor_input(model, dtype, "pixel_values", (2, 3, 32, 32), {0: "batch"})


def dinov2(dtype: str = "float32") -> TorchModel:
    """DINOv2: ViT's layout with LayerScale, ``(x @ W + b) * lambda`` before each residual Add (its attention
    output projection's and its MLP's second layer's)."""
    from transformers import Dinov2Config, Dinov2Model

    t = TINY_TEXT
    cfg = Dinov2Config(hidden_size=t["hidden"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                       mlp_ratio=t["ffn"] // t["hidden"], image_size=32, patch_size=8, num_channels=3)
    return _tensor_input(Dinov2Model(cfg), dtype, "pixel_values", (2, 3, 32, 32), {0: "batch"})


def whisper_encoder(dtype: str = "float32") -> TorchModel:
    """Whisper's audio encoder: two Conv1d over [batch, mel bins, frames] (frames fixed by the model)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    t = TINY_TEXT
    cfg = WhisperConfig(vocab_size=VOCAB, d_model=t["hidden"], encoder_layers=t["layers"],
                        decoder_layers=t["layers"], encoder_attention_heads=t["heads"],
                        decoder_attention_heads=t["heads"], encoder_ffn_dim=t["ffn"],
                        decoder_ffn_dim=t["ffn"],
                        num_mel_bins=16, max_source_positions=16, max_target_positions=16,
                        decoder_start_token_id=1, **_tokens())
    return _tensor_input(WhisperEncoder(cfg), dtype, "input_features", (2, 16, 32), {0: "batch"})


def _tensor_input(model, dtype: str, name: str, example_shape: tuple[int, ...], axes: dict[int, str],
                  key: str = "last_hidden_state") -> TorchModel:
    """A model of one float input (pixels, audio features); ``key``: the HF output, "" for a plain module."""
    import torch

    _randomize(model)
    if dtype == "float16":
        model = model.half()
    x = torch.randn(example_shape, generator=torch.Generator().manual_seed(1))
    x = x.half() if dtype == "float16" else x
    return TorchModel(_wrap(model.eval(), (name,), key), (name,), (x,), {name: axes}, key or "output",
                      {0: "batch"}, {name: "float"})


# --- CNNs in plain torch.nn ---------------------------------------------------------------------------------
# torchvision from PyPI does not import beside the pinned CPU torch (its compiled ops fail to register:
# "operator torchvision::nms does not exist"), so ResNet-18, MobileNetV2, EfficientNet's and ConvNeXt's blocks
# are written here with the same layer structure as torchvision.models' (narrower, to keep the tests small).

def _resnet18_module(width: int = 8, classes: int = 10):
    import torch.nn as nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            w = width
            self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(w)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            chans, layers, cin = (w, 2 * w, 4 * w, 8 * w), [], w
            for i, c in enumerate(chans):
                stride = 1 if i == 0 else 2
                layers.append(nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c, 1)))
                cin = c
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(8 * w, classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet18()


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _mobilenet_v2_module(width_mult: float = 0.25, classes: int = 10):
    import torch.nn as nn

    def conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1, act: bool = True):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU6(inplace=True)) if act else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = int(round(cin * expand))
            self.use_res = stride == 1 and cin == cout
            layers = [conv_bn(cin, hidden, 1, 1)] if expand != 1 else []
            layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden),  # depthwise
                       conv_bn(hidden, cout, 1, 1, act=False)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            setting = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)]  # t, c, n, s as in torchvision
            cin = _make_divisible(32 * width_mult)
            last = _make_divisible(1280 * max(1.0, width_mult))
            features = [conv_bn(3, cin, 3, 2)]
            for t, c, n, s in setting:
                cout = _make_divisible(c * width_mult)
                for i in range(n):
                    features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                    cin = cout
            features.append(conv_bn(cin, last, 1, 1))
            self.features = nn.Sequential(*features)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, classes))

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.classifier(x.flatten(1))

    return MobileNetV2()


def _efficientnet_module(classes: int = 10):
    """EfficientNet-B0's MBConv blocks (narrow): 1x1 expansion with SiLU, a depthwise 3x3 or 5x5 (stride 2 too)
    with SiLU, squeeze-and-excitation (two 1x1 convs on the pooled tensor, SiLU then Sigmoid, the gate
    multiplied in), a linear 1x1 projection and the identity where the block keeps its size."""
    import torch.nn as nn

    def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.SiLU()) if act else nn.Sequential(*layers)

    class MBConv(nn.Module):
        def __init__(self, cin: int, cout: int, k: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            self.expand = conv_bn(cin, hidden, 1) if expand != 1 else nn.Identity()
            self.depthwise = conv_bn(hidden, hidden, k, stride, groups=hidden)
            squeeze = max(1, cin // 4)
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, squeeze, 1), nn.SiLU(),
                                    nn.Conv2d(squeeze, hidden, 1), nn.Sigmoid())
            self.project = conv_bn(hidden, cout, 1, act=False)
            self.use_res = stride == 1 and cin == cout

        def forward(self, x):
            y = self.depthwise(self.expand(x))
            y = self.project(y * self.se(y))
            return x + y if self.use_res else y

    class EfficientNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = conv_bn(3, 16, 3, 2)
            self.blocks = nn.Sequential(MBConv(16, 8, 3, 1, 1), MBConv(8, 16, 3, 2, 6), MBConv(16, 16, 5, 1, 6),
                                        MBConv(16, 24, 5, 2, 6))
            self.head = conv_bn(24, 64, 1)
            self.fc = nn.Linear(64, classes)

        def forward(self, x):
            x = self.head(self.blocks(self.stem(x)))
            return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))

    return EfficientNet()


def _convnext_module(dim: int = 32, classes: int = 10):
    """ConvNeXt's blocks (narrow): a 4x4 stride-4 patchify stem, then per block a depthwise 7x7 conv, LayerNorm
    over the channels in NHWC (a permute), the 4x MLP as Linear layers (MatMuls) with GELU, a layer scale and the
    residual; a 2x2 stride-2 downsampling conv between the stages."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.dwconv = nn.Conv2d(d, d, 7, padding=3, groups=d)
            self.norm = nn.LayerNorm(d, eps=1e-6)
            self.pwconv1, self.pwconv2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.gamma = nn.Parameter(torch.full((d,), 0.5))

        def forward(self, x):
            y = self.dwconv(x).permute(0, 2, 3, 1)
            y = self.gamma * self.pwconv2(nn.functional.gelu(self.pwconv1(self.norm(y))))
            return x + y.permute(0, 3, 1, 2)

    class ConvNeXt(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, dim, 4, 4)
            self.stage1 = Block(dim)
            self.down = nn.Conv2d(dim, 2 * dim, 2, 2)
            self.stage2 = Block(2 * dim)
            self.head = nn.Linear(2 * dim, classes)

        def forward(self, x):
            x = self.stage2(self.down(self.stage1(self.stem(x))))
            return self.head(x.mean((2, 3)))

    return ConvNeXt()


def _decoder_module(width: int = 8, classes: int = 3):
    """The upsampling layers of a UNet decoder and a super-resolution head, in a chain: a stride-2 Conv, a Conv
    after ``F.pad`` (TorchScript computes its pads through a Transpose), ConvTranspose2d, ``nn.Upsample`` (Resize
    by scales) and PixelShuffle (DepthToSpace), each followed by a Conv whose shape runs through it."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            w = width
            self.down = nn.Conv2d(3, w, 3, 2, 1)
            self.mid = nn.Conv2d(w, w, 3)
            self.up = nn.ConvTranspose2d(w, w, 2, 2)
            self.fuse = nn.Conv2d(w, w, 3, padding=1)
            self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
            self.refine = nn.Conv2d(w, 4 * classes, 3, padding=1)
            self.shuffle = nn.PixelShuffle(2)
            self.head = nn.Conv2d(classes, classes, 1)

        def forward(self, x):
            x = F.relu(self.down(x))
            x = F.relu(self.mid(F.pad(x, (1, 1, 1, 1))))
            x = F.relu(self.fuse(self.up(x)))
            return self.head(self.shuffle(self.refine(self.upsample(x))))

    return Decoder()


_IMAGE_AXES = {0: "batch", 2: "height", 3: "width"}


def resnet18(dtype: str = "float32") -> TorchModel:
    return _tensor_input(_resnet18_module(), dtype, "image", (2, 3, 64, 48), _IMAGE_AXES, key="")


def mobilenet_v2(dtype: str = "float32") -> TorchModel:
    return _tensor_input(_mobilenet_v2_module(), dtype, "image", (2, 3, 64, 48), _IMAGE_AXES, key="")


def efficientnet(dtype: str = "float32") -> TorchModel:
    return _tensor_input(_efficientnet_module(), dtype, "image", (2, 3, 64, 48), _IMAGE_AXES, key="")


def convnext(dtype: str = "float32") -> TorchModel:
    return _tensor_input(_convnext_module(), dtype, "image", (2, 3, 64, 48), _IMAGE_AXES, key="")


def decoder(dtype: str = "float32") -> TorchModel:
    return _tensor_input(_decoder_module(), dtype, "image", (2, 3, 64, 48), _IMAGE_AXES, key="")


MODEL_BUILDERS: dict[str, Callable[..., TorchModel]] = {
    "bert": bert, "distilbert": distilbert, "gpt2": gpt2, "llama": llama, "t5-encoder": t5_encoder,
    "vit": vit, "dinov2": dinov2, "whisper-encoder": whisper_encoder, "resnet18": resnet18, "mobilenet-v2": mobilenet_v2,
    "efficientnet": efficientnet, "convnext": convnext, "bart-decoder": bart_decoder, "t5-decoder": t5_decoder,
    "upsampling-decoder": decoder,
}


# --- exporters ------------------------------------------------------------------------------------------

def export_torchscript(model: TorchModel, path: Path, dim_names: dict[str, str] | None = None,
                       opset: int | None = None, inits_as_inputs: bool = False) -> None:
    """``torch.onnx.export(..., dynamo=False, dynamic_axes=...)``; dims named by role (or ``dim_names``),
    at torch's default opset unless ``opset`` is given; ``inits_as_inputs``: every initializer is also
    listed as a graph input (``keep_initializers_as_inputs=True``, as older exports did)."""
    import torch

    rename = dim_names or {}
    axes = {n: {a: rename.get(r, r) for a, r in model.axes[n].items()} for n in model.inputs}
    axes[model.output] = {a: rename.get(r, r) for a, r in model.output_axes.items()}
    with torch.no_grad():
        torch.onnx.export(model.module, model.example, str(path), dynamo=False,
                          input_names=list(model.inputs), output_names=[model.output], dynamic_axes=axes,
                          opset_version=opset, keep_initializers_as_inputs=inits_as_inputs)


def export_dynamo(model: TorchModel, path: Path, opset: int | None = None) -> None:
    """``torch.onnx.export(..., dynamo=True, dynamic_shapes=...)`` with ``Dim.DYNAMIC``: torch names the
    dims itself (``s0``-style); at torch's default opset unless ``opset`` is given (from 23 torch writes
    scaled_dot_product_attention as ONNX's Attention op, LLaMA's RMSNorm and rotary embedding as
    RMSNormalization and RotaryEmbedding)."""
    import torch
    from torch.export import Dim

    shapes = tuple({a: Dim.DYNAMIC for a in model.axes[n]} for n in model.inputs)
    with torch.no_grad():
        program = torch.onnx.export(model.module, model.example, dynamo=True, input_names=list(model.inputs),
                                    output_names=[model.output], dynamic_shapes=(shapes,), verbose=False,
                                    opset_version=opset)
    program.save(str(path))


def ort_optimized_bert(path: Path) -> TorchModel:
    """BERT as optimum exports it (TorchScript, dims ``batch_size``/``sequence_length``), then onnxruntime's
    transformer optimizer: EmbedLayerNormalization, Attention, BiasGelu, SkipLayerNormalization
    (com.microsoft) leave only the dense MatMuls in the default domain. Eager attention is the pattern the
    optimizer fuses into Attention."""
    from onnxruntime.transformers.optimizer import optimize_model

    model = bert(attn="eager")
    raw = path.with_name(path.stem + ".raw.onnx")
    export_torchscript(model, raw, {"batch": "batch_size", "sequence": "sequence_length"})
    optimized = optimize_model(str(raw), model_type="bert", num_heads=TINY_TEXT["heads"],
                               hidden_size=TINY_TEXT["hidden"])
    stats = optimized.get_fused_operator_statistics()
    assert stats["Attention"] == TINY_TEXT["layers"] and stats["SkipLayerNormalization"] > 0, stats
    optimized.save_model_to_file(str(path))
    return model


# --- ONNX backend node tests ----------------------------------------------------------------------------

def onnx_node_case(test_name: str) -> tuple[onnx.ModelProto, list[np.ndarray], list[np.ndarray]]:
    """The onnx package's backend node test ``test_name`` (model, inputs, outputs of test_data_set_0).

    The onnx wheel ships the generators of ``onnx/backend/test/data/node`` (onnx.backend.test.case.node),
    not the .pb files; importing the op's generator module produces the same seeded data."""
    import onnx.backend.test.case.node as node_cases
    from onnx.backend.test.case.base import Base

    op = test_name.split("_")[1] if test_name.startswith("test_") else ""
    module = {"matmul": "matmul", "gemm": "gemm", "conv": "conv", "basic": "conv"}[op]
    node_cases._TargetOpType = None  # keep every case the generator module produces
    generators = importlib.import_module(f"onnx.backend.test.case.node.{module}")  # runs them once
    found = [c for c in node_cases._NodeTestCases if c.name == test_name]
    if not found:  # imported earlier under another op filter: run the generators again, seeded as onnx does
        for cls in vars(generators).values():
            if isinstance(cls, type) and issubclass(cls, Base) and cls is not Base:
                for name in dir(cls):
                    if name.startswith("export"):
                        np.random.seed(0)
                        getattr(cls, name)()
        found = [c for c in node_cases._NodeTestCases if c.name == test_name]
    if not found:
        raise LookupError(f"onnx has no backend node test {test_name!r}")
    case = found[0]
    inputs, outputs = case.data_sets[0]
    return copy.deepcopy(case.model), list(inputs), list(outputs)


def _set_dims(vi: onnx.ValueInfoProto, dims: list) -> None:
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        else:
            dim.dim_value = int(d)


def make_dynamic(model: onnx.ModelProto, inputs: list[np.ndarray]
                 ) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """Give a single-node test model symbolic dims, as an exporter writes a layer:

    MatMul: both operands stay inputs, every dim symbolic (``b0``.. batch, ``m``, ``k``, ``n``; broadcast 1s
    stay 1). Gemm and Conv: the weight (and bias) become initializers with the shipped values, as every
    exporter writes a Linear/Conv layer; the activation gets a symbolic M (Gemm) or N, H, W (Conv).
    Returns the model and the inputs that stay graph inputs."""
    g = model.graph
    node = g.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMul":
        a, b = inputs
        names_a: list = [1 if d == 1 else f"b{i}" for i, d in enumerate(a.shape[:-2])] + ["m", "k"]
        names_b: list = [1 if d == 1 else f"b{i + a.ndim - b.ndim}"
                         for i, d in enumerate(b.shape[:-2])] + ["k", "n"]
        if a.ndim == 1:
            names_a = ["k"]
        if b.ndim == 1:
            names_b = ["k"]
        _set_dims(g.input[0], names_a)
        _set_dims(g.input[1], names_b)
        kept = inputs
    else:
        weights = list(zip(g.input[1:], inputs[1:]))
        for vi, value in weights:
            g.initializer.append(numpy_helper.from_array(value, vi.name))
        del g.input[1:]
        if node.op_type == "Gemm":
            m_axis = 1 if attrs.get("transA", 0) else 0
            dims: list = list(inputs[0].shape)
            dims[m_axis] = "m"
        else:
            dims = ["n", inputs[0].shape[1], "h", "w"]
        _set_dims(g.input[0], dims)
        kept = inputs[:1]
    for out in g.output:  # the output's shape now depends on the symbols; let inference say how
        out.type.tensor_type.ClearField("shape")
    return model, kept


NODE_TESTS = {
    # name: expected refusal (None: the node is rewritten)
    "test_matmul_2d": None, "test_matmul_3d": None, "test_matmul_4d": None,
    "test_matmul_bcast": "need a partial broadcast", "test_matmul_1d_3d": "1-D MatMul operands",
    "test_matmul_4d_1d": "1-D MatMul operands", "test_matmul_1d_1d": "1-D MatMul operands",
    "test_gemm_default_no_bias": None, "test_gemm_default_zero_bias": None,
    "test_gemm_default_vector_bias": None, "test_gemm_transposeB": None,
    "test_gemm_default_matrix_bias": "not a constant bias of N elements",
    "test_gemm_default_scalar_bias": "not a constant bias of N elements",
    "test_gemm_default_single_elem_vector_bias": "not a constant bias of N elements",
    # alpha and beta are folded into the constant B and C first (tuner/affine.py)
    "test_gemm_transposeA": "transA=1", "test_gemm_alpha": None,
    "test_gemm_beta": None, "test_gemm_all_attributes": "transA=1",
    "test_basic_conv_with_padding": None, "test_basic_conv_without_padding": None,
    "test_conv_with_strides_padding": None, "test_conv_with_strides_no_padding": None,
    "test_conv_with_strides_and_asymmetric_padding": None, "test_conv_with_autopad_same": "auto_pad",
}


# --- the built model, its roles and feeds ---------------------------------------------------------------

@dataclass
class Built:
    path: Path
    symbols: dict[str, tuple[str, ...]]  # role -> the symbol names the exporter wrote for it
    kinds: dict[str, str]  # graph input -> "ids" | "mask" | "float"
    shipped: tuple[dict[str, np.ndarray], list[np.ndarray]] | None = None  # node tests: feeds, outputs


def role_dims(path: Path, axes: dict[str, dict[int, str]]) -> dict[str, tuple[str, ...]]:
    """Each role's symbol names, read from the exported model's inputs."""
    model = onnx.load(str(path), load_external_data=False)
    out: dict[str, list[str]] = {}
    for vi in model.graph.input:
        for axis, role in axes.get(vi.name, {}).items():
            dim = vi.type.tensor_type.shape.dim[axis]
            if not dim.dim_param:
                raise AssertionError(f"{path.name}: input {vi.name} axis {axis} ({role}) was exported as "
                                     f"a fixed {dim.dim_value}")
            if dim.dim_param not in out.setdefault(role, []):
                out[role].append(dim.dim_param)
    return {r: tuple(v) for r, v in out.items()}


def feeds(path: Path, built: Built, shape: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for ``shape`` (role -> value): token ids, a padding mask (the second row half padded), or
    normal floats in the input's dtype."""
    model = onnx.load(str(path), load_external_data=False)
    values = {sym: shape[role] for role, syms in built.symbols.items() for sym in syms}
    rng = np.random.default_rng(seed)
    out = {}
    inits = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        dims = [values[d.dim_param] if d.dim_param else d.dim_value for d in t.shape.dim]
        kind = built.kinds.get(vi.name, "float")
        if kind == "ids":
            out[vi.name] = rng.integers(3, VOCAB, dims).astype(np.int64)
        elif kind == "mask":
            mask = np.ones(dims, np.int64)
            if dims[0] > 1:
                mask[1, (dims[1] + 1) // 2:] = 0
            out[vi.name] = mask
        else:
            out[vi.name] = rng.standard_normal(dims).astype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    return out


# --- the table ------------------------------------------------------------------------------------------

TEXT_TUNED = {"batch": "1,2", "sequence": "4:16:4"}
TEXT_PROBES = ({"batch": 1, "sequence": 4}, {"batch": 2, "sequence": 11}, {"batch": 3, "sequence": 1},
               {"batch": 1, "sequence": 37})
# a decoder with cross-attention: the source (the encoder's output length) its own dim
DECODER_TUNED = {"batch": "1,2", "sequence": "4:16:4", "source": "8:24:8"}
DECODER_PROBES = ({"batch": 1, "sequence": 4, "source": 8}, {"batch": 2, "sequence": 11, "source": 13},
                  {"batch": 3, "sequence": 1, "source": 40}, {"batch": 1, "sequence": 37, "source": 5})
BATCH_TUNED = {"batch": "1,2"}
BATCH_PROBES = ({"batch": 1}, {"batch": 2}, {"batch": 5})
IMAGE_TUNED = {"batch": "1,2", "height": "32,64", "width": "32,64"}
IMAGE_PROBES = ({"batch": 1, "height": 32, "width": 32}, {"batch": 2, "height": 48, "width": 40},
                {"batch": 3, "height": 24, "width": 80}, {"batch": 1, "height": 97, "width": 33})


@dataclass(frozen=True)
class Case:
    """One model of the corpus: how it is built, the dims to tune and probe, what scan must leave alone."""

    name: str
    model: str  # a MODEL_BUILDERS key, "bert-ort-optimizer", or an onnx node test name
    # "torchscript" | "dynamo" | "onnxruntime.transformers.optimizer" | "onnx node test" | FLOAT16_CONVERTED
    exporter: str
    dtype: str = "float32"
    tuned: dict[str, str] = field(default_factory=dict)  # role -> --dim SPEC
    probes: tuple[dict[str, int], ...] = ()  # shapes run after optimize, inside and outside ``tuned``
    left_alone: tuple[str, ...] = ()  # the expected refusal reasons (substrings); each must occur
    unsupported: str | None = None  # the export itself fails: why (the combination is skipped)
    opset: int | None = None  # the opset asked for (None: torch's default, 20 at 2.13)
    dim_names: dict[str, str] = field(default_factory=dict)  # TorchScript: role -> dim name, if not the role
    inits_as_inputs: bool = False  # TorchScript: keep_initializers_as_inputs=True

    @property
    def rtol(self) -> float:
        return 1e-2 if self.dtype == "float16" else 1e-4

    @property
    def atol(self) -> float:
        return 1e-2 if self.dtype == "float16" else 1e-5


def _exports(name: str, dtype: str = "float32", tuned=TEXT_TUNED, probes=TEXT_PROBES, left_alone=(),
             dy_unsupported: str | None = None, text: bool = True, dynamo: bool = True) -> list[Case]:
    """The model through the TorchScript exporter and (unless ``dynamo`` is False) the dynamo one."""
    suffix = "-fp16" if dtype == "float16" else ""
    cases = [Case(f"{name}{suffix}-torchscript", name, "torchscript", dtype, tuned, probes, left_alone)]
    if dynamo:
        cases.append(Case(f"{name}{suffix}-dynamo", name, "dynamo", dtype, tuned, probes, left_alone,
                          dy_unsupported))
    return cases


# a float32 TorchScript export made float16 by onnxruntime's converter (the one onnxconverter-common ships too)
# with keep_io_types=True: float32 inputs and outputs, Casts around a float16 graph
FLOAT16_CONVERTED = "torchscript, then onnxruntime.transformers.float16 (keep_io_types)"


CASES: tuple[Case, ...] = tuple(
    _exports("bert") + _exports("distilbert") + _exports("gpt2") + _exports("llama")
    + _exports("llama", "float16")
    + _exports("t5-encoder", dy_unsupported="torch.export cannot trace T5's attention reshape with a "
               "dynamic sequence: ValueError: Cannot view a tensor with shape [s, s, 2, 16] and strides "
               "(32*s, 16, 16*s, 1) as a tensor with shape (s, s, 32)")
    # the decoder halves of encoder-decoder models: causal self-attention and cross-attention over the encoder's
    # output, whose length (source) is a dim of its own
    + _exports("bart-decoder", tuned=DECODER_TUNED, probes=DECODER_PROBES)
    + _exports("t5-decoder", tuned=DECODER_TUNED, probes=DECODER_PROBES)
    + _exports("vit", tuned=BATCH_TUNED, probes=BATCH_PROBES, text=False)
    + _exports("vit", "float16", tuned=BATCH_TUNED, probes=BATCH_PROBES, text=False)
    + _exports("dinov2", tuned=BATCH_TUNED, probes=BATCH_PROBES, text=False)
    + _exports("whisper-encoder", tuned=BATCH_TUNED, probes=BATCH_PROBES, text=False)
    + _exports("resnet18", tuned=IMAGE_TUNED, probes=IMAGE_PROBES, text=False)
    # MobileNetV2 through TorchScript only: its dynamo export alone takes half a minute on two cores. Every conv
    # is tuned, its depthwise ones as a batch of their groups.
    + _exports("mobilenet-v2", tuned=IMAGE_TUNED, probes=IMAGE_PROBES, text=False, dynamo=False)
    # grouped convs beside other layers: EfficientNet's depthwise 5x5s at stride 2 and its squeeze-and-excitation
    # 1x1 convs on a pooled [batch, C, 1, 1] tensor; ConvNeXt's depthwise 7x7s between NHWC LayerNorm + MLPs
    + _exports("efficientnet", tuned=IMAGE_TUNED, probes=IMAGE_PROBES, text=False, dynamo=False)
    + _exports("convnext", tuned=IMAGE_TUNED, probes=IMAGE_PROBES, text=False)
    # shapes through ConvTranspose, Resize by scales, DepthToSpace and a TorchScript F.pad (none was tuned after
    # them before tuner/scan.py gave onnxruntime's shape inference rules for them)
    + _exports("upsampling-decoder", tuned=IMAGE_TUNED, probes=IMAGE_PROBES, text=False)
    # optimum's dim names at an opset below 20, where Gelu is exported in its Erf form (a fusion candidate)
    + [Case("bert-opset17-torchscript", "bert", "torchscript", tuned=TEXT_TUNED, probes=TEXT_PROBES, opset=17,
            dim_names={"batch": "batch_size", "sequence": "sequence_length"}),
       Case("bert-inits-as-inputs-torchscript", "bert", "torchscript", tuned=TEXT_TUNED, probes=TEXT_PROBES,
            opset=17, dim_names={"batch": "batch_size", "sequence": "sequence_length"}, inits_as_inputs=True)]
    + [Case("bert-ort-optimizer", "bert-ort-optimizer", "onnxruntime.transformers.optimizer",
            tuned={"batch": "1,2", "sequence": "4:16:4"}, probes=TEXT_PROBES)]
    # opset 23: ONNX's own Attention (and LLaMA's RMSNormalization, RotaryEmbedding) in place of the MatMul chains;
    # onnxruntime 1.31's RotaryEmbedding refuses torch's export at a batch above 1, so LLaMA is probed at batch 1
    + [Case("bert-opset23-dynamo", "bert", "dynamo", tuned=TEXT_TUNED, probes=TEXT_PROBES, opset=23),
       Case("llama-opset23-dynamo", "llama", "dynamo", tuned=TEXT_TUNED, opset=23,
            probes=tuple(p for p in TEXT_PROBES if p["batch"] == 1) + ({"batch": 1, "sequence": 11},))]
    + [Case("gpt2-fp16-converted", "gpt2", FLOAT16_CONVERTED, "float16", TEXT_TUNED, TEXT_PROBES),
       Case("resnet18-fp16-converted", "resnet18", FLOAT16_CONVERTED, "float16", IMAGE_TUNED, IMAGE_PROBES)]
    + [Case(name, name, "onnx node test", left_alone=(reason,) if reason else ())
       for name, reason in NODE_TESTS.items()]
)

CASES_BY_NAME = {c.name: c for c in CASES}


def build_case(case: Case, folder: Path) -> Built:
    """Write the case's model under ``folder`` and say which symbols play which role."""
    path = folder / f"{case.name}.onnx"
    if case.exporter == "onnx node test":
        model, inputs, outputs = onnx_node_case(case.model)
        model, kept = make_dynamic(model, inputs)
        onnx.save(model, str(path))
        names = [vi.name for vi in model.graph.input]
        syms = sorted({d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim
                       if d.dim_param})
        return Built(path, {s: (s,) for s in syms}, {}, (dict(zip(names, kept)), outputs))
    if case.exporter == "onnxruntime.transformers.optimizer":
        model = ort_optimized_bert(path)
        rename = {"batch": "batch_size", "sequence": "sequence_length"}
        return Built(path, {r: (rename[r],) for r in ("batch", "sequence")}, dict(model.kinds))
    if case.exporter == FLOAT16_CONVERTED:
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = MODEL_BUILDERS[case.model]("float32")
        export_torchscript(model, path)
        onnx.save(convert_float_to_float16(onnx.load(str(path)), keep_io_types=True), str(path))
        return Built(path, role_dims(path, model.axes), dict(model.kinds))
    model = MODEL_BUILDERS[case.model](case.dtype)
    if case.exporter == "torchscript":
        export_torchscript(model, path, case.dim_names, case.opset, case.inits_as_inputs)
    else:
        export_dynamo(model, path, case.opset)
    return Built(path, role_dims(path, model.axes), dict(model.kinds))


def node_test_tuned(built: Built) -> tuple[dict[str, str], tuple[dict[str, int], ...]]:
    """A node test's --dim values (the shipped size and one more) and probes (shipped, inside, outside)."""
    feeds_, _ = built.shipped  # type: ignore[misc]
    model = onnx.load(str(built.path))
    shipped: dict[str, int] = {}
    for vi in model.graph.input:
        for d, size in zip(vi.type.tensor_type.shape.dim, feeds_[vi.name].shape):
            if d.dim_param:
                shipped[d.dim_param] = int(size)
    tuned = {s: f"{v},{v + 2}" for s, v in shipped.items()}
    probes = (shipped, {s: v + 1 for s, v in shipped.items()}, {s: v + 5 for s, v in shipped.items()})
    return tuned, probes


def gemm_view_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """Every MatMul/Gemm/Conv node in the default domain: how scan names it when it leaves the node alone
    (its name, else its first output) -> its first output (how workloads name their nodes)."""
    return {(n.name or n.output[0]): n.output[0] for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm", "Conv") and n.domain in ("", "ai.onnx")}

