"""Template-vs-torch cases run under TRITON_INTERPRET=1 in a child process (see test_templates.py).

The interpreter flag must be set before triton is imported and changes how @triton.jit decorates, so
these cases never run inside the pytest process. Importing this module does not import triton or torch:
``CASES`` is plain data; ``main()`` runs them all and prints one JSON object {case: result}.
Run by hand: ``TRITON_INTERPRET=1 python tests/_template_cases.py``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "CASES", "main"]


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    a: tuple[int, ...]
    b: tuple[int, ...]
    configs: tuple[tuple[int, ...], ...]  # MicroKernel fields: bm, bn, bk, warps, stages[, group_m, split_k]
    dtype: str = "float32"
    bias: bool = False
    activation: str = "none"
    trans_b: bool = False
    allow_tf32: bool = False
    conv: dict[str, Any] = field(default_factory=dict)  # ConvParams fields besides the channel counts
    alpha: float = 1.0  # the fused scale: act(alpha * acc + bias) + residual
    residual: bool = False  # add a second tensor of the output's shape last (gemm, conv)
    residual_first: bool = False  # ... before the activation instead: act(alpha * acc + bias + residual)
    residual_mul: bool = False  # ... multiplied after it instead: act(alpha * acc + bias) * residual
    nan_rows: tuple[int, ...] = ()  # rows of A set to NaN: their output rows stay NaN through every activation


CASES: tuple[Case, ...] = (
    # gemm: M = 1, ragged sizes, K < BLOCK_K, every epilogue, trans_b, split-K, fp32 and fp16.
    Case("gemm_m1", "gemm", (1, 40), (40, 33), ((16, 32, 16, 2, 2), (32, 16, 64, 4, 3, 1))),
    Case("gemm_ragged_bias_relu", "gemm", (37, 50), (50, 29), ((32, 16, 32, 2, 2), (16, 64, 16, 4, 3)),
         bias=True, activation="relu"),
    Case("gemm_many_tiles_swizzle", "gemm", (70, 20), (20, 40), ((16, 16, 16, 2, 2, 2), (16, 16, 32, 2, 2, 8))),
    Case("gemm_k_lt_block_k", "gemm", (20, 5), (5, 18), ((16, 32, 32, 2, 2), (64, 16, 64, 2, 2))),
    Case("gemm_transb_bias_gelu_fp16", "gemm", (19, 24), (45, 24), ((16, 16, 32, 2, 2), (32, 64, 16, 4, 3)),
         dtype="float16", bias=True, activation="gelu", trans_b=True),
    Case("gemm_gelu_nobias_fp16", "gemm", (1, 33), (33, 70), ((16, 64, 32, 2, 2, 1),), dtype="float16",
         activation="gelu"),
    Case("gemm_splitk_bias_fp32", "gemm", (7, 70), (70, 20), ((16, 16, 16, 2, 2, 8, 4), (16, 32, 16, 2, 2, 8, 2)),
         bias=True),
    Case("gemm_splitk_transb_fp16", "gemm", (3, 45), (17, 45), ((16, 16, 16, 2, 2, 8, 2),), dtype="float16",
         trans_b=True),
    Case("gemm_tf32", "gemm", (9, 30), (30, 11), ((16, 16, 16, 2, 2),), allow_tf32=True),
    # the epilogue's scale and residual: act(alpha * acc + bias) + residual, also under split-K (split 0 adds).
    Case("gemm_alpha_bias_residual", "gemm", (21, 30), (30, 19), ((16, 16, 16, 2, 2),), bias=True, alpha=0.125,
         residual=True),
    Case("gemm_alpha_bias_gelu_residual_fp16", "gemm", (9, 24), (24, 33), ((16, 32, 16, 2, 2),), dtype="float16",
         bias=True, activation="gelu", alpha=-0.5, residual=True),
    Case("gemm_splitk_residual", "gemm", (5, 48), (48, 17), ((16, 16, 16, 2, 2, 8, 3),), alpha=2.0, residual=True),
    # the residual before the activation: act(alpha * acc + bias + residual) (Add then Relu/Gelu in the graph)
    Case("gemm_bias_residual_first_gelu_fp16", "gemm", (13, 24), (24, 21), ((16, 16, 16, 2, 2),),
         dtype="float16", bias=True, activation="gelu", alpha=0.5, residual=True, residual_first=True),
    # bmm: broadcast of either operand, partial broadcast, trans_b, epilogue, split-K.
    Case("bmm_broadcast_b", "bmm", (2, 3, 5, 12), (12, 7), ((16, 16, 16, 2, 2), (32, 32, 32, 4, 2, 1))),
    Case("bmm_broadcast_a_bias_relu_fp16", "bmm", (1, 9, 20), (4, 20, 6), ((16, 16, 16, 2, 2),),
         dtype="float16", bias=True, activation="relu"),
    Case("bmm_transb_gelu", "bmm", (3, 4, 10), (3, 6, 10), ((16, 16, 16, 2, 2),), bias=True,
         activation="gelu", trans_b=True),
    Case("bmm_partial_broadcast", "bmm", (3, 1, 5, 8), (4, 8, 6), ((16, 16, 16, 2, 2),)),
    Case("bmm_splitk_fp16", "bmm", (2, 1, 40), (2, 40, 9), ((16, 16, 16, 2, 2, 8, 2),), dtype="float16"),
    Case("bmm_transb_alpha_scores", "bmm", (2, 7, 8), (2, 7, 8), ((16, 16, 16, 2, 2),), trans_b=True,
         alpha=0.35355339059327373),
    # conv: stride 2, padding (also asymmetric), dilation, 1x1, epilogues, split-K.
    Case("conv_stride2_pad_bias_relu", "conv", (2, 3, 9, 9), (5, 3, 3, 3), ((16, 16, 16, 2, 2), (32, 16, 32, 2, 2)),
         bias=True, activation="relu", conv={"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    Case("conv_dilation_asym_gelu_fp16", "conv", (1, 2, 9, 8), (3, 2, 3, 2), ((16, 16, 16, 2, 2),),
         dtype="float16", bias=True, activation="gelu",
         conv={"strides": (2, 1), "pads": (1, 2, 0, 1), "dilations": (2, 1)}),
    Case("conv_1x1_nobias", "conv", (1, 4, 5, 3), (7, 4, 1, 1), ((16, 16, 16, 2, 2),)),
    Case("conv_splitk", "conv", (2, 5, 6, 6), (4, 5, 3, 3), ((16, 16, 16, 2, 2, 8, 2),), bias=True,
         conv={"pads": (1, 1, 1, 1)}),
    # ResNet's Conv -> Add(shortcut) -> Relu: act(conv + bias + residual), the residual [n, OC, OH, OW] read at
    # the output's offsets (ragged tiles, strided, split-K); and the residual after the activation
    Case("conv_bias_residual_first_relu", "conv", (2, 6, 7, 5), (9, 6, 1, 1),
         ((16, 16, 16, 2, 2), (32, 16, 32, 2, 2, 8, 3)), bias=True, activation="relu", residual=True,
         residual_first=True),
    Case("conv_stride2_residual_first_relu_fp16", "conv", (2, 3, 9, 8), (5, 3, 3, 3), ((16, 16, 16, 2, 2),),
         dtype="float16", bias=True, activation="relu", residual=True, residual_first=True,
         conv={"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    Case("conv_gelu_residual_after", "conv", (1, 4, 6, 6), (3, 4, 3, 3), ((16, 16, 16, 2, 2),), bias=True,
         activation="gelu", residual=True, conv={"pads": (1, 1, 1, 1)}),
    # the activations of real exports beside Relu and the erf Gelu: GPT-2's tanh Gelu (its FFN up-projection),
    # LLaMA's SiLU (the MLP gate), MobileNetV2's ReLU6 (Clip(0, 6) after its pointwise convs); in float32,
    # float16 and bfloat16, with split-K and a residual
    Case("gemm_bias_gelu_tanh", "gemm", (21, 40), (40, 27), ((16, 16, 16, 2, 2), (16, 32, 16, 2, 2, 8, 3)),
         bias=True, activation="gelu_tanh"),
    Case("gemm_transb_bias_gelu_tanh_fp16", "gemm", (9, 48), (37, 48), ((16, 32, 16, 2, 2),), dtype="float16",
         bias=True, activation="gelu_tanh", trans_b=True),
    Case("gemm_bias_gelu_tanh_residual_bf16", "gemm", (11, 32), (32, 19), ((16, 16, 16, 2, 2),),
         dtype="bfloat16", bias=True, activation="gelu_tanh", residual=True),
    Case("gemm_silu", "gemm", (17, 45), (45, 23), ((16, 16, 16, 2, 2),), activation="silu"),
    Case("gemm_transb_silu_fp16", "gemm", (5, 64), (30, 64), ((16, 16, 32, 2, 2), (16, 16, 16, 2, 2, 8, 2)),
         dtype="float16", activation="silu", trans_b=True),
    Case("bmm_silu_bf16", "bmm", (2, 6, 24), (24, 13), ((16, 16, 16, 2, 2),), dtype="bfloat16", activation="silu"),
    Case("gemm_alpha_bias_residual_first_silu", "gemm", (7, 24), (24, 15), ((16, 16, 16, 2, 2),), bias=True,
         activation="silu", alpha=0.5, residual=True, residual_first=True),
    Case("conv_1x1_bias_relu6", "conv", (2, 8, 5, 4), (12, 8, 1, 1), ((16, 16, 16, 2, 2), (32, 16, 16, 2, 2, 8, 2)),
         bias=True, activation="relu6"),
    Case("conv_1x1_bias_relu6_fp16", "conv", (1, 16, 4, 5), (9, 16, 1, 1), ((16, 16, 16, 2, 2),), dtype="float16",
         bias=True, activation="relu6"),
    Case("conv_stride2_relu6_bf16", "conv", (1, 3, 9, 9), (6, 3, 3, 3), ((16, 16, 16, 2, 2),), dtype="bfloat16",
         bias=True, activation="relu6", conv={"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    # LLaMA's SwiGLU gate: silu(x @ Wg) * up, the up-projection's output as the residual, multiplied; in float32,
    # float16 and bfloat16, with a bias, a scale, trans_b and split-K (the last split multiplies); a conv's
    # residual multiplied at the output's offsets
    Case("gemm_silu_mul", "gemm", (19, 40), (40, 27), ((16, 16, 16, 2, 2), (16, 32, 16, 2, 2, 8, 3)),
         activation="silu", residual=True, residual_mul=True),
    Case("gemm_transb_alpha_bias_silu_mul_fp16", "gemm", (9, 48), (37, 48), ((16, 32, 16, 2, 2),),
         dtype="float16", bias=True, activation="silu", alpha=0.5, trans_b=True, residual=True, residual_mul=True),
    Case("gemm_silu_mul_bf16", "gemm", (13, 32), (32, 21), ((16, 16, 16, 2, 2), (16, 16, 16, 2, 2, 8, 2)),
         dtype="bfloat16", activation="silu", residual=True, residual_mul=True),
    Case("gemm_gelu_mul", "gemm", (6, 24), (24, 17), ((16, 16, 16, 2, 2),), activation="gelu",
         residual=True, residual_mul=True),
    # grouped convs (grid z = group): ResNeXt-style groups of 2 channels with a bias, split-K and a residual;
    # depthwise (group = channels, one output channel per group) in fp16 with ReLU6 as in MobileNetV2, and
    # dilated with a channel multiplier of 2 (two output channels per group)
    Case("conv_grouped_bias_residual_splitk", "conv", (2, 8, 6, 5), (12, 2, 3, 3),
         ((16, 16, 16, 2, 2), (16, 16, 16, 2, 2, 8, 2)), bias=True, activation="relu", residual=True,
         residual_first=True, conv={"pads": (1, 1, 1, 1), "groups": 4}),
    Case("conv_depthwise_stride2_relu6_fp16", "conv", (2, 6, 9, 8), (6, 1, 3, 3), ((16, 16, 16, 2, 2),),
         dtype="float16", bias=True, activation="relu6", conv={"strides": (2, 2), "pads": (1, 1, 1, 1), "groups": 6}),
    Case("conv_depthwise_multiplier2_dilated", "conv", (1, 3, 7, 7), (6, 1, 3, 3), ((16, 16, 16, 2, 2),),
         conv={"pads": (2, 2, 2, 2), "dilations": (2, 2), "groups": 3}),
    Case("conv_bias_relu_mul", "conv", (2, 4, 6, 5), (7, 4, 3, 3), ((16, 16, 16, 2, 2), (16, 16, 16, 2, 2, 8, 2)),
         bias=True, activation="relu", residual=True, residual_mul=True, conv={"pads": (1, 1, 1, 1)}),
    # channels-last convs (X, the residual and Y NHWC, W [OC, KH, KW, C]; a and b give the NCHW shapes, the case
    # permutes them): K slices within one (kh, kw) (channels a multiple of BLOCK_K, the vector path) and across
    # them (the per-element path: BLOCK_K above the channels, and 3 channels), split-K whose last slices lie past
    # K, stride, asymmetric pads, dilation, every residual form
    Case("conv_nhwc_3x3_bias_relu_fp16", "conv", (2, 32, 7, 6), (24, 32, 3, 3),
         ((16, 16, 16, 2, 2), (32, 16, 32, 2, 2), (16, 16, 64, 2, 2)), dtype="float16", bias=True,
         activation="relu", conv={"pads": (1, 1, 1, 1), "channels_last": True}),
    Case("conv_nhwc_stride_dilation_asym_splitk", "conv", (2, 16, 9, 8), (5, 16, 3, 2),
         ((16, 16, 16, 2, 2), (16, 16, 16, 2, 2, 8, 4)), bias=True, residual=True,
         conv={"strides": (2, 1), "pads": (1, 2, 0, 1), "dilations": (2, 1), "channels_last": True}),
    Case("conv_nhwc_1x1_residual_first_relu_bf16", "conv", (2, 16, 5, 4), (20, 16, 1, 1),
         ((16, 16, 16, 2, 2), (16, 32, 16, 2, 2, 8, 2)), dtype="bfloat16", bias=True, activation="relu",
         residual=True, residual_first=True, conv={"channels_last": True}),
    Case("conv_nhwc_3_channels_gelu_mul", "conv", (1, 3, 9, 9), (6, 3, 3, 3), ((16, 16, 16, 2, 2),),
         activation="gelu", residual=True, residual_mul=True,
         conv={"strides": (2, 2), "pads": (1, 1, 1, 1), "channels_last": True}),
    # NaN through relu and relu6 stays NaN, as onnxruntime's Relu and Clip give it (not max(NaN, 0) = 0)
    Case("gemm_nan_rows_bias_relu", "gemm", (9, 20), (20, 17), ((16, 16, 16, 2, 2),), bias=True, activation="relu",
         nan_rows=(0, 5)),
    Case("gemm_nan_rows_relu6_residual_first_fp16", "gemm", (9, 20), (20, 17), ((16, 16, 16, 2, 2, 8, 2),),
         dtype="float16", activation="relu6", residual=True, residual_first=True, nan_rows=(3,)),
)


def _reference(case: Case, a: Any, b: Any, bias: Any, residual: Any = None) -> Any:
    import torch
    import torch.nn.functional as F

    a64, b64 = a.double(), b.double()
    bias64 = bias.double() if bias is not None else None
    if case.op == "conv":
        top, left, bottom, right = case.conv.get("pads", (0, 0, 0, 0))
        y = F.conv2d(F.pad(a64, (left, right, top, bottom)), b64, bias64, stride=case.conv.get("strides", (1, 1)),
                     dilation=case.conv.get("dilations", (1, 1)), groups=case.conv.get("groups", 1))
    else:
        y = case.alpha * torch.matmul(a64, b64.transpose(-1, -2) if case.trans_b else b64)
        if bias64 is not None:
            y = y + bias64
    if residual is not None and case.residual_first:
        y = y + residual.double()
    if case.activation == "relu":
        y = torch.relu(y)
    elif case.activation == "gelu":
        y = F.gelu(y)
    elif case.activation == "gelu_tanh":  # the formula GPT-2 exports, in float64
        y = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
    elif case.activation == "silu":
        y = y * torch.sigmoid(y)
    elif case.activation == "relu6":
        y = torch.clamp(y, 0.0, 6.0)
    if residual is not None and case.residual_mul:
        y = y * residual.double()
    elif residual is not None and not case.residual_first:
        y = y + residual.double()
    return y


def _run_case(case: Case) -> dict[str, Any]:
    import torch

    from tuner.space import MicroKernel
    from tuner.templates import run
    from tuner.workload import ConvParams, Epilogue

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(len(case.name))
    a = torch.randn(case.a, generator=gen).to(dtype)
    for row in case.nan_rows:
        a[..., row, :] = float("nan")
    b = torch.randn(case.b, generator=gen).to(dtype)
    n_out = case.b[0] if case.op == "conv" else (case.b[-2] if case.trans_b else case.b[-1])
    bias = torch.randn(n_out, generator=gen).to(dtype) if case.bias else None
    conv = None
    if case.op == "conv":
        conv = ConvParams(in_channels=case.a[1], out_channels=case.b[0], kernel=(case.b[2], case.b[3]), **case.conv)
    residual = None
    if case.residual and conv is not None:  # the output's [n, OC, OH, OW]
        top, left, bottom, right = conv.pads
        out_h = (case.a[2] + top + bottom - conv.dilations[0] * (conv.kernel[0] - 1) - 1) // conv.strides[0] + 1
        out_w = (case.a[3] + left + right - conv.dilations[1] * (conv.kernel[1] - 1) - 1) // conv.strides[1] + 1
        residual = torch.randn(case.a[0], n_out, out_h, out_w, generator=gen).to(dtype)
    elif case.residual:
        residual = torch.randn(case.a[-2], n_out, generator=gen).to(dtype)
    ref = _reference(case, a, b, bias, residual)
    nhwc = conv is not None and conv.channels_last  # run on NHWC X and residual, W [OC, KH, KW, C]; Y back to NCHW
    if nhwc:
        a, b = a.permute(0, 2, 3, 1).contiguous(), b.permute(0, 2, 3, 1).contiguous()
        residual = residual.permute(0, 2, 3, 1).contiguous() if residual is not None else None
    rtol, atol = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (2e-2, 2e-2)}[case.dtype]
    if case.allow_tf32:
        rtol, atol = 1e-2, 1e-2
    results = []
    for fields_ in case.configs:
        config = MicroKernel(*fields_)
        y = run(case.op, config, a, b, bias=bias, residual=residual,
                epilogue=Epilogue(case.bias, case.activation, case.alpha, case.residual, case.residual_first,
                                  case.residual_mul),
                trans_b=case.trans_b,
                conv=conv, allow_tf32=case.allow_tf32)
        if nhwc:
            y = y.permute(0, 3, 1, 2)
        shape_ok = tuple(y.shape) == tuple(ref.shape)
        nan_ok = shape_ok and torch.equal(y.isnan(), ref.isnan())  # NaN exactly where the reference has it
        err = (y.double() - ref).abs().nan_to_num(nan=0.0 if nan_ok else math.inf)
        excess = (err - (atol + rtol * ref.abs().nan_to_num(nan=0.0))).max().item()
        results.append({"config": config.key(), "shape_ok": shape_ok, "dtype_ok": y.dtype == dtype,
                        "nan_ok": nan_ok, "excess": excess, "max_err": err.max().item()})
    return {"ok": True, "results": results}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from _splitk_cases import _exact_bf16_dot

    _exact_bf16_dot()  # the interpreter's bfloat16 tl.dot multiplies the uint16 storage (see _splitk_cases.py)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    for case in CASES:
        try:
            out[case.name] = _run_case(case)
        except Exception as exc:  # noqa: BLE001 - reported per case to the parent test
            out[case.name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["_seconds"] = time.perf_counter() - start
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
