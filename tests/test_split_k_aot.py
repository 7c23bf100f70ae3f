"""Split-K kernels compiled ahead of time (no GPU): the fp16 gemm with gelu and the residual for sm_80 and sm_90,
and the synchronization in its PTX.

What the PTX must show (tuner/templates.py, _split_k_reduce): the partial tile is stored, then the CTA waits at
a barrier, then one thread (%tid.x == 0) adds 1 to the tile's counter with an acq_rel, gpu-scope atomic (it
releases the CTA's partial and acquires the partials of the splits counted before); the other splits' partials
are loaded past L1 (ld.global.cg), and the same thread puts the counter back to 0.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from tuner.aot import compile_kernel, shipped_div16
    from tuner.space import Family, MicroKernel
    from tuner.workload import Epilogue

    from tuner import aot

    cache: Path = tmp_path_factory.mktemp("kernels")
    config = MicroKernel(16, 64, 64, 4, 3, 8, 4)
    epilogue = Epilogue(bias=True, activation="gelu", alpha=0.5, residual=True)
    with pytest.MonkeyPatch.context() as patch:  # line info, to find the template's barrier by its source line
        patch.setattr(aot, "_LINE_INFO", True)
        return {target: compile_kernel(Family("gemm", "float16", target), config, epilogue=epilogue, cache_dir=cache,
                                       div16=shipped_div16("gemm", True, 768, 768, residual=True))
                for target in ("sm_80", "sm_90")}


@pytest.mark.ptx
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_split_k_gelu_residual_compiles_with_the_workspace(kernels: dict[str, object], target: str) -> None:
    kernel = kernels[target]
    assert kernel.params == ("a", "b", "bias", "c", "M", "N", "K", "residual", "workspace", "counters")
    assert kernel.split_k == 4 and kernel.epilogue.activation == "gelu"
    assert "workspace" not in kernel.div16  # the launcher checks its alignment, not the bundle's div16 mask
    assert kernel.n_spills == 0
    assert f".target {target}" in kernel.ptx


def _barrier_line() -> int:
    """The source line of the barrier in _split_k_reduce."""
    import inspect

    from tuner import templates

    source, first = inspect.getsourcelines(templates._split_k_reduce.fn)
    return first + next(i for i, line in enumerate(source) if "tl.debug_barrier()" in line)


@pytest.mark.ptx
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_the_counter_is_one_threads_acq_rel_atomic_after_a_barrier(kernels: dict[str, object], target: str) -> None:
    lines = [line.strip() for line in kernels[target].ptx.splitlines()]
    tid = {m.group(1) for line in lines if (m := re.fullmatch(r"mov\.u32\s+(%r\d+), %tid\.x;", line))}
    atoms = [i for i, line in enumerate(lines) if "atom." in line]
    assert len(atoms) == 1, [lines[i] for i in atoms]
    atom = re.fullmatch(r"@(%p\d+) atom\.global\.gpu\.acq_rel\.add\.u32 %r\d+, \[ (%rd\d+) \+ 0 \], %r\d+;",
                        lines[atoms[0]])
    assert atom, lines[atoms[0]]
    predicate, counter = atom.groups()
    # the predicate is "thread 0": %tid.x == 0 (Triton 3.9), or (%tid.x & mask) == 0 with the mask covering the
    # block's 128 threads (Triton 3.6, the GPU image's)
    setp = [line for line in lines[:atoms[0]] if re.fullmatch(rf"setp\.eq\.b32\s+{re.escape(predicate)}, (%r\d+), 0;", line)]
    assert setp, predicate
    tested = re.search(r"(%r\d+), 0;$", setp[-1]).group(1)
    masked = {m.group(1) for line in lines if (m := re.fullmatch(r"and\.b32\s+(%r\d+), (%r\d+), (\d+);", line))
              and m.group(2) in tid and int(m.group(3)) + 1 >= 128 and ((int(m.group(3)) + 1) & int(m.group(3))) == 0}
    assert tested in tid | masked, setp
    # the partial's stores come before the atomic, and the template's own barrier (tl.debug_barrier, found by
    # its source line: Triton also puts a barrier before the atomic's broadcast when shared memory was in use,
    # which is not the one that orders the stores) lies between the last of them and the atomic
    stores = [i for i, line in enumerate(lines[:atoms[0]]) if line.startswith("st.global")]
    assert stores
    ours = [i for i in range(stores[-1], atoms[0]) if lines[i].startswith("bar.sync")
            and re.search(rf"// templates\.py:{_barrier_line()}:\d+( |$)", lines[i - 1])]
    assert ours, "\n".join(lines[stores[-1]:atoms[0] + 1])
    # the other splits' partials bypass L1; the same thread resets the counter afterwards
    assert any("ld.global.cg" in line for line in lines[atoms[0]:])
    assert f"@{predicate} st.global.b32 [ {counter} + 0 ]" in "\n".join(lines[atoms[0]:])
