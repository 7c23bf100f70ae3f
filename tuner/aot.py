"""Ahead-of-time compilation of the micro-kernel templates to cubin + PTX, with a disk cache.

``compile_kernel`` calls ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))``
directly: that needs no GPU (the ``triton.tools.compile`` CLI does). The result is a ``CompiledKernel``
record that carries everything the runtime needs to launch it under the kernel ABI: parameter names in
order (the two trailing scratch pointers are always there and take null), threads, shared bytes and the grid
rule. Split-K kernels take the fp32 ``workspace`` (templates.workspace_bytes); it is always compiled as
16-byte aligned, which the launcher checks per call (docs/abi.md), outside the bundle's div16 mask; and the
int32 ``counters``, which the launcher keeps per stream (no alignment assumed).

Value specialization: by default no scalar is assumed divisible by 16, so the kernel is valid for any
shape. Triton only vectorizes and software-pipelines (cp.async / TMA) operand loads when the row strides
are known multiples of 16, so ``div16`` can name ABI parameters (pointers: address % 16 == 0; int scalars:
value % 16 == 0) to compile with that assumption; the record lists them in ``div16`` and the runtime must
check each before choosing the kernel. ``aligned_params(op)`` gives the set that enables pipelining.

Toolchain: ``CompileToolchain`` says which CUDA driver the artifacts must load on (``min_driver``, default
CUDA 13.0) and optionally which ptxas to use. The PTX ISA is capped at what that driver JIT-compiles
(Triton's ``ptx_version`` option; Triton 3.9 would otherwise write its ptxas's ISA, 9.4 for CUDA 13.4, into
``.version`` while its LLVM emits PTX 9.0 features at most, so the cap changes only that line), and a
cubin is refused when its ptxas's CUDA major is newer than the driver's. Each record carries the ptxas
version, the PTX ISA and the minimum driver of its cubin and PTX (dietcode_ort/toolchain.py).

Cache: one JSON file per artifact under ``default_cache_dir()`` (or ``cache_dir``), keyed by the Triton
version, the template source hash, family, config, epilogue, trans_b, conv params, div16, TF32 flag and the
toolchain (PTX ISA cap, ptxas path and version).
"""
from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import io
import json
import math
import os
import re
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dietcode_ort import toolchain as tc
from dietcode_ort.bundle import LIMITS
from dietcode_ort.errors import DietcodeError
from dietcode_ort.toolchain import MMA_KINDS, ptx_mma, ptx_mma_shapes
from tuner import templates
from tuner.space import (DEFAULT_FP32_PRECISION, FP32_PRECISIONS, Family, MicroKernel, check_family,
                         check_fp32_precision, uses_tf32)
from tuner.workload import ConvParams, Epilogue, Problem

__all__ = ["CompiledKernel", "CompileJob", "CompileResult", "CompileToolchain", "GRID_RULE", "PERSISTENT_GRID_RULE", "compile_kernel", "compile_many",
           "aligned_params", "default_cache_dir", "ensure_cache_dir", "cache_key", "template_hash", "aot_hash",
           "shipped_div16", "tma_div16", "kernel_div16", "div16_refusal", "check_scratch", "MMA_KINDS", "ptx_mma", "ptx_mma_shapes", "FP32_PRECISIONS",
           "DEFAULT_FP32_PRECISION", "check_fp32_precision", "uses_tf32"]

GRID_RULE = "tiles_mn,split_k,batch"  # grid = (cdiv(M,BM)*cdiv(N,BN), SPLIT_K, batch)
# a persistent kernel (MicroKernel.persistent = n programs per SM): grid = (min(tiles_mn * batch, SMs * n), 1, 1)
PERSISTENT_GRID_RULE = "min(tiles_mn*batch,sms*persistent),1,1"
_TRITON_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_POINTERS = ("a", "b", "bias", "c", "residual")
_ALIGNED = {"gemm": ("K", "N"), "bmm": ("K", "N", "stride_a_batch", "stride_b_batch"), "conv": ("K", "N")}
# attention's operand pointers (bundle format 10: its div16 bits count from q); its sizes stay free (seq is the
# dynamic dim), and the mask, read as a vector of one key per lane, gains nothing from its alignment
_ATTENTION_ALIGNED = ("q", "k", "v", "out")
# How float32 dots are computed (FP32_PRECISIONS, DEFAULT_FP32_PRECISION, check_fp32_precision, uses_tf32): the
# precision shapes the float32 search space too, so tuner.space owns them (and says why tf32 is the default).
_FORMAT = 6  # bump when the record layout or the artifacts change (2: records carry a sha256 of their content; 3: toolchain;
# 4: split-K takes a workspace, no zero_output; 5: and the counters; 6: compiled without line info)


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The kernel cache folder: $DIETCODE_CACHE if set, else ``kernels`` in the user cache folder
    ($XDG_CACHE_HOME/dietcode-ort or ~/.cache/dietcode-ort). Not created here: see ``ensure_cache_dir``.

    This is the one place that reads DIETCODE_CACHE; pass ``cache_dir`` explicitly to bypass it."""
    from dietcode_ort.paths import user_cache_dir

    env = os.environ if env is None else env
    value = env.get("DIETCODE_CACHE")
    return Path(value).expanduser() if value else user_cache_dir(env) / "kernels"


def ensure_cache_dir(cache_dir: Path | None = None) -> Path:
    """The kernel cache folder (``cache_dir`` or the default), created and checked writable; a
    DietcodeError names it and how to choose another one."""
    from dietcode_ort.paths import writable_dir

    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return writable_dir(folder, "kernel cache", "--cache-dir or DIETCODE_CACHE")


def aligned_params(op: str, bias: bool = True, residual: bool = False) -> tuple[str, ...]:
    """The ``div16`` set that lets Triton vectorize and pipeline ``op``'s operand loads."""
    templates.kernel_for(op)
    if op == "attention":
        return _ATTENTION_ALIGNED
    return tuple(p for p in _POINTERS if (bias or p != "bias") and (residual or p != "residual")) + _ALIGNED[op]


SCRATCH_MAX = LIMITS["scratch"]  # bytes of global scratch per program the runtime passes
SCRATCH_ALIGN_MAX = LIMITS["scratch_align"]
# a bmm operand's batch stride is the product of its matrix's dims (0 when broadcast: custom_ops/shapes.cc
# MatMulView)
_BATCH_STRIDES = {"stride_a_batch": ("M", "K"), "stride_b_batch": ("K", "N")}
_TMA_DIV16 = {"gemm": ("a", "b", "K", "N"), "bmm": ("a", "b", "K", "N", "stride_a_batch", "stride_b_batch")}


def check_scratch(size: int, align: int) -> bool:
    """Whether the runtime can pass a global scratch of ``size`` bytes per program aligned to ``align`` (the
    bundle's rule: dietcode_ort/bundle.py LIMITS)."""
    return 0 < align <= SCRATCH_ALIGN_MAX and not align & (align - 1) and 0 <= size <= SCRATCH_MAX and not size % align


def tma_div16(op: str) -> tuple[str, ...]:
    """The ``div16`` assumptions every TMA kernel of ``op`` is compiled with: TMA reads a tensor only from a
    16-byte aligned base with row strides that are multiples of 16 bytes, so A's and B's bases, K and N (and for
    bmm the batch strides, which move the bases) must be multiples of 16; a call breaking one runs the vendor
    path (dc_kernel_fit's div16 check)."""
    if op not in _TMA_DIV16:
        raise DietcodeError(f"{op}: no TMA variant (TMA loads exist in the gemm and bmm templates)")
    return _TMA_DIV16[op]


def kernel_div16(op: str, config: MicroKernel, epilogue: Epilogue, div16: Sequence[str]) -> tuple[str, ...]:
    """The ``div16`` set ``compile_kernel`` compiles ``config`` with for a workload's ``div16``: without the
    pointers the kernel does not take, with a TMA config's ``tma_div16`` (TMA's hardware rules, checked per
    call as div16: docs/abi.md); sorted."""
    div16 = tuple(p for p in div16 if (epilogue.bias or p != "bias") and (epilogue.residual or p != "residual"))
    if config.tma:
        div16 = (*div16, *tma_div16(op))
    return tuple(sorted(set(div16)))


def div16_refusal(op: str, div16: Sequence[str], problem: Problem) -> str | None:
    """Which int parameter of the node call a gemm / bmm ``problem`` stands for (a MatMul or Gemm of
    [M, K] x [K, N], batched for bmm: K, N and the batch strides M*K and K*N) breaks a kernel compiled with
    ``div16`` (``kernel_div16``): the div16 part of the runtime's per-call check (dc_kernel_fit's code 6),
    which sends that call to the vendor path. A message, or None when they all hold or for other ops (a conv's
    K is the layer's, fixed for the workload). Pointers are not judged: ORT's allocations are aligned."""
    if op not in ("gemm", "bmm"):
        return None
    p = problem
    dims = {"M": p.m, "N": p.n, "K": p.k}
    values = {"K": p.k, "N": p.n}
    if op == "bmm":
        values |= {name: math.prod(dims[d] for d in factors) for name, factors in _BATCH_STRIDES.items()}
    for name in sorted(div16):
        if name in values and values[name] % 16:
            return f"div16 assumption: compiled for {name} a multiple of 16, and this call's is {values[name]}"
    return None


def launch_features(metadata: Any) -> list[str]:
    """What a compiled kernel's metadata asks of its launch beyond a plain cuLaunchKernel (grid, block,
    dynamic shared memory, stream): several CTAs per program, thread-block clusters, programmatic
    dependent launch or a cooperative grid. The runtime launches none of these; such kernels are refused."""
    asks = []
    if int(getattr(metadata, "num_ctas", 1) or 1) > 1:
        asks.append(f"num_ctas={metadata.num_ctas}")
    cluster = tuple(getattr(metadata, "cluster_dims", ()) or ())
    if any(int(d) > 1 for d in cluster):
        asks.append(f"cluster_dims={cluster}")
    if getattr(metadata, "launch_pdl", False):
        asks.append("programmatic dependent launch")
    if getattr(metadata, "launch_cooperative_grid", False):
        asks.append("a cooperative grid")
    return asks


@functools.lru_cache(maxsize=1)
def template_hash() -> str:
    """sha256 of the templates' source file: any edit to a template invalidates cached artifacts.
    Computed once per process, so it describes the source this process compiles."""
    return hashlib.sha256(Path(templates.__file__).read_bytes()).hexdigest()


@dataclass(frozen=True)
class CompileToolchain:
    """How kernels are compiled for a driver: ``min_driver`` (cuDriverGetVersion's encoding, 13000 = CUDA 13.0)
    is the oldest driver every artifact must load on; ``ptxas`` a ptxas binary to use for every arch instead of
    Triton's bundled ones (sets TRITON_PTXAS_PATH and TRITON_PTXAS_BLACKWELL_PATH for the compile)."""

    min_driver: int = tc.DEFAULT_MIN_DRIVER
    ptxas: str | None = None

    def check(self) -> None:
        """DietcodeError when the driver is older than the PTX table or the ptxas does not run."""
        tc.max_ptx_isa(self.min_driver)
        if self.ptxas is not None:
            tc.ptxas_version(self.ptxas)


def _ptxas_for(arch: int, chain: CompileToolchain) -> str:
    """The ptxas Triton runs for ``arch`` under ``chain`` (its bundled ptxas below sm_90, ptxas-blackwell from
    sm_90, unless ``chain.ptxas`` names one)."""
    if chain.ptxas is not None:
        return chain.ptxas
    from triton.backends.nvidia import compiler as nvidia

    try:
        tool = nvidia.get_ptxas(arch)
    except TypeError:  # Triton releases with one ptxas for every arch
        tool = nvidia.get_ptxas()
    return str(tool.path if hasattr(tool, "path") else tool[0])


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled micro-kernel and the launch facts the runtime needs (see the kernel ABI)."""

    name: str
    arch: int
    cubin: bytes
    ptx: str
    params: tuple[str, ...]  # ABI names in parameter order, without the trailing scratch pointers
    scratch_params: bool  # True: two trailing pointers (global, profile scratch) follow; pass null
    num_warps: int
    shared: int  # dynamic shared memory bytes to launch with
    global_scratch_size: int  # bytes per program (TMA descriptors made on the device); the launcher passes them
    profile_scratch_size: int
    config: MicroKernel
    family: Family
    grid: str  # GRID_RULE
    block_m: int
    block_n: int
    split_k: int
    epilogue: Epilogue
    trans_b: bool
    conv: ConvParams | None
    div16: tuple[str, ...]  # params assumed divisible by 16; the runtime checks them
    allow_tf32: bool
    triton_version: str
    n_regs: int | None = None  # from the ptxas log, when it was captured
    n_spills: int | None = None  # spill stores + loads in bytes, from the ptxas log
    constants: tuple[tuple[str, Any], ...] = field(default=())  # constexprs it was built with
    ptxas_version: str = ""  # the ptxas that made the cubin ("13.4.59")
    ptx_isa: int = 0  # the PTX's .version as major*10+minor (90 = 9.0)
    cubin_min_driver: int = 0  # the oldest driver that loads the cubin (13000 = CUDA 13.0)
    ptx_min_driver: int = 0  # the oldest driver that JIT-compiles the PTX
    global_scratch_align: int = 1  # the alignment of each program's global scratch

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    @property
    def mma(self) -> str:
        """The MMA kind its PTX uses (``ptx_mma``): "wgmma", "mma.sync" or "none"."""
        return ptx_mma(self.ptx)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (cubin as base64; ``mma`` is derived from the PTX, for readers of the record)."""
        data = asdict(self)
        data["mma"] = self.mma
        data["cubin"] = base64.b64encode(self.cubin).decode("ascii")
        data["config"] = self.config.to_dict()
        data["config_key"] = self.config.key()
        data["constants"] = [list(item) for item in self.constants]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CompiledKernel":
        conv = data.get("conv")
        return cls(
            name=data["name"], arch=int(data["arch"]), cubin=base64.b64decode(data["cubin"]), ptx=data["ptx"],
            params=tuple(data["params"]), scratch_params=bool(data["scratch_params"]),
            num_warps=int(data["num_warps"]), shared=int(data["shared"]),
            global_scratch_size=int(data["global_scratch_size"]),
            profile_scratch_size=int(data["profile_scratch_size"]),
            config=MicroKernel.from_dict(data["config"]), family=Family(**data["family"]), grid=data["grid"],
            block_m=int(data["block_m"]), block_n=int(data["block_n"]), split_k=int(data["split_k"]),
            epilogue=Epilogue(**data["epilogue"]), trans_b=bool(data["trans_b"]),
            conv=None if conv is None else ConvParams(
                in_channels=conv["in_channels"], out_channels=conv["out_channels"], kernel=tuple(conv["kernel"]),
                strides=tuple(conv["strides"]), pads=tuple(conv["pads"]), dilations=tuple(conv["dilations"]),
                groups=int(conv.get("groups", 1)), channels_last=bool(conv.get("channels_last", False))),
            div16=tuple(data["div16"]), allow_tf32=bool(data["allow_tf32"]),
            triton_version=data["triton_version"], n_regs=data.get("n_regs"), n_spills=data.get("n_spills"),
            constants=tuple((k, v) for k, v in data.get("constants", ())),
            ptxas_version=str(data.get("ptxas_version", "")), ptx_isa=int(data.get("ptx_isa", 0)),
            cubin_min_driver=int(data.get("cubin_min_driver", 0)), ptx_min_driver=int(data.get("ptx_min_driver", 0)),
            global_scratch_align=int(data.get("global_scratch_align", 1)))


def _check_inputs(family: Family, config: MicroKernel, epilogue: Epilogue, trans_b: bool,
                  conv: ConvParams | None, div16: Sequence[str], allow_tf32: bool) -> None:
    check_family(family)
    templates.check_epilogue(family.op, epilogue, config.split_k)
    if (family.op == "conv") != (conv is not None):
        raise DietcodeError(f"{family.op}: ConvParams are {'required' if family.op == 'conv' else 'only for conv'}")
    if conv is not None and conv.channels_last and conv.groups != 1:
        raise DietcodeError(f"conv: the channels-last form is ungrouped only, got groups={conv.groups}")
    if family.op == "conv" and trans_b:
        raise DietcodeError("conv: trans_b does not apply (the weight is always [OC, C*KH*KW])")
    allowed = set(templates.ABI_PARAMS[family.op]) - (set() if epilogue.bias else {"bias"}) - \
        (set() if epilogue.residual else {"residual"}) - {"workspace", "counters"}  # the launcher's own buffers
    unknown = sorted(set(div16) - allowed)
    if unknown:
        raise DietcodeError(f"div16 names {unknown} are not parameters of {family.op}; allowed: "
                            f"{', '.join(p for p in templates.ABI_PARAMS[family.op] if p in allowed)}")
    if allow_tf32 and family.dtype != "float32":
        raise DietcodeError(f"allow_tf32 applies to float32 only, not {family.dtype}")


def cache_key(family: Family, config: MicroKernel, *, epilogue: Epilogue, trans_b: bool,
              conv: ConvParams | None, div16: Sequence[str], allow_tf32: bool,
              toolchain: CompileToolchain = CompileToolchain()) -> str:
    """sha256 over everything that changes the compiled artifact."""
    import triton

    ptxas = _ptxas_for(check_family(family).arch, toolchain)
    payload = {"format": _FORMAT, "triton": triton.__version__, "templates": template_hash(),
               "family": asdict(family), "config": config.key(), "epilogue": asdict(epilogue),
               "trans_b": trans_b, "conv": None if conv is None else asdict(conv),
               "div16": sorted(div16), "allow_tf32": allow_tf32,
               "ptx_cap": tc.max_ptx_isa(toolchain.min_driver), "ptxas": [ptxas, tc.ptxas_version(ptxas)],
               **({"line_info": True} if _LINE_INFO else {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _signature(family: Family, config: MicroKernel, epilogue: Epilogue, trans_b: bool,
               conv: ConvParams | None, allow_tf32: bool) -> tuple[dict[str, str], dict[str, Any]]:
    fn = templates.kernel_for(family.op)
    pointer = "*" + _TRITON_DTYPE[family.dtype]
    constants: dict[str, Any] = dict(
        HAS_BIAS=epilogue.bias, ACTIVATION=epilogue.activation,
        DOT_PRECISION="tf32" if allow_tf32 else "ieee", BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, SPLIT_K=config.split_k)
    if family.op == "conv":
        assert conv is not None
        constants.update(templates.conv_geometry(conv))
        constants["CHANNELS_LAST"] = conv.channels_last
    else:
        constants["TRANS_B"] = trans_b
        constants["ALPHA"] = float(epilogue.alpha)  # a model constant, baked in: the ABI is unchanged
    if family.op in ("gemm", "conv"):
        constants["HAS_RESIDUAL"] = epilogue.residual
        constants["RESIDUAL_FIRST"] = epilogue.residual_first
        constants["RESIDUAL_MUL"] = epilogue.residual_mul
    if family.op in ("gemm", "bmm"):
        constants["USE_TMA"] = bool(config.tma)
        constants["PERSISTENT"] = bool(config.persistent)
    if family.op == "bmm" and not config.persistent:  # a persistent bmm loops over the batch: it takes it
        constants["batch"] = 1
    if not epilogue.bias:
        constants["bias"] = None
    if "residual" in fn.arg_names and not epilogue.residual:
        constants["residual"] = None
    if config.split_k == 1:
        constants["workspace"] = None
        constants["counters"] = None
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name == "workspace":
            signature[name] = "*fp32"
        elif name == "counters":
            signature[name] = "*i32"
        elif name in _POINTERS:
            signature[name] = pointer
        else:
            signature[name] = "i32"
    return signature, constants


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _parse_ptxas(log: str) -> tuple[int | None, int | None]:
    regs = _PTXAS_REGS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    return (int(regs.group(1)) if regs else None,
            int(spills.group(1)) + int(spills.group(2)) if spills else None)


@contextlib.contextmanager
def _ptxas_override(path: str | None) -> Any:
    """Make Triton run ``path`` as its ptxas for every arch for the duration (its knobs read the
    TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH environment variables); nothing when ``path`` is None."""
    if path is None:
        yield
        return
    keys = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
    previous = {key: os.environ.get(key) for key in keys}
    try:
        for key in keys:
            os.environ[key] = path
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Line info in the PTX (`.loc` lines, `// templates.py:LINE:COL` comments): off for every shipped kernel (see
# _triton_compile); a PTX test that finds an instruction by its template line turns it on while it compiles, and the
# cache keeps such kernels apart (cache_key)
_LINE_INFO = False


def _triton_compile(fn: Any, signature: dict[str, str], constants: dict[str, Any], aligned: Sequence[str],
                    arch: int, num_warps: int, num_stages: int,
                    toolchain: CompileToolchain = CompileToolchain()) -> tuple[Any, str]:
    """Compile, with the params named in ``aligned`` assumed divisible by 16 (pointers: 16-byte aligned; Triton's
    ``tt.divisibility``), and capture the ptxas log (Triton prints it when its dump knob is on). Triton's own cache
    is bypassed so ptxas always runs and reports registers and spills; this module caches artifacts.
    Triton still writes its working files to a cache folder, which it reads back into the compiled kernel at
    once: a temporary folder, removed after the compile (never ~/.triton, which may be read-only, and no
    ~330 KB per kernel that nothing reads again in the kernel cache). The PTX ISA is the lower of the ptxas's
    own and the newest ``toolchain.min_driver`` JIT-compiles (a ptxas refuses PTX newer than itself)."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import ptx_get_version
    from triton.compiler import ASTSource

    knobs, compilation = triton.knobs.nvidia, triton.knobs.compilation
    previous = (knobs.dump_ptxas_log, compilation.always_compile, compilation.disable_line_info,
                triton.knobs.cache.dir)
    log = io.StringIO()
    ptxas = _ptxas_for(arch, toolchain)
    release = ".".join(tc.ptxas_version(ptxas).split(".")[:2])
    ptx_version = min(ptx_get_version(release), tc.max_ptx_isa(toolchain.min_driver))
    try:
        knobs.dump_ptxas_log = True
        compilation.always_compile = True
        # no line info: it names the source files by absolute path (this installation's, often a home folder),
        # so every shipped PTX and cubin would carry the build machine's paths and differ between installs
        compilation.disable_line_info = not _LINE_INFO
        with tempfile.TemporaryDirectory(prefix="dietcode_triton_", dir=_SCRATCH) as scratch, \
                contextlib.redirect_stdout(log), \
                _ptxas_override(toolchain.ptxas):
            triton.knobs.cache.dir = scratch
            attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
            compiled = triton.compile(ASTSource(fn, signature, constants, attrs),
                                      target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": num_warps, "num_stages": num_stages,
                                               "enable_fp_fusion": True, "ptx_version": ptx_version})
    finally:
        (knobs.dump_ptxas_log, compilation.always_compile, compilation.disable_line_info,
         triton.knobs.cache.dir) = previous
    return compiled, log.getvalue()


def _toolchain_facts(arch: int, ptx: str, toolchain: CompileToolchain, what: str) -> dict[str, Any]:
    """The ptxas version, PTX ISA and the minimum drivers of a compiled kernel's cubin and PTX; DietcodeError
    when either needs a newer driver than ``toolchain.min_driver`` (a ptxas of a newer CUDA major than the
    driver's makes cubins that driver does not load: choose an older ptxas)."""
    ptxas = _ptxas_for(arch, toolchain)
    version = tc.ptxas_version(ptxas)
    isa = tc.ptx_isa(ptx)
    cubin_driver, ptx_driver = tc.cubin_min_driver(version), tc.ptx_min_driver(isa)
    want = tc.format_driver(toolchain.min_driver)
    if cubin_driver > toolchain.min_driver:
        raise DietcodeError(f"{what}: ptxas {version} ({ptxas}) makes cubins that need a CUDA "
                            f"{tc.format_driver(cubin_driver)} driver or newer, and the kernels must "
                            f"load on driver {want}: pass --ptxas with a ptxas of CUDA {want.split('.')[0]} or "
                            "older (the Triton wheel's triton/backends/nvidia/bin/ptxas is CUDA 12.9), or a "
                            "newer --min-driver")
    if ptx_driver > toolchain.min_driver:
        raise DietcodeError(f"{what}: its PTX has ISA {tc.format_isa(isa)}, which needs driver "
                            f"{tc.format_driver(ptx_driver)}; driver {want} JIT-compiles PTX up to "
                            f"{tc.format_isa(tc.max_ptx_isa(toolchain.min_driver))}")
    return {"ptxas_version": version, "ptx_isa": isa, "cubin_min_driver": cubin_driver, "ptx_min_driver": ptx_driver}


def compile_kernel(family: Family, config: MicroKernel, *, epilogue: Epilogue = Epilogue(),
                   trans_b: bool = False, conv: ConvParams | None = None, cache_dir: Path | None = None,
                   div16: Sequence[str] = (), allow_tf32: bool = False,
                   toolchain: CompileToolchain = CompileToolchain()) -> CompiledKernel:
    """Compile ``family.op``'s template with ``config`` for ``family.target`` (cached on disk), so that its
    cubin and PTX load on ``toolchain.min_driver``.

    Raises DietcodeError for bad input, for kernels that need scratch memory, and when the ptxas cannot make
    artifacts that driver loads."""
    import triton

    div16 = kernel_div16(family.op, config, epilogue, div16)
    _check_inputs(family, config, epilogue, trans_b, conv, div16, allow_tf32)
    profile = check_family(family)
    toolchain.check()
    key = cache_key(family, config, epilogue=epilogue, trans_b=trans_b, conv=conv, div16=div16,
                    allow_tf32=allow_tf32, toolchain=toolchain)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"{key}.json"
    cached = _read_cached(path, family, config)
    if cached is not None:
        return cached
    fn = templates.kernel_for(family.op)
    signature, constants = _signature(family, config, epilogue, trans_b, conv, allow_tf32)
    aligned = (*div16, "workspace") if config.split_k > 1 else div16  # the launcher checks the workspace
    compiled, log = _triton_compile(fn, signature, constants, aligned, profile.arch, config.num_warps,
                                    config.num_stages, toolchain=toolchain)
    md = compiled.metadata
    scratch_align = int(getattr(md, "global_scratch_align", 1) or 1)
    if md.profile_scratch_size > 0 or (md.global_scratch_size > 0 and (
            family.op == "attention" or not check_scratch(md.global_scratch_size, scratch_align))):
        raise DietcodeError(f"{family.op} {config.key()} for {family.target} needs scratch memory "
                            f"(global {md.global_scratch_size} B aligned to {scratch_align}, profile "
                            f"{md.profile_scratch_size} B); the runtime passes global scratch per program of at "
                            f"most {SCRATCH_MAX} B, aligned to a power of two up to {SCRATCH_ALIGN_MAX} that "
                            "divides it, and no profile scratch, so such kernels are refused")
    unsupported = launch_features(md)
    if unsupported:
        raise DietcodeError(f"{family.op} {config.key()} for {family.target} needs {', '.join(unsupported)}, which "
                            "the runtime's plain cuLaunchKernel does not set up, so such kernels are refused")
    n_regs, n_spills = _parse_ptxas(log)
    facts = _toolchain_facts(profile.arch, compiled.asm["ptx"], toolchain, f"{family.op} {config.key()} for "
                             f"{family.target}")
    params = tuple(p for p in templates.ABI_PARAMS[family.op] if signature[p] != "constexpr")
    kernel = CompiledKernel(
        name=md.name, arch=profile.arch, cubin=compiled.asm["cubin"], ptx=compiled.asm["ptx"], params=params,
        scratch_params=True, num_warps=md.num_warps, shared=md.shared,
        global_scratch_size=md.global_scratch_size, profile_scratch_size=md.profile_scratch_size,
        global_scratch_align=scratch_align if md.global_scratch_size else 1,
        config=config, family=family, grid=PERSISTENT_GRID_RULE if config.persistent else GRID_RULE,
        block_m=config.block_m, block_n=config.block_n, split_k=config.split_k, epilogue=epilogue,
        trans_b=trans_b, conv=conv, div16=div16, allow_tf32=allow_tf32, triton_version=triton.__version__,
        n_regs=n_regs, n_spills=n_spills,
        constants=tuple(sorted((k, v) for k, v in constants.items() if k not in ("bias", "residual", "workspace", "counters"))),
        **facts)
    record = kernel.to_dict()
    write_record(path, "kernel", record)
    return kernel


def _digest(record: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _read_cached(path: Path, family: Family, config: MicroKernel) -> CompiledKernel | None:
    """The cached kernel at ``path`` (``read_record``), or None."""
    return read_record(path, "kernel", CompiledKernel.from_dict,
                       lambda k: k.family == family and k.config == config and bool(k.cubin) and bool(k.ptx))


def read_record(path: Path, field: str, decode: Callable[[Any], Any], fits: Callable[[Any], bool]) -> Any:
    """The kernel cache entry at ``path`` (written by ``write_record`` under ``field``), decoded, or None when there
    is none or the entry is damaged (truncated, edited, checksum mismatch, or a record ``fits`` refuses: another
    kernel's): a damaged entry is removed and rebuilt; an unreadable one is compiled again (the write replaces it).
    The GEMM kernels' cache and the attention kernels' (tuner/attention.py) share it."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        entry = json.loads(text)
        record = entry[field]
        if not isinstance(record, dict) or entry.get("sha256") != _digest(record):
            raise ValueError("checksum mismatch")
        kernel = decode(record)
        if not fits(kernel):
            raise ValueError("record of another kernel")
        return kernel
    except (ValueError, KeyError, TypeError, AttributeError):
        path.unlink(missing_ok=True)
        return None


def write_record(path: Path, field: str, record: Mapping[str, Any]) -> None:
    """Store a kernel's ``record`` (its to_dict) at ``path`` under ``field``, with its checksum, atomically."""
    _write_atomic(path, json.dumps({"sha256": _digest(record), field: record}))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class CompileJob:
    """The arguments of one ``compile_kernel`` call."""

    family: Family
    config: MicroKernel
    epilogue: Epilogue = Epilogue()
    trans_b: bool = False
    conv: ConvParams | None = None
    div16: tuple[str, ...] = ()
    allow_tf32: bool = False
    cache_dir: Path | None = None
    toolchain: CompileToolchain = CompileToolchain()


@dataclass(frozen=True)
class CompileResult:
    """A compile outcome: the kernel, or None and the error (a failure is data, not an exception)."""

    job: CompileJob
    kernel: CompiledKernel | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.kernel is not None


def _run_job(job: CompileJob) -> CompileResult:
    try:
        if not isinstance(job, CompileJob):  # another template's job, e.g. tuner.attention.AttentionCompileJob
            return CompileResult(job, job.compile())
        kernel = compile_kernel(job.family, job.config, epilogue=job.epilogue, trans_b=job.trans_b,
                                conv=job.conv, cache_dir=job.cache_dir, div16=job.div16,
                                allow_tf32=job.allow_tf32, toolchain=job.toolchain)
        return CompileResult(job, kernel)
    except Exception as exc:  # noqa: BLE001 - any compiler failure becomes a recorded result
        return CompileResult(job, None, f"{type(exc).__name__}: {exc}".strip()[:2000])


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _worker_init(parent: int, scratch: str) -> None:
    """In each compile worker: die with the parent (Linux PR_SET_PDEATHSIG, so a killed optimize leaves
    no compiler running), leave SIGINT to the parent, which stops the workers itself, and keep every temporary
    file (Triton's working folders, the PTX and log files its ptxas step makes) in ``scratch``, the run's folder
    that the parent removes however the workers end (``compile_many``)."""
    import signal
    import tempfile

    global _SCRATCH
    _SCRATCH = tempfile.tempdir = scratch
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's workers now (pending compiles are abandoned) instead of waiting for them."""
    import signal

    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # shutdown forgets it
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.kill(process.pid, signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(timeout=5)
    # the pool, broken by its killed workers, closes its manager's wakeup pipe but (CPython 3.11) stays in the
    # registry that the interpreter's exit hook writes to, which then printed "Exception ignored ... OSError: [Errno
    # 9] Bad file descriptor" after the command had ended; a pool whose manager has stopped needs no wakeup
    if manager is not None:
        manager.join(timeout=5)
        if not manager.is_alive():
            from concurrent.futures import process as futures_process

            with contextlib.suppress(Exception):
                getattr(futures_process, "_threads_wakeups", {}).pop(manager, None)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (a container's cpuset or
    ``taskset`` grant fewer than the machine has), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def compile_many(jobs: Sequence[CompileJob], workers: int | None = None) -> list[CompileResult]:
    """Compile ``jobs`` in ``workers`` processes (default: ``usable_cpus()``); results in job order.

    The pool never exceeds ``usable_cpus()`` nor the number of jobs: each compile keeps one CPU busy, so more
    processes only add memory (a Triton compiler each) and scheduling, and ``--workers 5000`` would start
    one per job. Workers are forked (no ``if __name__ == "__main__"`` guard needed in callers; compiling
    touches no GPU state). A worker that dies (e.g. a crashing ptxas) turns into an error result for its
    job. The workers die with this process (SIGKILL, SIGTERM) and are killed at once on KeyboardInterrupt.
    DietcodeError for ``workers`` below 1."""
    if workers is not None and workers < 1:
        raise DietcodeError(f"compile workers must be at least 1, got {workers}")
    jobs = list(jobs)
    cpus = usable_cpus()
    workers = max(1, min(cpus if workers is None else workers, cpus, len(jobs) or 1))
    if workers == 1:
        return [_run_job(job) for job in jobs]
    import multiprocessing
    import shutil

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    scratch = _make_scratch()
    try:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init,
                                   initargs=(os.getpid(), scratch))
        try:
            futures = [pool.submit(_run_job, job) for job in jobs]
            results = []
            for job, future in zip(jobs, futures):
                try:
                    results.append(future.result())
                except Exception as exc:  # noqa: BLE001 - a lost worker is recorded, not raised
                    results.append(CompileResult(job, None, f"worker failed: {type(exc).__name__}: {exc}"))
            pool.shutdown(wait=True)
        except BaseException:
            _stop_workers(pool)
            raise
    finally:  # the workers are gone: what they left (killed mid-compile, a Triton folder or ptxas files) goes too
        shutil.rmtree(scratch, ignore_errors=True)
    return results


_SCRATCH: str | None = None  # a compile worker's temporary folder (_worker_init); None in the parent
_SCRATCH_PREFIX = "dietcode_compile_"


def _make_scratch() -> str:
    """A fresh folder for one ``compile_many``'s workers, named after this process, after removing the folders of
    runs whose process is gone (a SIGKILLed optimize's: nothing of its ran to remove them)."""
    import re
    import shutil
    import tempfile

    from dietcode_ort.paths import process_gone

    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for entry in root.glob(f"{_SCRATCH_PREFIX}*"):
            match = re.fullmatch(rf"{_SCRATCH_PREFIX}(\d+)_.*", entry.name)
            if match and entry.is_dir() and process_gone(int(match.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}_")


@functools.lru_cache(maxsize=1)
def aot_hash() -> str:
    """sha256 of this module's source: how a config becomes the shipped kernel (signature, constexprs,
    specialization). With ``template_hash`` it keys GPU timings, so an edited compile path is timed anew."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def shipped_div16(op: str, bias: bool, n: int | None, k: int | None, residual: bool = False,
                  m: int | None = None) -> tuple[str, ...]:
    """The ``div16`` set ``optimize`` compiles a workload's kernels with: every pointer (ORT's allocations
    are aligned; the runtime checks each call) and N / K where they are constant for the workload (``None``:
    symbolic) and divisible by 16. Without these Triton neither vectorizes nor pipelines the loads.

    bmm: a batch stride moves an operand's base, so without it Triton vectorizes neither operand's loads. The
    strides are products of the matrices' dims (``_BATCH_STRIDES``: A's M x K, B's K x N, 0 for a broadcast
    operand), so each is a multiple of 16 for every call where one of its dims is a constant multiple of 16
    (``m``: M where it is constant): attention's K = 64 makes both of Q x K^T's."""
    multiples = {name for name, value in (("M", m), ("N", n), ("K", k)) if value is not None and value % 16 == 0}
    fixed = multiples & {"N", "K"}
    if op == "bmm":
        fixed |= {name for name, factors in _BATCH_STRIDES.items() if multiples & set(factors)}
    return tuple(p for p in aligned_params(op, bias, residual) if p in _POINTERS or p in fixed)
