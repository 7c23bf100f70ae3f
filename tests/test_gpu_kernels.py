"""On a CUDA GPU: the templates through Triton's JIT against torch, and an AOT cubin launched through the
CUDA driver exactly as the kernel ABI says (params in order, two null scratch pointers, grid rule,
dynamic shared memory, a workspace with zeroed counters under split-K). Skipped without a GPU."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_TARGETS = {(8, 0): "sm_80", (8, 9): "sm_89", (9, 0): "sm_90"}


def _target() -> str:
    capability = torch.cuda.get_device_capability()
    if capability not in _TARGETS:
        pytest.skip(f"no profile for compute capability {capability}")
    return _TARGETS[capability]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jit_templates_match_torch(dtype: str) -> None:
    from tuner.space import MicroKernel
    from tuner.templates import run
    from tuner.workload import ConvParams, Epilogue

    dt = getattr(torch, dtype)
    tol = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-3}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(77, 300, device="cuda", generator=gen).to(dt)
    w = torch.randn(300, 130, device="cuda", generator=gen).to(dt)
    bias = torch.randn(130, device="cuda", generator=gen).to(dt)
    for config in (MicroKernel(64, 64, 32, 4, 3), MicroKernel(16, 64, 64, 2, 2, 8, 4)):
        act = "gelu"  # split-K too: the last split of a tile applies the epilogue
        y = run("gemm", config, a, w, bias=bias, epilogue=Epilogue(True, act))
        ref = a.float() @ w.float() + bias.float()
        ref = torch.nn.functional.gelu(ref) if act == "gelu" else ref
        torch.testing.assert_close(y.float(), ref, atol=tol * 10, rtol=tol)
    x = torch.randn(2, 8, 15, 13, device="cuda", generator=gen).to(dt)
    k = torch.randn(16, 8, 3, 3, device="cuda", generator=gen).to(dt)
    conv = ConvParams(8, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1))
    y = run("conv", MicroKernel(64, 32, 32, 4, 2), x, k, conv=conv)
    ref = torch.nn.functional.conv2d(x.float(), k.float(), stride=2, padding=1)
    torch.testing.assert_close(y.float(), ref, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("act", ["relu", "relu6"])
def test_jit_relu_keeps_nan_as_onnxruntime_does(act: str) -> None:
    """Rows of A that are NaN give NaN rows through relu and relu6 (max.NaN), as onnxruntime's CUDA Relu and Clip
    do, under split-K too; the other rows match torch."""
    from tuner.space import MicroKernel
    from tuner.templates import run
    from tuner.workload import Epilogue

    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(40, 96, device="cuda", generator=gen).half()
    w = torch.randn(96, 72, device="cuda", generator=gen).half()
    bias = torch.randn(72, device="cuda", generator=gen).half()
    a[[0, 17]] = float("nan")
    ref = a.float() @ w.float() + bias.float()
    ref = torch.relu(ref) if act == "relu" else torch.clamp(ref, 0.0, 6.0)
    for config in (MicroKernel(32, 64, 32, 4, 2), MicroKernel(16, 64, 32, 2, 2, 8, 3)):
        y = run("gemm", config, a, w, bias=bias, epilogue=Epilogue(True, act)).float()
        assert torch.equal(y.isnan(), ref.isnan()), f"{config.key()}: NaN rows lost"
        torch.testing.assert_close(y.nan_to_num(), ref.nan_to_num(), atol=0.2, rtol=2e-2)


def _check(result: int, what: str) -> None:
    assert result == 0, f"{what} failed with CUresult {result}"


def test_aot_cubin_launches_per_abi(tmp_path: Path) -> None:
    from tuner.aot import aligned_params, compile_kernel
    from tuner.space import Family, MicroKernel
    from tuner.workload import Epilogue

    target = _target()
    m, n, k = 100, 96, 64  # K, N multiples of 16 so the div16 variant applies
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    cuda = ctypes.CDLL("libcuda.so.1")
    from tuner.templates import workspace_bytes

    for config, epilogue in ((MicroKernel(64, 64, 32, 4, 3), Epilogue(True, "relu")),
                             (MicroKernel(32, 64, 64, 4, 2, 8, 4), Epilogue(True, "relu"))):
        kernel = compile_kernel(Family("gemm", "float16", target), config, epilogue=epilogue, cache_dir=tmp_path,
                                div16=aligned_params("gemm"))
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        size = workspace_bytes(m, n, 1, kernel.block_m, kernel.block_n, kernel.split_k)
        workspace = torch.full((max(size, 16) // 4,), float("nan"), device="cuda")  # NaN partials
        tiles = -(-m // kernel.block_m) * -(-n // kernel.block_n)
        counters = torch.zeros(max(tiles, 1), device="cuda", dtype=torch.int32)
        assert ("workspace" in kernel.params) == ("counters" in kernel.params) == (kernel.split_k > 1)
        values = {"a": a.data_ptr(), "b": b.data_ptr(), "bias": bias.data_ptr(), "c": c.data_ptr(),
                  "workspace": workspace.data_ptr(), "counters": counters.data_ptr(), "M": m, "N": n, "K": k}
        args = [ctypes.c_void_p(values[p]) if p in ("a", "b", "bias", "c", "workspace", "counters")
                else ctypes.c_int32(values[p])
                for p in kernel.params]
        args += [ctypes.c_void_p(0), ctypes.c_void_p(0)]  # global_scratch, profile_scratch
        params = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in args))
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(kernel.cubin)), "cuModuleLoadData")
        _check(cuda.cuModuleGetFunction(ctypes.byref(function), module, kernel.name.encode()), "cuModuleGetFunction")
        if kernel.shared > 48 * 1024:
            _check(cuda.cuFuncSetAttribute(function, 8, kernel.shared), "cuFuncSetAttribute")
        grid = (-(-m // kernel.block_m) * -(-n // kernel.block_n), kernel.split_k, 1)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(cuda.cuLaunchKernel(function, *grid, kernel.threads, 1, 1, kernel.shared, stream, params, None),
               "cuLaunchKernel")
        torch.cuda.synchronize()
        ref = a.float() @ b.float() + bias.float()
        ref = torch.relu(ref) if epilogue.activation == "relu" else ref
        torch.testing.assert_close(c.float(), ref, atol=0.2, rtol=2e-2)
        cuda.cuModuleUnload(module)
