"""custom_ops/launch.cc run on the CPU against a stand-in CUDA driver (tests/_fake_libcuda.c), case by case.

tests/test_fake_cuda.py compiles each case's kernel ahead of time for sm_90 (tuner/aot.py, real cubins and
PTX), writes one bundle per case and runs this script in a child process whose LD_LIBRARY_PATH puts the
stand-in first as libcuda.so.1 (the name launch.cc opens), with TRITON_INTERPRET=1. Per case the child makes
host buffers, launches the bundle's kernel through the C ABI (``CoreBundle.launch``: dc_launch with
LaunchArgs) on a stream of the stand-in's context and collects what the driver was given (its log). It then maps the launch's recorded parameter bytes back to its buffers and runs
the interpreted Triton template with exactly those values, grid and constexprs, compared with float64 torch.
Launches happen before torch or triton is imported, so no other libcuda can be loaded first. Besides the
cases: context handling (``contexts``), a bundle's eager module load (``eager``), the split-K counters kept per
stream (``resident_counters``) and the vendor path's epilogue launch (``vendor_epilogue``).
Prints one JSON object {case: {...}} (see ``run_case``).
"""
from __future__ import annotations

import ctypes
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FakeCase", "CASES", "SM_COUNT", "WORKSPACE_OFFSET", "FILL", "EAGER_KERNELS", "EAGER_LAUNCHES",
           "build_fake_driver", "compile_case", "decode_params", "eager_bundle", "main"]

SM_COUNT = 4  # the stand-in's multiprocessor count (a persistent grid of 2 programs per SM: 8 < 9 tiles)
WORKSPACE_OFFSET = 16  # workspaces start 16 bytes past a 256-byte boundary: aligned as the ABI asks, not to 128
FILL = 0xAB  # workspace bytes before the launch: the launcher writes none of them (the kernel is not run)


@dataclass(frozen=True)
class FakeCase:
    name: str
    op: str  # gemm | bmm | conv | attention
    config: tuple[int, ...]  # MicroKernel fields (attention: AttentionConfig fields)
    shapes: dict[str, tuple[int, ...]]  # the node's inputs: a, b (conv: x, w), q, kt, v, mask
    bias: bool = False
    activation: str = "none"
    alpha: float = 1.0
    residual: bool = False
    tma: bool = False
    persistent: int = 0
    conv: tuple[Any, ...] = ()  # ConvParams fields
    target: str = "sm_90"

    def micro_kernel(self) -> Any:
        from tuner.space import MicroKernel

        return MicroKernel(*self.config, tma=int(self.tma), persistent=self.persistent)


CASES: tuple[FakeCase, ...] = (
    # 128x128 tiles: two programs along M; 32 KiB of shared memory, under the 48 KiB default
    FakeCase("gemm_bias_gelu_residual", "gemm", (128, 128, 64, 4, 3), {"a": (150, 40), "b": (40, 24)}, bias=True,
             activation="gelu", alpha=0.5, residual=True),
    FakeCase("gemm_split_k", "gemm", (32, 64, 64, 4, 2, 8, 4), {"a": (40, 256), "b": (256, 70)}, bias=True,
             activation="gelu"),
    # TMA: 256 B of global scratch per program, 128-aligned, and 48 KiB + 24 B of shared memory (the attribute)
    FakeCase("gemm_tma", "gemm", (64, 64, 64, 4, 3), {"a": (100, 64), "b": (64, 96)}, bias=True, activation="gelu",
             alpha=0.5, residual=True, tma=True),
    # TMA and split-K: the scratch follows the partials and counters, aligned up to 128
    FakeCase("gemm_tma_split_k", "gemm", (64, 64, 64, 4, 3, 8, 4), {"a": (100, 256), "b": (256, 96)}, bias=True,
             tma=True),
    # persistent bmm (takes `batch`): 3 tiles x 3 batches = 9 > 4 SMs x 2 = 8 programs
    FakeCase("bmm_tma_persistent", "bmm", (64, 64, 64, 4, 3), {"a": (3, 130, 64), "b": (3, 64, 64)}, bias=True,
             activation="gelu", tma=True, persistent=2),
    FakeCase("bmm_broadcast_a", "bmm", (32, 32, 32, 4, 2), {"a": (20, 16), "b": (2, 3, 16, 24)}),
    FakeCase("conv_stride2_bias_relu", "conv", (32, 32, 32, 4, 2), {"x": (2, 3, 9, 9), "w": (8, 3, 3, 3)}, bias=True,
             activation="relu", conv=(3, 8, (3, 3), (2, 2), (1, 1, 1, 1))),
    # a 1-D conv as tuner/conv1d.py writes it: height 1, kernel 1 x 3, strides (1, 2), pads only along the width
    FakeCase("conv1d_height1_bias_gelu", "conv", (32, 32, 32, 4, 2), {"x": (2, 4, 1, 37), "w": (8, 4, 1, 3)},
             bias=True, activation="gelu", conv=(4, 8, (1, 3), (1, 2), (0, 1, 0, 1))),
    # grouped convs: the launch's grid z is the group count, N and K one group's. A depthwise 3x3 with a channel
    # multiplier of 2 (12 groups of 1 input and 2 output channels), and 4 groups of 3 -> 4 channels whose
    # 36-long reduction is split in 4 (the workspace holds a partial tile per group, tile and split)
    FakeCase("conv_depthwise_bias_relu", "conv", (32, 16, 16, 4, 2), {"x": (2, 12, 9, 7), "w": (24, 1, 3, 3)},
             bias=True, activation="relu", conv=(12, 24, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 12)),
    FakeCase("conv_grouped_split_k", "conv", (32, 16, 16, 4, 2, 8, 4), {"x": (1, 12, 8, 8), "w": (16, 3, 3, 3)},
             bias=True, conv=(12, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 4)),
    # channels-last: X NHWC, W [OC, KH, KW, C], Y and the residual NHWC; 16 channels in K slices of 16 (one
    # (kh, kw) each, the vector path), stride 2, and a 1x1 under split-K
    FakeCase("conv_nhwc_stride2_bias_relu_residual", "conv", (32, 32, 16, 4, 2),
             {"x": (2, 9, 7, 16), "w": (24, 3, 3, 16)}, bias=True, activation="relu", residual=True,
             conv=(16, 24, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1, True)),
    FakeCase("conv_nhwc_1x1_split_k", "conv", (32, 16, 16, 4, 2, 8, 2), {"x": (1, 5, 6, 32), "w": (16, 1, 1, 32)},
             conv=(32, 16, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, True)),
    # compiled for sm_80 only: the sm_90 device JIT-compiles its PTX
    FakeCase("gemm_ptx_jit", "gemm", (32, 32, 32, 4, 2), {"a": (40, 48), "b": (48, 40)}, bias=True, target="sm_80"),
    FakeCase("attention_mask", "attention", (64, 64, 4, 2), {"q": (2, 3, 17, 16), "kt": (2, 3, 16, 17),
                                                           "v": (2, 3, 17, 16), "mask": (2, 1, 1, 17)},
             alpha=0.25),
)


# The eager-load bundle (eager_bundle): the cases whose kernels it holds, in kernel order. On the sm_90 device
# kernels 0 and 1 load from their cubins, kernel 2 (compiled for sm_80) from its PTX, and kernel 3, case 2's sm_80
# cubin labelled sm_90 and without PTX, is refused by the driver (a cubin for another SM).
EAGER_KERNELS = ("gemm_bias_gelu_residual", "gemm_split_k", "gemm_ptx_jit", "gemm_ptx_jit")
# Its launches in the child, (context 0 or 1, kernel id), in order (eager).
EAGER_LAUNCHES = ((0, 0), (0, 1), (0, 2), (0, 3), (0, 3), (0, 0), (1, 1), (1, 3), (1, 0))


def eager_bundle(kernels: dict[str, Any]) -> bytes:
    """The eager-load bundle's payload from the cases' bundle kernels (EAGER_KERNELS)."""
    from dataclasses import replace

    from dietcode_ort.bundle import Bundle, DispatchTree, Toolchain

    held = [kernels[name] for name in EAGER_KERNELS]
    (arch, cubin), = held[3].images
    assert arch == "sm_80", arch
    held[3] = replace(held[3], images=(("sm_90", cubin),), ptx="", ptx_toolchain=Toolchain(), ptx_scratch=(0, 1))
    return Bundle((), tuple(held), DispatchTree.single(0)).to_bytes()


def build_fake_driver(folder: Path, driver: int = 13010) -> str:
    """Builds the stand-in playing CUDA driver ``driver`` as folder/libcuda.so.1 (against the cuda.h the
    custom-op library is built with); "" when built, else why it cannot be (no C compiler, no cuda.h)."""
    import shutil
    import subprocess

    from dietcode_ort.build import _find_cuda_include
    from dietcode_ort.errors import DietcodeError

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler"
    try:
        include = _find_cuda_include()
    except DietcodeError as exc:
        return str(exc)
    subprocess.run([cc, "-O1", "-Wall", "-Wextra", "-shared", "-fPIC", f"-I{include}", f"-DFAKE_CUDA_DRIVER={driver}",
                    "-Wl,-soname,libcuda.so.1", str(Path(__file__).resolve().parent / "_fake_libcuda.c"),
                    "-o", str(folder / "libcuda.so.1"), "-lpthread"], check=True, capture_output=True)
    return ""


def compile_case(case: FakeCase, cache_dir: Path) -> Any:
    """The case's kernel compiled ahead of time for sm_90 (tuner.aot; attention: tuner.attention)."""
    from tuner.aot import compile_kernel
    from tuner.attention import AttentionConfig, compile_attention
    from tuner.space import Family
    from tuner.workload import ConvParams, Epilogue

    if case.op == "attention":
        return compile_attention(AttentionConfig(*case.config), "float16", "sm_90", case.shapes["q"][-1],
                                 scale=case.alpha, has_mask=True, mask_rows=True)
    return compile_kernel(Family(case.op, "float16", case.target), case.micro_kernel(),
                          epilogue=Epilogue(case.bias, case.activation, case.alpha, case.residual),
                          conv=ConvParams(*case.conv) if case.conv else None, cache_dir=cache_dir)


def decode_params(event: dict[str, Any]) -> list[int]:
    """A launch event's parameters as unsigned little-endian integers."""
    return [int.from_bytes(bytes.fromhex(p["hex"]), "little") for p in event["params"]]


def _events(fake: ctypes.CDLL) -> list[dict[str, Any]]:
    text = ctypes.cast(fake.fake_cuda_log(), ctypes.c_char_p).value or b""
    return [json.loads(line) for line in text.decode().splitlines() if line]


def _aligned(nbytes: int, offset: int = 0) -> tuple[np.ndarray, int]:
    """A zeroed byte buffer holding ``nbytes`` at an address ``offset`` past a 256-byte boundary."""
    raw = np.zeros(nbytes + 512, dtype=np.uint8)
    start = (-raw.ctypes.data) % 256 + offset
    return raw, start


def _buffers(case: FakeCase, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The node's inputs (float16, seeded) and its bias and residual."""
    out = {name: rng.standard_normal(shape).astype(np.float16) for name, shape in case.shapes.items()}
    n = case.shapes["w"][0] if case.op == "conv" else case.shapes["b"][-1] if "b" in case.shapes else 0
    if case.bias:
        out["bias"] = rng.standard_normal(n).astype(np.float16)
    return out


def _args(core: Any, case: FakeCase, bufs: dict[str, np.ndarray]) -> tuple[Any, tuple[int, ...]]:
    """The C core's launch arguments for the node call (its views) and the output's shape."""
    s = case.shapes
    if case.op == "attention":
        args = core.attention_view(s["q"], s["kt"], s["v"], s["mask"], head_dim=s["q"][-1])
        return args, s["q"]
    if case.op == "conv":
        from tuner.workload import ConvParams

        conv = ConvParams(*case.conv)
        args = core.abi_view("Conv", s["x"], s["w"], (s["w"][0],) if case.bias else None,
                             ints=(*conv.strides, *conv.pads, *conv.dilations, conv.groups),
                             channels_last=conv.channels_last)
        if conv.channels_last:
            return args, (args.img_n, args.out_h, args.out_w, s["w"][0])
        return args, (args.img_n, s["w"][0], args.out_h, args.out_w)
    args = core.abi_view("MatMul", s["a"], s["b"], batched=case.op == "bmm")
    out = np.broadcast_shapes(s["a"][:-2], s["b"][:-2]) + (s["a"][-2], s["b"][-1])
    return args, out


def _bound_args(core: Any, case: FakeCase, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray]]:
    """The case's launch arguments pointing at its buffers: seeded inputs, bias and residual, a NaN output."""
    bufs = _buffers(case, rng)
    args, out_shape = _args(core, case, bufs)
    assert args is not None, core.error()
    bufs["out"] = np.full(out_shape, np.nan, dtype=np.float16)
    if case.residual:
        bufs["residual"] = rng.standard_normal(out_shape).astype(np.float16)
    names = ({"q": "q", "k": "kt", "v": "v", "mask": "mask", "out": "out"} if case.op == "attention" else
             {"a": "x" if case.op == "conv" else "a", "b": "w" if case.op == "conv" else "b", "bias": "bias",
              "c": "out", "residual": "residual"})
    for field_name, buf in names.items():
        if buf in bufs:
            setattr(args, field_name, bufs[buf].ctypes.data)
    return args, bufs


def run_case(core: Any, fake: ctypes.CDLL, case: FakeCase, bundle_bytes: bytes, stream: int) -> dict[str, Any]:
    """Launch the case's kernel on ``stream``; returns the driver log, the buffers' addresses, the C core's
    arguments, grid and workspace size for the call, and the workspace after the launch."""
    args, bufs = _bound_args(core, case, np.random.default_rng(0))
    bundle = core.parse(bundle_bytes)
    grid_args = type(args).from_buffer_copy(args)
    grid_args.sm_count = SM_COUNT
    size = bundle.workspace_bytes(0, grid_args)
    raw, start = _aligned(size, WORKSPACE_OFFSET)
    raw[:] = FILL
    if size:
        args.workspace, args.workspace_bytes = raw.ctypes.data + start, size
    fake.fake_cuda_log_clear()
    bundle.launch(0, args, stream)  # sm_count 0: a persistent kernel's launcher asks the device
    events = _events(fake)
    fields = {name: getattr(args, name) for name, _ in type(args)._fields_}
    result = {"events": events, "args": fields, "grid": bundle.grid(0, grid_args), "workspace_bytes": size,
              "pointers": {name: int(b.ctypes.data) for name, b in bufs.items()},
              "workspace_after": raw[start:start + size].tobytes().hex(), "stream": stream}
    result["_keep"] = (bufs, raw[start:start + size].view(np.float32) if size else None, events)
    del bundle
    return result


def interpret(case: FakeCase, bufs: dict[str, np.ndarray], workspace: np.ndarray | None,
              events: list[dict[str, Any]]) -> dict[str, Any]:
    """Run the case's template interpreted with the launch's recorded parameters (pointers mapped back to the
    buffers they are the addresses of), grid and the compiled kernel's constexprs; compare with float64."""
    import torch

    from tuner import aot, templates
    from tuner.attention import AttentionConfig, attention_constexprs, reference_attention
    from tuner.space import Family
    from tuner.workload import ConvParams, Epilogue

    launch = next(e for e in events if e["event"] == "launch")
    values = decode_params(launch)
    arrays = [*bufs.values(), *([workspace] if workspace is not None else [])]
    by_address = {int(b.ctypes.data): torch.from_numpy(b) for b in arrays}
    # the split-K counters the launcher allocated for the stream (zeroed by its memset, freed with the bundle
    # since): zeros of that size here, which the kernel must leave at zero
    kept = {e["ptr"]: torch.zeros(e["bytes"] // 4, dtype=torch.int32) for e in events if e["event"] == "alloc"}
    by_address.update(kept)
    if case.op == "attention":
        config = AttentionConfig(*case.config)
        params = templates.ATTENTION_PARAMS
        constants = attention_constexprs(config, case.shapes["q"][-1], scale=case.alpha, has_mask=True,
                                         mask_rows=True)
        fn, warps, stages = templates.attention_kernel, config.num_warps, config.num_stages
    else:
        family = Family(case.op, "float16", case.target)
        epilogue = Epilogue(case.bias, case.activation, case.alpha, case.residual)
        conv = ConvParams(*case.conv) if case.conv else None
        _, constants = aot._signature(family, case.micro_kernel(), epilogue, False, conv, False)
        params = tuple(p for p in templates.ABI_PARAMS[case.op] if p not in constants)
        fn, warps, stages = templates.KERNELS[case.op], case.config[3], case.config[4]
    named: dict[str, Any] = {}
    for name, value, p in zip(params, values, launch["params"]):
        if p["size"] == 8:  # a pointer: the buffer it is the address of (the workspace: a float32 view)
            named[name] = by_address[value]
        else:
            named[name] = value - (1 << 32) if value >= 1 << 31 else value
    fn[tuple(launch["grid"])](**named, **constants, num_warps=warps, num_stages=stages)
    counters_left = sum(int(t.count_nonzero()) for t in kept.values())
    got = torch.from_numpy(bufs["out"]).double()
    t = {k: torch.from_numpy(v).double() for k, v in bufs.items() if k != "out"}
    if case.op == "attention":
        want = reference_attention(t["q"], t["kt"], t["v"], mask=t["mask"], scale=case.alpha).double()
    else:
        if case.op == "conv":
            layer = ConvParams(*case.conv)
            x, w = t["x"], t["w"]
            if layer.channels_last:  # computed NCHW, compared NHWC
                x, w = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)
            want = torch.nn.functional.conv2d(x, w, stride=layer.strides, padding=layer.pads[:2],
                                              dilation=layer.dilations, groups=layer.groups)
            want = want + t["bias"][None, :, None, None] if case.bias else want
            want = want.permute(0, 2, 3, 1) if layer.channels_last else want
        else:
            want = case.alpha * torch.matmul(t["a"], t["b"])
            want = want + t["bias"] if case.bias else want
        if case.activation == "relu":
            want = torch.relu(want)
        elif case.activation == "gelu":
            want = 0.5 * want * (1 + torch.erf(want / math.sqrt(2)))
        if case.residual:
            want = want + t["residual"]
    return {"max_err": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "counters_left": counters_left}


def main() -> int:
    folder = Path(sys.argv[1])
    fake = ctypes.CDLL("libcuda.so.1")  # the library the core's dlopen finds (LD_LIBRARY_PATH)
    if not hasattr(fake, "fake_cuda_log"):
        print(f"libcuda.so.1 is not the stand-in: {fake}", file=sys.stderr)
        return 2
    fake.fake_cuda_log.restype = ctypes.c_void_p
    fake.fake_cuda_context.restype = ctypes.c_void_p
    fake.fake_cuda_stream.restype = ctypes.c_void_p
    fake.fake_cuda_stream.argtypes = [ctypes.c_void_p]
    fake.fake_cuda_set_current.argtypes = [ctypes.c_void_p]
    ctypes.c_int.in_dll(fake, "fake_cuda_sm_count").value = SM_COUNT
    from dietcode_ort.runtime import load_core

    core = load_core(build=False)
    if sys.argv[2:] == ["timing"]:
        print(json.dumps(timing(core, fake, folder)))
        return 0
    stream = fake.fake_cuda_stream(fake.fake_cuda_context(0))
    out: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    for case in CASES:
        try:
            result = run_case(core, fake, case, (folder / f"{case.name}.bundle").read_bytes(), stream)
            if "_keep" in result:
                kept[case.name] = result.pop("_keep")
            out[case.name] = result
        except Exception as exc:  # reported per case
            out[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
    out["contexts"] = contexts(core, fake, folder)
    try:
        out["eager"] = eager(core, fake, folder)
    except Exception as exc:  # reported to the parent
        out["eager"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["head_dim"] = head_dim_refused(core, fake, folder, stream)
    except Exception as exc:  # reported to the parent
        out["head_dim"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["resident_counters"] = resident_counters(core, fake, folder)
    except Exception as exc:  # reported to the parent
        out["resident_counters"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["vendor_epilogue"] = vendor_epilogue(core, fake, stream)
    except Exception as exc:  # reported to the parent
        out["vendor_epilogue"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["lt_handles"] = lt_handles(core, fake, folder)
    except Exception as exc:  # reported to the parent
        out["lt_handles"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name, keep in kept.items():  # only now import torch and triton (interpreted)
        case = next(c for c in CASES if c.name == name)
        try:
            out[name]["interpreted"] = interpret(case, *keep)
        except Exception as exc:  # reported per case
            out[name]["interpreted"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
    return 0


def resident_counters(core: Any, fake: ctypes.CDLL, folder: Path) -> dict[str, Any]:
    """The split-K counters the launcher keeps per (context, stream), with the gemm_split_k case's kernel: per
    launch (in order: ``first``, ``again`` on the same stream, ``larger`` needing 4224 counters, ``small_after``,
    ``capturing``, the same stream while it is captured into a graph, ``other_stream``, a second stream of the
    context, ``no_memory``, a stream of the other context while cuMemAlloc fails, and ``no_memory_again``, that
    stream with memory back) the driver log, the call's M, N and workspace, and how many workspace bytes kept
    their FILL; then the log of freeing the bundle."""
    from dataclasses import replace

    case = next(c for c in CASES if c.name == "gemm_split_k")
    bundle = core.parse((folder / f"{case.name}.bundle").read_bytes())
    first, second = (fake.fake_cuda_stream(fake.fake_cuda_context(0)) for _ in range(2))
    other = fake.fake_cuda_stream(fake.fake_cuda_context(1))
    larger = replace(case, shapes={"a": (4200, 256), "b": (256, 2048)})  # 132 x 32 tiles
    fails = ctypes.c_int.in_dll(fake, "fake_cuda_alloc_fails")
    capturing = ctypes.c_int.in_dll(fake, "fake_cuda_capturing")
    out: dict[str, Any] = {}
    kept = []
    for name, call, stream in (("first", case, first), ("again", case, first), ("larger", larger, first),
                               ("small_after", case, first), ("capturing", case, first),
                               ("other_stream", case, second), ("no_memory", case, other),
                               ("no_memory_again", case, other)):
        args, bufs = _bound_args(core, call, np.random.default_rng(0))
        size = bundle.workspace_bytes(0, args)
        # the larger call's 138 MB are claimed, not allocated: the stand-in runs no kernel, and that call takes
        # the kept counters, so nothing writes the workspace
        raw, start = _aligned(min(size, 1 << 22), WORKSPACE_OFFSET)
        raw[:] = FILL
        args.workspace, args.workspace_bytes = raw.ctypes.data + start, size
        fails.value = int(name == "no_memory")
        capturing.value = int(name == "capturing")
        fake.fake_cuda_log_clear()
        try:
            bundle.launch(0, args, stream)
        finally:
            fails.value = capturing.value = 0
        window = raw[start:start + min(size, 1 << 22)]
        out[name] = {"events": _events(fake), "M": args.M, "N": args.N, "workspace": args.workspace,
                     "workspace_bytes": size, "stream": stream, "untouched": window.tobytes().count(FILL)}
        kept.append((bufs, raw))
    fake.fake_cuda_log_clear()
    del bundle  # dc_bundle_free frees every block of counters it kept
    out["freed"] = _events(fake)
    return out


def head_dim_refused(core: Any, fake: ctypes.CDLL, folder: Path, stream: int) -> dict[str, Any]:
    """The attention case's kernel (HEAD_DIM 16) given a call of head dim 8 (what a node without the head_dim
    attribute sees from shapes of another head dim): the launcher refuses it before the driver launches
    anything. Returns the driver log of the attempt, the launcher's error and the call's head dim."""
    from dataclasses import replace

    from dietcode_ort.errors import DietcodeError

    case = next(c for c in CASES if c.op == "attention")
    half = replace(case, shapes={"q": (2, 3, 17, 8), "kt": (2, 3, 8, 17), "v": (2, 3, 17, 8), "mask": (2, 1, 1, 17)})
    bundle = core.parse((folder / f"{case.name}.bundle").read_bytes())
    args, bufs = _bound_args(core, half, np.random.default_rng(0))
    fake.fake_cuda_log_clear()
    error = ""
    try:
        bundle.launch(0, args, stream)
    except DietcodeError as exc:
        error = str(exc)
    result = {"events": _events(fake), "error": error, "call_head_dim": args.head_dim,
              "out_untouched": bool(np.isnan(bufs["out"]).all())}
    del bundle
    return result


def contexts(core: Any, fake: ctypes.CDLL, folder: Path) -> dict[str, Any]:
    """Context handling: a module is loaded once per (context, kernel); a stream of another context loads it
    there, with that context pushed for the launch and popped after; the null stream launches in the thread's
    current context, and without one the launch fails with the launcher's message."""
    case = next(c for c in CASES if c.op == "conv")  # small, no workspace
    bundle = core.parse((folder / f"{case.name}.bundle").read_bytes())
    rng = np.random.default_rng(0)
    bufs = _buffers(case, rng)
    args, out_shape = _args(core, case, bufs)
    c = np.zeros(out_shape, dtype=np.float16)
    args.a, args.b, args.bias, args.c = bufs["x"].ctypes.data, bufs["w"].ctypes.data, bufs["bias"].ctypes.data, c.ctypes.data
    other = fake.fake_cuda_stream(fake.fake_cuda_context(1))
    first = fake.fake_cuda_stream(fake.fake_cuda_context(0))
    out: dict[str, Any] = {}
    fake.fake_cuda_log_clear()
    for name, stream in (("first", first), ("again", first), ("other", other), ("other_again", other)):
        bundle.launch(0, args, stream)
        out[name] = _events(fake)
        out[name + "_depth"] = fake.fake_cuda_context_depth()
        fake.fake_cuda_log_clear()
    try:
        bundle.launch(0, args, 0)
        out["null_without_context"] = "launched"
    except Exception as exc:
        out["null_without_context"] = str(exc)
    fake.fake_cuda_set_current(fake.fake_cuda_context(1))
    fake.fake_cuda_log_clear()
    bundle.launch(0, args, 0)
    out["null_in_current"] = _events(fake)
    out["null_in_current_depth"] = fake.fake_cuda_context_depth()
    fake.fake_cuda_log_clear()
    bundle.launch(0, args, first)  # a stream of context 1 while context 2 is current
    out["first_over_current"] = _events(fake)
    out["first_over_current_depth"] = fake.fake_cuda_context_depth()
    out["probe"] = core.cuda_probe(0)
    out["sm_count_current"] = core.sm_count(None)
    out["sm_count_stream"] = core.sm_count(first)
    fake.fake_cuda_set_current(None)
    fake.fake_cuda_log_clear()
    del bundle  # dc_bundle_free unloads each module in its own context
    out["freed"] = _events(fake)
    out["streams"] = {"first": first, "other": other}
    return out


def lt_handles(core: Any, fake: ctypes.CDLL, folder: Path) -> dict[str, Any]:
    """dc_vendor_cublaslt_handle with the host stand-in for cuBLASLt (tests/_fake_vendor_libs.c, built by the
    parent into ``folder``): the handle of each stream's context, created once per context with that context
    current (pushed for it and popped after), the same handle for every stream of a context."""
    lib = folder / "libfakevendor.so"
    if not lib.exists():
        return {"skipped": "no C compiler for the stand-in"}
    core.vendor_cublaslt_load(lib)
    vendor = ctypes.CDLL(str(lib))
    first = fake.fake_cuda_stream(fake.fake_cuda_context(0))
    second = fake.fake_cuda_stream(fake.fake_cuda_context(0))
    other = fake.fake_cuda_stream(fake.fake_cuda_context(1))
    handles = [core.vendor_cublaslt_handle(s) for s in (first, second, other, first)]
    creates = ctypes.c_int.in_dll(vendor, "fake_lt_creates").value
    contexts = list((ctypes.c_void_p * 8).in_dll(vendor, "fake_lt_create_contexts"))[:creates]
    return {"handles": handles, "creates": creates, "contexts": contexts, "depth": fake.fake_cuda_context_depth(),
            "context_of": [fake.fake_cuda_context(0), fake.fake_cuda_context(1)]}


def eager(core: Any, fake: ctypes.CDLL, folder: Path) -> dict[str, Any]:
    """The eager-load bundle's launches (EAGER_LAUNCHES) on a stream of each context, each kernel with its case's
    arguments (and a workspace where it needs one): per launch the driver log and the launcher's error ("" when it
    launched); then the log of freeing the bundle."""
    from dietcode_ort.errors import DietcodeError

    bundle = core.parse((folder / "eager.bundle").read_bytes())
    rng = np.random.default_rng(0)
    calls = []
    for k, name in enumerate(EAGER_KERNELS):
        args, bufs = _bound_args(core, next(c for c in CASES if c.name == name), rng)
        size = bundle.workspace_bytes(k, args)
        raw, start = _aligned(size)
        if size:
            args.workspace, args.workspace_bytes = raw.ctypes.data + start, size
        calls.append((args, bufs, raw))
    streams = [fake.fake_cuda_stream(fake.fake_cuda_context(i)) for i in (0, 1)]
    launches = []
    for context, k in EAGER_LAUNCHES:
        fake.fake_cuda_log_clear()
        error = ""
        try:
            bundle.launch(k, calls[k][0], streams[context])
        except DietcodeError as exc:
            error = str(exc)
        launches.append({"context": context + 1, "kernel": k, "events": _events(fake), "error": error})
    fake.fake_cuda_log_clear()
    del bundle
    return {"launches": launches, "freed": _events(fake)}


def vendor_epilogue(core: Any, fake: ctypes.CDLL, stream: int) -> dict[str, Any]:
    """The vendor path's epilogue kernel (custom_ops/vendor.cc, launched by launch.cc's LaunchPtx) on a
    float16 [5, 7] output with a per-column bias, gelu and a residual: its module loaded first
    (dc_vendor_epilogue_load, twice), then launched twice on one stream; the first launch's
    recorded parameters, named by its PTX's .param list, then run its PTX on the host (tests/_ptx_run.py) over
    the very buffers (addresses) the launcher passed, compared with float64 numpy."""
    import re

    from _ptx_run import Memory, run
    from dietcode_ort.runtime import Epilogue

    rng = np.random.default_rng(1)
    rows, cols = 5, 7
    y = rng.standard_normal((rows, cols)).astype(np.float16)
    bias = rng.standard_normal(cols).astype(np.float16)
    residual = rng.standard_normal((rows, cols)).astype(np.float16)
    plan = Epilogue(dtype=1, has_bias=1, activation=2, has_residual=1, bias_scale=0.5, rows=rows, cols=cols,
                    bias_rows=1, bias_rs=0, bias_cs=1)
    original = y.copy()
    fake.fake_cuda_log_clear()
    for _ in range(2):
        if core.lib.dc_vendor_epilogue_load(1, ctypes.c_void_p(stream)):
            raise RuntimeError(core.error())
    loaded = _events(fake)
    fake.fake_cuda_log_clear()
    for _ in range(2):
        if core.lib.dc_vendor_epilogue(ctypes.byref(plan), ctypes.c_void_p(y.ctypes.data),
                                       ctypes.c_void_p(bias.ctypes.data), ctypes.c_void_p(residual.ctypes.data),
                                       ctypes.c_void_p(stream)):
            raise RuntimeError(core.error())
    events = _events(fake)
    ptx = core.vendor_epilogue_ptx("float16")
    header = ptx[ptx.index(".entry dc_epilogue("):]
    names = re.findall(r"\.param\s+\.\w+\s+(\w+)", header[:header.index(")")])
    launch = next(e for e in events if e["event"] == "launch")
    values = decode_params(launch)
    params: dict[str, Any] = dict(zip(names, values))
    scale_bits = values[names.index("p_scale")]
    params["p_scale"] = float(np.array([scale_bits], np.uint32).view(np.float32)[0])
    y[:] = original
    memory = Memory()
    memory.buffers += [(arr.ctypes.data, arr.view(np.uint8).reshape(-1)) for arr in (y, bias, residual)]
    run(ptx, params, memory, grid=tuple(launch["grid"][:2]), block=tuple(launch["block"][:2]))
    ref = original.astype(np.float64) + 0.5 * bias.astype(np.float64)
    ref = 0.5 * ref * (1.0 + np.vectorize(math.erf)(ref / math.sqrt(2.0))) + residual.astype(np.float64)
    # LLaMA's SwiGLU gate: silu(y) * residual (dc_epilogue.residual_mul), launched with p_first 2; a plan both
    # adding the residual first and multiplying by it is refused before any launch
    gated = y.copy()
    mul_plan = Epilogue(dtype=1, activation=4, has_residual=1, residual_mul=1, bias_scale=1.0, rows=rows, cols=cols,
                        bias_rows=1)
    fake.fake_cuda_log_clear()
    if core.lib.dc_vendor_epilogue(ctypes.byref(mul_plan), ctypes.c_void_p(gated.ctypes.data), None,
                                   ctypes.c_void_p(residual.ctypes.data), ctypes.c_void_p(stream)):
        raise RuntimeError(core.error())
    mul_values = dict(zip(names, decode_params(next(e for e in _events(fake) if e["event"] == "launch"))))
    mul_values["p_scale"] = 1.0
    gate_in = gated.astype(np.float64)
    memory = Memory()
    memory.buffers += [(arr.ctypes.data, arr.view(np.uint8).reshape(-1)) for arr in (gated, residual)]
    mul_launch = next(e for e in _events(fake) if e["event"] == "launch")
    run(ptx, mul_values, memory, grid=tuple(mul_launch["grid"][:2]), block=tuple(mul_launch["block"][:2]))
    mul_ref = gate_in / (1.0 + np.exp(-gate_in)) * residual.astype(np.float64)
    both = Epilogue(dtype=1, activation=4, has_residual=1, residual_first=1, residual_mul=1, bias_scale=1.0,
                    rows=rows, cols=cols, bias_rows=1)
    fake.fake_cuda_log_clear()
    refused = core.lib.dc_vendor_epilogue(ctypes.byref(both), ctypes.c_void_p(gated.ctypes.data), None,
                                          ctypes.c_void_p(residual.ctypes.data), ctypes.c_void_p(stream))
    return {"loaded": loaded, "events": events, "ptx": ptx, "names": names, "stream": stream,
            "pointers": {"y": y.ctypes.data, "bias": bias.ctypes.data, "residual": residual.ctypes.data},
            "max_err": float(np.abs(y.astype(np.float64) - ref).max()), "scale": float(np.abs(ref).max()),
            "mul_first": int(mul_values["p_first"]), "mul_bias": int(mul_values["p_bias"]),
            "mul_max_err": float(np.abs(gated.astype(np.float64) - mul_ref).max()),
            "mul_scale": float(np.abs(mul_ref).max()),
            "both_refused": (refused, core.error() if refused else "", len(_of_launches(fake)))}


def _of_launches(fake: ctypes.CDLL) -> list[dict[str, Any]]:
    return [e for e in _events(fake) if e["event"] == "launch"]


def timing(core: Any, fake: ctypes.CDLL, folder: Path) -> dict[str, Any]:
    """The tuner's GPU timer (custom_ops/timing.cc, as tuner/gpu_timing.py calls it) on an sm_80 device: the
    primary context and a stream (dc_timing_open), device buffers (dc_mem_alloc, dc_mem_upload), then
    dc_time_kernel with 2 warm-up and 3 timed launches, each timed one after an L2 flush."""
    from dietcode_ort.runtime import LaunchArgs

    lib, u64, vp = core.lib, ctypes.c_uint64, ctypes.c_void_p
    lib.dc_timing_open.argtypes = [ctypes.c_int, ctypes.POINTER(vp)]
    lib.dc_mem_alloc.argtypes = [u64, ctypes.POINTER(u64)]
    lib.dc_mem_upload.argtypes = [u64, vp, u64]
    lib.dc_time_kernel.argtypes = [vp, ctypes.c_int32, ctypes.POINTER(LaunchArgs), vp, ctypes.c_int, ctypes.c_int,
                                   u64, u64, ctypes.POINTER(ctypes.c_float)]
    ctypes.c_int.in_dll(fake, "fake_cuda_cc_major").value = 8
    ctypes.c_int.in_dll(fake, "fake_cuda_cc_minor").value = 0
    case = next(c for c in CASES if c.target == "sm_80")
    bundle = core.parse((folder / f"{case.name}.bundle").read_bytes())
    out: dict[str, Any] = {"driver": core.driver_version()}
    fake.fake_cuda_log_clear()
    stream = vp()
    if lib.dc_timing_open(0, ctypes.byref(stream)):
        return {**out, "error": core.error(), "events": _events(fake)}
    bufs = _buffers(case, np.random.default_rng(0))
    args, out_shape = _args(core, case, bufs)
    bufs["out"] = np.zeros(out_shape, dtype=np.float16)
    pointers = {}
    for name, arr in [*bufs.items(), ("flush", np.zeros(4096, np.uint8))]:
        ptr = u64()
        if lib.dc_mem_alloc(arr.nbytes, ctypes.byref(ptr)) or lib.dc_mem_upload(ptr.value, arr.ctypes.data, arr.nbytes):
            return {**out, "error": core.error(), "events": _events(fake)}
        pointers[name] = ptr.value
    args.a, args.b, args.bias, args.c = pointers["a"], pointers["b"], pointers["bias"], pointers["out"]
    times = (ctypes.c_float * 3)()
    rc = lib.dc_time_kernel(bundle.handle, 0, ctypes.byref(args), stream, 2, 3, pointers["flush"], 4096, times)
    return {**out, "rc": rc, "error": core.error() if rc else "", "times": list(times), "events": _events(fake),
            "stream": stream.value, "pointers": pointers}


if __name__ == "__main__":
    sys.exit(main())
