"""Ahead-of-time compilation: cubins for sm_80/sm_90 without a GPU, metadata within the profile's limits,
the disk cache, scratch refusal, failures as data, JSON round trips, the compile-time filter."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dietcode_ort.errors import DietcodeError
from tuner import aot, space
from tuner.aot import CompiledKernel, CompileJob, CompileResult, aligned_params, compile_kernel, compile_many
from tuner.hardware import get_profile
from tuner.space import Family, MicroKernel, validate
from tuner.workload import ConvParams, Epilogue

CONV = ConvParams(in_channels=8, out_channels=16, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
DTYPE_OF = {"gemm": "float16", "bmm": "bfloat16", "conv": "float32"}
TILE = MicroKernel(64, 64, 32, 4, 3)
SPLIT = MicroKernel(32, 64, 64, 4, 2, 8, 4)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def _jobs(cache: Path) -> list[CompileJob]:
    """One config per (op, target): each op gets a plain tile with bias+gelu (pipelined, div16) on one
    target and a split-K tile with gelu (trans_b for gemm/bmm; conv in float32, the others in their 16-bit
    dtype) on the other."""
    jobs = []
    for target, split_ops in (("sm_80", ("gemm", "conv")), ("sm_90", ("bmm",))):
        for op, dtype in DTYPE_OF.items():
            family = Family(op, dtype, target)
            conv = CONV if op == "conv" else None
            if op in split_ops:
                jobs.append(CompileJob(family, SPLIT, Epilogue(op != "bmm", "gelu"), trans_b=op != "conv",
                                       conv=conv, cache_dir=cache))
            else:
                jobs.append(CompileJob(family, TILE, Epilogue(True, "gelu"), conv=conv, cache_dir=cache,
                                       div16=aligned_params(op)))
    return jobs


@pytest.fixture(scope="module")
def sample(cache: Path) -> list[CompileResult]:
    return compile_many(_jobs(cache), workers=2)


@pytest.mark.ptx
def test_sample_of_each_family_compiles_within_limits(sample: list[CompileResult]) -> None:
    assert len(sample) == 6
    assert {r.job.family.op for r in sample if r.job.config.split_k > 1} == {"gemm", "bmm", "conv"}
    for result in sample:
        assert result.ok, result.error
        kernel, job = result.kernel, result.job
        assert kernel is not None
        validate(job.family, job.config)
        profile = get_profile(job.family.target)
        assert kernel.arch == profile.arch and kernel.cubin[:4] == b"\x7fELF"
        assert f".target sm_{profile.arch}" in kernel.ptx
        assert kernel.shared <= profile.smem_per_block_optin
        assert kernel.global_scratch_size == 0 and kernel.profile_scratch_size == 0 and kernel.scratch_params
        assert kernel.n_regs is not None and 0 < kernel.n_regs <= profile.regs_per_thread
        assert kernel.n_spills is not None
        assert kernel.num_warps == job.config.num_warps and kernel.grid == "tiles_mn,split_k,batch"
        assert (kernel.block_m, kernel.block_n, kernel.split_k) == (job.config.block_m, job.config.block_n,
                                                                    job.config.split_k)

        expected = {"gemm": ["a", "b", "bias", "c", "M", "N", "K"],
                    "bmm": ["a", "b", "bias", "c", "M", "N", "K", "stride_a_batch", "stride_b_batch"],
                    "conv": ["a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w"]}
        params = [p for p in expected[job.family.op] if p != "bias" or job.epilogue.bias]
        params += ["workspace", "counters"] if job.config.split_k > 1 else []  # split-K kernels take them, last
        assert list(kernel.params) == params
        # The PTX entry takes the ABI params plus the two trailing scratch pointers.
        entry = kernel.ptx[kernel.ptx.index(".entry"):]
        assert entry[:entry.index(")")].count(".param") == len(params) + 2


def test_pipelined_variant_uses_more_shared_memory(sample: list[CompileResult]) -> None:
    """div16 lets Triton pipeline the loads: on sm_90 the stages show up in shared memory."""
    by_job = {(r.job.family, r.job.config): r.kernel for r in sample}
    kernel = by_job[(Family("gemm", "float16", "sm_90"), TILE)]
    assert kernel is not None and kernel.div16 == tuple(sorted(aligned_params("gemm")))
    assert kernel.shared >= 2 * (64 * 32 + 32 * 64) * 2


def test_cache_hit_returns_identical_artifact(sample: list[CompileResult], cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    job = sample[-1].job
    calls: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("recompiled")

    monkeypatch.setattr(aot, "_triton_compile", refuse)
    again = compile_kernel(job.family, job.config, epilogue=job.epilogue, trans_b=job.trans_b, conv=job.conv,
                           cache_dir=cache, div16=job.div16)
    assert again == sample[-1].kernel and not calls
    with pytest.raises(AssertionError, match="recompiled"):  # a different epilogue is a different entry
        compile_kernel(job.family, job.config, epilogue=Epilogue(False, "relu"), conv=job.conv, cache_dir=cache,
                       div16=job.div16)
    assert len(calls) == 1


def test_json_round_trip(sample: list[CompileResult]) -> None:
    for result in sample:
        assert result.kernel is not None
        data = json.loads(json.dumps(result.kernel.to_dict()))
        assert CompiledKernel.from_dict(data) == result.kernel


@pytest.mark.parametrize("global_size, align, profile_size", [(256, 128, 64), (1 << 20, 128, 0), (256, 96, 0)])
def test_scratch_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, global_size: int, align: int,
                            profile_size: int) -> None:
    """Profile scratch, and global scratch the launcher does not pass (over 64 KiB per program, or an alignment
    that is not a power of two dividing it), are refused; TMA's 256 B aligned to 128 is taken (tests/test_tma.py)."""
    fake = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=global_size, global_scratch_align=align,
                                                    profile_scratch_size=profile_size, name="k", num_warps=4, shared=0),
                           asm={"cubin": b"", "ptx": ""})
    monkeypatch.setattr(aot, "_triton_compile", lambda *a, **k: (fake, ""))
    with pytest.raises(DietcodeError, match="needs scratch memory .*refused"):
        compile_kernel(Family("gemm", "float16", "sm_80"), TILE, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_bad_input_is_rejected(tmp_path: Path) -> None:
    gemm = Family("gemm", "float16", "sm_80")
    with pytest.raises(DietcodeError, match=r"\['workspace'\] are not parameters of gemm"):
        compile_kernel(gemm, SPLIT, div16=("workspace",), cache_dir=tmp_path)  # always aligned, not a div16 bit
    with pytest.raises(DietcodeError, match="ConvParams are required"):
        compile_kernel(Family("conv", "float16", "sm_80"), TILE, cache_dir=tmp_path)
    with pytest.raises(DietcodeError, match="not parameters of gemm; allowed: a, b, c, M, N, K"):
        compile_kernel(gemm, TILE, div16=("bias", "stride_a_batch"), cache_dir=tmp_path)
    with pytest.raises(DietcodeError, match="float32 only"):
        compile_kernel(gemm, TILE, allow_tf32=True, cache_dir=tmp_path)
    with pytest.raises(DietcodeError, match="known targets"):
        compile_kernel(Family("gemm", "float16", "sm_75"), TILE, cache_dir=tmp_path)


def test_compile_failures_are_data(tmp_path: Path) -> None:
    bad = CompileJob(Family("gemm", "float16", "sm_80"), SPLIT, Epilogue(False, "tanh"), cache_dir=tmp_path)
    (result,) = compile_many([bad], workers=1)
    assert result.kernel is None and not result.ok and "unknown activation 'tanh'" in result.error


def test_compile_many_refuses_no_workers_and_caps_them_at_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each compile keeps one CPU busy: a pool larger than the CPUs this process may use (or than the jobs) only
    adds processes (``space --workers 5000`` started one per job); fewer than one worker is refused."""
    from concurrent.futures import Future

    sizes: list[int] = []

    class Pool:  # runs each job here, recording the pool's size
        def __init__(self, max_workers: int, **_: Any) -> None:
            sizes.append(max_workers)

        def submit(self, fn: Any, job: CompileJob) -> Future:
            future: Future = Future()
            future.set_result(fn(job))
            return future

        def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
            pass

    monkeypatch.setattr(aot, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(aot, "_run_job", lambda job: CompileResult(job, None, "not compiled"))
    monkeypatch.setattr(aot, "usable_cpus", lambda: 4)
    jobs = [CompileJob(Family("gemm", "float16", "sm_80"), TILE)] * 50
    assert len(compile_many(jobs, workers=100000)) == 50 and sizes == [4]
    assert len(compile_many(jobs)) == 50 and sizes == [4, 4]
    assert len(compile_many(jobs[:3], workers=8)) == 3 and sizes == [4, 4, 3]
    assert len(compile_many(jobs, workers=1)) == 50 and sizes == [4, 4, 3]  # one: no pool
    for bad in (0, -3):
        with pytest.raises(DietcodeError, match=f"compile workers must be at least 1, got {bad}"):
            compile_many(jobs, workers=bad)
    monkeypatch.undo()
    assert 1 <= aot.usable_cpus() <= (os.cpu_count() or 1)


def test_default_cache_dir_reads_one_variable(tmp_path: Path) -> None:
    assert aot.default_cache_dir({"DIETCODE_CACHE": str(tmp_path)}) == tmp_path
    assert aot.default_cache_dir({}).parts[-3:] == (".cache", "dietcode-ort", "kernels")


def test_compile_filter_drops_by_metadata(sample: list[CompileResult], monkeypatch: pytest.MonkeyPatch) -> None:
    family = Family("gemm", "float16", "sm_80")
    base = next(r.kernel for r in sample if r.job.family.op == "gemm" and r.job.family.dtype == "float16")
    assert base is not None
    configs = [MicroKernel(64, 64, 32, 4, 2), MicroKernel(64, 64, 32, 4, 3), MicroKernel(64, 64, 32, 4, 4),
               MicroKernel(64, 128, 32, 4, 2)]
    limit = get_profile("sm_80").smem_per_block_optin

    def fake_many(jobs: list[CompileJob], workers: int | None = None) -> list[CompileResult]:
        # the heaviest epilogue every config takes, split-K ones too: bias, gelu and the residual
        assert all(job.div16 == aligned_params("gemm", residual=True) for job in jobs)
        assert all(job.epilogue == Epilogue(True, "gelu", residual=True) for job in jobs)
        kernels = [dataclasses.replace(base, shared=limit + 1), dataclasses.replace(base, n_spills=16),
                   None, dataclasses.replace(base, config=jobs[3].config)]
        return [CompileResult(job, k, "" if k else "PTXASError: boom") for job, k in zip(jobs, kernels)]

    monkeypatch.setattr(aot, "compile_many", fake_many)
    result = space.compile_filter(family, configs)
    assert result.counts() == {"compile_error": 1, "compiled_shared": 1, "spills": 1, "kept": 1}
    assert [c for c, _ in result.kept] == [configs[3]]
    with pytest.raises(DietcodeError, match="outside the space"):
        space.compile_filter(family, [MicroKernel(48, 64, 32, 4, 2)])


def test_launch_features_beyond_a_plain_launch_are_refused():
    """Metadata asking for several CTAs, clusters, PDL or a cooperative grid is named (and compile_kernel
    refuses the kernel); Triton's plain metadata asks for none."""
    from types import SimpleNamespace

    from tuner.aot import launch_features

    plain = SimpleNamespace(num_ctas=1, cluster_dims=(1, 1, 1), launch_pdl=False, launch_cooperative_grid=False)
    assert launch_features(plain) == []
    assert launch_features(SimpleNamespace(num_ctas=2)) == ["num_ctas=2"]
    assert launch_features(SimpleNamespace(cluster_dims=(2, 1, 1))) == ["cluster_dims=(2, 1, 1)"]
    assert launch_features(SimpleNamespace(launch_pdl=True, launch_cooperative_grid=True)) == [
        "programmatic dependent launch", "a cooperative grid"]


def test_conv_with_the_residual_before_the_relu_compiles_for_sm80_and_sm90(cache: Path) -> None:
    """ResNet's ConvBiasResidualRelu kernel: the conv template takes the residual pointer after out_w (ABI param
    15, before the split-K workspace), RESIDUAL_FIRST baked in; the bundle records it (flags bit 0) and the C
    reader reads it back."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, read_bundle

    epilogue = Epilogue(True, "relu", residual=True, residual_first=True)
    jobs = [CompileJob(Family("conv", "float16", "sm_80"), TILE, epilogue, conv=CONV, cache_dir=cache,
                       div16=aligned_params("conv", residual=True)),
            CompileJob(Family("conv", "float32", "sm_90"), SPLIT, epilogue, conv=CONV, cache_dir=cache)]
    for result in compile_many(jobs, workers=2):
        assert result.ok, result.error
        kernel = result.kernel
        assert kernel is not None and kernel.cubin[:4] == b"\x7fELF"
        want = ["a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual"]
        assert list(kernel.params) == want + (["workspace", "counters"] if result.job.config.split_k > 1 else [])
        assert dict(kernel.constants)["RESIDUAL_FIRST"] is True and dict(kernel.constants)["HAS_RESIDUAL"] is True
        if result.job.config.split_k == 1:
            assert "residual" in kernel.div16
        bundled = BundleKernel.from_compiled([kernel])
        assert bundled.residual_first and bundled.activation == "relu" and bundled.view == "conv"
        assert read_bundle(Bundle((), (bundled,), DispatchTree.single(0)).to_bytes()).kernels[0] == bundled


@pytest.mark.parametrize("m, n, k, strides", [
    (None, None, 64, ("stride_a_batch", "stride_b_batch")),  # attention's Q x K^T: K is the head dim
    (None, 64, None, ("stride_b_batch",)),  # its scores x V: N is the head dim, A's M x K is T x T
    (32, None, None, ("stride_a_batch",)),
    (None, 24, 40, ()),  # constants that are not multiples of 16 prove nothing
    (None, None, None, ()),
])
def test_bmm_batch_strides_are_assumed_where_a_constant_dim_makes_them_multiples_of_16(m, n, k, strides) -> None:
    div16 = aot.shipped_div16("bmm", False, n, k, m=m)
    assert {p for p in div16 if p.startswith("stride")} == set(strides)
    assert aot.shipped_div16("gemm", False, n, k, m=m) == tuple(p for p in div16 if not p.startswith("stride"))
    # what is assumed holds on every call of the workload: the runtime's per-call check never refuses one
    from tuner.workload import Problem
    for free in (1, 3, 17, 100, 511):
        p = Problem(m or free, n or free + 2, k or free + 5, 12)
        assert aot.div16_refusal("bmm", div16, p) is None, p


@pytest.mark.ptx
def test_bmm_with_its_batch_strides_assumed_loads_in_vectors_without_spills(cache: Path) -> None:
    """Without a batch stride's alignment Triton knows nothing of an operand's base, so it loads every element
    alone; Q x K^T's A (rows of K = 64) then comes in 16-byte cp.async copies, and this tile's spills go."""
    import re

    family = Family("bmm", "float16", "sm_90")
    config = MicroKernel(64, 128, 64, 4, 5)
    kernels = {assumed: compile_kernel(family, config, epilogue=Epilogue(alpha=0.125), cache_dir=cache,
                                       div16=tuple(p for p in aot.shipped_div16("bmm", False, None, 64)
                                                   if assumed or not p.startswith("stride")))
               for assumed in (True, False)}
    copies = {assumed: set(re.findall(r"cp\.async\.c[ag]\.shared\.global\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)",
                                      k.ptx)) for assumed, k in kernels.items()}
    assert copies[True] == {"0x10"} and not copies[False]
    assert kernels[True].n_spills == 0 < kernels[False].n_spills
