"""The split-K workspace in the C core, without a GPU: its size per call (dc_kernel_workspace_bytes, the same
rule as tuner.templates.workspace_bytes), a size that overflows refused as a fit code, and a launch of a split-K
kernel without a workspace of that size (16-byte aligned) refused before anything reaches the driver."""
from __future__ import annotations

import pytest

from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
from dietcode_ort.errors import DietcodeError
from dietcode_ort.runtime import LaunchArgs, load_core

PTX = ".version 8.0\n.target sm_80\n"


def _bundle(split_k: int, block_m: int = 16, block_n: int = 64, bmm: bool = False):
    params = ("a", "b", "c", "M", "N", "K") + (("stride_a_batch", "stride_b_batch") if bmm else ()) + \
        (("workspace", "counters") if split_k > 1 else ())
    kernel = BundleKernel(name="k", ptx=PTX, params=params, block_m=block_m, block_n=block_n, split_k=split_k)
    return load_core().parse(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes())


@pytest.mark.parametrize("m, n, batch, split_k, bm, bn", [
    (16, 768, 1, 8, 16, 64), (37, 29, 1, 4, 16, 16), (1, 1, 1, 2, 64, 64), (17, 19, 6, 2, 16, 16),
    (128, 3072, 1, 4, 64, 64), (5, 40, 3, 1, 16, 16)])
def test_workspace_size_is_the_templates(m: int, n: int, batch: int, split_k: int, bm: int, bn: int) -> None:
    from tuner.templates import workspace_bytes

    bundle = _bundle(split_k, bm, bn, bmm=batch > 1)
    args = LaunchArgs(M=m, N=n, K=64, batch=batch)
    want = workspace_bytes(m, n, batch, bm, bn, split_k)
    assert bundle.workspace_bytes(0, args) == want
    if split_k > 1:
        tiles = -(-m // bm) * -(-n // bn) * batch
        assert want >= tiles * (split_k * bm * bn * 4 + 4) and want % 16 == 0
    else:
        assert want == 0


def test_workspace_overflow_is_refused() -> None:
    # 4096 tiles of 4096x4096 x batch 65535 x 1024 splits: 2^64 bytes of partials, past int64
    bundle = _bundle(1024, 4096, 4096, bmm=True)
    args = LaunchArgs(M=4096 * 64, N=4096 * 64, K=64, batch=65535)
    fit, message = bundle.fit(0, args)
    assert fit == "workspace size" and "overflows int64" in message
    with pytest.raises(DietcodeError, match="workspace size: .*overflows int64"):
        bundle.workspace_bytes(0, args)
    core = load_core()
    assert core.lib.dc_launch(bundle.handle, 0, args, None) == -1 and "overflows int64" in core.error()
    args.batch = 1  # 2^48 bytes: a size, which the allocator may refuse, but no overflow
    assert bundle.fit(0, args)[0] == "fits"
    assert bundle.workspace_bytes(0, args) == 4096 * (1024 * 4096 * 4096 * 4 + 4)


def test_a_split_k_launch_needs_its_workspace() -> None:
    """dc_launch_fit refuses a split-K call whose workspace is missing, too small or misaligned (an error, not a
    fit code: the caller sizes it with dc_kernel_workspace_bytes), before it loads the driver."""
    core = load_core()
    bundle = _bundle(4)
    args = LaunchArgs(a=256, b=512, c=768, M=16, N=768, K=768, batch=1)
    need = bundle.workspace_bytes(0, args)
    assert need == 12 * (4 * 16 * 64 * 4 + 4)
    for workspace, size in ((0, need), (4096, need - 16), (4104, need)):
        args.workspace, args.workspace_bytes = workspace, size
        assert core.lib.dc_launch(bundle.handle, 0, args, None) == -1
        assert f"needs a workspace of {need} bytes, 16-byte aligned" in core.error(), core.error()
    args.workspace, args.workspace_bytes = 4096, need
    assert core.lib.dc_launch(bundle.handle, 0, args, None) == -1
    assert "workspace" not in core.error()  # past the workspace check: the driver (or no GPU) answers
