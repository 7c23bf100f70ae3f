"""GPU launch through the C core: a Triton kernel compiled ahead of time, bundled, launched with dc_launch.

Skipped without a CUDA GPU (torch.cuda). Uses torch tensors for device memory and torch's current stream,
so it tests the core's module loading, argument marshalling and grid rule without ORT.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _compile():
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def mm(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BLOCK_N)
        rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            y = tl.load(b + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(x, y)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c + rm[:, None] * N + rn[None, :], acc, mask=mask)

    major, minor = torch.cuda.get_device_capability()
    sig = {"a": "*fp32", "b": "*fp32", "c": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    consts = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
    compiled = triton.compile(ASTSource(mm, sig, consts), target=GPUTarget("cuda", major * 10 + minor, 32))
    return compiled, major * 10 + minor


def test_dc_launch_matches_torch() -> None:
    """A plain kernel (split-K kernels, with their workspace: tests/test_split_k_gpu.py)."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
    from dietcode_ort.runtime import LaunchArgs, load_core

    compiled, cc = _compile()
    md = compiled.metadata
    arch = f"sm_{cc}{'a' if cc >= 90 else ''}"
    kernel = BundleKernel(name=md.name, images=((arch, compiled.asm["cubin"]),), ptx=compiled.asm["ptx"],
                          params=("a", "b", "c", "M", "N", "K"), num_warps=md.num_warps, shared=md.shared,
                          block_m=32, block_n=32)
    bundle = Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), kernel),
                    DispatchTree((0, -1, -1), (0, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1)))
    cb = load_core().parse(bundle.to_bytes())
    for m, n, k in [(1, 1, 1), (37, 45, 70), (128, 96, 64)]:
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(k, n, device="cuda")
        c = torch.full((m, n), float("nan"), device="cuda")  # every element is written
        kid = cb.select([m])
        assert kid == 1
        args = LaunchArgs(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), c_bytes=c.numel() * 4, M=m, N=n, K=k,
                          batch=1)
        cb.launch(kid, args, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        torch.testing.assert_close(c, a @ b, rtol=2e-2, atol=2e-2)  # tf32 dot
