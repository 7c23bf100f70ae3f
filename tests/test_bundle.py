"""Kernel bundle format: Python writes, the C++ core reads (round trips through its accessors), Python and
C++ agree on dispatch, and the reader refuses bad payloads."""
from __future__ import annotations

import ctypes
import math
import random
import struct
from dataclasses import replace

import numpy as np
import pytest

from dietcode_ort.bundle import (ACTIVATION_CODES, ATTENTION_PARAMS, FLAG_RESIDUAL_FIRST, MAGIC, VIEWS, Bundle, BundleKernel, DispatchTree, Feature, parse_arch,
                                 read_bundle, seal, select_image)
from dietcode_ort.errors import DietcodeError
from dietcode_ort.runtime import load_core

PTX80 = "//\n.version 8.0\n.target sm_80\n.address_size 64\n"


def _kernel(name: str, **kw: object) -> BundleKernel:
    base = dict(name=name, images=(("sm_90a", b"\x7fELF" + name.encode() * 3), ("sm_80", b"\x7fELF80")),
                ptx=PTX80, params=("a", "b", "bias", "c", "M", "N", "K"), num_warps=4, shared=16384,
                block_m=64, block_n=128, split_k=1, div16=("a", "b", "c", "K"))
    base.update(kw)
    return BundleKernel(**base)  # type: ignore[arg-type]


def random_tree(rng: random.Random, n_features: int, n_kernels: int, max_depth: int = 6) -> DispatchTree:
    """A random valid tree in preorder (children after parents), thresholds spread over small ints."""
    feat, thr, left, right, leaf = [], [], [], [], []

    def grow(depth: int) -> int:
        i = len(leaf)
        feat.append(-1), thr.append(0), left.append(-1), right.append(-1), leaf.append(-1)
        if depth >= max_depth or rng.random() < 0.25:
            leaf[i] = rng.randrange(n_kernels)
            return i
        feat[i] = rng.randrange(n_features)
        thr[i] = rng.randrange(-5, 600)
        left[i] = grow(depth + 1)
        right[i] = grow(depth + 1)
        return i

    grow(0)
    return DispatchTree(tuple(feat), tuple(thr), tuple(left), tuple(right), tuple(leaf))


def sample_bundle(seed: int = 0) -> Bundle:
    rng = random.Random(seed)
    features = (Feature("M", ((0, 0), (0, 1))), Feature("N", ((1, -1),)), Feature("K", ((0, -1),)))
    kernels = (BundleKernel.vendor(), _kernel("gemm_64x128"), _kernel("gemm_128x64_sk4", split_k=4,
                                                                     params=("a", "b", "bias", "c", "M", "N", "K",
                                                                             "workspace", "counters")),
               _kernel("bmm_32x32", params=("a", "b", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch"),
                       div16=("a", "b", "c", "stride_b_batch")))
    return Bundle(features, kernels, random_tree(rng, len(features), len(kernels)))


@pytest.fixture(scope="module")
def core():
    return load_core()


def test_round_trip_through_the_c_reader(core) -> None:
    """Every field the writer encodes comes back from the C core's parse, bytes for bytes."""
    for seed in range(4):
        b = sample_bundle(seed)
        data = b.to_bytes()
        assert data[:8] == MAGIC
        back = core.parse(data).decode()
        assert back == b and back.to_bytes() == data
    conv = Bundle((Feature("N", ((0, 0),)), Feature("H", ((0, -2), (1, 3)))), (_conv_kernel(), BundleKernel.vendor()),
                  DispatchTree((1, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1)))
    assert read_bundle(conv.to_bytes()) == conv
    assert read_bundle(conv.to_bytes()).kernels[0].conv == (64, 3, 3, 2, 2, 1, 1, 1, 1)


def test_reading_accessors_refuse_bad_ids(core) -> None:
    cb = core.parse(sample_bundle().to_bytes())
    lib = core.lib
    assert lib.dc_bundle_kernel_name(cb.handle, 4) is None and "kernel id 4 out of range" in core.error()
    assert lib.dc_bundle_feature_name(cb.handle, -1) is None and "feature id -1 out of range" in core.error()
    assert lib.dc_bundle_kernel_image(cb.handle, 1, 2, None, None, None, None) is None
    assert "image 2 out of range" in core.error()
    assert lib.dc_bundle_tree(cb.handle, None, None, None, None, None, cb.n_nodes) == -1


def test_read_bundle_refuses_with_the_readers_message() -> None:
    with pytest.raises(DietcodeError, match="invalid kernel bundle: .*bad magic"):
        read_bundle(b"XXBUNDLE" + sample_bundle().to_bytes()[8:])


def test_python_and_cpp_agree_on_random_trees(core) -> None:
    rng = random.Random(7)
    for seed in range(30):
        b = sample_bundle(seed)
        cb = core.parse(b.to_bytes())
        assert (cb.n_features, cb.n_kernels, cb.n_nodes) == (3, 4, len(b.tree.leaf))
        for _ in range(100):
            feats = [rng.randrange(-10, 700) for _ in range(3)]
            assert cb.select(feats) == b.evaluate(feats), (seed, feats)


def test_features_from_shapes_agree(core) -> None:
    b = sample_bundle(3)
    cb = core.parse(b.to_bytes())
    for shapes in ([[2, 7, 16], [16, 33]], [[1, 1, 8], [4, 8, 5]], [[9, 3, 2, 4], [4, 6]]):
        assert cb.features(shapes) == b.feature_values(shapes) == [shapes[0][0] * shapes[0][1], shapes[1][-1],
                                                                   shapes[0][-1]]
    with pytest.raises(DietcodeError, match="reads dim"):
        cb.features([[5], [4, 4]])
    with pytest.raises(DietcodeError, match="reads input 1"):
        cb.features([[2, 3, 4]])
    # feature 0 multiplies two dims: a product past 2^63 (or a negative dim) is refused, never wrapped around
    with pytest.raises(DietcodeError, match="overflows 64 bits"):
        cb.features([[2 ** 40, 2 ** 40, 16], [16, 33]])
    with pytest.raises(DietcodeError, match="negative"):
        cb.features([[2, -3, 16], [16, 33]])


def test_vendor_and_params_queries(core) -> None:
    b = sample_bundle()
    cb = core.parse(b.to_bytes())
    assert [cb.is_vendor(k) for k in range(4)] == [True, False, False, False]
    assert core.lib.dc_bundle_kernel_takes_param(cb.handle, 3, b"batch") == 1
    assert core.lib.dc_bundle_kernel_takes_param(cb.handle, 1, b"batch") == 0
    with pytest.raises(DietcodeError, match="out of range"):
        cb.is_vendor(4)


@pytest.mark.parametrize("op, view", [("gemm", "gemm"), ("bmm", "bmm"), ("conv", "conv")])
def test_kernel_view_follows_the_template_params(core, op: str, view: str) -> None:
    """The C++ core and Python agree on each template's view; attention (bmm) kernels take the bmm view."""
    from tuner import templates

    params = templates.ABI_PARAMS[op]
    conv = (64, 3, 3, 1, 1, 1, 1, 1, 1) if op == "conv" else ()
    kernel = _kernel("k", params=params, conv=conv, split_k=4)  # the full param list: a split-K kernel
    assert kernel.view == view
    cb = core.parse(Bundle((), (kernel, BundleKernel.vendor()), DispatchTree.single(0)).to_bytes())
    assert core.lib.dc_bundle_kernel_view(cb.handle, 0) == VIEWS.index(view)
    assert core.lib.dc_bundle_kernel_view(cb.handle, 1) == 0  # vendor: the node as it is
    assert core.lib.dc_bundle_kernel_view(cb.handle, 2) == -1


def test_kernel_with_two_views_is_refused(core) -> None:
    kernel = _kernel("k", params=("a", "b", "c", "M", "N", "K", "stride_a_batch", "img_h"),
                     conv=(64, 3, 3, 1, 1, 1, 1, 1, 1))
    with pytest.raises(DietcodeError, match="both a conv and a bmm view"):
        Bundle((), (kernel,), DispatchTree.single(0)).to_bytes()
    payload = Bundle((), (kernel,), DispatchTree.single(0)).to_bytes(validate=False)
    with pytest.raises(DietcodeError, match="both a conv and a bmm view"):
        core.parse(payload)


@pytest.mark.parametrize("cc,expected", [((9, 0), ("cubin", "sm_90a")), ((8, 6), ("cubin", "sm_80")),
                                         ((8, 0), ("cubin", "sm_80")), ((10, 0), ("ptx", "sm_80")),
                                         ((12, 0), ("ptx", "sm_80"))])
def test_image_choice(core, cc, expected) -> None:
    k = _kernel("g")
    cb = core.parse(Bundle((), (k,), DispatchTree.single(0)).to_bytes())
    assert cb.pick_image(0, *cc) == expected
    choice = select_image(k, *cc)
    assert (choice.kind, choice.arch) == expected


def test_arch_without_cubin_or_ptx_is_refused(core) -> None:
    k = _kernel("hopper_only", images=(("sm_90a", b"\x7fELF"),), ptx="")
    cb = core.parse(Bundle((), (k,), DispatchTree.single(0)).to_bytes())
    for major, minor in ((8, 0), (10, 0), (9, 1)):
        with pytest.raises(DietcodeError, match="cannot run on sm_.*sm_90a.*no PTX"):
            cb.pick_image(0, major, minor)
        with pytest.raises(DietcodeError, match="cannot run on"):
            select_image(k, major, minor)
    # arch-specific PTX (sm_90a) is not forward compatible either
    k2 = _kernel("ptx90a", images=(), ptx=".version 8.0\n.target sm_90a\n")
    cb2 = core.parse(Bundle((), (k2,), DispatchTree.single(0)).to_bytes())
    assert cb2.pick_image(0, 9, 0) == ("ptx", "sm_90a")
    with pytest.raises(DietcodeError, match="PTX for a different target"):
        cb2.pick_image(0, 10, 0)


def _refused(core, data: bytes, pattern: str) -> None:
    """A crafted payload, resealed (its checksum made to match, as a crafter would): the field checks refuse it."""
    data = seal(data)
    with pytest.raises(DietcodeError, match=pattern):
        core.parse(data)
    with pytest.raises(DietcodeError, match=pattern):
        read_bundle(data)


def test_every_truncation_is_refused(core) -> None:
    data = sample_bundle(1).to_bytes()
    for n in list(range(0, 64)) + list(range(64, len(data), 7)) + [len(data) - 1]:
        _refused(core, data[:n], "invalid kernel bundle")


def _tree_bundle(tree: DispatchTree) -> bytes:
    feats = (Feature("M", ((0, 0),)), Feature("N", ((1, 1),)))
    return Bundle(feats, (BundleKernel.vendor(), _kernel("k")), tree).to_bytes(validate=False)


@pytest.mark.parametrize("tree,pattern", [
    (DispatchTree((0, -1, -1), (4, 0, 0), (1, -1, -1), (0, -1, -1), (-1, 0, 1)), "child 0 out of range"),
    (DispatchTree((0, 1, -1), (4, 4, 0), (1, 2, -1), (2, 1, -1), (-1, -1, 0)), "more than one parent"),
    (DispatchTree((0, -1, -1, -1), (4, 0, 0, 0), (1, -1, -1, -1), (2, -1, -1, -1), (-1, 0, 1, 0)),
     "not reachable"),
    (DispatchTree((0, -1, -1), (4, 0, 0), (1, -1, -1), (3, -1, -1), (-1, 0, 1)), "child 3 out of range"),
    (DispatchTree((2, -1, -1), (4, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1)), "feature 2 out of range"),
    (DispatchTree((0, -1, -1), (4, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 2)), "leaf kernel id 2"),
    (DispatchTree((0, -1, -1), (4, 0, 0), (1, -1, -1), (2, -1, -1), (-2, 0, 1)), "leaf id -2"),
    (DispatchTree((-1,), (0,), (0,), (-1,), (1,)), "a leaf must have"),
])
def test_bad_trees_are_refused(core, tree, pattern) -> None:
    _refused(core, _tree_bundle(tree), pattern)


def test_crafted_sizes_are_refused(core) -> None:
    data = bytearray(sample_bundle(2).to_bytes())
    total = len(data)
    _refused(core, bytes(b"XXBUNDLE" + data[8:]), "bad magic")
    bad = bytearray(data)
    struct.pack_into("<I", bad, 8, 1)
    _refused(core, bytes(bad), "version 1")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 16, total + 1)
    _refused(core, bytes(bad), "header says")
    _refused(core, bytes(data) + b"\0", "header says")
    for field_offset, value, pattern in [(32 + 8, 1 << 62, "outside the payload"),
                                         (32 + 16, total, "outside the payload"),
                                         (32 + 8, 0, "outside the payload"),
                                         (32, 7, "unknown or repeated")]:
        bad = bytearray(data)
        struct.pack_into("<Q" if field_offset % 8 == 0 and field_offset != 32 else "<I", bad, field_offset, value)
        _refused(core, bytes(bad), pattern)
    # kernel count absurd, first kernel record size past the section
    _, _, k_off, _ = struct.unpack_from("<IIQQ", data, 32 + 24)
    bad = bytearray(data)
    struct.pack_into("<I", bad, k_off, 100000)
    _refused(core, bytes(bad), "kernel count")
    bad = bytearray(data)
    struct.pack_into("<I", bad, k_off + 4, 0xFFFFFFF0)
    _refused(core, bytes(bad), "record size")


def test_bad_kernels_are_refused(core) -> None:
    tree = DispatchTree.single(0)
    cases = [
        (_kernel("k", num_warps=3), "num_warps 3"),
        (_kernel("k", split_k=2), "split_k 2 but the params lack the 'workspace' pointer"),
        (_kernel("k", params=("a", "b", "c", "M", "N", "K", "workspace")), "takes a 'workspace' but has split_k 1"),
        (_kernel("k", params=("a", "b", "c", "M", "N", "K", "counters")), "takes a 'counters' but has split_k 1"),
        (_kernel("k", split_k=2, params=("a", "b", "c", "M", "N", "K", "workspace")),
         "lack the 'counters' pointer split-K kernels take"),
        (_kernel("k", split_k=2, params=ATTENTION_PARAMS + ("workspace", "counters")),
         "both an attention and another view"),
        (_kernel("k", block_m=0), "block_m 0"),
        (_kernel("k", params=("a", "b", "M")), "lack the output pointer"),
        (_kernel("k", params=("a", "c", "a")), "repeat"),
        (_kernel("k", images=(), ptx=""), "neither a cubin nor PTX"),
        (_kernel("k", images=(("sm_90a", b"x"), ("sm_90a", b"y"))), "two cubins"),
        (BundleKernel(name="vendor", kind="vendor", ptx=PTX80), "vendor kernel carries"),
    ]
    for kernel, pattern in cases:
        _refused(core, Bundle((), (kernel,), tree).to_bytes(validate=False), pattern)
    with pytest.raises(DietcodeError, match="not of the form"):
        parse_arch("compute_90")


def test_from_compiled_merges_archs() -> None:
    class CK:
        def __init__(self, arch: str, cubin: bytes) -> None:
            self.name, self.arch, self.cubin, self.ptx = "mm", arch, cubin, PTX80 if arch == "sm_80" else ""
            self.params = ["a", "b", "c", "M", "N", "K", "global_scratch", "profile_scratch"]
            self.num_warps, self.shared = 4, 1024 if arch == "sm_80" else 4096
            self.block_m, self.block_n, self.split_k = 64, 64, 1

    k = BundleKernel.from_compiled([CK("sm_90a", b"h"), CK("sm_80", b"a")])
    assert k.params == ("a", "b", "c", "M", "N", "K")
    assert dict(k.images) == {"sm_90a": b"h", "sm_80": b"a"} and k.ptx == PTX80
    # each cubin keeps its own shared size; the PTX launches with that of the arch it came from (sm_80)
    assert k.image_shared == (4096, 1024) and k.shared == 1024
    # tuner/aot records the integer cc; Triton's cc >= 90 cubins are arch-specific; the portable PTX wins
    hopper, ampere = CK("sm_90a", b"h"), CK("sm_80", b"a")
    hopper.arch, hopper.ptx, ampere.arch = 90, ".target sm_90a\n", 80
    k2 = BundleKernel.from_compiled([ampere, hopper])
    assert dict(k2.images) == {"sm_80": b"a", "sm_90a": b"h"} and k2.ptx == PTX80


def test_cuda_entry_points_fail_cleanly_without_a_driver(core) -> None:
    """The launch path is compiled in; without libcuda it reports why instead of crashing."""
    from dietcode_ort.runtime import LaunchArgs

    try:
        core.cuda_probe(0)
    except DietcodeError as exc:
        assert "CUDA driver" in str(exc) or "cuInit" in str(exc) or "device" in str(exc)
        cb = core.parse(sample_bundle().to_bytes())
        with pytest.raises(DietcodeError):
            cb.launch(1, LaunchArgs(M=4, N=4, K=4, batch=1))
    else:
        pytest.skip("a CUDA driver and device are present")
    with pytest.raises(DietcodeError, match="vendor kind"):
        core.parse(sample_bundle().to_bytes()).launch(0, LaunchArgs(M=4, N=4, K=4))


def test_div16_round_trips_and_is_checked_per_call(core) -> None:
    from dietcode_ort.runtime import LaunchArgs

    bundle = sample_bundle()
    assert read_bundle(bundle.to_bytes()).kernels[1].div16 == ("a", "b", "c", "K")
    parsed = core.parse(bundle.to_bytes())
    ok = LaunchArgs(a=0x1000, b=0x2000, bias=0x3004, c=0x4000, M=17, N=33, K=64)
    assert parsed.accepts(1, ok) == (True, "")  # bias and N are not assumed: any value passes
    for field, value, what in (("a", 0x1008, "a 16-byte aligned"), ("c", 0x4002, "c 16-byte aligned"),
                               ("K", 40, "K a multiple of 16")):
        args = LaunchArgs(**{**{f: getattr(ok, f) for f, _ in LaunchArgs._fields_}, field: value})
        accepted, why = parsed.accepts(1, args)
        assert not accepted and what in why and "gemm_64x128" in why
    assert parsed.accepts(0, ok)[0]  # the vendor kernel assumes nothing


def test_div16_naming_a_param_the_kernel_lacks_is_refused(core) -> None:
    bad = Bundle((Feature("M", ((0, 0),)),), (_kernel("k", div16=("a", "batch")),), DispatchTree.single(0))
    with pytest.raises(DietcodeError, match="div16 mask names param 'batch'"):
        bad.validate()
    # set a mask bit past the param enum in the first compiled kernel's record: the reader refuses
    data = Bundle((Feature("M", ((0, 0),)),), (_kernel("k"),), DispatchTree.single(0)).to_bytes()
    at = data.index(struct.pack("<I", 4) + struct.pack("<I", 16384)) - 2  # u16 mask precedes num_warps
    assert struct.unpack_from("<H", data, at)[0] == 0b1001011  # a, b, c, K
    for mask, pattern in ((1 << 15, "div16 mask names param 15"), (1 << 7, "div16 mask names param")):
        bad_bytes = bytearray(data)
        struct.pack_into("<H", bad_bytes, at, mask)
        _refused(core, bytes(bad_bytes), pattern)


def test_attention_div16_counts_from_q_round_trips_and_is_checked_per_call(core) -> None:
    """Format 10: an attention kernel's div16 bit i names param 16 + i (its params all sit from ``q`` on), so its
    pointers can carry the alignment Triton vectorizes and pipelines with; both readers agree, the C core checks
    it per call, and a mask bit past the attention params (the workspace's, 28) is refused."""
    from dietcode_ort.runtime import LaunchArgs

    attention = ("q", "k", "v", "out", "seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h",
                 "stride_mask_q", "stride_mask_k")
    aligned = _kernel("aligned", params=attention, div16=("q", "k", "v", "out"), head_dim=64)
    bundle = Bundle((), (aligned, _kernel("plain", params=attention, div16=(), head_dim=64)), DispatchTree.single(0))
    data = bundle.to_bytes()
    at = data.index(b"aligned") - 70  # the u16 mask: 5 u32s, 4 u8s, the 9 u32 conv fields, alpha, name length
    assert struct.unpack_from("<H", data, at)[0] == 0b10111  # q, k, v, out: params 16, 17, 18, 20
    back = read_bundle(data)
    assert back == bundle and back.kernels[0].div16 == ("q", "k", "v", "out") and back.kernels[1].div16 == ()
    parsed = core.parse(data)
    ok = LaunchArgs(q=0x1000, k=0x2000, v=0x3000, out=0x4000, seq_q=17, seq_k=17, heads=2, batch=2, head_dim=64)
    for field, value in (("q", 0x1002), ("k", 0x2008), ("v", 0x3004), ("out", 0x4006)):
        args = LaunchArgs(**{**{f: getattr(ok, f) for f, _ in LaunchArgs._fields_}, field: value})
        accepted, why = parsed.accepts(0, args)
        assert not accepted and f"{field} 16-byte aligned" in why
        assert parsed.accepts(1, args)[0]  # the kernel compiled without the assumption takes the call
    assert parsed.accepts(0, ok) == (True, "")
    for mask, pattern in ((1 << 12, "div16 mask names param 28"), (1 << 3, "div16 mask names param 19")):
        bad = bytearray(data)  # 28: the workspace, no attention param; 19: the mask, which this kernel lacks
        struct.pack_into("<H", bad, at, mask)
        _refused(core, bytes(bad), pattern)
    with pytest.raises(DietcodeError, match="div16 names 'a'|div16 mask names param 'a'"):
        Bundle((), (_kernel("mixed", params=attention, div16=("a",), head_dim=64),), DispatchTree.single(0)).to_bytes()


def _conv_kernel(**kw: object) -> BundleKernel:
    base = dict(params=("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w"),
                div16=(), dtype="float16", activation="relu", conv=(64, 3, 3, 2, 2, 1, 1, 1, 1))
    base.update(kw)
    return _kernel("conv_k", **base)


def test_every_activation_code_round_trips_and_one_past_them_is_refused(core) -> None:
    """Format 9's activation codes (gelu_tanh, silu, relu6 after none, relu, gelu) round trip through the writer
    and both readers and must match the node's; the code after the last is refused by both readers."""
    payloads = {}
    for act in ACTIVATION_CODES:
        bundle = Bundle((Feature("M", ((0, 0),)),), (_kernel("g", activation=act),), DispatchTree.single(0))
        payloads[act] = bundle.to_bytes()
        assert read_bundle(payloads[act]).kernels[0].activation == act
        parsed = core.parse(payloads[act])
        parsed.check_node("float32", "MatMul", act)
        other = ACTIVATION_CODES[(ACTIVATION_CODES.index(act) + 1) % len(ACTIVATION_CODES)]
        with pytest.raises(DietcodeError, match="another activation"):
            parsed.check_node("float32", "MatMul", other)
    a, b = payloads["silu"], payloads["relu6"]
    (at,) = [i for i in range(len(a)) if a[i] != b[i] and not 28 <= i < 32]  # the activation byte (28: the CRC)
    assert (a[at], b[at]) == (4, 5)
    bad = bytearray(b)
    bad[at] = len(ACTIVATION_CODES)
    _refused(core, bytes(bad), "activation 6")


def test_build_facts_round_trip_and_must_fit_the_node(core) -> None:
    gemm = _kernel("g", dtype="float16", activation="gelu", trans_b=True)
    bundle = Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), gemm), DispatchTree.single(1))
    back = read_bundle(bundle.to_bytes()).kernels[1]
    assert (back.dtype, back.activation, back.trans_b, back.conv) == ("float16", "gelu", True, ())
    parsed = core.parse(bundle.to_bytes())
    parsed.check_node("float16", "Gemm", "gelu", trans_b=True)
    for args, pattern in ((("float32", "Gemm", "gelu", True), "another element type"),
                          (("float16", "Gemm", "relu", True), "another activation"),
                          (("float16", "Gemm", "gelu", False), "transB=1, the node has 0"),
                          (("float16", "Conv", "gelu", True), "not a kernel for this op type")):
        with pytest.raises(DietcodeError, match=pattern):
            parsed.check_node(*args)

    conv = core.parse(Bundle((Feature("N", ((0, 0),)),), (_conv_kernel(),), DispatchTree.single(0)).to_bytes())
    conv.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 3, 3))
    conv.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 0, 0))  # kernel_shape not given
    with pytest.raises(DietcodeError, match="another conv geometry"):
        conv.check_node("float16", "Conv", "relu", conv=(1, 1, 1, 1, 1, 1, 3, 3))
    with pytest.raises(DietcodeError, match="another conv geometry"):
        conv.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 5, 5))
    with pytest.raises(DietcodeError, match="needs explicit pads"):
        conv.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 3, 3), explicit_pads=False)
    # a grouped node takes only kernels compiled for a grouped conv (their group from the grid's z); those
    # compute group 1 too
    with pytest.raises(DietcodeError, match=r"compiled for an ungrouped conv, the node has group 4"):
        conv.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 3, 3), group=4)
    with pytest.raises(DietcodeError, match="Conv group 0 must be at least 1"):
        conv.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 3, 3), group=0)
    grouped = core.parse(Bundle((Feature("N", ((0, 0),)),), (_conv_kernel(grouped=True), BundleKernel.vendor()),
                                DispatchTree((0, -1, -1), (8, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))).to_bytes())
    for group in (1, 4, 64):
        grouped.check_node("float16", "Conv", "relu", conv=(2, 2, 1, 1, 1, 1, 3, 3), group=group)


@pytest.mark.parametrize("kernel, pattern", [
    (BundleKernel(name="v", kind="vendor", dtype="float16"), "vendor kernel carries no"),
    (_kernel("g", conv=(64, 3, 3, 1, 1, 0, 0, 1, 1)), "conv geometry field 0"),
    (_conv_kernel(conv=(0, 3, 3, 1, 1, 0, 0, 1, 1)), "conv geometry field 0"),
    (_conv_kernel(conv=(64, 3, 3, 1, 1, 0, 0, 1, 999)), "conv geometry field 8"),
])
def test_bad_build_facts_are_refused(core, kernel, pattern) -> None:
    bundle = Bundle((Feature("M", ((0, 0),)),), (kernel,), DispatchTree.single(0))
    with pytest.raises(DietcodeError, match=pattern):
        bundle.validate()
    # the same bytes, written without validation, are refused by the reader
    _refused(core, _unchecked_bytes(bundle), pattern)


def _unchecked_bytes(bundle: Bundle) -> bytes:
    """Serialize without validating (to_bytes may validate first)."""
    import dietcode_ort.bundle as mod

    original = mod.Bundle.validate
    try:
        mod.Bundle.validate = lambda self: None  # type: ignore[method-assign]
        return bundle.to_bytes()
    finally:
        mod.Bundle.validate = original  # type: ignore[method-assign]


def _fit_bundle(core, **kw: object):
    """One compiled kernel without div16 assumptions (so only the size hazards decide), parsed in C++."""
    kernel = _kernel("k", div16=(), **kw)
    return core.parse(Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), kernel),
                             DispatchTree.single(1)).to_bytes())


_BMM = ("a", "b", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch")


@pytest.mark.parametrize("kw, bad, good, reason", [
    # an empty output needs no launch at all (ORT's kernel allocates it and returns); K = 0 is ORT's to fill
    ({}, dict(M=0, N=8, K=8), dict(M=1, N=8, K=8), "empty output"),
    ({}, dict(M=8, N=0, K=8), dict(M=8, N=1, K=8), "empty output"),
    ({}, dict(M=8, N=8, K=0), dict(M=8, N=8, K=1), "K is 0"),
    ({}, dict(M=-1, N=8, K=8), dict(M=1, N=8, K=8), "negative size"),
    # grid z holds at most 65535 batches
    (dict(params=_BMM), dict(M=4, N=4, K=4, batch=65536, stride_a_batch=16, stride_b_batch=16),
     dict(M=4, N=4, K=4, batch=65535, stride_a_batch=16, stride_b_batch=16), "batch above grid z"),
    # a batched MatMul whose output's batch dims hold a 0 ([0, 3, M, N]): empty, not one matrix (0 read as 1
    # launched a program that wrote M x N elements of an output with none)
    (dict(params=_BMM), dict(M=4, N=4, K=4, batch=0, stride_a_batch=16, stride_b_batch=16),
     dict(M=4, N=4, K=4, batch=1, stride_a_batch=16, stride_b_batch=16), "empty output"),
    # grid x holds at most 2^31-1 tiles (1x1 tiles: tiles = M*N; K = 1 keeps the operands small)
    (dict(block_m=1, block_n=1), dict(M=2**31 - 1, N=2, K=1), dict(M=2**31 - 1, N=1, K=1), "tiles above grid x"),
])
def test_call_hazards_fall_back_with_their_reason(core, kw, bad, good, reason) -> None:
    from dietcode_ort.runtime import LaunchArgs

    parsed = _fit_bundle(core, **kw)
    accepted, why = parsed.accepts(1, LaunchArgs(**bad))
    assert not accepted and reason in why and "'k'" in why
    assert parsed.fit(1, LaunchArgs(**bad))[0] == reason
    assert parsed.accepts(1, LaunchArgs(**good)) == (True, "")
    assert parsed.fit(1, LaunchArgs(**good)) == ("fits", "")
    assert parsed.accepts(0, LaunchArgs(**bad)) == (True, "")  # ORT's own kernel takes any call


def test_tile_indices_must_not_wrap(core) -> None:
    """pid * BLOCK + arange is int32 in the templates: M (or N) rounded up to whole tiles must stay below 2^31."""
    from dietcode_ort.runtime import LaunchArgs

    parsed = _fit_bundle(core)  # 64 x 128 tiles
    name, why = parsed.fit(1, LaunchArgs(M=2**31 - 63, N=1, K=1))
    assert name == "int32 offsets" and "rounded up" in why
    assert parsed.fit(1, LaunchArgs(M=2**31 - 64, N=1, K=1)) == ("fits", "")  # exactly 2^25 - 1 whole tiles
    assert parsed.fit(1, LaunchArgs(M=1, N=2**31 - 127, K=1))[0] == "int32 offsets"


def test_gemm_and_bmm_offsets_are_64_bit(core) -> None:
    """The gemm and bmm templates compute offsets in int64: a 65536 x 50257 LM head (C spans 2^31 elements
    and more), an A of 2^31 elements, a batch of 2048 1024x1024 outputs and a batch stride near 2^31 all fit."""
    from dietcode_ort.runtime import LaunchArgs

    gemm = _fit_bundle(core)
    assert gemm.fit(1, LaunchArgs(M=65536, N=50257, K=64)) == ("fits", "")
    assert gemm.fit(1, LaunchArgs(M=2**16, N=64, K=2**15)) == ("fits", "")
    bmm = _fit_bundle(core, params=_BMM)
    assert bmm.fit(1, LaunchArgs(M=1024, N=1024, K=16, batch=2048, stride_a_batch=16384)) == ("fits", "")
    assert bmm.fit(1, LaunchArgs(M=16, N=16, K=16, batch=2, stride_a_batch=2**31 - 1)) == ("fits", "")


def test_conv_hazards_count_per_image(core) -> None:
    from dietcode_ort.runtime import LaunchArgs

    parsed = _fit_bundle(core, params=("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w"),
                         dtype="float16", activation="relu", conv=(64, 3, 3, 1, 1, 1, 1, 1, 1))
    # X per image = 64 channels * img_h * img_w; A as [M, K] would span 2^37 (the image part of offsets is int64)
    ok = dict(M=2**15 * 4096, N=64, K=576, img_n=2**15, img_h=64, img_w=64, out_h=64, out_w=64)
    assert parsed.fit(1, LaunchArgs(**ok)) == ("fits", "")
    big = dict(ok, M=4096 * 4096, N=1, img_n=1, img_h=8192, img_w=4096, out_h=4096, out_w=4096)
    name, why = parsed.fit(1, LaunchArgs(**big))
    assert name == "int32 offsets" and "X per image" in why
    assert parsed.fit(1, LaunchArgs(**dict(big, img_h=8191)))[0] == "fits"  # 64*8191*4096 < 2^31
    # Y per image = N * out_h * out_w; W = K * N
    name, why = parsed.fit(1, LaunchArgs(**dict(ok, N=512, out_h=2048, out_w=2048, M=2048 * 2048)))
    assert name == "int32 offsets" and "Y per image" in why
    assert parsed.fit(1, LaunchArgs(**dict(ok, N=511, out_h=2048, out_w=2048, M=2048 * 2048)))[0] == "fits"
    name, why = parsed.fit(1, LaunchArgs(**dict(ok, M=64, N=2**22, K=512)))
    assert name == "int32 offsets" and "W spans" in why


# made-up devices: (major, minor, opt-in shared memory per block)
SM80, SM86, SM90 = (8, 0, 163 * 1024), (8, 6, 99 * 1024), (9, 0, 227 * 1024)


def test_kernels_that_cannot_run_on_the_device_are_vendor_for_the_session(core) -> None:
    kernels = (BundleKernel.vendor(),
               _kernel("small", shared=16384),  # sm_90a + sm_80 cubins, sm_80 PTX: runs everywhere here
               _kernel("big", shared=120 * 1024),  # too much shared memory for sm_86
               _kernel("huge", shared=200 * 1024),  # only sm_90 has room
               _kernel("hopper_only", images=(("sm_90a", b"\x7fELF90"),), ptx=""))
    parsed = core.parse(Bundle((Feature("M", ((0, 0),)),), kernels, DispatchTree.single(1)).to_bytes())
    fits, why = parsed.fit_device(*SM80)
    assert fits == [True, True, True, False, False]
    assert "'huge' needs 204800 bytes of shared memory, sm_80 allows 166912" in why[3]
    assert "'hopper_only' cannot run on sm_80" in why[4] and "no PTX" in why[4]
    fits, why = parsed.fit_device(*SM86)
    assert fits == [True, True, False, False, False]
    assert "'big' needs 122880 bytes" in why[2] and "sm_86 allows 101376" in why[2]
    fits, why = parsed.fit_device(*SM90)
    assert fits == [True] * 5 and why == [""] * 5
    # just at the limit fits
    at_limit = core.parse(Bundle((Feature("M", ((0, 0),)),), (_kernel("k", shared=99 * 1024),),
                                 DispatchTree.single(0)).to_bytes())
    assert at_limit.fit_device(*SM86)[0] == [True]
    # PTX the driver can JIT only for a newer device than the one at hand
    ptx90 = core.parse(Bundle((Feature("M", ((0, 0),)),), (_kernel("p", images=(), ptx=".target sm_90\n"),),
                              DispatchTree.single(0)).to_bytes())
    fits, why = ptx90.fit_device(*SM86)
    assert fits == [False] and "PTX for a different target" in why[0]
    assert ptx90.fit_device(*SM90)[0] == [True] and ptx90.fit_device(12, 0, 99 * 1024)[0] == [True]
    assert at_limit.fit_device(8, 6, 99 * 1024 - 1)[0] == [False]
    with pytest.raises(DietcodeError, match="not a device"):
        at_limit.fit_device(8, 6, 0)


def test_shared_memory_is_per_image(core) -> None:
    """An sm_90a cubin may use far more shared memory than the sm_80 one: each image launches with its own,
    so the sm_80 cubin (and the PTX) still fit an sm_86 device."""
    kernel = _kernel("k", shared=20000, image_shared=(200 * 1024, 30000))  # images: sm_90a, sm_80
    bundle = Bundle((Feature("M", ((0, 0),)),), (kernel,), DispatchTree.single(0))
    back = read_bundle(bundle.to_bytes())
    assert back == bundle and back.kernels[0].image_shared == (200 * 1024, 30000)
    parsed = core.parse(bundle.to_bytes())
    assert parsed.image_shared(0, 9, 0) == 200 * 1024  # the sm_90a cubin
    assert parsed.image_shared(0, 8, 6) == 30000  # the sm_80 cubin, binary compatible
    assert parsed.image_shared(0, 12, 0) == 20000  # the sm_80 PTX, JIT-ed
    for major, minor in ((9, 0), (8, 6), (12, 0)):
        assert parsed.image_shared(0, major, minor) == kernel.shared_for(select_image(kernel, major, minor))
    assert parsed.fit_device(*SM86)[0] == [True]
    assert parsed.fit_device(*SM90)[0] == [True]
    fits, why = parsed.fit_device(9, 0, 160 * 1024)
    assert fits == [False] and "needs 204800 bytes" in why[0]
    # defaults: no image_shared means every cubin takes `shared`
    assert _kernel("d", shared=123).image_shared == (123, 123)


def test_image_shared_is_checked_by_writer_and_reader(core) -> None:
    with pytest.raises(DietcodeError, match="image shared sizes for 2 cubins"):
        _kernel("k", image_shared=(1,)).validate(0)
    with pytest.raises(DietcodeError, match="shared 1048577 bytes outside"):
        _kernel("k", image_shared=(1, (1 << 20) + 1)).validate(0)
    data = Bundle((Feature("M", ((0, 0),)),), (_kernel("k", image_shared=(7777, 16384)),),
                  DispatchTree.single(0)).to_bytes()
    at = data.index(struct.pack("<III", 90, 1, 7777)) + 8  # sm_90a image: cc, flags, shared
    bad = bytearray(data)
    struct.pack_into("<I", bad, at, (1 << 20) + 1)
    _refused(core, bytes(bad), "image shared")
    struct.pack_into("<I", bad, at, 1 << 20)  # the limit itself is fine
    assert read_bundle(seal(bad)).kernels[0].image_shared == (1 << 20, 16384)
    assert core.parse(seal(bad)).image_shared(0, 9, 0) == 1 << 20


def test_older_bundle_versions_are_refused(core) -> None:
    data = bytearray(sample_bundle().to_bytes())
    for version in (2, 4, 5, 6, 7, 8, 9, 10, 11, 12):  # 4: before the kernels' alpha; 5: split-K by atomics
        # (zero_output, flag bit 0); 6: before the persistent byte and the packed QKV layout bit; 7: flag bit 0
        # unused, no conv residual; 8: activations 0..2 only; 9: attention kernels without div16 bits; 10: no
        # channels-last conv kernels (epilogue flags bit 4); 11: split-K kernels without the counters param;
        # 12: no checksum
        struct.pack_into("<I", data, 8, version)
        _refused(core, bytes(data), f"version {version}, this reader knows 13: the model was optimized by an older "
                 "dietcode-ort; optimize it again")
    struct.pack_into("<I", data, 8, 14)  # a later format: the library is the older one
    _refused(core, bytes(data), "version 14, this reader knows 13: the model was optimized by a newer dietcode-ort; "
             "update the custom-op library")


def test_residual_first_flag_round_trips_and_needs_a_residual_and_an_activation(core) -> None:
    """Flag bit 0 (format 8; format 5's zero_output before) marks a kernel adding its residual before the
    activation. It round trips on a gemm or conv kernel taking the residual with an activation; a kernel
    without either is refused by the reader and the writer alike."""
    conv = dict(params=("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual"),
                conv=(8, 3, 3, 1, 1, 1, 1, 1, 1), div16=("a", "b", "c", "residual"))
    for kw in ({"params": ("a", "b", "bias", "c", "M", "N", "K", "residual")}, conv):
        kernel = _kernel("k", residual_first=True, activation="relu", **kw)  # type: ignore[arg-type]
        bundle = Bundle((), (kernel,), DispatchTree.single(0))
        back = read_bundle(bundle.to_bytes()).kernels[0]
        assert back.residual_first and back.params == kernel.params and back == kernel
        parsed = core.parse(bundle.to_bytes())
        assert core.lib.dc_bundle_kernel_residual_first(parsed.handle, 0) == 1
    plain = Bundle((), (_kernel("k", activation="relu"),), DispatchTree.single(0))
    data = bytearray(plain.to_bytes())
    _, _, k_off, _ = struct.unpack_from("<IIQQ", data, 32 + 24)
    flags_at = k_off + 4 + 4 + 1  # kernel count, record size, kind
    assert data[flags_at] == 0
    data[flags_at] = FLAG_RESIDUAL_FIRST
    _refused(core, bytes(data), "residual_first orders a residual before an activation, and the kernel takes no "
                                "residual")
    with pytest.raises(DietcodeError, match="takes no activation"):
        Bundle((), (_kernel("k", residual_first=True, params=("a", "b", "bias", "c", "M", "N", "K", "residual")),),
               DispatchTree.single(0)).to_bytes()
    with pytest.raises(DietcodeError, match="only gemm-view and conv kernels take"):
        Bundle((), (_kernel("k", params=("a", "b", "bias", "c", "M", "N", "K", "stride_a_batch", "residual")),),
               DispatchTree.single(0)).to_bytes()


def test_residual_mul_round_trips_and_needs_a_residual_and_an_activation(core) -> None:
    """The kernel record's epilogue flags (bit 0) mark a kernel multiplying the activation's
    result by its residual (LLaMA's SwiGLU gate). It round trips on a gemm or conv kernel taking the residual
    with an activation; a kernel without either, one adding the residual first, a vendor kernel and unknown
    bits are refused by the reader or the writer."""
    gemm = dict(params=("a", "b", "c", "M", "N", "K", "residual"), div16=("a", "b", "c", "residual"))
    conv = dict(params=("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual"),
                conv=(8, 3, 3, 1, 1, 1, 1, 1, 1))
    for kw in (gemm, conv):
        kernel = _kernel("k", residual_mul=True, activation="silu", **kw)  # type: ignore[arg-type]
        bundle = Bundle((), (kernel,), DispatchTree.single(0))
        back = read_bundle(bundle.to_bytes()).kernels[0]
        assert back.residual_mul and not back.residual_first and back == kernel
        parsed = core.parse(bundle.to_bytes())
        assert core.lib.dc_bundle_kernel_residual_mul(parsed.handle, 0) == 1
        assert core.lib.dc_bundle_kernel_residual_first(parsed.handle, 0) == 0
    added = core.parse(Bundle((), (_kernel("k", activation="silu", **gemm),),  # type: ignore[arg-type]
                              DispatchTree.single(0)).to_bytes())
    assert core.lib.dc_bundle_kernel_residual_mul(added.handle, 0) == 0
    assert core.lib.dc_bundle_kernel_residual_mul(added.handle, 1) == -1

    with_epilogue_flags = _with_epilogue_flags
    _refused(core, with_epilogue_flags(_kernel("k", activation="relu"), 1),
             "residual_mul multiplies an activation's result by a residual, and the kernel takes no residual")
    _refused(core, with_epilogue_flags(_kernel("k", **gemm), 1), "and the kernel takes no activation")  # type: ignore[arg-type]
    _refused(core, with_epilogue_flags(_kernel("k", residual_first=True, activation="relu", **gemm), 1),  # type: ignore[arg-type]
             "and the kernel takes it before the activation")
    _refused(core, with_epilogue_flags(_kernel("k", activation="silu", **gemm), 32), "epilogue flags 32 invalid")  # type: ignore[arg-type]
    _refused(core, with_epilogue_flags(_kernel("k", activation="silu", **gemm), 8), "grouped applies to conv kernels only")  # type: ignore[arg-type]
    for bad, why in ((_kernel("k", residual_mul=True, **gemm), "takes no activation"),  # type: ignore[arg-type]
                     (_kernel("k", residual_mul=True, activation="silu"), "takes no residual"),
                     (_kernel("k", residual_mul=True, residual_first=True, activation="silu", **gemm),  # type: ignore[arg-type]
                      "takes it before the activation")):
        with pytest.raises(DietcodeError, match=why):
            Bundle((), (bad,), DispatchTree.single(0)).to_bytes()
    with pytest.raises(DietcodeError, match="a vendor kernel carries no"):
        Bundle((), (replace(BundleKernel.vendor(), residual_mul=True),), DispatchTree.single(0)).to_bytes()


def _with_epilogue_flags(kernel: BundleKernel, value: int) -> bytes:
    """A one-kernel bundle's payload with the kernel record's epilogue flags byte set to ``value``."""
    data = bytearray(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes())
    _, _, k_off, _ = struct.unpack_from("<IIQQ", data, 32 + 24)
    (record,) = struct.unpack_from("<I", data, k_off + 4)  # after the kernel count
    at = k_off + 4 + record - 5  # the epilogue flags, before the u32 head_dim ending the record
    assert data[at] == 0
    data[at] = value
    return seal(data)


def test_channels_last_flag_round_trips_on_ungrouped_conv_kernels_only(core) -> None:
    """Format 11: epilogue flags bit 4 marks a channels-last (NHWC) conv kernel. It round trips through the writer,
    the C reader and its accessor; both readers refuse it on a gemm kernel, a vendor kernel, or with grouped."""
    conv = dict(params=("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual"),
                conv=(8, 3, 3, 1, 1, 1, 1, 1, 1), activation="relu")
    for channels_last in (True, False):
        kernel = _kernel("k", channels_last=channels_last, **conv)  # type: ignore[arg-type]
        data = Bundle((), (kernel,), DispatchTree.single(0)).to_bytes()
        back = read_bundle(data).kernels[0]
        assert back == kernel and back.channels_last == channels_last
        parsed = core.parse(data)
        assert core.lib.dc_bundle_kernel_channels_last(parsed.handle, 0) == int(channels_last)
        assert core.lib.dc_bundle_kernel_grouped(parsed.handle, 0) == 0
        assert parsed.decode().kernels[0].channels_last == channels_last
    assert core.lib.dc_bundle_kernel_channels_last(core.parse(data).handle, 1) == -1
    assert _with_epilogue_flags(_kernel("k", **conv), 16) == (  # type: ignore[arg-type]
        Bundle((), (_kernel("k", channels_last=True, **conv),), DispatchTree.single(0)).to_bytes())  # type: ignore[arg-type]
    # the C reader: on a gemm kernel, or with grouped (8 | 16)
    _refused(core, _with_epilogue_flags(_kernel("k", activation="relu"), 16), "channels_last applies to conv kernels only")
    _refused(core, _with_epilogue_flags(_kernel("k", **conv), 8 | 16),  # type: ignore[arg-type]
             "channels_last applies to ungrouped conv kernels only")
    # the writer, the same rules
    with pytest.raises(DietcodeError, match="channels_last applies to conv kernels only"):
        Bundle((), (_kernel("k", channels_last=True),), DispatchTree.single(0)).to_bytes()
    with pytest.raises(DietcodeError, match="channels_last applies to ungrouped conv kernels only"):
        Bundle((), (_kernel("k", channels_last=True, grouped=True, **conv),), DispatchTree.single(0)).to_bytes()  # type: ignore[arg-type]
    with pytest.raises(DietcodeError, match="a vendor kernel carries no"):
        Bundle((), (replace(BundleKernel.vendor(), channels_last=True),), DispatchTree.single(0)).to_bytes()


def test_check_node_needs_the_nodes_layout(core) -> None:
    """C ABI 13: every compiled conv kernel's channels-last flag must be the node's ``channels_last``; vendor kernels
    take either layout; channels_last outside 0/1 or on another op is refused."""
    geometry = (2, 2, 1, 1, 1, 1, 3, 3)
    tree = DispatchTree((0, -1, -1), (8, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    nhwc = core.parse(Bundle((Feature("N", ((0, 0),)),), (_conv_kernel(channels_last=True), BundleKernel.vendor()),
                             tree).to_bytes())
    nchw = core.parse(Bundle((Feature("N", ((0, 0),)),), (_conv_kernel(), BundleKernel.vendor()), tree).to_bytes())
    nhwc.check_node("float16", "Conv", "relu", conv=geometry, channels_last=True)
    nchw.check_node("float16", "Conv", "relu", conv=geometry, channels_last=False)
    with pytest.raises(DietcodeError, match=r"bundle kernel 0 \('conv_k'\) was compiled for NHWC, the node is NCHW "
                                            r"\(channels_last=0\): optimize again"):
        nhwc.check_node("float16", "Conv", "relu", conv=geometry)
    with pytest.raises(DietcodeError, match=r"was compiled for NCHW, the node is NHWC \(channels_last=1\): optimize "
                                            r"again"):
        nchw.check_node("float16", "Conv", "relu", conv=geometry, channels_last=True)
    vendor = core.parse(Bundle((), (BundleKernel.vendor(),), DispatchTree.single(0)).to_bytes())
    vendor.check_node("float16", "Conv", "relu", conv=geometry, channels_last=True)
    arr = (ctypes.c_int64 * 9)(*geometry, 1)
    for base, value in ((2, 2), (2, -1), (0, 1)):
        assert core.lib.dc_bundle_check_node(nchw.handle, 1, base, 1, 0, arr, 1, value) == -1
        assert "channels_last" in core.error()


def test_grouped_flag_round_trips_on_conv_kernels_only(core) -> None:
    """Epilogue flags bit 3 marks a conv kernel compiled for a grouped conv (its group from the grid's z): it round
    trips through the C reader and the accessor; a gemm kernel or a vendor kernel with it is refused."""
    conv = dict(params=("a", "b", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w"), conv=(8, 3, 3, 1, 1, 1, 1, 1, 1))
    for grouped in (True, False):
        kernel = _kernel("k", grouped=grouped, **conv)  # type: ignore[arg-type]
        data = Bundle((), (kernel,), DispatchTree.single(0)).to_bytes()
        assert read_bundle(data).kernels[0] == kernel
        assert core.lib.dc_bundle_kernel_grouped(core.parse(data).handle, 0) == int(grouped)
    assert core.lib.dc_bundle_kernel_grouped(core.parse(data).handle, 1) == -1
    with pytest.raises(DietcodeError, match="grouped applies to conv kernels only"):
        Bundle((), (_kernel("k", grouped=True),), DispatchTree.single(0)).to_bytes()
    with pytest.raises(DietcodeError, match="a vendor kernel carries no"):
        Bundle((), (replace(BundleKernel.vendor(), grouped=True),), DispatchTree.single(0)).to_bytes()


def test_attention_and_causal_flags_need_their_kernels(core) -> None:
    bundle = Bundle((), (_kernel("k"),), DispatchTree.single(0))
    data = bytearray(bundle.to_bytes())
    _, _, k_off, _ = struct.unpack_from("<IIQQ", data, 32 + 24)
    flags_at = k_off + 4 + 4 + 1  # kernel count, record size, kind
    data[flags_at] = 128  # bit 7 (the packed QKV layout) is known, but only attention kernels take it
    _refused(core, bytes(data), "operand layouts apply to attention kernels only")
    data[flags_at] = 8  # bit 3 (Q's layout) is known, but only attention kernels take it
    _refused(core, bytes(data), "operand layouts apply to attention kernels only")
    data[flags_at] = 2  # bit 1 (causal) is known, but only attention kernels take it
    _refused(core, bytes(data), "causal applies to attention kernels only")


def test_alpha_round_trips_and_must_be_the_nodes_scale(core) -> None:
    """Each compiled kernel records its baked-in alpha (float32); the check both EPs run refuses a node scale
    other than any compiled kernel's, vendor kernels carrying none."""
    kernels = (BundleKernel.vendor(), _kernel("scaled", alpha=0.125), _kernel("scaled2", alpha=0.125))
    bundle = Bundle((Feature("M", ((0, 0),)),), kernels, DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1),
                                                                      (2, -1, -1), (-1, 1, 2)))
    back = read_bundle(bundle.to_bytes())
    assert [k.alpha for k in back.kernels] == [1.0, 0.125, 0.125] and back == bundle
    parsed = core.parse(bundle.to_bytes())
    parsed.check_scale(0.125)
    with pytest.raises(DietcodeError, match=r"kernel 1 \('scaled'\) was compiled with alpha 0\.125, the node's scale is 0\.5"):
        parsed.check_scale(0.5)
    with pytest.raises(DietcodeError, match="alpha 0.125, the node's scale is 1"):
        parsed.check_scale(1.0)
    odd = read_bundle(Bundle((), (_kernel("third", alpha=float(np.float32(1 / 3))),), DispatchTree.single(0)).to_bytes())
    assert odd.kernels[0].alpha == float(np.float32(1 / 3))
    with pytest.raises(DietcodeError, match="not a finite, non-zero float32"):
        Bundle((), (_kernel("third", alpha=1 / 3),), DispatchTree.single(0)).to_bytes()
    for bad, pattern in ((_kernel("z", alpha=0.0), "alpha 0.0+ is not a finite"),
                         (_kernel("n", alpha=math.inf), "alpha inf is not a finite"),
                         (BundleKernel(name="vendor", kind="vendor", alpha=0.5), "a vendor kernel carries no")):
        _refused(core, Bundle((), (bad,), DispatchTree.single(0)).to_bytes(validate=False), pattern)


def test_alpha_comes_from_the_compiled_kernels_constants() -> None:
    from types import SimpleNamespace

    compiled = SimpleNamespace(name="k", arch=90, cubin=b"\x7fELF", ptx="", params=("a", "b", "c", "M", "N", "K"),
                               num_warps=4, shared=0, block_m=64, block_n=64, split_k=1,
                               constants=(("ALPHA", 0.1), ("BLOCK_M", 64)))
    assert BundleKernel.from_compiled([compiled]).alpha == float(np.float32(0.1))
    del compiled.constants
    assert BundleKernel.from_compiled([compiled]).alpha == 1.0
    compiled.epilogue = SimpleNamespace(activation="none", alpha=0.5)  # a cached compile without constants
    assert BundleKernel.from_compiled([compiled]).alpha == 0.5


def test_causal_flag_round_trips_on_attention_kernels_only(core) -> None:
    """Flags bit 1 marks an attention kernel compiled in causal mode (what an Attention node's `causal`
    attribute is checked against); a GEMM or vendor kernel carrying it is refused by both readers."""
    attention = ("q", "k", "v", "out", "seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h",
                 "stride_mask_q", "stride_mask_k")
    kernels = (_kernel("causal", params=attention, div16=(), causal=True, head_dim=64),
               _kernel("plain", params=attention, div16=(), head_dim=64))
    bundle = Bundle((Feature("seq_q", ((0, -2),)),), kernels, DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1),
                                                                           (2, -1, -1), (-1, 0, 1)))
    back = read_bundle(bundle.to_bytes())
    assert [k.causal for k in back.kernels] == [True, False] and back == bundle
    for bad, pattern in ((_kernel("gemm", causal=True), "causal applies to attention kernels only"),
                         (BundleKernel(name="vendor", kind="vendor", causal=True), "a vendor kernel carries no")):
        with pytest.raises(DietcodeError, match=pattern):
            Bundle((), (bad,), DispatchTree.single(0)).to_bytes()
        _refused(core, Bundle((), (bad,), DispatchTree.single(0)).to_bytes(validate=False), pattern)


def test_attention_head_dim_mask_rows_and_nan_to_zero_round_trip_and_are_checked(core) -> None:
    """The u32 ending the kernel record is an attention kernel's HEAD_DIM, epilogue flags bits 1 and 2 its
    MASK_ROWS and NAN_TO_ZERO: they round trip through both readers, other kernels carry none, and
    ``dc_bundle_check_attention`` refuses a node whose head_dim (when > 0), mask_rows or nan_to_zero differs."""
    masked = ("q", "k", "v", "mask", "out", "seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h",
              "stride_mask_q", "stride_mask_k")
    plain = tuple(p for p in masked if p != "mask")
    kernels = (_kernel("m", params=masked, div16=(), head_dim=80, mask_rows=True, nan_to_zero=True),
               _kernel("m2", params=masked, div16=(), head_dim=80, mask_rows=True, nan_to_zero=True, block_n=32))
    one_row = _kernel("one_row", params=masked, div16=(), head_dim=80, nan_to_zero=True)
    bundle = Bundle((Feature("seq_q", ((0, -2),)),), kernels, DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1),
                                                                           (2, -1, -1), (-1, 0, 1)))
    assert read_bundle(bundle.to_bytes()) == bundle
    parsed = core.parse(bundle.to_bytes())
    assert parsed.decode() == bundle
    parsed.check_attention(0, 80, mask_rows=True, nan_to_zero=True)
    parsed.check_attention(0, 0, mask_rows=True, nan_to_zero=True)  # head_dim 0: not checked
    with pytest.raises(DietcodeError, match=r"kernel 0 \('m'\) was compiled for head_dim 80, the node's head_dim "
                                            "attribute is 64"):
        parsed.check_attention(0, 64, mask_rows=True, nan_to_zero=True)
    with pytest.raises(DietcodeError, match=r"kernel 0 \('one_row'\) was compiled with mask_rows=0, the node has "
                                            "mask_rows=1"):
        core.parse(Bundle((), (one_row,), DispatchTree.single(0)).to_bytes()).check_attention(0, 80, True, True)
    with pytest.raises(DietcodeError, match="compiled with mask_rows=1, the node has mask_rows=0"):
        parsed.check_attention(0, 80, mask_rows=False, nan_to_zero=True)
    with pytest.raises(DietcodeError, match="compiled with nan_to_zero=1, the node has nan_to_zero=0"):
        parsed.check_attention(0, 80, mask_rows=True, nan_to_zero=False)
    # a kernel without the mask: mask_rows is not compared (the node's attribute defaults to 1)
    core.parse(Bundle((), (_kernel("p", params=plain, div16=(), head_dim=32),), DispatchTree.single(0))
               .to_bytes()).check_attention(0, 32, mask_rows=True)
    for bad, pattern in ((_kernel("a", params=plain, div16=()), "head_dim 0 outside 1..256"),
                         (_kernel("a", params=plain, div16=(), head_dim=257), "head_dim 257 outside 1..256"),
                         (_kernel("g", head_dim=64), "only attention kernels have one"),
                         (_kernel("a", params=plain, div16=(), head_dim=64, mask_rows=True),
                          "mask_rows applies to attention kernels taking a mask"),
                         (_kernel("g", nan_to_zero=True), "nan_to_zero applies to attention kernels only"),
                         (replace(BundleKernel.vendor(), head_dim=64), "a vendor kernel carries no")):
        with pytest.raises(DietcodeError, match=pattern):
            Bundle((), (bad,), DispatchTree.single(0)).to_bytes()
        _refused(core, Bundle((), (bad,), DispatchTree.single(0)).to_bytes(validate=False), pattern)


def test_channels_last_comes_from_the_compiled_kernels_conv() -> None:
    """A kernel compiled for a channels-last layer (ConvParams.channels_last) goes in a bundle with the flag set
    (the writer once refused it); an NCHW one, grouped or not, without it."""
    from types import SimpleNamespace

    from tuner.workload import ConvParams

    params = ("a", "b", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w")
    for conv, channels_last, grouped in ((ConvParams(8, 16, (3, 3), pads=(1, 1, 1, 1), channels_last=True), True, False),
                                         (ConvParams(8, 16, (3, 3), pads=(1, 1, 1, 1)), False, False),
                                         (ConvParams(8, 16, (3, 3), pads=(1, 1, 1, 1), groups=2), False, True)):
        compiled = SimpleNamespace(name="k", arch=90, cubin=b"\x7fELF", ptx="", params=params, num_warps=4, shared=0,
                                   block_m=64, block_n=64, split_k=1, conv=conv)
        kernel = BundleKernel.from_compiled([compiled])
        assert (kernel.channels_last, kernel.grouped) == (channels_last, grouped)
        assert read_bundle(Bundle((), (kernel,), DispatchTree.single(0)).to_bytes()).kernels[0] == kernel


def test_a_changed_byte_anywhere_is_refused_by_the_checksum(core) -> None:
    """Format 13: the header's CRC-32 covers every byte, so a bit flipped on disk or in transfer is refused even
    where the changed field would pass every check (a kernel's BLOCK_N 64 -> 320, hence its grid: wrong results
    on a GPU, with no error). The magic, version and size fields are checked first, with their own messages."""
    data = sample_bundle().to_bytes()
    assert core.parse(data).decode() == read_bundle(data)
    for at in range(len(data)):
        bad = bytearray(data)
        bad[at] ^= 1 << (at % 8)
        with pytest.raises(DietcodeError, match="checksum mismatch|magic|version|bytes, payload has|header size"):
            core.parse(bytes(bad))
    flipped = bytearray(data)
    flipped[40] ^= 0x10
    with pytest.raises(DietcodeError, match=r"checksum mismatch: the header says [0-9a-f]{8}, its bytes sum to "
                                            r"[0-9a-f]{8}: the bundle was changed after dietcode-ort wrote it"):
        core.parse(bytes(flipped))
    assert seal(data) == data and seal(data[:20]) == data[:20]  # the writer seals; a stub has no header to seal
