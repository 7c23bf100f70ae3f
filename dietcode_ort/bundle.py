"""The kernel bundle: the binary payload a rewritten ``ai.dietcode`` node carries.

A bundle holds everything the runtime needs to run one node for any shape: the compiled kernels (a cubin
per GPU arch and PTX for newer GPUs, with their launch metadata), the dispatch tree over the node's
symbolic features, and the definitions of those features in terms of the node's input dims, so the C++
side can compute them from the actual input shapes. The layout is documented in docs/bundle.md. Python
only writes bundles: ``Bundle.validate`` refuses what the C++ reader (custom_ops/core.cc) refuses, so a
written payload parses there, and ``read_bundle`` decodes a payload through that reader (ctypes).
"""
from __future__ import annotations

import math
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from dietcode_ort.errors import DietcodeError
from dietcode_ort.toolchain import format_isa, ptx_isa

__all__ = [
    "DOMAIN", "MAGIC", "VERSION", "CHECKSUM_AT", "seal", "PARAM_NAMES", "POINTER_PARAMS", "ATTENTION_PARAMS", "KERNEL_KINDS", "VIEWS", "DTYPE_CODES", "ACTIVATION_CODES", "ACTIVATION_OP_NAMES", "CONV_FIELDS", "CONV_RANGES", "LIMITS",
    "Feature", "Toolchain", "BundleKernel", "DispatchTree", "Bundle", "ImageChoice", "parse_arch", "select_image", "make_bundle",
    "NodeBundle", "node_bundles", "DietcodeNode", "dietcode_nodes", "subgraphs", "read_bundle", "BUNDLELESS_OPS", "ATTENTION_INPUTS", "op_takes_residual",
    "ATTENTION_OP", "LEGACY_OP_TYPES", "LIBRARY_OP_TYPES", "canonical_op_type", "is_attention",
]

DOMAIN = "ai.dietcode"  # the custom ops' domain (docs/bundle.md, node contract)
MAGIC = b"DCBUNDLE"
# 2: the kernel record's 16-bit field is the div16 mask (was reserved, 0); 3: shared memory bytes per image;
# 4: a toolchain record (Triton, ptxas, PTX ISA, minimum driver) per cubin and for the PTX; 5: alpha;
# 6: split-K kernels take a workspace (param 28), the zero_output flag is refused; 7: the kernel record's byte
# after trans_b (was reserved, 0) is the programs per SM of a persistent kernel (0: one program per tile), and
# kernel flags bit 7 is the packed QKV attention layout; 8: kernel flags bit 0 (format 5's zero_output) is
# residual_first, and conv kernels may take the residual (param 15); 9: activations 3 gelu_tanh, 4 silu,
# 5 relu6, and after the PTX scratch the epilogue flags (bit 0 residual_mul: the residual multiplies; bits 1, 2
# an attention kernel's mask_rows, nan_to_zero) and a u32 head_dim ending the kernel record
# 10: an attention kernel's div16 bit i names param 16 + i (q, k, v, mask, out, ...: all its params sit there)
# 11: epilogue flags bit 4, a channels-last (NHWC) conv kernel (EPILOGUE_CHANNELS_LAST)
# 12: split-K kernels also take the int32 counters (param 29), which the launcher keeps per stream
# 13: the header's last u32 (reserved, 0) is a CRC-32 of the payload (``seal``)
VERSION = 13
HEADER_SIZE = 32
CHECKSUM_AT = 28  # the header's CRC-32 field: of the whole payload, read with this field as 0
SECTION_ENTRY_SIZE = 24
SECTION_FEATURES, SECTION_KERNELS, SECTION_TREE = 1, 2, 3

# ABI parameter names (abi.md) in enum order: the index is what the payload stores.
PARAM_NAMES: tuple[str, ...] = (
    "a", "b", "bias", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch",
    "img_n", "img_h", "img_w", "out_h", "out_w", "residual",
    "q", "k", "v", "mask", "out", "seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h", "stride_mask_q",
    "stride_mask_k", "workspace", "counters",
)
# residual (15), the attention params (16..27), the split-K workspace (28) and counters (29) came after out_w, so the indices
# earlier bundles store keep their meaning. The div16 mask is 16 bits and counts from param 0, or from param 16
# for an attention kernel (format 10), whose params are all 16..27; the workspace (28) and counters (29), which
# the launcher gives itself, take no div16 bit.
POINTER_PARAMS: tuple[str, ...] = ("a", "b", "bias", "c", "residual", "q", "k", "v", "mask", "out",
                                   "workspace", "counters")  # the rest int32
# The params of the attention view (q .. stride_mask_k): a kernel takes all of them or none.
ATTENTION_PARAMS: tuple[str, ...] = PARAM_NAMES[PARAM_NAMES.index("q"):PARAM_NAMES.index("stride_mask_k") + 1]
KERNEL_KINDS: tuple[str, ...] = ("triton", "vendor")
# How a kernel reads its node's operands (docs/abi.md), in dc_bundle_kernel_view's order.
VIEWS: tuple[str, ...] = ("gemm", "bmm", "conv", "attention")
DTYPE_CODES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# gelu: the erf form; gelu_tanh: the tanh approximation; silu: x * sigmoid(x); relu6: min(max(x, 0), 6)
ACTIVATION_CODES: tuple[str, ...] = ("none", "relu", "gelu", "gelu_tanh", "silu", "relu6")
# How an ai.dietcode op type names each activation ("MatMulBiasGeluTanh", "ConvBiasRelu6"), in code order
ACTIVATION_OP_NAMES: tuple[str, ...] = ("", "Relu", "Gelu", "GeluTanh", "Silu", "Relu6")
# A conv kernel's geometry (its constexprs), in the payload's order, with the allowed ranges.
CONV_FIELDS: tuple[str, ...] = ("CHANNELS", "KH", "KW", "STRIDE_H", "STRIDE_W", "PAD_H", "PAD_W", "DIL_H", "DIL_W")
# each CONV_FIELDS value's range (inclusive) in a kernel record; the scanner leaves a conv outside it untouched
CONV_RANGES = ((1, 1 << 20), (1, 64), (1, 64), (1, 64), (1, 64), (0, 1024), (0, 1024), (1, 64), (1, 64))
VALID_NUM_WARPS = (1, 2, 4, 8, 16, 32)
# a kernel taking the residual that adds it before the activation (RESIDUAL_FIRST: act(alpha * acc + bias +
# residual)); clear: after it. Bit 0 was format 5's zero_output (atomic split-K into a zeroed output).
FLAG_RESIDUAL_FIRST = 1
FLAG_CAUSAL = 2  # an attention kernel compiled in causal mode (CAUSAL): keys past the query's diagonal dropped
FLAG_TF32 = 4  # a float32 kernel compiled with TF32 dots (DOT_PRECISION="tf32"); clear: ieee float32 products
# bits 3..7: an attention kernel's operand layouts (tuner.attention.LAYOUT_BITS shifted left by 3: Q, K, V, out
# read/written as [batch, seq, heads, d], bit 7 Q, K and V packed in one projection; constexprs Q_BSHD, K_BSHD,
# V_BSHD, O_BSHD, QKV_PACKED)
FLAG_LAYOUT_SHIFT = 3
# the kernel record's last byte (format 9), the epilogue flags: bit 0 a kernel taking the residual that multiplies
# by it (RESIDUAL_MUL: act(alpha * acc + bias) * residual); clear: the residual is added
EPILOGUE_RESIDUAL_MUL = 1
# bits 1, 2 of the epilogue flags: an attention kernel's MASK_ROWS (the mask varies along the queries; only on a
# kernel taking the mask) and NAN_TO_ZERO (a row with no finite score gives 0). The record ends with a u32, an
# attention kernel's HEAD_DIM (0 for other kernels).
EPILOGUE_MASK_ROWS = 2
EPILOGUE_NAN_TO_ZERO = 4
# bit 3 of the epilogue flags: a conv kernel compiled for a grouped conv (ConvParams.groups > 1), computing group
# program_id(2) of the launch's batch = group; a node with group > 1 runs only such kernels (added within format
# 9: a library older than C ABI 11 refuses a bundle with it)
EPILOGUE_GROUPED = 8
# bit 4 of the epilogue flags (format 11): a conv kernel compiled for channels-last tensors (ConvParams.channels_last:
# X [N, H, W, C], W [OC, KH, KW, C], Y and the residual [N, OH, OW, OC]); never with grouped. A node's
# `channels_last` attribute must say the same.
EPILOGUE_CHANNELS_LAST = 16
MAX_HEAD_DIM = 256  # tuner/attention.py's MAX_HEAD_DIM
LAYOUT_CONSTEXPRS: tuple[str, ...] = ("Q_BSHD", "K_BSHD", "V_BSHD", "O_BSHD", "QKV_PACKED")  # bit 0..4 of ``layout``
_PACKED_QKV = 0b10111  # packed (bit 4) comes with Q, K and V (bits 0..2)
ARCH_FLAG_SPECIFIC = 1  # the 'a' suffix: sm_90a runs on compute capability 9.0 only

# Upper bounds shared with the C++ reader; anything larger is refused as absurd.
LIMITS: dict[str, int] = {
    "features": 64, "terms": 8, "inputs": 8, "dim": 8, "name": 256, "kernels": 1024, "params": 32,
    "images": 16, "image_bytes": 64 << 20, "ptx_bytes": 64 << 20, "nodes": 1 << 16, "block": 4096,
    "split_k": 1024, "shared": 1 << 20, "total_bytes": 1 << 30, "toolchain_name": 64, "ptx_isa": 999,
    "driver": 999999, "scratch": 1 << 16, "scratch_align": 1024, "persistent": 8,
}


def _fail(msg: str) -> DietcodeError:
    return DietcodeError(f"invalid kernel bundle: {msg}")


@dataclass(frozen=True)
class Feature:
    """One feature of the dispatch tree: the product of some input dims (e.g. M = A.dim0 * A.dim1).

    ``terms`` are (input index, dim index) pairs; a negative dim counts from the end as in Python, so
    (0, -1) is the last dim of input 0 whatever its rank.
    """

    name: str
    terms: tuple[tuple[int, int], ...]

    def value(self, shapes: Sequence[Sequence[int]]) -> int:
        """The feature's value for concrete input shapes (raises DietcodeError if a dim is missing)."""
        out = 1
        for inp, dim in self.terms:
            if inp >= len(shapes):
                raise DietcodeError(f"feature {self.name!r} reads input {inp}, the node has {len(shapes)} inputs")
            shape = shapes[inp]
            if not -len(shape) <= dim < len(shape):
                raise DietcodeError(f"feature {self.name!r} reads dim {dim} of input {inp}, whose rank is {len(shape)}")
            out *= int(shape[dim])
        return out


@dataclass(frozen=True)
class Toolchain:
    """What made one image of a kernel (a cubin, or its PTX) and the oldest CUDA driver that loads it.

    ``triton`` and ``ptxas`` are versions ("3.9.0", "13.4.59": the ptxas that ran, which for PTX is the one
    whose ISA Triton targeted); ``ptx_isa`` is the PTX's ``.version`` as major*10+minor (94 = 9.4; for a cubin,
    that of the PTX it was assembled from); ``min_driver`` is in cuDriverGetVersion's encoding (13000 = CUDA
    13.0), derived by dietcode_ort/toolchain.py. Empty / 0 means not recorded: no driver check is then made.
    """

    triton: str = ""
    ptxas: str = ""
    ptx_isa: int = 0
    min_driver: int = 0

    def validate(self, where: str) -> None:
        for attr in ("triton", "ptxas"):
            if len(getattr(self, attr).encode()) > LIMITS["toolchain_name"]:
                raise _fail(f"{where}: {attr} version longer than {LIMITS['toolchain_name']} bytes")
        if not 0 <= self.ptx_isa <= LIMITS["ptx_isa"] or not 0 <= self.min_driver <= LIMITS["driver"]:
            raise _fail(f"{where}: PTX ISA {self.ptx_isa} / minimum driver {self.min_driver} out of range "
                        f"(0..{LIMITS['ptx_isa']} / 0..{LIMITS['driver']})")

    def encode(self) -> bytes:
        triton, ptxas = self.triton.encode(), self.ptxas.encode()
        return (struct.pack("<III", self.ptx_isa, self.min_driver, len(triton)) + triton
                + struct.pack("<I", len(ptxas)) + ptxas)


@dataclass(frozen=True)
class BundleKernel:
    """One kernel: a compiled Triton micro-kernel, or ``kind="vendor"`` (run ONNX Runtime's own kernel).

    ``images`` maps an arch name ("sm_80", "sm_90a", "sm_100") to cubin bytes; ``ptx`` is PTX text the
    driver can JIT on newer GPUs. ``shared`` is the dynamic shared memory the PTX launches with (that of the
    arch it was compiled for), ``image_shared`` that of each cubin, in ``images``' order (left empty, every
    cubin takes ``shared``); a launch uses the picked image's. ``params`` lists the ABI parameter names in the
    kernel's order, without the two trailing scratch pointers every Triton kernel takes (the runtime always
    appends them as null). ``image_toolchains`` (one per cubin, in ``images``' order) and ``ptx_toolchain``
    record what made each image and the oldest driver that loads it (left empty: not recorded).
    """

    name: str
    kind: str = "triton"
    images: tuple[tuple[str, bytes], ...] = ()
    ptx: str = ""
    params: tuple[str, ...] = ()
    num_warps: int = 4
    shared: int = 0
    image_shared: tuple[int, ...] = ()
    block_m: int = 1
    block_n: int = 1
    split_k: int = 1
    causal: bool = False  # attention kernels only: compiled with CAUSAL (the Attention node's `causal` attribute)
    # kernels taking the residual, with an activation: compiled with RESIDUAL_FIRST, act(alpha * acc + bias +
    # residual) (a node whose op type names the residual before the activation, ConvBiasResidualRelu)
    residual_first: bool = False
    # kernels taking the residual: compiled with RESIDUAL_MUL, act(alpha * acc + bias) * residual (LLaMA's SwiGLU
    # gate; a node whose op type ends in Mul, MatMulSiluMul); record's epilogue flags bit 0
    residual_mul: bool = False
    # attention kernels only: HEAD_DIM (the length of the rows read and written; 0 for other kernels), MASK_ROWS
    # and NAN_TO_ZERO (the Attention node's head_dim, mask_rows and nan_to_zero attributes must say the same)
    head_dim: int = 0
    mask_rows: bool = False
    nan_to_zero: bool = False
    grouped: bool = False  # conv kernels only: compiled for a grouped conv (EPILOGUE_GROUPED)
    channels_last: bool = False  # conv kernels only: compiled for NHWC tensors (EPILOGUE_CHANNELS_LAST)
    tf32: bool = False  # float32 kernels only: dots in TF32 on the tensor cores (else exact float32 products)
    # attention kernels only: the operand layouts compiled in (bit set of LAYOUT_CONSTEXPRS; the Attention
    # node's `layout` attribute must equal it)
    layout: int = 0
    # gemm / bmm kernels only: n > 0 for a persistent kernel, launched as min(tiles x batch, SMs x n) programs
    # that loop over the tiles (docs/abi.md); 0: one program per tile and split
    persistent: int = 0
    # params the kernel was compiled to assume 16-byte aligned (pointers) or multiples of 16 (ints);
    # the runtime checks them per call and runs ORT's kernel instead when one does not hold
    div16: tuple[str, ...] = ()
    # what a compiled kernel was built for; the CUDA path refuses a node it does not fit (a vendor kernel
    # leaves these at their defaults: float32, none, False, ())
    dtype: str = "float32"
    activation: str = "none"
    trans_b: bool = False
    conv: tuple[int, ...] = ()  # conv kernels: CONV_FIELDS values; empty for other kernels
    alpha: float = 1.0  # the scale baked in (float32): ALPHA of the epilogue, SCALE of attention; 1 for conv, vendor
    image_toolchains: tuple[Toolchain, ...] = ()
    ptx_toolchain: Toolchain = Toolchain()
    # global scratch per program (bytes, alignment) of each cubin, in ``images``' order, and of the PTX: Triton's
    # device-side TMA descriptors (docs/abi.md); (0, 1) for none. Left empty, every cubin takes (0, 1).
    image_scratch: tuple[tuple[int, int], ...] = ()
    ptx_scratch: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        if not self.image_scratch and self.images:
            object.__setattr__(self, "image_scratch", ((0, 1),) * len(self.images))
        if not self.image_shared and self.images:
            object.__setattr__(self, "image_shared", (self.shared,) * len(self.images))
        if not self.image_toolchains and self.images:
            object.__setattr__(self, "image_toolchains", (Toolchain(),) * len(self.images))

    def all_images(self) -> list[tuple["ImageChoice", Toolchain]]:
        """Every image with its toolchain record: the cubins in order, then the PTX (its arch is its .target)."""
        out = [(ImageChoice("cubin", arch), chain) for (arch, _), chain in zip(self.images, self.image_toolchains)]
        if self.ptx:
            m = _PTX_TARGET_RE.search(self.ptx.encode())
            target = f"sm_{int(m.group(1))}{'a' if m.group(2) else ''}" if m else "unknown target"
            out.append((ImageChoice("ptx", target), self.ptx_toolchain))
        return out

    def toolchain_for(self, choice: "ImageChoice") -> Toolchain:
        """The toolchain record of the chosen image."""
        if choice.kind == "ptx":
            return self.ptx_toolchain
        return self.image_toolchains[[a for a, _ in self.images].index(choice.arch)]

    def shared_for(self, choice: "ImageChoice") -> int:
        """The shared memory bytes a launch of the chosen image asks for."""
        if choice.kind == "ptx":
            return self.shared
        return self.image_shared[[a for a, _ in self.images].index(choice.arch)]

    @property
    def view(self) -> str:
        """How the kernel reads its node's operands, from its ABI params as the C++ core decides it
        (dc_bundle_kernel_view): bmm kernels take the batch strides, conv kernels the image size, attention
        kernels seq_q."""
        if "seq_q" in self.params:
            return "attention"
        if "img_h" in self.params:
            return "conv"
        return "bmm" if "stride_a_batch" in self.params else "gemm"

    @classmethod
    def vendor(cls) -> "BundleKernel":
        """The fallback kernel: the vendor path (CUDA: cuBLAS/cuDNN on ORT's stream; CPU: ORT's kernel)."""
        return cls(name="vendor", kind="vendor")

    @classmethod
    def from_compiled(cls, compiled: Sequence[Any]) -> "BundleKernel":
        """Merge compiled kernels of one config (one object per arch, as tuner/aot.py makes them).

        Each object needs ``name, arch, cubin, ptx, params, num_warps, shared, block_m,
        block_n, split_k``; the launch metadata must agree across archs. Trailing scratch parameter names
        (``global_scratch``, ``profile_scratch``) are dropped since the runtime always appends them.
        """
        if not compiled:
            raise DietcodeError("BundleKernel.from_compiled needs at least one compiled kernel")
        first = compiled[0]
        meta = ("params", "num_warps", "block_m", "block_n", "split_k", "div16")
        for other in compiled[1:]:
            for attr in meta:
                if getattr(other, attr, ()) != getattr(first, attr, ()):
                    raise DietcodeError(f"compiled kernels of {first.name!r} disagree on {attr}: "
                                        f"{getattr(first, attr, ())!r} vs {getattr(other, attr, ())!r}")
        params = tuple(p for p in first.params if p not in ("global_scratch", "profile_scratch"))
        ptx, ptx_from = _portable_ptx(compiled)
        with_cubin = [c for c in compiled if getattr(c, "cubin", b"")]
        return cls(name=str(first.name), kind="triton",
                   images=tuple((_compiled_arch(c.arch), bytes(c.cubin)) for c in with_cubin),
                   image_shared=tuple(int(c.shared) for c in with_cubin),
                   image_toolchains=tuple(_toolchain_of(c, "cubin") for c in with_cubin),
                   image_scratch=tuple(_scratch_of(c) for c in with_cubin),
                   ptx_scratch=_scratch_of(ptx_from) if ptx_from is not None else (0, 1),
                   ptx_toolchain=_toolchain_of(ptx_from, "ptx") if ptx_from is not None else Toolchain(),
                   ptx=ptx, params=params, num_warps=int(first.num_warps),
                   shared=(int(ptx_from.shared) if ptx_from is not None
                           else max(int(c.shared) for c in compiled)),
                   block_m=int(first.block_m),
                   block_n=int(first.block_n), split_k=int(first.split_k),
                   causal=bool(dict(getattr(first, "constants", ())).get("CAUSAL", False)),
                   head_dim=int(dict(getattr(first, "constants", ())).get("HEAD_DIM", 0)),
                   mask_rows=bool(dict(getattr(first, "constants", ())).get("MASK_ROWS", False)),
                   nan_to_zero=bool(dict(getattr(first, "constants", ())).get("NAN_TO_ZERO", False)),
                   persistent=int(getattr(getattr(first, "config", None), "persistent", 0)),
                   layout=sum(1 << i for i, name in enumerate(LAYOUT_CONSTEXPRS)
                              if dict(getattr(first, "constants", ())).get(name, False)),
                   div16=tuple(p for p in PARAM_NAMES if p in tuple(getattr(first, "div16", ()))),
                   **_built_for(first))

    def _div16_base(self) -> int:
        """The param index the div16 mask's bit 0 names: 16 (``q``) for an attention kernel, else 0."""
        return PARAM_NAMES.index("q") if "q" in self.params else 0

    def _div16_mask(self) -> int:
        """The record's u16 div16 mask (names outside its 16 bits, which ``validate`` refuses, left out)."""
        bits = (PARAM_NAMES.index(p) - self._div16_base() for p in self.div16)
        return sum(1 << bit for bit in bits if 0 <= bit < 16)

    def validate(self, index: int) -> None:
        """Check the fields the C++ reader checks; raises DietcodeError naming the kernel."""
        where = f"kernel {index} ({self.name!r})"
        if self.kind not in KERNEL_KINDS:
            raise _fail(f"{where}: kind {self.kind!r}, allowed: {', '.join(KERNEL_KINDS)}")
        if not 1 <= len(self.name.encode()) <= LIMITS["name"]:
            raise _fail(f"{where}: name must be 1..{LIMITS['name']} bytes")
        if self.kind == "vendor":
            if (self.images or self.image_shared or self.ptx or self.params or self.div16 or self.dtype != "float32"
                    or self.activation != "none" or self.trans_b or self.conv or self.alpha != 1.0 or self.causal
                    or self.residual_first or self.residual_mul or self.head_dim or self.mask_rows or self.nan_to_zero
                    or self.grouped or self.channels_last
                    or self.tf32 or self.layout or self.persistent or self.image_toolchains or self.image_scratch
                    or self.ptx_scratch != (0, 1)
                    or self.ptx_toolchain != Toolchain()):
                raise _fail(f"{where}: a vendor kernel carries no cubin, PTX, params, div16 assumptions or build facts")
            return
        if self.num_warps not in VALID_NUM_WARPS:
            raise _fail(f"{where}: num_warps {self.num_warps}, allowed: {VALID_NUM_WARPS}")
        for attr in ("block_m", "block_n"):
            if not 1 <= getattr(self, attr) <= LIMITS["block"]:
                raise _fail(f"{where}: {attr} {getattr(self, attr)} outside 1..{LIMITS['block']}")
        if not 1 <= self.split_k <= LIMITS["split_k"]:
            raise _fail(f"{where}: split_k {self.split_k} outside 1..{LIMITS['split_k']}")
        if not isinstance(self.persistent, int) or not 0 <= self.persistent <= LIMITS["persistent"]:
            raise _fail(f"{where}: persistent {self.persistent!r} programs per SM outside 0..{LIMITS['persistent']}")
        if self.persistent and (self.split_k != 1 or "seq_q" in self.params or "img_h" in self.params):
            raise _fail(f"{where}: persistent applies to gemm and bmm kernels with split_k 1 (split_k "
                        f"{self.split_k}, params {', '.join(self.params)})")
        if self.persistent and "stride_a_batch" in self.params and "batch" not in self.params:
            raise _fail(f"{where}: a persistent bmm kernel takes the 'batch' param (it loops over the batch)")
        if self.causal and "seq_q" not in self.params:
            raise _fail(f"{where}: causal applies to attention kernels only")
        attention_kernel = "seq_q" in self.params
        if (not isinstance(self.head_dim, int)
                or not (1 <= self.head_dim <= MAX_HEAD_DIM if attention_kernel else self.head_dim == 0)):
            raise _fail(f"{where}: head_dim {self.head_dim!r} "
                        + (f"outside 1..{MAX_HEAD_DIM} (an attention kernel's HEAD_DIM)" if attention_kernel
                           else ", but only attention kernels have one"))
        if self.mask_rows and "mask" not in self.params:
            raise _fail(f"{where}: mask_rows applies to attention kernels taking a mask")
        if self.nan_to_zero and not attention_kernel:
            raise _fail(f"{where}: nan_to_zero applies to attention kernels only")
        if self.tf32 and self.dtype != "float32":
            raise _fail(f"{where}: tf32 applies to float32 kernels only, not {self.dtype}")
        if not isinstance(self.layout, int) or not 0 <= self.layout < 1 << len(LAYOUT_CONSTEXPRS):
            raise _fail(f"{where}: layout {self.layout!r} is not a bit set of {LAYOUT_CONSTEXPRS}")
        if self.layout & 16 and self.layout & _PACKED_QKV != _PACKED_QKV:
            raise _fail(f"{where}: layout {self.layout} is packed without Q, K and V all [batch, seq, heads, d]")
        if self.layout and "seq_q" not in self.params:
            raise _fail(f"{where}: operand layouts apply to attention kernels only")
        if not 0 <= self.shared <= LIMITS["shared"]:
            raise _fail(f"{where}: shared {self.shared} bytes outside 0..{LIMITS['shared']}")
        if len(self.image_shared) != len(self.images):
            raise _fail(f"{where}: {len(self.image_shared)} image shared sizes for {len(self.images)} cubins")
        for (arch, _), shared in zip(self.images, self.image_shared):
            if not 0 <= shared <= LIMITS["shared"]:
                raise _fail(f"{where}: cubin for {arch}: shared {shared} bytes outside 0..{LIMITS['shared']}")
        if len(self.params) > LIMITS["params"]:
            raise _fail(f"{where}: {len(self.params)} params, at most {LIMITS['params']}")
        for p in self.params:
            if p not in PARAM_NAMES:
                raise _fail(f"{where}: unknown param {p!r}, allowed: {', '.join(PARAM_NAMES)}")
        if len(set(self.params)) != len(self.params):
            raise _fail(f"{where}: params repeat a name: {self.params}")
        attention = [p for p in self.params if p in ATTENTION_PARAMS]
        if "seq_q" in self.params:
            if not {"q", "k", "v", "out"} <= set(self.params):
                raise _fail(f"{where}: an attention kernel's params lack q, k, v or out")
            if len(attention) != len(self.params):
                raise _fail(f"{where}: params name both an attention and another view")
        elif attention:
            raise _fail(f"{where}: params name attention params without seq_q")
        elif "c" not in self.params:
            raise _fail(f"{where}: params lack the output pointer 'c'")
        for pointer in ("workspace", "counters"):
            if self.split_k > 1 and pointer not in self.params:
                raise _fail(f"{where}: split_k {self.split_k} but the params lack the {pointer!r} pointer split-K "
                            "kernels take (a kernel of an older split-K scheme: optimize the model again)")
            if self.split_k == 1 and pointer in self.params:
                raise _fail(f"{where}: takes a {pointer!r} but has split_k 1")
        if "img_h" in self.params and "stride_a_batch" in self.params:
            raise _fail(f"{where}: params name both a conv and a bmm view")
        if "residual" in self.params and "stride_a_batch" in self.params:
            raise _fail(f"{where}: params name a residual, which only gemm-view and conv kernels take")
        if self.residual_first and ("residual" not in self.params or self.activation == "none"):
            raise _fail(f"{where}: residual_first orders a residual before an activation, and the kernel takes "
                        f"{'no residual' if 'residual' not in self.params else 'no activation'}")
        if self.residual_mul and ("residual" not in self.params or self.activation == "none" or self.residual_first):
            what = "no residual" if "residual" not in self.params else "no activation" \
                if self.activation == "none" else "it before the activation"
            raise _fail(f"{where}: residual_mul multiplies an activation's result by a residual, and the kernel "
                        f"takes {what}")
        for p in self.div16:
            if p not in self.params:
                raise _fail(f"{where}: div16 mask names param {p!r}, which the kernel does not take")
            if not 0 <= PARAM_NAMES.index(p) - self._div16_base() < 16:
                raise _fail(f"{where}: div16 names {p!r} (param {PARAM_NAMES.index(p)}), but the mask is 16 bits "
                            "from param 0 (16 for an attention kernel): the workspace carries no divisibility "
                            "assumption")
        if self.dtype not in DTYPE_CODES or self.activation not in ACTIVATION_CODES:
            raise _fail(f"{where}: dtype {self.dtype!r} / activation {self.activation!r}; allowed "
                        f"{DTYPE_CODES} / {ACTIVATION_CODES}")
        if not math.isfinite(self.alpha) or self.alpha == 0.0 or _float32(self.alpha) != self.alpha:
            raise _fail(f"{where}: alpha {self.alpha!r} is not a finite, non-zero float32")
        conv = self.conv or (0,) * len(CONV_FIELDS)
        if self.grouped and "img_h" not in self.params:
            raise _fail(f"{where}: grouped applies to conv kernels only")
        if self.channels_last and "img_h" not in self.params:
            raise _fail(f"{where}: channels_last applies to conv kernels only")
        if self.channels_last and self.grouped:
            raise _fail(f"{where}: channels_last applies to ungrouped conv kernels only, the kernel is grouped")
        if len(conv) != len(CONV_FIELDS):
            raise _fail(f"{where}: conv geometry needs {len(CONV_FIELDS)} values {CONV_FIELDS}, got {len(conv)}")
        for i, (v, (lo, hi)) in enumerate(zip(conv, CONV_RANGES)):
            if not ((lo <= v <= hi) if "img_h" in self.params else v == 0):
                raise _fail(f"{where}: conv geometry field {i} = {v} invalid")
        if len(self.images) > LIMITS["images"]:
            raise _fail(f"{where}: {len(self.images)} cubins, at most {LIMITS['images']}")
        seen = set()
        for arch, image in self.images:
            key = parse_arch(arch)
            if key in seen:
                raise _fail(f"{where}: two cubins for {arch}")
            seen.add(key)
            if not 0 < len(image) <= LIMITS["image_bytes"]:
                raise _fail(f"{where}: cubin for {arch} has {len(image)} bytes")
        if len(self.ptx.encode()) > LIMITS["ptx_bytes"]:
            raise _fail(f"{where}: PTX larger than {LIMITS['ptx_bytes']} bytes")
        if len(self.image_toolchains) != len(self.images):
            raise _fail(f"{where}: {len(self.image_toolchains)} image toolchains for {len(self.images)} cubins")
        for (arch, _), chain in zip(self.images, self.image_toolchains):
            chain.validate(f"{where}: cubin for {arch}")
        self.ptx_toolchain.validate(f"{where}: PTX")
        if not self.ptx and self.ptx_toolchain != Toolchain():
            raise _fail(f"{where}: a toolchain record for PTX it does not carry")
        if len(self.image_scratch) != len(self.images):
            raise _fail(f"{where}: {len(self.image_scratch)} image scratch records for {len(self.images)} cubins")
        for (arch, _), scratch in zip(self.images, self.image_scratch):
            _check_scratch(scratch, f"{where}: cubin for {arch}")
        _check_scratch(self.ptx_scratch, f"{where}: PTX")
        if not self.ptx and self.ptx_scratch != (0, 1):
            raise _fail(f"{where}: a global scratch record for PTX it does not carry")
        if self.ptx_toolchain.ptx_isa and self.ptx_toolchain.ptx_isa != ptx_isa(self.ptx):
            raise _fail(f"{where}: PTX toolchain says ISA {format_isa(self.ptx_toolchain.ptx_isa)}, the PTX's "
                        f".version says {format_isa(ptx_isa(self.ptx))}")
        if not self.images and not self.ptx:
            raise _fail(f"{where}: has neither a cubin nor PTX")


_ARCH_RE = re.compile(r"^sm_(\d+)(a?)$")
_PTX_TARGET_RE = re.compile(rb"^[ \t]*\.target[ \t]+sm_(\d{1,6})(a?)", re.MULTILINE)


def _built_for(compiled: Any) -> dict[str, Any]:
    """The build facts of a tuner/aot CompiledKernel (absent fields keep BundleKernel's defaults)."""
    out: dict[str, Any] = {}
    family = getattr(compiled, "family", None)
    if family is not None:
        out["dtype"] = family.dtype
    elif isinstance(getattr(compiled, "dtype", None), str):  # tuner/attention's CompiledAttention
        out["dtype"] = compiled.dtype
    epilogue = getattr(compiled, "epilogue", None)
    if epilogue is not None:
        out["activation"] = epilogue.activation
    constants = dict(getattr(compiled, "constants", ()))
    # the residual before the activation: the RESIDUAL_FIRST constexpr, or the epilogue of a compile cached without
    # its constexprs
    out["residual_first"] = bool(constants.get("RESIDUAL_FIRST", getattr(epilogue, "residual_first", False)))
    out["residual_mul"] = bool(constants.get("RESIDUAL_MUL", getattr(epilogue, "residual_mul", False)))
    if hasattr(compiled, "trans_b"):
        out["trans_b"] = bool(compiled.trans_b)
    # the dot precision: tuner/aot's allow_tf32, or the constexpr an attention kernel was compiled with
    out["tf32"] = bool(getattr(compiled, "allow_tf32", False)) or constants.get("DOT_PRECISION") == "tf32"
    alpha = constants.get("ALPHA", constants.get("SCALE"))  # SCALE: an attention kernel's softmax scale
    if alpha is None and epilogue is not None and getattr(compiled, "conv", None) is None:
        alpha = epilogue.alpha  # a compile cached without its constexprs: its epilogue's alpha was baked in
    if alpha is not None:
        out["alpha"] = _float32(float(alpha))
    conv = getattr(compiled, "conv", None)
    if conv is not None:
        out["conv"] = tuple(conv.geometry())
        out["grouped"] = getattr(conv, "groups", 1) > 1
        out["channels_last"] = bool(getattr(conv, "channels_last", False))
    return out


def _float32(value: float) -> float:
    """``value`` rounded to float32 (how the bundle stores alpha and ONNX a float attribute)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _check_scratch(scratch: tuple[int, int], where: str) -> None:
    """A global scratch record (bytes per program, alignment): the alignment a power of two up to
    LIMITS["scratch_align"], the size a multiple of it up to LIMITS["scratch"] (the C reader's rule)."""
    if (len(scratch) != 2 or not all(isinstance(v, int) for v in scratch)):
        raise _fail(f"{where}: global scratch record {scratch!r} is not (bytes, alignment)")
    size, align = scratch
    if (not 0 < align <= LIMITS["scratch_align"] or align & (align - 1) or not 0 <= size <= LIMITS["scratch"]
            or size % align):
        raise _fail(f"{where}: global scratch of {size} bytes aligned to {align} invalid (align a power of two up to "
                    f"{LIMITS['scratch_align']}, size a multiple of it up to {LIMITS['scratch']})")


def _scratch_of(compiled: Any) -> tuple[int, int]:
    """A compiled kernel's global scratch per program, (0, 1) when it needs none."""
    size = int(getattr(compiled, "global_scratch_size", 0) or 0)
    return (size, int(getattr(compiled, "global_scratch_align", 1) or 1)) if size else (0, 1)


def _toolchain_of(compiled: Any, image: str) -> Toolchain:
    """The toolchain record of a tuner/aot CompiledKernel's cubin or PTX (absent fields: not recorded)."""
    return Toolchain(triton=str(getattr(compiled, "triton_version", "") or ""),
                     ptxas=str(getattr(compiled, "ptxas_version", "") or ""),
                     ptx_isa=int(getattr(compiled, "ptx_isa", 0) or 0),
                     min_driver=int(getattr(compiled, f"{image}_min_driver", 0) or 0))


def _compiled_arch(arch: Any) -> str:
    """Name a compiled kernel's arch: tuner/aot records the integer cc; Triton compiles every cc >= 90 for
    the arch-specific target (sm_90a, sm_100a: wgmma/tcgen05), which runs on that exact cc only."""
    if isinstance(arch, int) or str(arch).isdigit():
        cc = int(arch)
        return f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    return str(arch)


def _portable_ptx(compiled: Sequence[Any]) -> tuple[str, Any]:
    """The PTX newer GPUs can JIT: the highest target without the 'a' suffix, else any PTX at all; with the
    compiled object it came from (its shared size is the PTX's), or ("", None)."""
    best: tuple[int, str, Any] | None = None
    fallback: tuple[str, Any] = ("", None)
    for c in compiled:
        ptx = str(getattr(c, "ptx", "") or "")
        m = _PTX_TARGET_RE.search(ptx.encode())
        if not ptx:
            continue
        fallback = fallback if fallback[1] is not None else (ptx, c)
        if m and not m.group(2) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), ptx, c)
    return (best[1], best[2]) if best else fallback


def parse_arch(arch: str) -> tuple[int, int]:
    """'sm_90a' -> (90, ARCH_FLAG_SPECIFIC); 'sm_80' -> (80, 0). Raises DietcodeError otherwise."""
    m = _ARCH_RE.match(arch)
    if not m or not 10 <= int(m.group(1)) <= 9999:
        raise _fail(f"arch {arch!r} is not of the form sm_<cc> or sm_<cc>a (e.g. sm_80, sm_90a)")
    return int(m.group(1)), ARCH_FLAG_SPECIFIC if m.group(2) else 0


@dataclass(frozen=True)
class ImageChoice:
    """What the runtime loads for a device: a cubin for ``arch`` or PTX (``arch`` is its .target)."""

    kind: str  # "cubin" or "ptx"
    arch: str


def select_image(kernel: BundleKernel, major: int, minor: int, driver: int = 0) -> ImageChoice:
    """Pick the image to load on a device of compute capability major.minor (same rule as C++).

    1. a cubin built for exactly this cc (sm_90a or sm_90 on a 9.0 device);
    2. a cubin without the 'a' suffix for the same major and a lower or equal minor (binary compatible);
    3. PTX whose .target is not above the device (an 'a' target only on that exact cc), JIT-ed by the
       driver: this is how a newer GPU runs kernels built before it existed;
    otherwise a DietcodeError naming what the bundle has. With ``driver`` (cuDriverGetVersion's encoding,
    e.g. 13000; 0 = not checked), an image whose recorded minimum driver is newer is passed over for the next
    one, and when every image the arch allows needs a newer driver the error says so.
    """
    from dietcode_ort.toolchain import format_driver

    cc = major * 10 + minor
    parsed = [(parse_arch(a), a) for a, _ in kernel.images]
    candidates = [ImageChoice("cubin", name) for (acc, _flags), name in parsed if acc == cc]
    compatible = sorted(((acc, name) for (acc, flags), name in parsed
                         if not flags & ARCH_FLAG_SPECIFIC and acc // 10 == major and acc % 10 <= minor and acc != cc),
                        reverse=True)
    candidates += [ImageChoice("cubin", name) for _, name in compatible]
    if kernel.ptx:
        m = _PTX_TARGET_RE.search(kernel.ptx.encode())
        if m:
            tcc, specific = int(m.group(1)), bool(m.group(2))
            if (tcc == cc) if specific else (tcc <= cc):
                candidates.append(ImageChoice("ptx", f"sm_{tcc}{'a' if specific else ''}"))
    for choice in candidates:
        if driver <= 0 or kernel.toolchain_for(choice).min_driver <= driver:
            return choice
    if candidates:
        first = candidates[0]
        need = kernel.toolchain_for(first).min_driver
        raise DietcodeError(f"kernel {kernel.name!r}: {first.kind} {first.arch} needs driver >= {format_driver(need)}, "
                            f"this driver is {format_driver(driver)}")
    have = ", ".join(a for a, _ in kernel.images) or "no cubin"
    ptx = "no PTX" if not kernel.ptx else "PTX for a different target"
    raise DietcodeError(f"kernel {kernel.name!r} cannot run on sm_{cc}: the bundle has {have} and {ptx}")


@dataclass(frozen=True)
class DispatchTree:
    """A binary decision tree as flat arrays; node 0 is the root.

    Inner node i: go to ``left[i]`` when ``features[feature[i]] <= threshold[i]`` else ``right[i]``,
    ``leaf[i] == -1``. Leaf node i: ``leaf[i]`` is the kernel id, ``feature[i] == left[i] == right[i] == -1``.
    """

    feature: tuple[int, ...]
    threshold: tuple[int, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    leaf: tuple[int, ...]

    @classmethod
    def single(cls, kernel_id: int) -> "DispatchTree":
        """A tree of one leaf: every shape runs ``kernel_id``."""
        return cls((-1,), (0,), (-1,), (-1,), (kernel_id,))

    @classmethod
    def from_sklearn(cls, estimator: Any, kernel_of_class: Mapping[Any, int]) -> "DispatchTree":
        """Convert a fitted sklearn DecisionTreeClassifier over integer features.

        sklearn goes left when x <= t for a float t; for integer x that is x <= floor(t). Leaves take the
        majority class, mapped to a kernel id through ``kernel_of_class``.
        """
        import math

        t = estimator.tree_
        feats: list[int] = []
        thr: list[int] = []
        left: list[int] = []
        right: list[int] = []
        leaf: list[int] = []
        for i in range(t.node_count):
            if t.children_left[i] == -1:
                cls_ = estimator.classes_[int(t.value[i][0].argmax())]
                feats.append(-1)
                thr.append(0)
                left.append(-1)
                right.append(-1)
                leaf.append(int(kernel_of_class[cls_.item() if hasattr(cls_, "item") else cls_]))
            else:
                feats.append(int(t.feature[i]))
                thr.append(int(math.floor(float(t.threshold[i]))))
                left.append(int(t.children_left[i]))
                right.append(int(t.children_right[i]))
                leaf.append(-1)
        return cls(tuple(feats), tuple(thr), tuple(left), tuple(right), tuple(leaf))

    def validate(self, n_features: int, n_kernels: int) -> None:
        """Check ids and shape: every node reachable from node 0 exactly once (so no cycles)."""
        n = len(self.leaf)
        if not all(len(a) == n for a in (self.feature, self.threshold, self.left, self.right)):
            raise _fail("tree arrays differ in length")
        if not 1 <= n <= LIMITS["nodes"]:
            raise _fail(f"tree has {n} nodes, allowed 1..{LIMITS['nodes']}")
        parents = [0] * n
        for i in range(n):
            if not -(1 << 63) <= self.threshold[i] < (1 << 63):
                raise _fail(f"tree node {i}: threshold {self.threshold[i]} does not fit int64")
            if self.leaf[i] >= 0:
                if self.leaf[i] >= n_kernels:
                    raise _fail(f"tree node {i}: leaf kernel id {self.leaf[i]} out of range 0..{n_kernels - 1}")
                if (self.feature[i], self.left[i], self.right[i]) != (-1, -1, -1):
                    raise _fail(f"tree node {i}: a leaf must have feature, left and right -1")
                continue
            if self.leaf[i] != -1:
                raise _fail(f"tree node {i}: leaf id {self.leaf[i]} (use -1 for inner nodes)")
            if not 0 <= self.feature[i] < n_features:
                raise _fail(f"tree node {i}: feature {self.feature[i]} out of range 0..{n_features - 1}")
            for child in (self.left[i], self.right[i]):
                if not 1 <= child < n:
                    raise _fail(f"tree node {i}: child {child} out of range 1..{n - 1}")
                parents[child] += 1
                if parents[child] > 1:
                    raise _fail(f"tree node {child} has more than one parent (cycle or shared subtree)")
        seen, stack = [False] * n, [0]
        while stack:
            i = stack.pop()
            seen[i] = True
            if self.leaf[i] < 0:
                stack += [self.left[i], self.right[i]]
        if not all(seen):
            raise _fail(f"tree node {seen.index(False)} is not reachable from the root (cycle?)")

    def evaluate(self, features: Sequence[int]) -> int:
        """The kernel id for a feature vector (the tree must be valid)."""
        i = 0
        for _ in range(len(self.leaf)):
            if self.leaf[i] >= 0:
                return self.leaf[i]
            i = self.left[i] if features[self.feature[i]] <= self.threshold[i] else self.right[i]
        raise _fail("tree walk did not reach a leaf")

    def render(self, features: Sequence[str], kernels: Sequence[str]) -> str:
        """The tree as an if-chain over the named ``features``, most specific condition first, ending in the
        catch-all; each leaf shows ``kernels[leaf id]``."""
        import math

        leaves: list[tuple[dict[int, list[float]], int]] = []
        stack: list[tuple[int, dict[int, list[float]]]] = [(0, {})]
        while stack:  # depth first, left before right
            node, bounds = stack.pop()
            if self.leaf[node] >= 0:
                leaves.append((bounds, self.leaf[node]))
                continue
            f, t = self.feature[node], self.threshold[node]
            lo, hi = bounds.get(f, [-math.inf, math.inf])
            stack.append((self.right[node], {**bounds, f: [max(lo, t), hi]}))
            stack.append((self.left[node], {**bounds, f: [lo, min(hi, t)]}))

        def specificity(item: tuple[dict[int, list[float]], int]) -> tuple[int, float]:
            bounds = item[0]
            finite = sum(math.isfinite(v) for lo_hi in bounds.values() for v in lo_hi)
            width = sum(hi - lo for lo, hi in bounds.values() if math.isfinite(hi - lo))
            return (-finite, width)

        ordered = sorted(leaves, key=specificity)
        lines: list[str] = []
        for n, (bounds, index) in enumerate(ordered):
            if n == len(ordered) - 1:
                lines.append(("else" if lines else "always") + f" -> {kernels[index]}")
                break
            terms = []
            for f, (lo, hi) in sorted(bounds.items()):
                if math.isfinite(lo) and math.isfinite(hi):
                    terms.append(f"{int(lo)} < {features[f]} <= {int(hi)}")
                elif math.isfinite(hi):
                    terms.append(f"{features[f]} <= {int(hi)}")
                elif math.isfinite(lo):
                    terms.append(f"{features[f]} > {int(lo)}")
            lines.append(f"{'if' if n == 0 else 'elif'} {' and '.join(terms)} -> {kernels[index]}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Bundle:
    """Kernels + dispatch tree + feature definitions for one rewritten node."""

    features: tuple[Feature, ...]
    kernels: tuple[BundleKernel, ...]
    tree: DispatchTree
    version: int = field(default=VERSION)

    def validate(self) -> None:
        """Everything the C++ reader refuses, refused here with the same reasons."""
        if self.version != VERSION:
            raise _fail(f"version {self.version}, this reader knows {VERSION}: the model was optimized by "
                        + ("an older dietcode-ort; optimize it again" if self.version < VERSION else
                           "a newer dietcode-ort; update the custom-op library"))
        if len(self.features) > LIMITS["features"]:
            raise _fail(f"{len(self.features)} features, at most {LIMITS['features']}")
        for j, f in enumerate(self.features):
            if len(f.name.encode()) > LIMITS["name"]:
                raise _fail(f"feature {j}: name longer than {LIMITS['name']} bytes")
            if not 1 <= len(f.terms) <= LIMITS["terms"]:
                raise _fail(f"feature {j} ({f.name!r}): {len(f.terms)} terms, allowed 1..{LIMITS['terms']}")
            for inp, dim in f.terms:
                if not 0 <= inp < LIMITS["inputs"] or not -LIMITS["dim"] <= dim < LIMITS["dim"]:
                    raise _fail(f"feature {j} ({f.name!r}): term (input {inp}, dim {dim}) out of range "
                                f"(input 0..{LIMITS['inputs'] - 1}, dim -{LIMITS['dim']}..{LIMITS['dim'] - 1})")
        if not 1 <= len(self.kernels) <= LIMITS["kernels"]:
            raise _fail(f"{len(self.kernels)} kernels, allowed 1..{LIMITS['kernels']}")
        for k, kern in enumerate(self.kernels):
            kern.validate(k)
        self.tree.validate(len(self.features), len(self.kernels))

    def feature_values(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        """The feature vector for concrete input shapes."""
        return [f.value(shapes) for f in self.features]

    def evaluate(self, features: Sequence[int]) -> int:
        """The kernel id the dispatch tree picks for a feature vector."""
        if len(features) != len(self.features):
            raise DietcodeError(f"expected {len(self.features)} feature values, got {len(features)}")
        return self.tree.evaluate([int(v) for v in features])

    def select(self, shapes: Sequence[Sequence[int]]) -> int:
        """The kernel id for concrete input shapes."""
        return self.evaluate(self.feature_values(shapes))

    # ---- encoding -------------------------------------------------------------------------------------
    def to_bytes(self, validate: bool = True) -> bytes:
        """Encode: header, section table, then features, kernels, tree.

        ``validate=False`` encodes whatever the fields hold (tests use it to craft payloads the readers
        must refuse); kinds, params and arch names must still be encodable.
        """
        if validate:
            self.validate()
        sections = [(SECTION_FEATURES, self._features_bytes()), (SECTION_KERNELS, self._kernels_bytes()),
                    (SECTION_TREE, self._tree_bytes())]
        offset = HEADER_SIZE + SECTION_ENTRY_SIZE * len(sections)
        table, body = b"", b""
        for kind, data in sections:
            table += struct.pack("<IIQQ", kind, 0, offset + len(body), len(data))
            body += data
        total = offset + len(body)
        header = MAGIC + struct.pack("<IIQII", self.version, HEADER_SIZE, total, len(sections), 0)
        return seal(header + table + body)

    def _features_bytes(self) -> bytes:
        out = [struct.pack("<I", len(self.features))]
        for f in self.features:
            name = f.name.encode()
            out.append(struct.pack("<I", len(name)) + name + struct.pack("<I", len(f.terms)))
            out += [struct.pack("<Ii", inp, dim) for inp, dim in f.terms]
        return b"".join(out)

    def _kernels_bytes(self) -> bytes:
        out = [struct.pack("<I", len(self.kernels))]
        for k in self.kernels:
            name, ptx = k.name.encode(), k.ptx.encode()
            flags = (FLAG_CAUSAL if k.causal else 0) | (FLAG_TF32 if k.tf32 else 0) | k.layout << FLAG_LAYOUT_SHIFT \
                | (FLAG_RESIDUAL_FIRST if k.residual_first else 0)
            body = struct.pack("<BBHIIIII", KERNEL_KINDS.index(k.kind), flags,
                               k._div16_mask(), k.num_warps, k.shared, k.block_m,
                               k.block_n, k.split_k)
            body += struct.pack("<BBBB9If", DTYPE_CODES.index(k.dtype), ACTIVATION_CODES.index(k.activation),
                                int(k.trans_b), k.persistent, *(k.conv or (0,) * len(CONV_FIELDS)), k.alpha)
            body += struct.pack("<I", len(name)) + name
            body += struct.pack("<I", len(k.params)) + bytes(PARAM_NAMES.index(p) for p in k.params)
            body += struct.pack("<I", len(k.images))
            for (arch, image), shared, chain, scratch in zip(k.images, k.image_shared, k.image_toolchains,
                                                            k.image_scratch):
                cc, flags = parse_arch(arch)
                body += (struct.pack("<III", cc, flags, shared) + struct.pack("<II", *scratch) + chain.encode()
                         + struct.pack("<Q", len(image)) + image)
            body += struct.pack("<Q", len(ptx)) + ptx + k.ptx_toolchain.encode() + struct.pack("<II", *k.ptx_scratch)
            body += struct.pack("<BI", (EPILOGUE_RESIDUAL_MUL if k.residual_mul else 0)
                                | (EPILOGUE_MASK_ROWS if k.mask_rows else 0)
                                | (EPILOGUE_NAN_TO_ZERO if k.nan_to_zero else 0)
                                | (EPILOGUE_GROUPED if k.grouped else 0)
                                | (EPILOGUE_CHANNELS_LAST if k.channels_last else 0), k.head_dim)
            out.append(struct.pack("<I", 4 + len(body)) + body)
        return b"".join(out)

    def _tree_bytes(self) -> bytes:
        t, n = self.tree, len(self.tree.leaf)
        return (struct.pack("<I", n) + struct.pack(f"<{n}i", *t.feature) + struct.pack(f"<{n}q", *t.threshold)
                + struct.pack(f"<{n}i", *t.left) + struct.pack(f"<{n}i", *t.right) + struct.pack(f"<{n}i", *t.leaf))


def seal(payload: bytes) -> bytes:
    """``payload`` with its header's checksum (format 13) set: the CRC-32 (zlib's, IEEE 802.3) of every byte, the
    checksum field read as 0. The reader refuses a payload whose bytes no longer match it: a bit flipped on disk
    or in transfer could otherwise change a field the reader cannot check against anything else (a kernel's
    BLOCK_N, hence its grid) and give wrong results without an error. Payloads shorter than the header are
    returned as they are."""
    import zlib

    if len(payload) < HEADER_SIZE:
        return bytes(payload)
    data = bytearray(payload)
    struct.pack_into("<I", data, CHECKSUM_AT, 0)
    struct.pack_into("<I", data, CHECKSUM_AT, zlib.crc32(data))
    return bytes(data)


def read_bundle(data: bytes) -> Bundle:
    """Decode a payload with the C core's parser (custom_ops/core.cc), the one bundle reader: DietcodeError
    with its message (``invalid kernel bundle: ...``) when it refuses the bytes. Loads the custom-op
    library (built on first use)."""
    from dietcode_ort.runtime import load_core

    return load_core().parse(bytes(data)).decode()


def make_bundle(features: Iterable[Feature], kernels: Iterable[BundleKernel], tree: DispatchTree) -> Bundle:
    """Build and validate a bundle from parts (a convenience for callers that assemble lists)."""
    bundle = Bundle(tuple(features), tuple(kernels), tree)
    bundle.validate()
    return bundle


# The fused attention node's op type. No ai.dietcode op type is a name an ONNX or com.microsoft op has: tools that
# match nodes by op type alone (onnxruntime's quantizer and SymbolicShapeInference) would take the node for that
# op (quantize_dynamic turned a MatMul with a fused scale into a MatMulInteger without it: wrong outputs).
ATTENTION_OP = "ScaledDotProductAttention"
# The op types models written before that used, and their names now: the library runs both.
LEGACY_OP_TYPES = {"MatMul": "MatMulPlain", "Gemm": "GemmPlain", "Conv": "ConvPlain", "Attention": ATTENTION_OP}


def _library_op_types() -> frozenset[str]:
    """The op types the library registers (custom_ops/shapes.cc ``OpTypeName`` and ``AllOpTypes``, and the attention
    op): per base, ``<Op>Plain``; ``<Op>[Bias][<Act>]`` with a bias or an activation; ``<Op>[Bias][<Act>]Residual``
    (``MatMulResidual`` included); with an activation ``<Op>[Bias]Residual<Act>`` and ``<Op>[Bias]<Act>Mul``; and the
    names of ``LEGACY_OP_TYPES``. 137 in all."""
    names = set(LEGACY_OP_TYPES) | {ATTENTION_OP}
    for base in ("MatMul", "Gemm", "Conv"):
        names.add(f"{base}Plain")
        for bias in ("", "Bias"):
            for act in ACTIVATION_OP_NAMES:
                names.add(f"{base}{bias}{act}Residual")
                if bias or act:
                    names.add(f"{base}{bias}{act}")
                if act:
                    names |= {f"{base}{bias}Residual{act}", f"{base}{bias}{act}Mul"}
    return frozenset(names)


LIBRARY_OP_TYPES = _library_op_types()


def canonical_op_type(op_type: str) -> str:
    """An ai.dietcode op type under its current name (``LEGACY_OP_TYPES``: "Attention" is ATTENTION_OP)."""
    return LEGACY_OP_TYPES.get(op_type, op_type)


def is_attention(op_type: str) -> bool:
    return canonical_op_type(op_type) == ATTENTION_OP


def op_takes_residual(op_type: str) -> bool:
    """Whether an ai.dietcode MatMul/Gemm/Conv op type takes the residual input: it names "Residual" (added,
    MatMulBiasResidual, ConvBiasResidualRelu) or ends in "Mul" after its activation (multiplied, MatMulSiluMul)."""
    op_type = canonical_op_type(op_type)
    return "Residual" in op_type or op_type.endswith("Mul")


# ai.dietcode op types whose nodes carry no kernel bundle (none: Attention carries one, docs/bundle.md).
BUNDLELESS_OPS: tuple[str, ...] = ()
# Attention(Q, Kt, V, mask, bundle): the mask slot is an empty name when the chain adds none, so the bundle
# always is input 4 (tuner/attention_graph.py).
ATTENTION_INPUTS = 5


@dataclass(frozen=True)
class NodeBundle:
    """Where an ``ai.dietcode`` node's bundle lives: its last input, a uint8 initializer shared by every node
    of the workload (docs/bundle.md, node contract)."""

    node: str
    op_type: str
    initializer: str
    payload: bytes


class DietcodeNode(NamedTuple):
    """An ``ai.dietcode`` node, with the initializers and graph inputs its graph sees and where that graph is."""

    node: Any
    initializers: dict[str, Any]  # its graph's and the outer graphs' (a subgraph's own shadow the outer ones)
    inputs: set[str]  # the graph inputs among those names
    where: str  # "" in the main graph; "the then_branch of If 'name'" (nested: joined by " > ")


def subgraphs(node: Any) -> list[Any]:
    """The graphs a node holds as attributes: an If's branches, a Loop's or Scan's body."""
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]


def dietcode_nodes(model: Any) -> list[DietcodeNode]:
    """Every ``ai.dietcode`` node of an ``onnx.ModelProto`` that takes a bundle (not ``BUNDLELESS_OPS``), in graph
    order, the nodes of an If branch or a loop body right after the node holding it (``optimize`` rewrites If
    branches too). DietcodeError where two initializers of a graph share the name of a node's bundle input."""
    out: list[DietcodeNode] = []

    def walk(graph: Any, inits: dict[str, Any], inputs: set[str], where: str) -> None:
        own = {t.name: t for t in graph.initializer}
        inits = {**inits, **own}
        inputs = (inputs - set(own)) | {v.name for v in graph.input}
        twice = {n for n, count in Counter(t.name for t in graph.initializer).items() if count > 1}
        for node in graph.node:
            if node.domain == DOMAIN and node.op_type not in BUNDLELESS_OPS:
                if node.input and node.input[-1] in twice:  # a tool reading one and a session the other
                    raise DietcodeError(f"node {node.name or node.output[0]!r} ({node.op_type}): two initializers "
                                        f"are named {node.input[-1]!r}, its kernel bundle input; which one a "
                                        "reader takes is not defined: optimize the original model again")
                out.append(DietcodeNode(node, inits, inputs, where))
            for a in node.attribute:
                for sub in ([a.g] if a.HasField("g") else list(a.graphs)):  # named by its attribute
                    inner = f"the {a.name} of {node.op_type} {node.name or node.output[0]!r}"
                    walk(sub, inits, inputs, f"{where} > {inner}" if where else inner)

    walk(model.graph, {}, set(), "")
    return out


def node_bundles(model: Any, base_dir: str | None = None) -> list[NodeBundle]:
    """The bundle of every ``ai.dietcode`` node of an ``onnx.ModelProto`` (``dietcode_nodes``), in that order; equal bundles are
    one ``bytes`` object. ``base_dir`` is where external data lives when the model was loaded without it.
    DietcodeError naming the node when a bundle is missing, is not a 1-D uint8 initializer, or is still a
    per-node attribute (the contract before ai.dietcode opset 2)."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    payloads: dict[str, bytes] = {}
    out = []
    for i, (node, inits, graph_inputs, _) in enumerate(dietcode_nodes(model)):
        label = f"node {node.name or i!r} ({node.op_type})"
        if any(a.name == "bundle" for a in node.attribute):
            raise DietcodeError(f"{label} carries its kernel bundle as an attribute, the node contract before "
                                "ai.dietcode opset 2; optimize the original model again")
        if is_attention(node.op_type):
            want = ATTENTION_INPUTS
            if len(node.input) < want:
                raise DietcodeError(f"{label} has {len(node.input)} inputs and no kernel bundle; Attention takes "
                                    "(Q, Kt, V, mask, bundle): optimize the original model again")
        else:
            want = 3 + ("Bias" in node.op_type) + op_takes_residual(node.op_type)
        if len(node.input) != want:
            raise DietcodeError(f"{label} has {len(node.input)} inputs, expected {want} with the kernel bundle last")
        name = node.input[-1]
        if not name:
            raise DietcodeError(f"{label}: its kernel bundle input (the last of its {want}) is empty")
        tensor = inits.get(name)
        if tensor is None or name in graph_inputs:
            raise DietcodeError(f"{label}: its bundle input {name!r} is not a constant initializer")
        if tensor.data_type != TensorProto.UINT8 or len(tensor.dims) != 1 or tensor.dims[0] == 0:
            raise DietcodeError(f"{label}: its bundle input {name!r} must be a non-empty 1-D uint8 tensor")
        if name not in payloads:
            try:
                payloads[name] = np.asarray(numpy_helper.to_array(tensor, base_dir or ""), np.uint8).tobytes()
            except Exception as exc:  # external data file missing or short
                raise DietcodeError(f"{label}: cannot read its bundle input {name!r} ({exc})") from None
        out.append(NodeBundle(node.name, node.op_type, name, payloads[name]))
    return out
