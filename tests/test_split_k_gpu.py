"""On a CUDA GPU: split-K kernels compiled ahead of time, bundled and launched through the C core (dc_launch,
which passes the counters it keeps for the stream, zeroed once) against torch, fp16 / bf16 / fp32, gemm with
gelu and the residual and bmm with a broadcast operand; bit-identical from launch to launch and shape to shape
on the same counters (so each launch left them at 0). Skipped without a GPU."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_TARGETS = {(8, 0): "sm_80", (8, 9): "sm_89", (9, 0): "sm_90"}


def _bundle_of(op: str, dtype: str, config, epilogue, tmp_path):
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import load_core
    from tuner.aot import compile_kernel
    from tuner.space import Family

    capability = torch.cuda.get_device_capability()
    if capability not in _TARGETS:
        pytest.skip(f"no profile for compute capability {capability}")
    kernel = compile_kernel(Family(op, dtype, _TARGETS[capability]), config, epilogue=epilogue, cache_dir=tmp_path)
    assert kernel.params[-2:] == ("workspace", "counters")
    bundle = Bundle((), (BundleKernel.from_compiled([kernel]),), DispatchTree.single(0))
    return load_core().parse(bundle.to_bytes())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_split_k_gemm_through_the_launcher(dtype: str, tmp_path) -> None:
    from dietcode_ort.runtime import LaunchArgs
    from tuner.space import MicroKernel
    from tuner.workload import Epilogue

    dt = getattr(torch, dtype)
    config = MicroKernel(16, 64, 64, 4, 3, 8, 8)
    epilogue = Epilogue(bias=True, activation="gelu", alpha=0.5, residual=True)
    cb = _bundle_of("gemm", dtype, config, epilogue, tmp_path)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(16, 768, 3072), (37, 100, 70), (5, 64, 40)]:  # the last: K < 8 x 64, empty splits
        a = torch.randn(m, k, device="cuda", generator=gen).to(dt)
        b = torch.randn(k, n, device="cuda", generator=gen).to(dt)
        bias = torch.randn(n, device="cuda", generator=gen).to(dt)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(dt)
        args = LaunchArgs(a=a.data_ptr(), b=b.data_ptr(), bias=bias.data_ptr(), residual=residual.data_ptr(),
                          M=m, N=n, K=k, batch=1)
        size = cb.workspace_bytes(0, args)
        # garbage everywhere: each split writes its partial, the counters are the launcher's own
        workspace = torch.full((size // 4,), -1, device="cuda", dtype=torch.int32)
        args.workspace, args.workspace_bytes = workspace.data_ptr(), size
        outs = []
        for _ in range(3):
            c = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
            args.c = c.data_ptr()
            cb.launch(0, args, torch.cuda.current_stream().cuda_stream)
            outs.append(c)
        torch.cuda.synchronize()
        ref = 0.5 * (a.double() @ b.double()) + bias.double()
        ref = 0.5 * ref * (1 + torch.erf(ref / math.sqrt(2))) + residual.double()
        tol = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-4}[dtype] * max(1.0, float(ref.abs().max()))
        assert float((outs[0].double() - ref).abs().max()) <= tol, (dtype, m, n, k)
        assert all(torch.equal(o, outs[0]) for o in outs[1:])  # deterministic
        tiles = -(-m // 16) * -(-n // 64)
        room = workspace[tiles * 8 * 16 * 64:tiles * 8 * 16 * 64 + tiles]
        assert bool((room == -1).all())  # the workspace's counter room is the fallback's, unused here


def test_split_k_bmm_with_a_broadcast_operand(tmp_path) -> None:
    from dietcode_ort.runtime import LaunchArgs
    from tuner.space import MicroKernel
    from tuner.workload import Epilogue

    config = MicroKernel(32, 64, 64, 4, 3, 8, 4)
    cb = _bundle_of("bmm", "float16", config, Epilogue(activation="none", alpha=0.125), tmp_path)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, m, n, k = 6, 50, 70, 300
    a = torch.randn(m, k, device="cuda", generator=gen).half()  # broadcast: batch stride 0
    b = torch.randn(batch, k, n, device="cuda", generator=gen).half()
    c = torch.full((batch, m, n), float("nan"), device="cuda", dtype=torch.float16)
    args = LaunchArgs(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), M=m, N=n, K=k, batch=batch,
                      stride_a_batch=0, stride_b_batch=k * n)
    size = cb.workspace_bytes(0, args)
    workspace = torch.empty(size, device="cuda", dtype=torch.uint8)
    args.workspace, args.workspace_bytes = workspace.data_ptr(), size
    cb.launch(0, args, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref = 0.125 * (a.float() @ b.float())
    torch.testing.assert_close(c.float(), ref, atol=2e-2 * float(ref.abs().max()), rtol=2e-2)


def test_split_k_node_on_the_cuda_ep_takes_its_workspace_from_ort(tmp_path) -> None:
    """An ai.dietcode::MatMulBiasGeluResidual node whose bundle holds one split-K kernel: on ORT's CUDA EP the
    node takes the workspace from ORT's scratch allocator per call and launches the kernel (the node's
    counters show launches and no fallback), with ORT's result."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import dietcode_ort
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
    from tuner.aot import compile_kernel
    from tuner.space import Family, MicroKernel
    from tuner.workload import Epilogue

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider")
    capability = torch.cuda.get_device_capability()
    if capability not in _TARGETS:
        pytest.skip(f"no profile for compute capability {capability}")
    epilogue = Epilogue(bias=True, activation="gelu", alpha=0.25, residual=True)
    kernel = compile_kernel(Family("gemm", "float16", _TARGETS[capability]), MicroKernel(16, 64, 64, 4, 3, 8, 4),
                            epilogue=epilogue, cache_dir=tmp_path)
    payload = Bundle((Feature("M", ((0, 0),)),), (BundleKernel.from_compiled([kernel]), BundleKernel.vendor()),
                     DispatchTree((0, -1, -1), (1 << 30, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes()
    node = helper.make_node("MatMulBiasGeluResidual", ["A", "B", "bias", "R", "bundle"], ["Y"], domain="ai.dietcode",
                            name="split", scale=0.25)
    f16 = TensorProto.FLOAT16
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, f16, None) for n in ("A", "B", "bias", "R")],
                              [helper.make_tensor_value_info("Y", f16, None)],
                              [numpy_helper.from_array(np.frombuffer(payload, np.uint8), "bundle")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.dietcode", 2)])
    model.ir_version = 10
    path = tmp_path / "split.onnx"
    onnx.save(model, path)
    sess = dietcode_ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        pytest.skip("the CUDA EP does not run here")
    rng = np.random.default_rng(0)
    dietcode_ort.reset_node_stats()
    for m in (16, 45, 128):
        feeds = {"A": rng.standard_normal((m, 768)).astype(np.float16),
                 "B": rng.standard_normal((768, 96)).astype(np.float16),
                 "bias": rng.standard_normal(96).astype(np.float16),
                 "R": rng.standard_normal((m, 96)).astype(np.float16)}
        (y,) = sess.run(None, feeds)
        z = 0.25 * (feeds["A"].astype(np.float64) @ feeds["B"].astype(np.float64)) + feeds["bias"]
        want = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2))) + feeds["R"]
        assert np.abs(y.astype(np.float64) - want).max() <= 2e-2 * max(1.0, np.abs(want).max())
    stats = dietcode_ort.node_stats()["split"]
    assert stats["launches"] == 3 and stats["fallbacks"] == 0, stats
