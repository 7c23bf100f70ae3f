"""Randomized fuzzing of the bundle reader (the C++ core) through ctypes (no clang/libFuzzer needed), and of the
core's call views on hostile shapes and attributes (``run_view_fuzz``).

Valid bundles are mutated (bit flips, boundary values written over size/offset/id fields, truncation,
extension, splices). For every mutant the C++ parser must not crash and must refuse with a message or
accept; what it accepts, read back through its accessors, must pass the Python writer's validation (the
writer's rules are the reader's), re-encode to a payload the reader reads back the same, and agree with the
Python dispatch semantics on tree evaluation, feature computation and image choice. The loop runs in a
subprocess so a crash (signal) fails the test instead of killing pytest.
"""
from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

FUZZ_SECONDS = 8.0
_BOUNDARY = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 255, 256, 1023, 1024, 65535, 65536, 0x7FFFFFFF,
             0x80000000, 0xFFFFFFFF, 0xFFFFFFFE]


def _seeds() -> list[bytes]:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_bundle import _conv_kernel, _kernel, sample_bundle

    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature

    out = [sample_bundle(s).to_bytes() for s in range(6)]
    out.append(Bundle((), (BundleKernel.vendor(),), DispatchTree.single(0)).to_bytes())
    out.append(Bundle((Feature("T", ((0, 1),)),), (_kernel("a", images=(), ptx=".target sm_90a\n"), _kernel("b")),
                      DispatchTree((0, -1, -1), (16, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    out.append(Bundle((Feature("N", ((0, 0),)), Feature("H", ((0, 2),))),
                      (_conv_kernel(), BundleKernel.vendor(),
                       _kernel("g", dtype="bfloat16", trans_b=True, shared=30000, image_shared=(200000, 40000))),
                      DispatchTree((1, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    from test_toolchain import _bundle as toolchain_bundle
    from test_toolchain import _kernel as toolchain_kernel

    out.append(toolchain_bundle(toolchain_kernel("t"), BundleKernel.vendor()).to_bytes())
    # the params after out_w: a gemm kernel with a residual (15, with a div16 bit) and an attention kernel
    # (16..27, its div16 bits counting from q since format 10)
    from dietcode_ort.bundle import ATTENTION_PARAMS

    out.append(Bundle((), (_kernel("r", params=("a", "b", "c", "M", "N", "K", "residual"), div16=("a", "residual")),),
                      DispatchTree.single(0)).to_bytes())
    out.append(Bundle((), (_kernel("att", params=ATTENTION_PARAMS, div16=("q", "k", "v", "out"), block_n=64, head_dim=64,
                                   mask_rows=True),),
                      DispatchTree.single(0)).to_bytes())
    # persistent kernels (the record's programs-per-SM byte): a gemm, and a TMA bmm, which takes the batch
    bmm = ("a", "b", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch")
    out.append(Bundle((Feature("M", ((0, 0),)),),
                      (_kernel("pg", persistent=2), _kernel("pb", persistent=1, params=bmm, div16=("a", "b"),
                                                            image_scratch=((256, 128), (0, 1)))),
                      DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    # an attention kernel in the packed QKV layout (flags bits 3..7 all set): mutants flip the layout bits
    out.append(Bundle((), (_kernel("attp", params=ATTENTION_PARAMS, div16=(), block_n=64, layout=31, head_dim=64, nan_to_zero=True),),
                      DispatchTree.single(0)).to_bytes())
    # a conv kernel taking the residual (15) before its Relu (flags bit 0, format 8), next to a gemm one adding
    # it after: mutants flip the flag onto kernels without a residual or an activation
    conv_params = ("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual")
    out.append(Bundle((Feature("N", ((0, 0),)),),
                      (_conv_kernel(params=conv_params, residual_first=True, div16=("a", "residual")),
                       _kernel("ra", params=("a", "b", "c", "M", "N", "K", "residual"), activation="gelu")),
                      DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    # format 9's activations (3 gelu_tanh, 4 silu, 5 relu6): mutants step the code past the last one
    out.append(Bundle((Feature("N", ((0, 0),)),),
                      (_conv_kernel(activation="relu6"), _kernel("s", activation="silu"),
                       _kernel("t", activation="gelu_tanh", dtype="bfloat16")),
                      DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    # a conv kernel compiled for a grouped conv (epilogue flags bit 3) next to a gemm one: mutants move the
    # flag onto the gemm kernel and set the bits past it
    out.append(Bundle((Feature("N", ((0, 0),)),), (_conv_kernel(grouped=True), _kernel("gm", activation="relu")),
                      DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    # format 11: a channels-last conv kernel (epilogue flags bit 4) taking the residual, next to a gemm one and a
    # vendor kernel: mutants move the flag onto the gemm kernel and combine it with grouped (bit 3)
    out.append(Bundle((Feature("N", ((0, 0),)), Feature("H", ((0, 1),))),
                      (_conv_kernel(params=conv_params, channels_last=True, div16=("a", "b", "residual")),
                       _kernel("gl", activation="relu"), BundleKernel.vendor()),
                      DispatchTree((0, 1, -1, -1, -1), (64, 32, 0, 0, 0), (1, 3, -1, -1, -1), (2, 4, -1, -1, -1),
                                   (-1, -1, 2, 0, 1))).to_bytes())
    return out


def _mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 6))):
        op = rng.randrange(7)
        if not buf:
            buf = bytearray(rng.choice(seeds))
        pos = rng.randrange(len(buf))
        if op == 0:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2 and pos + 4 <= len(buf):
            struct.pack_into("<I", buf, pos - pos % 4, rng.choice(_BOUNDARY))
        elif op == 3 and pos + 8 <= len(buf):
            struct.pack_into("<Q", buf, pos - pos % 8, rng.choice([1 << 62, 1 << 32, 2**64 - 1] + _BOUNDARY))
        elif op == 4:
            del buf[rng.randrange(len(buf) + 1):]
        elif op == 5:
            buf += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        else:
            other = rng.choice(seeds)
            start = rng.randrange(len(other))
            buf[pos:pos + 16] = other[start:start + 16]
    if rng.random() < 0.3 and len(buf) >= 32:  # keep the header's size honest so deeper fields get exercised
        struct.pack_into("<Q", buf, 16, len(buf))
    if rng.random() < 0.9:  # resealed (the checksum made to match, as a crafter would) so the field checks are
        from dietcode_ort.bundle import seal  # reached; the rest exercise the checksum's refusal

        return seal(buf)
    return bytes(buf)


def run_fuzz(seconds: float, seed: int) -> dict[str, int]:
    from dietcode_ort.bundle import select_image
    from dietcode_ort.errors import DietcodeError
    from dietcode_ort.runtime import load_core

    core = load_core()
    rng = random.Random(seed)
    seeds = _seeds()
    stats = {"cases": 0, "accepted": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = _mutate(rng, rng.choice(seeds), seeds)
        stats["cases"] += 1
        try:
            cb = core.parse(data)
        except DietcodeError as exc:
            assert str(exc).startswith("invalid kernel bundle"), str(exc)
            cb = None
        shared = core.lib.dc_bundle_acquire(data, len(data))  # the path the custom ops take: same verdict
        assert bool(shared) == (cb is not None), data.hex()
        core.lib.dc_bundle_release(shared)
        if cb is None:
            continue
        py = cb.decode()
        try:
            py.validate()  # what the reader accepts, the writer would write
        except DietcodeError as exc:
            raise AssertionError(f"the reader accepts what the writer refuses ({exc}): {data.hex()}") from None
        assert core.parse(py.to_bytes()).decode() == py, data.hex()
        stats["accepted"] += 1
        for _ in range(8):
            feats = [rng.randrange(-20, 2000) for _ in py.features]
            assert cb.select(feats) == py.evaluate(feats), data.hex()
        shapes = [[2, 3, 5, 7], [4, 8, 16], [9]]
        try:
            want = py.feature_values(shapes)
        except DietcodeError:
            want = None
        try:
            got = cb.features(shapes)
        except DietcodeError:
            got = None
        assert got == want, data.hex()
        for k, kern in enumerate(py.kernels):
            if kern.kind == "vendor":
                continue
            for major, minor in ((8, 0), (9, 0), (12, 0)):
                try:
                    c = select_image(kern, major, minor)
                    want_img = (c.kind, c.arch, kern.shared_for(c))
                except DietcodeError:
                    want_img = None
                try:
                    got_img = (*cb.pick_image(k, major, minor), cb.image_shared(k, major, minor))
                except DietcodeError:
                    got_img = None
                assert got_img == want_img, data.hex()
                for driver in (12090, 13000):  # the per-session fit against a driver (toolchain records)
                    try:
                        select_image(kern, major, minor, driver)
                        want_fit = True
                    except DietcodeError:
                        want_fit = False
                    got_fit = cb.fit_device(major, minor, 1 << 20, driver)[0][k]  # every image's shared fits
                    assert got_fit == want_fit, data.hex()
    return stats


_HOSTILE_DIMS = [0, 1, 2, 3, 16, 64, -1, -2, 2**31 - 1, 2**31, 2**32 + 1, 2**40, 2**62, 2**63 // 3 + 1, 2**63 - 1,
                 -2**63]


def run_view_fuzz(seconds: float, seed: int) -> dict[str, int]:
    """The C core's views of a node call (``dc_abi_view``, ``dc_attention_view_layout``) and the vendor plans
    (``dc_gemm_plan_make``, ``dc_conv_plan_make``) on shapes and attributes a hand-edited model can carry
    (negative, zero, past int32, near 2^63): each answers or refuses with a message, never crashes."""
    from dietcode_ort.errors import DietcodeError
    from dietcode_ort.runtime import load_core

    core = load_core()
    rng = random.Random(seed)

    def dim() -> int:
        return rng.choice(_HOSTILE_DIMS) if rng.random() < 0.3 else rng.randrange(1, 70)

    def shape(rank: int | None = None) -> list[int]:
        return [dim() for _ in range(rng.randrange(0, 6) if rank is None else rank)]

    stats = {"cases": 0, "answered": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats["cases"] += 1
        kind = rng.randrange(5)
        try:
            if kind == 0:
                r = core.abi_view(rng.choice(["MatMul", "Gemm"]), shape(), shape(), shape() if rng.random() < .5 else None,
                                  ints=[rng.choice([0, 1, -1])] * 2, floats=[rng.choice([1.0, 0.5, 0.0])] * 2,
                                  batched=rng.random() < .5)
            elif kind == 1:
                r = core.abi_view("Conv", shape(4), shape(4), shape(1) if rng.random() < .5 else None,
                                  ints=[dim() for _ in range(8)] + [rng.choice([1, 2, 3, 0, -1, dim(), 2**62, -2**63])],
                                  channels_last=rng.random() < .3)
            elif kind == 2:
                rank = rng.choice([3, 4])
                q = shape(rank)
                kt, v = (list(q), list(q)) if rng.random() < .5 else (shape(rank), shape(rank))
                r = core.attention_view(q, kt, v, shape() if rng.random() < .5 else None,
                                        head_dim=rng.choice([0, 64, dim()]),
                                        layout=rng.choice([0, 15, 23, 31, 16, -1, rng.randrange(32)]), out_shape=[])
            elif kind == 3:
                r = core.gemm_plan(rng.choice(["MatMul", "Gemm"]), shape(), shape(), shape() if rng.random() < .5 else None,
                                   trans_a=rng.random() < .3, trans_b=rng.random() < .5, alpha=rng.choice([1.0, 2.0]),
                                   beta=rng.choice([1.0, 0.0]))
            else:
                r = core.conv_plan(shape(4), shape(4), shape(1) if rng.random() < .5 else None, strides=[dim(), dim()],
                                   pads=[dim() for _ in range(4)], dilations=[dim(), dim()],
                                   group=rng.choice([1, 2, 0, -1, 2**40, 2**62, -2**63]),
                                   auto_pad=rng.choice(["NOTSET", "SAME_UPPER", "VALID"]), channels_last=rng.random() < .3)
            stats["answered"] += r is not None
        except DietcodeError as exc:
            assert str(exc), "a refusal without a message"
    return stats


def test_fuzz_views_in_subprocess() -> None:
    proc = subprocess.run([sys.executable, __file__, str(FUZZ_SECONDS / 2), "99", "views"], capture_output=True, text=True,
                          timeout=FUZZ_SECONDS + 120)
    assert proc.returncode == 0, f"fuzzer died (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["cases"] > 1000 and stats["answered"] > 10, stats


def test_fuzz_readers_in_subprocess() -> None:
    proc = subprocess.run([sys.executable, __file__, str(FUZZ_SECONDS), "1234"], capture_output=True, text=True,
                          timeout=FUZZ_SECONDS + 120)
    assert proc.returncode == 0, f"fuzzer died (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["cases"] > 1000 and stats["accepted"] > 20, stats


if __name__ == "__main__":
    fuzz = run_view_fuzz if sys.argv[3:] == ["views"] else run_fuzz
    print(json.dumps(fuzz(float(sys.argv[1]), int(sys.argv[2]))))
