"""Fused attention on a CUDA GPU (skipped without one): the JIT template against torch, and a fused tiny BERT
under ORT's CUDA EP against stock ORT's CUDA EP on the original model."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_TOL = {"float32": 2e-3, "float16": 2e-3, "bfloat16": 2e-2}  # float32: the reference's matmuls may use TF32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("seq", [1, 17, 128, 509])
def test_jit_attention_matches_torch(dtype: str, seq: int) -> None:
    from tuner.attention import AttentionConfig, attention_space, reference_attention, run_attention

    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seq)
    batch, heads, d = 3, 4, 64
    q = torch.randn(batch, heads, seq, d, device="cuda", generator=gen).to(dt)
    kt = torch.randn(batch, heads, d, seq, device="cuda", generator=gen).to(dt)
    v = torch.randn(batch, heads, seq, d, device="cuda", generator=gen).to(dt)
    mask = torch.zeros(batch, 1, 1, seq, device="cuda")
    mask[1:, ..., seq // 2 + 1:] = -10000.0
    mask = mask.to(dt)
    want = reference_attention(q.cpu(), kt.cpu(), v.cpu(), mask=mask.cpu(), scale=0.125).double()
    space = attention_space(dtype, "sm_90" if torch.cuda.get_device_capability()[0] >= 9 else "sm_80", d)
    for config in (space[0], space[len(space) // 2], space[-1], AttentionConfig(64, 64, 4, 2)):
        if config not in space:
            continue
        got = run_attention(config, q, kt, v, mask=mask, scale=0.125).double().cpu()
        assert (got - want).abs().max().item() <= _TOL[dtype], config.key()


@pytest.mark.parametrize("layout", [1, 2, 12, 15])
def test_jit_attention_reads_the_head_split_layouts(layout: int) -> None:
    """Q, K, V given as [batch, seq, heads, d] (the Reshape outputs before the head-split Transposes) and the
    output written so, as the layout bits say, on the GPU against the float64 chain."""
    from tuner.attention import AttentionConfig, reference_attention, run_attention

    gen = torch.Generator(device="cuda").manual_seed(layout)
    batch, heads, seq, d = 2, 3, 77, 64
    q, kt, v = (torch.randn(*s, device="cuda", generator=gen).half()
                for s in ((batch, heads, seq, d), (batch, heads, d, seq), (batch, heads, seq, d)))
    mask = torch.zeros(batch, 1, 1, seq, device="cuda", dtype=torch.half)
    mask[1:, ..., seq // 2:] = -10000.0
    want = reference_attention(q.cpu(), kt.cpu(), v.cpu(), mask=mask.cpu(), scale=0.125).double()
    given = (q.transpose(1, 2).contiguous() if layout & 1 else q, kt.permute(0, 3, 1, 2).contiguous() if layout & 2
             else kt, v.transpose(1, 2).contiguous() if layout & 4 else v)
    got = run_attention(AttentionConfig(64, 64, 4, 2), *given, mask=mask, scale=0.125, layout=layout)
    got = (got.transpose(1, 2) if layout & 8 else got).double().cpu()
    assert (got - want).abs().max().item() <= _TOL["float16"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_optimized_bert_attention_launches_on_cuda_ep_and_matches_stock_ort(dtype: str, tmp_path) -> None:
    """optimize (fused attention by default, analytic tuning for this GPU's target) -> the CUDA EP launches the
    Attention nodes' tuned kernels (node_stats) and matches stock ORT's CUDA EP on the original model."""
    import onnxruntime as ort

    import models
    from dietcode_ort.runtime import node_stats, provider_usable, register, reset_node_stats
    from models.bert import PRESETS, build_graph
    from tuner.optimize import OptimizeOptions, default_targets, optimize

    if not provider_usable("CUDAExecutionProvider"):
        pytest.skip("ORT's CUDA EP is not usable here")
    model = build_graph(PRESETS["tiny"], dtype, 0)
    src, out = tmp_path / "bert.onnx", tmp_path / "bert.opt.onnx"
    models.save_model(model, src)
    optimize(src, out, OptimizeOptions(targets=default_targets(), dims=("batch=1:4", "seq=1:128:16"), budget=8,
                                       max_kernels=2, measure="analytic", db=tmp_path / "t.db",
                                       cache_dir=tmp_path / "k", progress=False), log=lambda _: None)
    import onnx

    # the head-split and head-merge Transposes are absorbed: the Attention nodes read and write [B, S, H, d]
    assert [n.op_type for n in model.graph.node].count("Transpose") == 4 * PRESETS["tiny"].layers
    assert "Transpose" not in [n.op_type for n in onnx.load(str(out)).graph.node]
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    stock = ort.InferenceSession(model.SerializeToString(), providers=providers)
    opts = ort.SessionOptions()
    register(opts)
    ours = ort.InferenceSession(str(out), opts, providers=providers)
    reset_node_stats()
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 1), (4, 33), (2, 128)):
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq // 2:] = 0
        feeds = {"input_ids": rng.integers(0, 100, size=(batch, seq), dtype=np.int64), "attention_mask": mask}
        want = stock.run(None, feeds)[0].astype(np.float64)
        got = ours.run(None, feeds)[0].astype(np.float64)
        tol = 2e-2 if dtype == "float16" else 2e-3
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    stats = node_stats()
    attention = [name for name in stats if name.endswith("attention/self/MatMul_1")]
    assert len(attention) == PRESETS["tiny"].layers
    assert all(stats[name]["launches"] == 3 and stats[name]["fallbacks"] == 0 for name in attention)


@pytest.mark.parametrize("layout", [23, 31])
def test_jit_attention_reads_the_packed_projection(layout: int) -> None:
    """The packed layout on the GPU: Q, K, V parts 0, 1, 2 of one [B, S, 3*H*d] projection, against float64."""
    from tuner.attention import AttentionConfig, reference_attention, run_attention

    gen = torch.Generator(device="cuda").manual_seed(layout)
    batch, heads, seq, d = 2, 3, 77, 64
    packed = torch.randn(batch, seq, 3 * heads * d, device="cuda", generator=gen).half()
    q, k, v = (t.transpose(1, 2) for t in packed.view(batch, seq, 3, heads, d).unbind(2))
    mask = torch.zeros(batch, 1, 1, seq, device="cuda").half()
    mask[0, ..., -9:] = -10000.0
    want = reference_attention(q.cpu(), k.transpose(-1, -2).cpu(), v.cpu(), mask=mask.cpu(), scale=0.125).double()
    got = run_attention(AttentionConfig(64, 64, 4, 2), packed, packed, packed, mask=mask, scale=0.125, layout=layout,
                        head_dim=d)
    got = (got.transpose(1, 2) if layout & 8 else got).double().cpu()
    assert (got - want).abs().max() < 2e-2


def test_optimized_bert_reads_packed_qkv_on_cuda_ep_like_the_cpu_ep(tmp_path) -> None:
    """optimize merges tiny BERT's Q/K/V projections into one GEMM read packed by the Attention nodes; the CUDA
    EP's outputs equal the CPU EP's (the library's CPU kernels) on the optimized model."""
    import onnx
    import onnxruntime as ort

    import models
    from dietcode_ort.runtime import provider_usable, register
    from models.bert import PRESETS, build_graph
    from tuner.optimize import OptimizeOptions, default_targets, optimize

    if not provider_usable("CUDAExecutionProvider"):
        pytest.skip("ORT's CUDA EP is not usable here")
    model = build_graph(PRESETS["tiny"], "float16", 0)
    src, out = tmp_path / "bert.onnx", tmp_path / "bert.opt.onnx"
    models.save_model(model, src)
    optimize(src, out, OptimizeOptions(targets=default_targets(), dims=("batch=1:4", "seq=1:128:16"), budget=8,
                                       max_kernels=2, measure="analytic", db=tmp_path / "t.db",
                                       cache_dir=tmp_path / "k", progress=False), log=lambda _: None)
    nodes = onnx.load(str(out)).graph.node
    assert all(next(a.i for a in n.attribute if a.name == "layout") == 31 for n in nodes if n.op_type == "ScaledDotProductAttention")
    assert not any(n.op_type in ("Split", "Transpose") for n in nodes)
    opts = ort.SessionOptions()
    register(opts)
    cuda = ort.InferenceSession(str(out), opts, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    opts = ort.SessionOptions()
    register(opts)
    cpu = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 1), (4, 33), (2, 128)):
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq // 2:] = 0
        feeds = {"input_ids": rng.integers(0, 100, size=(batch, seq), dtype=np.int64), "attention_mask": mask}
        np.testing.assert_allclose(cuda.run(None, feeds)[0].astype(np.float64),
                                   cpu.run(None, feeds)[0].astype(np.float64), atol=2e-2, rtol=2e-2)
