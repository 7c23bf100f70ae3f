"""The kernel ABI end to end without a GPU: the C++ runtime's view of a node call drives the Triton template.

For each ONNX node call below, the custom-op library computes the launch arguments its CUDA path would
pass (``dc_abi_view``: M, N, K, batch, batch strides, conv dims) and, for a split-K kernel, the workspace
bytes the call needs (``dc_kernel_workspace_bytes`` of a bundle holding that kernel); this script then
launches the matching template under ``TRITON_INTERPRET=1`` with exactly those arguments and a workspace of
exactly that size (NaN-filled, its counters zeroed as ``dc_launch_fit`` does), in the ABI's parameter order
and grid rule (as ``custom_ops/launch.cc`` does with a cubin), and compares with the ONNX semantics computed
by torch; a split-K case also checks that every counter is back to 0.
Run by tests/test_abi_contract.py in a child process (the interpreter flag must precede importing triton).
Prints one JSON object {case: {"view": "kernel"|"vendor", "max_err": float}}.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AbiCase", "CASES", "AttentionAbiCase", "ATTENTION_CASES", "main"]


@dataclass(frozen=True)
class AbiCase:
    name: str
    onnx_op: str  # MatMul | Gemm | Conv
    a: tuple[int, ...]
    b: tuple[int, ...]
    bias: tuple[int, ...] | None = None
    activation: str = "none"
    attrs: dict[str, Any] = field(default_factory=dict)
    config: tuple[int, ...] = (16, 16, 16, 2, 2)  # MicroKernel fields
    dtype: str = "float32"
    expect_kernel: bool = True  # False: the ABI cannot express it and ORT's kernel runs
    alpha: float = 1.0  # a MatMul's fused scale (the node's `scale`, the kernel's ALPHA constexpr)
    residual: bool = False  # MatMul/Conv...Residual: a tensor of the output's shape, the pointer after the ints
    residual_first: bool = False  # ...Residual<Act>: added before the activation (RESIDUAL_FIRST)
    residual_mul: bool = False  # ...<Act>Mul: multiplied after it (RESIDUAL_MUL, LLaMA's SwiGLU gate)
    tma: bool = False  # a TMA config (USE_TMA): the bundle kernel records 256 B of global scratch per program and
    # the TMA div16 set, so a call breaking it runs the vendor path (dc_kernel_fit)


CASES: tuple[AbiCase, ...] = (
    AbiCase("matmul_3d_bias_relu", "MatMul", (3, 17, 40), (40, 24), bias=(24,), activation="relu"),
    AbiCase("matmul_m1_gelu", "MatMul", (1, 33), (33, 20), activation="gelu"),
    AbiCase("matmul_fp16", "MatMul", (2, 9, 32), (32, 48), bias=(48,), dtype="float16"),
    AbiCase("matmul_split_k", "MatMul", (5, 64), (64, 12), config=(16, 16, 16, 2, 2, 8, 2)),
    AbiCase("matmul_3d_scale_bias_gelu_residual", "MatMul", (3, 17, 40), (40, 24), bias=(24,), activation="gelu",
            alpha=0.125, residual=True),
    AbiCase("matmul_split_k_residual_fp16", "MatMul", (2, 5, 64), (64, 12), config=(16, 16, 16, 2, 2, 8, 2),
            residual=True, dtype="float16"),
    AbiCase("matmul_split_k_bias_gelu_residual_fp16", "MatMul", (2, 9, 40), (40, 33), bias=(33,), activation="gelu",
            alpha=0.5, residual=True, config=(16, 16, 16, 2, 2, 8, 4), dtype="float16"),
    AbiCase("attention_split_k_batched", "MatMul", (2, 3, 17, 24), (2, 3, 24, 19), config=(16, 16, 16, 2, 2, 8, 2),
            alpha=0.25),
    AbiCase("conv_split_k_bias_gelu", "Conv", (2, 3, 9, 8), (8, 3, 3, 3), bias=(8,), activation="gelu",
            attrs={"pads": (1, 1, 1, 1)}, config=(16, 16, 16, 2, 2, 8, 4)),
    AbiCase("attention_scores_scaled", "MatMul", (2, 3, 17, 8), (2, 3, 8, 19), alpha=0.35355339059327373),
    AbiCase("attention_4d", "MatMul", (2, 3, 17, 8), (2, 3, 8, 19)),
    AbiCase("attention_a_broadcast", "MatMul", (17, 8), (2, 3, 8, 19)),
    AbiCase("attention_partial_broadcast", "MatMul", (2, 3, 17, 8), (1, 3, 8, 19), expect_kernel=False),
    AbiCase("gemm_trans_b_bias", "Gemm", (13, 40), (24, 40), bias=(24,), attrs={"trans_b": 1}),
    AbiCase("gemm_alpha", "Gemm", (13, 40), (40, 24), attrs={"alpha": 2.0}, expect_kernel=False),
    AbiCase("conv_stride2_pad_bias_relu", "Conv", (2, 3, 17, 15), (8, 3, 3, 3), bias=(8,), activation="relu",
            attrs={"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    AbiCase("conv_dilated_asymmetric", "Conv", (1, 4, 12, 11), (6, 4, 3, 2),
            attrs={"pads": (0, 1, 2, 1), "dilations": (2, 1)}),
    # ResNet's ConvBiasResidualRelu (the shortcut added before the Relu), also split-K; and the residual after
    AbiCase("conv_bias_residual_first_relu", "Conv", (2, 8, 9, 7), (16, 8, 1, 1), bias=(16,), activation="relu",
            residual=True, residual_first=True),
    AbiCase("conv_split_k_residual_first_relu_fp16", "Conv", (2, 3, 9, 8), (8, 3, 3, 3), bias=(8,),
            activation="relu", attrs={"strides": (2, 2), "pads": (1, 1, 1, 1)}, residual=True, residual_first=True,
            config=(16, 16, 16, 2, 2, 8, 3), dtype="float16"),
    AbiCase("conv_gelu_residual", "Conv", (1, 4, 6, 6), (5, 4, 3, 3), activation="gelu",
            attrs={"pads": (1, 1, 1, 1)}, residual=True),
    AbiCase("matmul_bias_residual_first_gelu", "MatMul", (2, 7, 24), (24, 20), bias=(20,), activation="gelu",
            alpha=0.5, residual=True, residual_first=True),
    # LLaMA's MatMulSiluMul: silu(x @ Wg) * up, the up-projection's output as the residual, also split-K
    AbiCase("matmul_3d_silu_mul", "MatMul", (2, 9, 40), (40, 24), activation="silu", residual=True, residual_mul=True),
    AbiCase("matmul_split_k_silu_mul_fp16", "MatMul", (2, 5, 64), (64, 20), activation="silu", residual=True,
            residual_mul=True, config=(16, 16, 16, 2, 2, 8, 3), dtype="float16"),
    AbiCase("tma_matmul_bias_gelu_residual_fp16", "MatMul", (2, 9, 32), (32, 48), bias=(48,), activation="gelu",
            alpha=0.5, residual=True, config=(16, 16, 16, 4, 2), dtype="float16", tma=True),
    AbiCase("tma_matmul_split_k_fp16", "MatMul", (5, 64), (64, 32), config=(16, 16, 16, 4, 2, 8, 4), dtype="float16",
            tma=True),
    AbiCase("tma_attention_batched_fp16", "MatMul", (2, 3, 17, 16), (2, 3, 16, 32), alpha=0.25, config=(16, 16, 16, 4, 2),
            dtype="float16", tma=True),
    AbiCase("tma_gemm_trans_b_fp16", "Gemm", (13, 48), (32, 48), bias=(32,), attrs={"trans_b": 1},
            config=(16, 16, 16, 4, 2), dtype="float16", tma=True),
    # K = 40: rows of 80 bytes break the TMA kernel's K div16 assumption, so the call runs the vendor path
    AbiCase("tma_matmul_k_not_div16", "MatMul", (9, 40), (40, 32), config=(16, 16, 16, 4, 2), dtype="float16",
            tma=True, expect_kernel=False),
)
TMA_SCRATCH = (256, 128)  # what Triton 3.9 asks of the TMA templates per program on sm_90 (tests/test_tma.py)


@dataclass(frozen=True)
class AttentionAbiCase:
    """An ai.dietcode::Attention call: the node's inputs in its operand layout (tuner.attention.LAYOUT_BITS)."""

    name: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    layout: int
    mask: tuple[int, ...] | None = None
    scale: float = 1.0
    config: tuple[int, int, int, int] = (16, 16, 2, 1)


ATTENTION_CASES: tuple[AttentionAbiCase, ...] = (
    AttentionAbiCase("attention_contiguous_bert_mask", 2, 3, 17, 17, 16, 0, mask=(2, 1, 1, 17), scale=0.25),
    AttentionAbiCase("attention_bshd_all_bert_mask", 2, 3, 17, 17, 16, 15, mask=(2, 1, 1, 17), scale=0.25),
    AttentionAbiCase("attention_bshd_q_k_rows_mask", 2, 2, 5, 19, 16, 3, mask=(2, 2, 5, 19)),
    AttentionAbiCase("attention_bshd_v_out_decode", 3, 2, 1, 17, 32, 12, scale=0.5),
)


def run_attention_case(case: AttentionAbiCase) -> dict[str, Any]:
    """dc_attention_view_layout's arguments for the node's input shapes drive attention_kernel (the ABI's
    parameter order and grid), compiled with the layout's constexprs; compared with the float64 chain."""
    import torch
    import triton

    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import load_core
    from tuner import templates
    from tuner.attention import AttentionConfig, attention_constexprs, reference_attention

    torch.manual_seed(0)
    b, h, tq, tk, d = case.batch, case.heads, case.seq_q, case.seq_k, case.head_dim
    q, kt, v = torch.randn(b, h, tq, d), torch.randn(b, h, d, tk), torch.randn(b, h, tk, d)
    mask = torch.randn(case.mask) if case.mask else None
    given = {"q": q.transpose(1, 2).contiguous() if case.layout & 1 else q,
             "k": kt.permute(0, 3, 1, 2).contiguous() if case.layout & 2 else kt,
             "v": v.transpose(1, 2).contiguous() if case.layout & 4 else v}
    core = load_core()
    args = core.attention_view(list(given["q"].shape), list(given["k"].shape), list(given["v"].shape),
                               list(case.mask) if case.mask else None, head_dim=d, layout=case.layout)
    if args is None:
        return {"view": "vendor"}
    out = torch.full((b, tq, h, d) if case.layout & 8 else (b, h, tq, d), float("nan"))
    config = AttentionConfig(*case.config)
    params = tuple(p for p in templates.ATTENTION_PARAMS if p != "mask" or mask is not None)
    mask_rows = mask is not None and args.stride_mask_q != 0
    kernel = BundleKernel(name="k", ptx=".version 8.0\n.target sm_80\n", params=params, block_m=config.block_m,
                          block_n=config.block_n, layout=case.layout, head_dim=d, mask_rows=mask_rows)
    bundle = core.parse(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes())
    bundle.check_attention(case.layout, d, mask_rows=mask_rows)
    assert args.head_dim == d
    fit, why = bundle.fit(0, args)
    assert fit == "fits", why
    pointers = {**given, "mask": mask.contiguous() if mask is not None else None, "out": out}
    values = [pointers[p] if p in pointers else getattr(args, p) for p in templates.ATTENTION_PARAMS]
    meta = attention_constexprs(config, d, scale=case.scale, has_mask=mask is not None,
                                mask_rows=args.stride_mask_q != 0, layout=case.layout)
    grid = (triton.cdiv(args.seq_q, config.block_m), 1, args.batch)  # the attention view's grid rule
    templates.attention_kernel[grid](*values, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
    want = reference_attention(q, kt, v, mask=mask, scale=case.scale).double()
    got = out.transpose(1, 2) if case.layout & 8 else out
    return {"view": "kernel", "max_err": float((got.double() - want).abs().max()), "scale": float(want.abs().max()),
            "workspace_bytes": 0}


def _view(core: Any, case: AbiCase, batched: bool) -> Any:
    at = case.attrs
    if case.onnx_op == "MatMul":
        return core.abi_view("MatMul", case.a, case.b, batched=batched)
    if case.onnx_op == "Gemm":
        return core.abi_view("Gemm", case.a, case.b, case.bias, ints=(0, at.get("trans_b", 0)),
                             floats=(at.get("alpha", 1.0), 1.0))
    ints = (*at.get("strides", (1, 1)), *at.get("pads", (0, 0, 0, 0)), *at.get("dilations", (1, 1)), 1)
    return core.abi_view("Conv", case.a, case.b, case.bias, ints=ints)


def _reference(torch: Any, case: AbiCase, a: Any, b: Any, bias: Any, residual: Any = None) -> Any:
    at = case.attrs
    a32, b32 = a.float(), b.float()
    if case.onnx_op == "MatMul":
        y = case.alpha * torch.matmul(a32, b32)
    elif case.onnx_op == "Gemm":
        y = at.get("alpha", 1.0) * (a32 @ (b32.T if at.get("trans_b") else b32))
    else:
        top, left, bottom, right = at.get("pads", (0, 0, 0, 0))
        y = torch.nn.functional.conv2d(torch.nn.functional.pad(a32, (left, right, top, bottom)), b32,
                                       stride=at.get("strides", (1, 1)), dilation=at.get("dilations", (1, 1)))
        if bias is not None:
            y = y + bias.float()[None, :, None, None]
        bias = None
    if bias is not None:
        y = y + bias.float()
    if residual is not None and case.residual_first:
        y = y + residual.float()
    if case.activation == "relu":
        y = torch.relu(y)
    elif case.activation == "gelu":
        y = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    elif case.activation == "silu":
        y = y * torch.sigmoid(y)
    if residual is not None and case.residual_mul:
        y = y * residual.float()
    elif residual is not None and not case.residual_first:
        y = y + residual.float()
    return y


def run_case(case: AbiCase) -> dict[str, Any]:
    import torch
    import triton

    from dietcode_ort.runtime import load_core
    from tuner import templates
    from tuner.workload import ConvParams

    torch.manual_seed(0)
    dtype = getattr(torch, case.dtype)
    a, b = torch.randn(case.a, dtype=dtype), torch.randn(case.b, dtype=dtype)
    bias = torch.randn(case.bias, dtype=dtype) if case.bias else None
    batched = case.onnx_op == "MatMul" and (len(case.a) > 2 and len(case.b) > 2 or len(case.b) > 2)
    args = _view(load_core(), case, batched)
    if args is None:
        return {"view": "vendor"}
    if case.tma:
        fit, why = _bundle(case, "bmm" if batched else "gemm", bias is not None).fit(0, args)
        if fit != "fits":
            return {"view": "vendor", "fit": fit, "why": why}
    op = {"MatMul": "bmm" if batched else "gemm", "Gemm": "gemm", "Conv": "conv"}[case.onnx_op]
    bm, bn, bk, warps, stages, *rest = case.config
    group_m, split_k = (rest + [8, 1])[:2] if rest else (8, 1)
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=case.activation, DOT_PRECISION="ieee", BLOCK_M=bm,
                BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    if case.tma:
        meta["USE_TMA"] = True
    if op in ("gemm", "conv"):
        meta["HAS_RESIDUAL"] = case.residual
        meta["RESIDUAL_FIRST"] = case.residual_first
        meta["RESIDUAL_MUL"] = case.residual_mul
    if op == "conv":
        at = case.attrs
        oc, c, kh, kw = case.b
        meta.update(templates.conv_geometry(ConvParams(c, oc, (kh, kw), tuple(at.get("strides", (1, 1))),
                                                       tuple(at.get("pads", (0, 0, 0, 0))),
                                                       tuple(at.get("dilations", (1, 1))))))
        out_shape = (args.img_n, oc, args.out_h, args.out_w)
    else:
        meta["TRANS_B"] = bool(case.attrs.get("trans_b", 0))
        meta["ALPHA"] = case.alpha
        out_shape = tuple(torch.matmul(torch.empty(case.a, device="meta"), torch.empty(case.b, device="meta").mT
                                       if meta["TRANS_B"] else torch.empty(case.b, device="meta")).shape)
    c_out = torch.full(out_shape, float("nan"), dtype=dtype)  # every element must be written
    residual = torch.randn(out_shape, dtype=dtype) if case.residual else None  # the output's shape (ort_ops.cc)
    size = _workspace_bytes(op, case, args, bias is not None, split_k)
    workspace = None
    if size and split_k > 1:  # what dc_launch_fit is given (a TMA kernel's scratch follows the split-K part): NaN partials (each split writes its own), counters zeroed
        workspace = torch.full((size // 4,), float("nan"), dtype=torch.float32)
        tiles = triton.cdiv(args.M, bm) * triton.cdiv(args.N, bn) * max(1, args.batch)
        counters = torch.zeros(tiles, dtype=torch.int32)  # what the launcher keeps per stream: zeros
    pointers = {"a": a.contiguous(), "b": b.contiguous(), "bias": bias, "c": c_out, "residual": residual,
                "workspace": workspace, "counters": counters if workspace is not None else None}
    values = [pointers[p] if p in pointers else getattr(args, p) for p in templates.ABI_PARAMS[op]]
    grid = (triton.cdiv(args.M, bm) * triton.cdiv(args.N, bn), split_k, max(1, args.batch))  # the ABI's grid rule
    templates.KERNELS[op][grid](*values, **meta)
    want = _reference(torch, case, a, b, bias, residual)
    out = {"view": "kernel", "max_err": float((c_out.float() - want).abs().max()), "scale": float(want.abs().max()),
           "workspace_bytes": size, "python_workspace_bytes": templates.workspace_bytes(
               args.M, args.N, args.batch, bm, bn, split_k, *(TMA_SCRATCH if case.tma else (0, 1)))}
    if workspace is not None:
        out["counters"] = counters.tolist()
    return out


def _bundle(case: AbiCase, op: str, bias: bool) -> Any:
    """The C core's parse of a one-kernel bundle of this case's config (a TMA one with its scratch and div16)."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import load_core
    from tuner import templates
    from tuner.aot import tma_div16

    bm, bn, *_ = case.config
    split_k = (list(case.config[5:]) + [8, 1])[1]
    params = tuple(p for p in templates.ABI_PARAMS[op] if (p != "bias" or bias) and (p != "residual" or case.residual)
                   and (p not in ("workspace", "counters") or split_k > 1))
    conv = (case.b[1], case.b[2], case.b[3], 1, 1, 1, 1, 1, 1) if op == "conv" else ()
    kernel = BundleKernel(name="k", ptx=".version 8.0\n.target sm_90a\n", params=params, block_m=bm, block_n=bn,
                          split_k=split_k, conv=conv, div16=tma_div16(op) if case.tma else (),
                          ptx_scratch=TMA_SCRATCH if case.tma else (0, 1))
    return load_core().parse(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes())


def _workspace_bytes(op: str, case: AbiCase, args: Any, bias: bool, split_k: int) -> int:
    """The workspace bytes the C core gives this call for a bundle kernel of this config
    (dc_kernel_workspace_bytes), after checking that the call fits it (dc_kernel_fit)."""
    bundle = _bundle(case, op, bias)
    fit, why = bundle.fit(0, args)
    assert fit == "fits", why
    return bundle.workspace_bytes(0, args)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    out = {}
    for case in CASES:
        try:
            out[case.name] = run_case(case)
        except Exception as exc:  # reported per case
            out[case.name] = {"view": "error", "error": f"{type(exc).__name__}: {exc}"}
    for acase in ATTENTION_CASES:
        try:
            out[acase.name] = run_attention_case(acase)
        except Exception as exc:  # reported per case
            out[acase.name] = {"view": "error", "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
