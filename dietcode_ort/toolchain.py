"""Which CUDA driver can load a compiled kernel: PTX ISA versions, ptxas versions and driver versions.

Driver versions are written as ``cuDriverGetVersion`` reports them: 1000 * major + 10 * minor (13000 is
CUDA 13.0, the R580 driver; 12090 is 12.9). Two rules decide what an image needs (docs/bundle.md):

- PTX is JIT-compiled by the driver, which accepts PTX ISA versions up to the one its CUDA release
  introduced: the table below, NVIDIA's "PTX ISA release history" (docs.nvidia.com/cuda/
  parallel-thread-execution, section "Release Notes"; the same table as cuda-python's
  ``cuda.bindings.utils.get_minimal_required_cuda_ver_from_ptx_ver``), where PTX ISA 9.N ships with CUDA 13.N
  and 8.N with CUDA 12.N up to 8.5, then 8.6 with 12.7, 8.7 with 12.8 and 8.8 with 12.9.
- A cubin is machine code: under CUDA's minor version compatibility (docs.nvidia.com/deploy/
  cuda-compatibility, "Minor Version Compatibility") any driver of the same major release as the ptxas
  that made it loads it (CUDA 13.x: R580 and later, i.e. 13.0), whatever its PTX ISA; the PTX rule above is
  the one minor version compatibility excludes.
"""
from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

from dietcode_ort.errors import DietcodeError

__all__ = ["PTX_ISA_MIN_DRIVER", "DEFAULT_MIN_DRIVER", "ptx_isa", "ptx_min_driver", "cubin_min_driver",
           "max_ptx_isa", "format_driver", "parse_driver", "format_isa", "ptxas_version", "MMA_KINDS", "ptx_mma",
           "ptx_mma_shapes", "ptx_target"]

# PTX ISA (major*10+minor) -> the first CUDA driver that JIT-compiles it (cuDriverGetVersion's encoding).
PTX_ISA_MIN_DRIVER: dict[int, int] = {
    70: 11000, 71: 11010, 72: 11020, 73: 11030, 74: 11040, 75: 11050, 76: 11060, 77: 11070, 78: 11080,
    80: 12000, 81: 12010, 82: 12020, 83: 12030, 84: 12040, 85: 12050, 86: 12070, 87: 12080, 88: 12090,
    90: 13000, 91: 13010, 92: 13020, 93: 13030, 94: 13040,
}

# What optimize compiles for unless told otherwise: CUDA 13.0 (driver R580), the oldest driver of the CUDA 13
# family whose ptxas Triton 3.9 ships, and the driver of the GPU machines this project is measured on.
DEFAULT_MIN_DRIVER = 13000

_VERSION_LINE_RE = re.compile(r"^[ \t]*\.version([^\n]*)", re.MULTILINE)
_VERSION_OPERAND_RE = re.compile(r"[ \t]+([0-9]{1,3})\.([0-9])[ \t\r]*")
_PTXAS_RE = re.compile(r"release (\d+)\.(\d+), V(\d+\.\d+\.\d+)")
_MMA_PATTERNS = (("wgmma", re.compile(r"\bwgmma\.mma_async\.\S*?\.(m\d+n\d+k\d+)\.")),
                 ("mma.sync", re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)\.")))
_TARGET_RE = re.compile(r"^[ \t]*\.target[ \t]+(sm_\w+)", re.MULTILINE)
MMA_KINDS = ("wgmma", "mma.sync", "none")  # Hopper warpgroup MMA (MMAv3), warp-level MMA (MMAv2), no tensor core


def ptx_mma(ptx: str) -> str:
    """The tensor-core instruction a kernel's PTX uses: "wgmma" (sm_90's asynchronous warpgroup MMA,
    ``wgmma.mma_async``), "mma.sync" (the warp-level MMA of sm_80, which sm_90 runs at a fraction of its
    tensor-core rate) or "none" (no tensor core: an fp32 dot in ieee precision runs on the FMA units)."""
    for kind, pattern in _MMA_PATTERNS:
        if pattern.search(ptx):
            return kind
    return "none"


def ptx_target(ptx: str) -> str:
    """The arch PTX text was written for (its ``.target``, e.g. "sm_90a"), "" when it names none."""
    match = _TARGET_RE.search(ptx)
    return match.group(1) if match else ""


def ptx_mma_shapes(ptx: str) -> tuple[str, ...]:
    """The distinct MMA instruction shapes of ``ptx`` (e.g. ``("m64n128k16",)``), of its ``ptx_mma`` kind."""
    for _, pattern in _MMA_PATTERNS:
        shapes = sorted(set(pattern.findall(ptx)))
        if shapes:
            return tuple(shapes)
    return ()


def ptx_isa(ptx: str) -> int:
    """The PTX text's ``.version`` directive as major*10+minor (9.4 -> 94): the first line whose first
    non-blank text is ``.version``, whose operand must be MAJOR.MINOR (1-3 digits, one digit); 0 when there is
    no such line or operand (the C++ reader's PtxIsa is the same rule)."""
    line = _VERSION_LINE_RE.search(ptx)
    m = _VERSION_OPERAND_RE.fullmatch(line.group(1)) if line else None
    return int(m.group(1)) * 10 + int(m.group(2)) if m else 0


def ptx_min_driver(isa: int) -> int:
    """The oldest driver that JIT-compiles PTX of ISA ``isa`` (major*10+minor); DietcodeError for an ISA the
    table does not know (extend PTX_ISA_MIN_DRIVER from NVIDIA's PTX ISA release notes)."""
    if isa not in PTX_ISA_MIN_DRIVER:
        raise DietcodeError(f"PTX ISA {format_isa(isa)} is not in dietcode_ort/toolchain.py's table of the drivers "
                            f"that load each PTX ISA (it knows {format_isa(min(PTX_ISA_MIN_DRIVER))} to "
                            f"{format_isa(max(PTX_ISA_MIN_DRIVER))}); extend it from NVIDIA's PTX ISA release notes")
    return PTX_ISA_MIN_DRIVER[isa]


def cubin_min_driver(ptxas: str) -> int:
    """The oldest driver that loads a cubin made by ptxas version ``ptxas`` ("13.4.59"): the first of its
    CUDA major release (minor version compatibility), e.g. 13000."""
    try:
        major = int(ptxas.split(".")[0])
    except ValueError:
        raise DietcodeError(f"ptxas version {ptxas!r} is not of the form MAJOR.MINOR.PATCH") from None
    return major * 1000


def max_ptx_isa(driver: int) -> int:
    """The newest PTX ISA a driver JIT-compiles (13000 -> 90); DietcodeError below the table."""
    known = [isa for isa, need in PTX_ISA_MIN_DRIVER.items() if need <= driver]
    if not known:
        raise DietcodeError(f"driver {format_driver(driver)} is older than every driver the PTX ISA table knows "
                            f"(the oldest is {format_driver(min(PTX_ISA_MIN_DRIVER.values()))})")
    return max(known)


def format_driver(version: int) -> str:
    """13040 -> "13.4" (cuDriverGetVersion's encoding)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def format_isa(isa: int) -> str:
    """94 -> "9.4"."""
    return f"{isa // 10}.{isa % 10}"


def parse_driver(text: str) -> int:
    """ "13.0" -> 13000; DietcodeError for anything else."""
    m = re.fullmatch(r"\s*(\d{1,3})\.(\d{1,2})\s*", str(text))
    if not m or int(m.group(2)) > 99:
        raise DietcodeError(f"driver version {text!r} is not MAJOR.MINOR (e.g. 13.0, the CUDA version "
                            "nvidia-smi shows)")
    return int(m.group(1)) * 1000 + int(m.group(2)) * 10


@functools.lru_cache(maxsize=None)
def ptxas_version(path: str) -> str:
    """The full version of the ptxas at ``path`` ("13.4.59", from ``ptxas --version``); DietcodeError
    naming the path when it does not run or says no version."""
    if not Path(path).is_file():
        raise DietcodeError(f"ptxas {path!r} does not exist")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        raise DietcodeError(f"ptxas {path!r} does not run ({exc.strerror or exc})") from None
    m = _PTXAS_RE.search(out.stdout + out.stderr)
    if out.returncode != 0 or not m:
        raise DietcodeError(f"{path!r} --version did not print a ptxas release (exit {out.returncode})")
    return m.group(3)
