"""Persistent configs (``MicroKernel.persistent``: n programs per SM, each looping over output tiles): the gemm
and bmm templates interpreted against float64 and against their one-program-per-tile twins
(tests/_persistent_cases.py), compiled for sm_80 and sm_90 (the tile loop in the PTX, no more spills than the
twin), the sm_90-only space axis, the bundle's programs-per-SM byte (both readers, crafted values refused), the
C core's grid rule and the workspace that follows the launched grid, and on a GPU a launch through the C
launcher against the twin. Compiles are few and small."""
from __future__ import annotations

import math
import re
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from _interpreter import run_interpreted
from _persistent_cases import CASES as PERSISTENT_CASES
from dietcode_ort.bundle import seal
from dietcode_ort.errors import DietcodeError
from tuner.hardware import get_profile
from tuner.space import (Family, MicroKernel, enumerate_space, persistent_programs, prune_report, validate,
                         wgmma_eligible)
from tuner.workload import Epilogue

FULL = Epilogue(bias=True, activation="gelu", residual=True)
BMM = ("a", "b", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch")


# ---- the templates under the interpreter ----

@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_interpreted("_persistent_cases.py")


@pytest.mark.parametrize("name", list(PERSISTENT_CASES))
def test_persistent_template_matches_float64_and_its_twin(interpreted: dict[str, Any], name: str) -> None:
    outcome = interpreted[name]
    assert outcome["ok"], outcome.get("error")
    assert outcome["shape_ok"] and outcome["dtype_ok"], outcome
    assert outcome["excess"] <= 0.0, f"{name}: max error {outcome['max_err']}"
    assert outcome["equals_twin"], f"{name}: differs from the one-program-per-tile launch"
    assert outcome["programs"] == min(outcome["tiles"], outcome["sm_count"] * outcome["persistent"])


def test_cases_cover_fewer_as_many_and_more_tiles_than_programs(interpreted: dict[str, Any]) -> None:
    rows = [interpreted[name] for name in PERSISTENT_CASES]
    slots = [(r["tiles"], r["sm_count"] * r["persistent"]) for r in rows]
    assert any(t < s for t, s in slots) and any(t == s for t, s in slots) and any(t > 2 * s for t, s in slots)


def test_run_refuses_persistent_split_k_and_a_missing_sm_count(interpreted: dict[str, Any]) -> None:
    refusals = interpreted["refusals"]
    assert "persistent kernels exist for gemm and bmm with split_k 1" in refusals["split_k"]
    assert "needs sm_count" in refusals["no_sm_count"]


def test_python_grid_rule() -> None:
    from tuner.templates import programs, workspace_bytes

    assert programs(100, 100, 1, 16, 16) == 49 and programs(100, 100, 2, 16, 16, 4) == 392
    assert programs(100, 100, 1, 16, 16, 1, 2, 132) == 49  # fewer tiles than 264 slots: one program per tile
    assert programs(1000, 1000, 3, 64, 64, 1, 2, 132) == 264  # 768 tiles on 132 SMs x 2
    assert programs(1000, 1000, 3, 64, 64, 1, 2, 0) == 768  # SM count unknown: the bound
    # TMA scratch per launched program: 264 programs, not 768 tiles
    assert workspace_bytes(1000, 1000, 3, 64, 64, 1, 256, 128, 2, 132) == (128 - 16) + 264 * 256
    assert workspace_bytes(1000, 1000, 3, 64, 64, 1, 256, 128) == (128 - 16) + 768 * 256


# ---- the space ----

def test_persistent_twins_only_of_sm90_tma_configs_without_split_k() -> None:
    profile = get_profile("sm_90")
    for target in ("sm_80", "sm_89"):
        for op in ("gemm", "bmm", "conv"):
            for dtype in ("float32", "float16", "bfloat16"):
                assert not any(c.persistent for c in enumerate_space(Family(op, dtype, target)))
    for op in ("gemm", "bmm"):
        for dtype in ("float16", "bfloat16"):
            space = enumerate_space(Family(op, dtype, "sm_90"))
            twins = [c for c in space if c.persistent]
            tma = {c for c in space if c.tma and not c.persistent and c.split_k == 1}
            assert {MicroKernel(**{**c.to_dict(), "persistent": 0}) for c in twins} == tma
            assert len(twins) == len(tma) == 222 and len(space) == 1007 + 222
            assert all(c.tma and wgmma_eligible(c, dtype, profile) for c in twins)
            assert all(c.persistent == persistent_programs(c, dtype, profile) in (1, 2) for c in twins)
            assert {c.persistent for c in twins} == {1, 2}  # large tiles fill an SM alone, small ones two
            assert all(re.fullmatch(r".*k1tp[12]", c.key()) for c in twins)
        # float32: persistent twins in tf32 (wgmma, TMA), none in ieee (no tensor cores, no TMA)
        assert not any(c.persistent for c in enumerate_space(Family(op, "float32", "sm_90"), "ieee"))
        assert sum(1 for c in enumerate_space(Family(op, "float32", "sm_90"), "tf32") if c.persistent) == 235
    assert not any(c.persistent for c in enumerate_space(Family("conv", "float16", "sm_90")))
    assert prune_report(Family("gemm", "float16", "sm_90"))["persistent"] > 0


def test_validate_names_the_persistent_rule() -> None:
    family = Family("gemm", "float16", "sm_90")
    big = MicroKernel(128, 128, 64, 8, 4, tma=1)
    assert persistent_programs(big, "float16", get_profile("sm_90")) == 1
    validate(family, MicroKernel(128, 128, 64, 8, 4, tma=1, persistent=1))
    for bad in (MicroKernel(128, 128, 64, 8, 4, persistent=1),  # pointer loads: no persistent twin
                MicroKernel(128, 128, 64, 8, 4, tma=1, persistent=2),  # one block of it fills an SM
                MicroKernel(64, 64, 64, 4, 3, 8, 2, tma=1, persistent=1)):  # split-K
        with pytest.raises(DietcodeError, match="rule 'persistent'"):
            validate(family, bad)
    with pytest.raises(DietcodeError, match="persistent=1 is outside the space"):
        validate(Family("gemm", "float16", "sm_80"), MicroKernel(64, 64, 64, 4, 3, persistent=1))


def test_keys_and_records() -> None:
    twin = MicroKernel(128, 128, 64, 8, 4, tma=1, persistent=1)
    assert twin.key() == "m128n128k64w8s4g8k1tp1" and twin.to_dict()["persistent"] == 1
    plain = MicroKernel(128, 128, 64, 8, 4, tma=1)
    assert plain.key() == "m128n128k64w8s4g8k1t" and "persistent" not in plain.to_dict()
    for config in (twin, plain, MicroKernel(64, 64, 32, 4, 3, persistent=2)):
        assert MicroKernel.from_key(config.key()) == config
        assert MicroKernel.from_dict(config.to_dict()) == config
    for bad in ("m64n64k64w4s3g8k1p0", "m64n64k64w4s3g8k1p", "m64n64k64w4s3g8k1pt1"):
        with pytest.raises(DietcodeError, match="bad micro-kernel key"):
            MicroKernel.from_key(bad)


# ---- the cost model and the analytic measurer ----

def test_cost_model_credits_half_the_tail_to_persistent_configs() -> None:
    from tuner.cost_model import (FEATURE_NAMES, adapt_terms, blocks_per_sm, f_adapt_matrix, kernel_features,
                                  tail_alpha)
    from tuner.measure import AnalyticMeasurer
    from tuner.workload import Problem

    h100 = get_profile("sm_90")
    twin = MicroKernel(128, 128, 64, 8, 4, tma=1)
    persistent = MicroKernel(128, 128, 64, 8, 4, tma=1, persistent=1)
    assert blocks_per_sm(twin, h100, "float16") == 1
    assert tail_alpha(twin, 0.2, True) == 0.2 and tail_alpha(persistent, 0.2, True) == pytest.approx(0.6)
    assert tail_alpha(persistent, 0.2, False) == 0.2  # programs that do not loop: a plain launch, no credit
    partial = Problem(m=128 * 12, n=128 * 16, k=1024)  # 192 tiles: one full wave of 132 and 60 more
    full = Problem(m=128 * 12, n=128 * 11, k=1024)  # 132 tiles: one full wave
    for problem, better in ((partial, True), (full, False)):
        a = adapt_terms(twin, problem, h100, 1, 0.2)
        b = adapt_terms(persistent, problem, h100, 1, 0.2)
        assert (b.occupancy > a.occupancy) is better and b.occupancy >= a.occupancy and b.waves == a.waves
    matrix = f_adapt_matrix([twin, persistent], [partial, full], h100, "float16", 0.2)
    for i, config in enumerate((twin, persistent)):
        for j, problem in enumerate((partial, full)):
            assert math.isclose(matrix[i, j], adapt_terms(config, problem, h100, 1, 0.2).value)
    features = kernel_features([twin, persistent], h100, "float16")
    assert FEATURE_NAMES[-1] == "persistent" and list(features[:, -1]) == [0.0, 1.0]
    # the compute term carries f_adapt (the bandwidth term has no waves): a GPU whose DRAM never limits
    measurer = AnalyticMeasurer(replace(h100, dram_bandwidth_gbs=1e9), "float16")
    slow, fast, same, same_p = measurer.measure(Family("gemm", "float16", "sm_90"), [
        (twin, partial), (persistent, partial), (twin, full), (persistent, full)])
    assert fast.seconds < slow.seconds and math.isclose(same.seconds, same_p.seconds)  # no partial round: no credit


# ---- ahead-of-time compilation ----

def _back_edges(ptx: str) -> int:
    """Branches to a label earlier in the PTX: its loops."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\$\w+):", line))}
    return sum(1 for i, line in enumerate(lines)
               if (m := re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", line)) and labels.get(m.group(1), i) < i)


@pytest.mark.ptx
@pytest.mark.parametrize("target, op, config", [
    ("sm_90", "gemm", MicroKernel(128, 128, 64, 8, 4, tma=1, persistent=1)),
    ("sm_90", "bmm", MicroKernel(64, 128, 64, 4, 4, tma=1, persistent=2)),
    ("sm_80", "gemm", MicroKernel(64, 64, 32, 4, 3, persistent=1)),
    ("sm_80", "bmm", MicroKernel(64, 64, 32, 4, 3, persistent=1)),
])
def test_persistent_compiles_with_the_tile_loop_and_no_more_spills(target: str, op: str, config: MicroKernel,
                                                                   tmp_path: Path) -> None:
    from tuner.aot import PERSISTENT_GRID_RULE, aligned_params, compile_kernel

    family = Family(op, "float16", target)
    epilogue = FULL if op == "gemm" else Epilogue(bias=True, activation="gelu", alpha=0.125)
    div16 = aligned_params(op, residual=op == "gemm")
    kernel = compile_kernel(family, config, epilogue=epilogue, trans_b=op == "bmm", div16=div16, cache_dir=tmp_path)
    twin = compile_kernel(family, MicroKernel(**{**config.to_dict(), "persistent": 0}), epilogue=epilogue,
                          trans_b=op == "bmm", div16=div16, cache_dir=tmp_path)
    assert "%nctaid.x" in kernel.ptx  # the loop steps by the grid's size
    assert _back_edges(kernel.ptx) > _back_edges(twin.ptx), "no tile loop around the K loop"
    assert kernel.n_spills is not None and twin.n_spills is not None and kernel.n_spills <= twin.n_spills
    assert kernel.grid == PERSISTENT_GRID_RULE and kernel.split_k == 1
    assert ("batch" in kernel.params) == (op == "bmm") and "batch" not in twin.params
    if config.tma:
        assert "cp.async.bulk.tensor" in kernel.ptx and kernel.mma == "wgmma"
        assert (kernel.global_scratch_size, kernel.global_scratch_align) == (256, 128)  # per program, as the twin


def test_persistent_split_k_does_not_compile(tmp_path: Path) -> None:
    from tuner.aot import compile_kernel

    with pytest.raises(Exception, match="persistent kernels take no split-K"):
        compile_kernel(Family("gemm", "float16", "sm_80"), MicroKernel(64, 64, 32, 4, 3, 8, 2, persistent=1),
                       cache_dir=tmp_path)


# ---- the bundle's programs-per-SM byte ----

def _bundle_kernel(**changes: Any) -> Any:
    from dietcode_ort.bundle import BundleKernel

    fields = dict(name="k", images=(("sm_90a", b"\x7fELF"),), image_scratch=((256, 128),),
                  ptx=".version 8.0\n.target sm_90a\n", ptx_scratch=(256, 128),
                  params=("a", "b", "c", "M", "N", "K"), block_m=64, block_n=64, div16=("a", "b", "K", "N"),
                  dtype="float16", persistent=2)
    fields.update(changes)
    return BundleKernel(**fields)


def _payload(*kernels: Any, validate_: bool = True) -> bytes:
    from dietcode_ort.bundle import Bundle, DispatchTree

    if len(kernels) == 1:
        return Bundle((), kernels, DispatchTree.single(0)).to_bytes(validate=validate_)
    raise AssertionError("one kernel per payload")


def _persistent_byte_at(payload: bytes, kernel: Any) -> int:
    """The offset of ``kernel``'s persistent byte in ``payload``: the byte after trans_b in "<BBBB9If", which
    follows the record's "<BBHIIIII" head (kind, flags, div16 mask, num_warps, shared, block_m, block_n, split_k)."""
    from dietcode_ort.bundle import PARAM_NAMES

    head = struct.pack("<BBHIIIII", 0, 0, sum(1 << PARAM_NAMES.index(p) for p in kernel.div16), kernel.num_warps,
                       kernel.shared, kernel.block_m, kernel.block_n, kernel.split_k)
    assert payload.count(head) == 1
    return payload.index(head) + len(head) + 3


def test_bundle_round_trips_the_persistent_byte(tmp_path: Path) -> None:
    from dietcode_ort.bundle import BundleKernel, read_bundle
    from tuner.aot import compile_kernel

    payload = _payload(_bundle_kernel())
    assert payload[_persistent_byte_at(payload, _bundle_kernel())] == 2
    assert read_bundle(payload).kernels[0].persistent == 2
    assert read_bundle(_payload(_bundle_kernel(persistent=0))).kernels[0].persistent == 0
    bmm = _bundle_kernel(params=BMM, persistent=1)
    assert read_bundle(_payload(bmm)).kernels[0].params == BMM
    kernel = compile_kernel(Family("gemm", "float16", "sm_80"), MicroKernel(64, 64, 32, 4, 3, persistent=1),
                            cache_dir=tmp_path)
    assert BundleKernel.from_compiled([kernel]).persistent == 1


@pytest.mark.parametrize("value", [9, 0x80, 0xFF])
def test_crafted_persistent_byte_is_refused(value: int) -> None:
    from dietcode_ort.runtime import load_core

    with pytest.raises(DietcodeError, match=r"persistent .* outside 0\.\.8"):
        _bundle_kernel(persistent=value).validate(0)
    payload = bytearray(_payload(_bundle_kernel()))
    payload[_persistent_byte_at(bytes(payload), _bundle_kernel())] = value
    with pytest.raises(DietcodeError, match=rf"invalid kernel bundle: kernel 0: persistent {value} programs per SM "
                                            r"outside 0\.\.8"):
        load_core().parse(seal(payload))


@pytest.mark.parametrize("changes, message", [
    (dict(split_k=2, params=("a", "b", "c", "M", "N", "K", "workspace", "counters")), "persistent applies to gemm and bmm "
                                                                         "kernels with split_k 1"),
    (dict(params=("a", "b", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w"), conv=(64, 3, 3, 1, 1, 1, 1, 1, 1),
          div16=()), "persistent applies to gemm and bmm kernels"),
    (dict(params=tuple(p for p in BMM if p != "batch")), "a persistent bmm kernel takes the 'batch' param"),
])
def test_persistent_kernels_the_readers_refuse(changes: dict[str, Any], message: str) -> None:
    from dietcode_ort.runtime import load_core

    kernel = _bundle_kernel(**changes)
    with pytest.raises(DietcodeError, match=message):
        kernel.validate(0)
    with pytest.raises(DietcodeError, match="invalid kernel bundle: .*" + message):
        load_core().parse(_payload(kernel, validate_=False))


def test_vendor_kernel_with_a_persistent_byte_is_refused() -> None:
    from dietcode_ort.bundle import BundleKernel
    from dietcode_ort.runtime import load_core

    vendor = BundleKernel(name="vendor", kind="vendor", persistent=1)
    with pytest.raises(DietcodeError, match="a vendor kernel carries no"):
        vendor.validate(0)
    with pytest.raises(DietcodeError, match="invalid kernel bundle: .*a vendor kernel carries no"):
        load_core().parse(_payload(vendor, validate_=False))


# ---- the C core's grid rule and workspace ----

@pytest.mark.parametrize("m, n, batch, sm_count, n_per_sm, want", [
    (100, 100, 1, 132, 2, 4),  # 4 tiles < 264 slots: one program per tile
    (512, 1056, 1, 132, 1, 132),  # 8 x 17 = 136 tiles, 132 slots
    (512, 1024, 1, 64, 2, 128),  # 128 tiles = 128 slots
    (1000, 1000, 3, 132, 2, 264),  # 16 x 16 x 3 = 768 tiles over a batch
    (1000, 1000, 3, 0, 2, 768),  # SM count unknown: one program per tile (the bound)
    (64, 64, 1, 1, 8, 1),
])
def test_c_grid_and_workspace_follow_the_sm_count(m: int, n: int, batch: int, sm_count: int, n_per_sm: int,
                                                  want: int) -> None:
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.templates import programs, workspace_bytes

    core = load_core()
    params = BMM if batch > 1 else ("a", "b", "c", "M", "N", "K")
    bundle = core.parse(_payload(_bundle_kernel(params=params, persistent=n_per_sm, div16=("a", "b"))))
    args = LaunchArgs(M=m, N=n, K=64, batch=batch, sm_count=sm_count)
    assert bundle.grid(0, args) == (want, 1, 1)
    assert programs(m, n, batch, 64, 64, 1, n_per_sm, sm_count) == want
    size = bundle.workspace_bytes(0, args)
    assert size == workspace_bytes(m, n, batch, 64, 64, 1, 256, 128, n_per_sm, sm_count) == (128 - 16) + want * 256
    # the same kernel launched one program per tile: the ABI's (tiles, split_k, batch) and a scratch per tile
    twin = core.parse(_payload(_bundle_kernel(params=params, persistent=0, div16=("a", "b"))))
    tiles = math.ceil(m / 64) * math.ceil(n / 64)
    assert twin.grid(0, args) == (tiles, 1, batch)
    assert twin.workspace_bytes(0, args) == (128 - 16) + tiles * batch * 256


def test_c_grid_refuses_what_does_not_fit() -> None:
    from dietcode_ort.bundle import BundleKernel
    from dietcode_ort.runtime import LaunchArgs, load_core

    core = load_core()
    bundle = core.parse(_payload(_bundle_kernel(params=BMM, div16=("a", "b"))))
    with pytest.raises(DietcodeError, match="empty output"):
        bundle.grid(0, LaunchArgs(M=0, N=64, K=64, batch=1, sm_count=132))
    # the persistent loop index is int32: tiles x batch above 2^30 is refused, the same kernel unpersisted is not
    huge = LaunchArgs(M=2**31 - 64, N=4096, K=64, batch=1, sm_count=132)  # 2^31 - 64 tiles
    with pytest.raises(DietcodeError, match="persistent kernel's int32 tile loop"):
        bundle.grid(0, huge)
    assert bundle.fit(0, huge)[0] == "tiles above grid x"
    twin = core.parse(_payload(_bundle_kernel(params=BMM, div16=("a", "b"), persistent=0, image_scratch=(),
                                              ptx_scratch=(0, 1))))
    assert twin.grid(0, huge) == (2**31 - 64, 1, 1)
    vendor = core.parse(_payload(BundleKernel(name="vendor", kind="vendor")))
    with pytest.raises(DietcodeError, match="vendor kind and has no grid"):
        vendor.grid(0, LaunchArgs(M=64, N=64, K=64, batch=1))


def test_launch_without_a_driver_fails_with_a_message_and_a_short_workspace_is_refused() -> None:
    """Without args.sm_count, dc_launch_fit asks the device for its SM count (no GPU here: the driver's
    message); with it, a workspace sized for fewer programs than the grid is refused before any driver call."""
    from dietcode_ort.runtime import LaunchArgs, load_core

    core = load_core()
    bundle = core.parse(_payload(_bundle_kernel(div16=("a", "b"))))
    args = LaunchArgs(M=1000, N=1000, K=64, batch=1, sm_count=4, workspace=0x10000)
    size = bundle.workspace_bytes(0, args)
    assert size == (128 - 16) + 8 * 256  # 4 SMs x 2 programs
    args.workspace_bytes = size - 16
    with pytest.raises(DietcodeError, match="global scratch 256 B per program, 4 SMs\\) needs a workspace of "
                                            f"{size} bytes"):
        bundle.launch(0, args, None)


# ---- on a GPU: the real launcher ----

@pytest.mark.gpu
@pytest.mark.parametrize("op, config", [
    ("gemm", MicroKernel(128, 128, 64, 8, 4, tma=1, persistent=1)),
    ("gemm", MicroKernel(64, 128, 64, 4, 4, persistent=2)),
    ("bmm", MicroKernel(64, 128, 64, 4, 4, tma=1, persistent=2)),
    ("gemm", MicroKernel(64, 64, 32, 4, 3, persistent=1)),
], ids=["gemm_tma_p1", "gemm_p2", "bmm_tma_p2", "gemm_ampere_p1"])
def test_persistent_matches_its_twin_through_the_launcher(op: str, config: MicroKernel, tmp_path: Path) -> None:
    """A persistent kernel and its one-program-per-tile twin, compiled ahead of time, bundled and launched with
    dc_launch (the grid from the device's SM count): the same output bit for bit, and against float64, for
    fewer, as many and more tiles than the grid's programs."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if config.tma and (major, minor) != (9, 0):
        pytest.skip("TMA configs need an sm_90 GPU")
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.aot import compile_kernel

    target = "sm_90" if (major, minor) == (9, 0) else "sm_80"
    core = load_core()
    family = Family(op, "float16", target)
    epilogue = FULL if op == "gemm" else Epilogue(bias=True, activation="gelu", alpha=0.125)
    kernels = [compile_kernel(family, c, epilogue=epilogue, cache_dir=tmp_path)
               for c in (config, MicroKernel(**{**config.to_dict(), "persistent": 0}))]
    cb = core.parse(Bundle((), tuple(BundleKernel.from_compiled([k]) for k in kernels),
                           DispatchTree((-1,), (0,), (-1,), (-1,), (0,))).to_bytes(validate=False))
    stream = torch.cuda.current_stream().cuda_stream
    sms = core.sm_count(stream)
    assert sms == torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = 3 if op == "bmm" else 1
    for m, n, k in [(64, 128, 64), (config.block_m * 11, config.block_n * sms // 11 + 1, 256), (2048, 3072, 512)]:
        a = torch.randn(batch, m, k, device="cuda", generator=gen).half()
        b = torch.randn(batch, k, n, device="cuda", generator=gen).half()
        bias = torch.randn(n, device="cuda", generator=gen).half()
        residual = torch.randn(m, n, device="cuda", generator=gen).half() if op == "gemm" else None
        outs = []
        for index in (0, 1):
            c = torch.full((batch, m, n), float("nan"), device="cuda", dtype=torch.float16)
            args = LaunchArgs(a=a.data_ptr(), b=b.data_ptr(), bias=bias.data_ptr(), c=c.data_ptr(),
                              residual=residual.data_ptr() if residual is not None else 0, M=m, N=n, K=k,
                              batch=batch, stride_a_batch=m * k if op == "bmm" else 0,
                              stride_b_batch=k * n if op == "bmm" else 0, sm_count=sms)
            grid = cb.grid(index, args)
            if index == 0:
                tiles = math.ceil(m / config.block_m) * math.ceil(n / config.block_n) * batch
                assert grid == (min(tiles, sms * config.persistent), 1, 1)
            args.sm_count = 0  # the launcher asks the device, as a caller that does not know it
            size = cb.workspace_bytes(index, args)
            workspace = torch.full((max(size, 16),), 0xAB, device="cuda", dtype=torch.uint8)
            args.workspace, args.workspace_bytes = workspace.data_ptr(), size
            cb.launch(index, args, stream)
            torch.cuda.synchronize()
            outs.append(c)
        assert torch.equal(outs[0], outs[1]), (m, n, k)
        ref = epilogue.alpha * (a.double() @ b.double()) + bias.double()
        ref = 0.5 * ref * (1 + torch.erf(ref / math.sqrt(2)))
        if residual is not None:
            ref = ref + residual.double()
        assert float((outs[0].double() - ref).abs().max()) <= 2e-2 * max(1.0, float(ref.abs().max())), (m, n, k)


def test_gpu_timer_sizes_the_workspace_for_the_launched_grid() -> None:
    """The GPU timer asks the core for its stream's SM count before sizing a persistent kernel's workspace (as
    the custom op does), so dc_time_kernel's dc_launch runs the runtime's grid with the scratch it carves; a
    kernel launched one program per tile does not ask. The driver is faked: the timer's own code runs."""
    from types import SimpleNamespace

    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner.gpu_timing import CudaBackend, TimingSettings

    core = load_core()
    seen: list[tuple[int, int]] = []

    def time_kernel(handle: Any, k: int, args: Any, stream: Any, warmup: int, repeat: int, flush: int,
                    flush_bytes: int, times: Any) -> int:
        launch = args._obj
        seen.append((launch.sm_count, launch.workspace_bytes))
        for i in range(repeat):
            times[i] = 0.5
        return 0

    backend = CudaBackend(TimingSettings(repeats=3, flush_bytes=0))
    backend._core = SimpleNamespace(lib=SimpleNamespace(dc_time_kernel=time_kernel), sm_count=lambda stream: 7,
                                    error=core.error)
    backend._buffer = lambda name, size, fill_dtype=None: 0x10000  # type: ignore[method-assign]
    for persistent, want in ((2, (7, (128 - 16) + 14 * 256)), (0, (0, (128 - 16) + 256 * 256))):
        bundle = core.parse(_payload(_bundle_kernel(div16=("a", "b"), persistent=persistent)))
        result = backend._launch_timed(bundle, LaunchArgs(M=1024, N=1024, K=64, batch=1))
        assert result.ok and seen[-1] == want, (result, seen)
