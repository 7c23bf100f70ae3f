"""Hardware profiles of the target GPUs: the limits the search space is pruned by, the occupancy limiter
the cost model's f_adapt needs (resident blocks per SM), and peak figures for an analytic roofline.

Sources, cited per figure below:
- [CG] CUDA C++ Programming Guide, "Compute Capabilities", table "Technical Specifications per Compute
  Capability" (columns 8.0, 8.9, 9.0), and its sections 16.6 (cc 8.x) / 16.7 (cc 9.0) on shared memory.
- [A100] NVIDIA A100 Tensor Core GPU datasheet (2021) and the NVIDIA A100 Tensor Core GPU Architecture
  whitepaper (2020), A100 SXM4.
- [L4] NVIDIA L4 Tensor Core GPU datasheet (2023).
- [H100] NVIDIA H100 Tensor Core GPU datasheet (2023) and the NVIDIA H100 Tensor Core GPU Architecture
  whitepaper (2022), H100 SXM5 (the datasheet's other columns: H100 PCIe, H100 NVL; the whitepaper gives the
  PCIe card's 114 SMs).
- [H200] NVIDIA H200 Tensor Core GPU datasheet (2024): H200 SXM and H200 NVL (GH100 with 141 GB of HBM3e).
- [L40] NVIDIA L40 and L40S datasheets (2023): AD102 with 142 SMs (18,176 CUDA cores) and 864 GB/s GDDR6.
- [FA3] J. Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
  arXiv:2407.08608 (2024), section 2.2 (Hopper's wgmma against mma.sync).
- [Luo] W. Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture", arXiv:2402.13499
  (2024): tensor-core throughput of mma and wgmma instructions measured on an H800.
Tensor throughputs are dense (the datasheets' headline figures with sparsity are twice these).

A target's profile describes one product of that architecture (sm_90: the H100 SXM5). Other products of the
same architecture share its limits (so its kernel space) but not its SM count, bandwidth or peaks: ``PRODUCTS``
lists them, and ``device_profile`` gives the profile of the GPU a CUDA device name (``cuDeviceGetName``) names,
which is what tuning on that GPU, or replaying its table, models (``tuner.measure.tuning_profile``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from dietcode_ort.errors import DietcodeError

__all__ = ["HardwareProfile", "PROFILES", "TARGETS", "Product", "PRODUCTS", "get_profile", "device_profile", "named_profile",
           "resident_blocks"]

KIB = 1024


@dataclass(frozen=True)
class HardwareProfile:
    """Per-GPU limits (per block / per SM) and peak throughputs. Memory sizes are bytes."""

    name: str
    arch: int  # compute capability x 10 (80, 89, 90); Triton's GPUTarget arch
    num_sms: int
    warp_size: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_block: int  # without opt-in (static + dynamic)
    smem_per_block_optin: int  # after cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)
    smem_per_sm: int
    regs_per_sm: int  # 32-bit registers
    regs_per_thread: int
    mma_min_tile: tuple[int, int, int]  # (m, n, k) of the smallest fp16 tensor-core MMA (mma.sync)
    dram_bandwidth_gbs: float
    fp16_tensor_tflops: float
    tf32_tensor_tflops: float
    fp32_tflops: float
    wgmma: bool = False  # has the asynchronous warpgroup MMA (wgmma.mma_async, sm_90 only)
    mma_sync_fraction: float = 1.0  # share of fp16_tensor_tflops a warp-level mma.sync kernel can reach
    smem_reserved_per_block: int = 1 * KIB  # [CG] 16.6/16.7: 1 KB of shared memory per block is reserved
    reg_alloc_unit: int = 256  # [CG] register allocation unit size (per warp), cc 8.x and 9.0
    # dense fp16 tensor-core FLOP per clock per SM: with num_sms and fp16_tensor_tflops it gives the clock the
    # datasheet peak is quoted at (``tensor_clock_hz``), which turns instruction-issue cycles into seconds
    fp16_flops_per_clk_sm: int = 2048

    @property
    def tensor_clock_hz(self) -> float:
        """The SM clock the dense fp16 tensor peak is quoted at: peak / (SMs x FLOP per clock per SM)."""
        return self.fp16_tensor_tflops * 1e12 / (self.num_sms * self.fp16_flops_per_clk_sm)

    def limits(self) -> dict[str, int]:
        """The integer limits the space is pruned by, for reports and JSON."""
        return {"max_threads_per_block": self.max_threads_per_block, "smem_per_block": self.smem_per_block,
                "smem_per_block_optin": self.smem_per_block_optin, "smem_per_sm": self.smem_per_sm,
                "regs_per_thread": self.regs_per_thread, "regs_per_sm": self.regs_per_sm,
                "num_sms": self.num_sms, "max_blocks_per_sm": self.max_blocks_per_sm}


PROFILES: dict[str, HardwareProfile] = {
    "sm_80": HardwareProfile(
        name="NVIDIA A100 SXM4 (40/80 GB)",
        arch=80,
        num_sms=108,  # [A100] whitepaper: 108 SMs enabled on A100
        warp_size=32,  # [CG] all compute capabilities
        max_threads_per_block=1024,  # [CG] cc 8.0
        max_threads_per_sm=2048,  # [CG] cc 8.0: 64 resident warps per SM
        max_blocks_per_sm=32,  # [CG] cc 8.0
        smem_per_block=48 * KIB,  # [CG] default per-block limit without opt-in
        smem_per_block_optin=163 * KIB,  # [CG] cc 8.0: 163 KB per block with opt-in
        smem_per_sm=164 * KIB,  # [CG] cc 8.0: max shared memory per SM 164 KB
        regs_per_sm=64 * KIB,  # [CG] 64K 32-bit registers per SM
        regs_per_thread=255,  # [CG] max registers per thread
        mma_min_tile=(16, 8, 16),  # PTX ISA: mma.sync.m16n8k16 for f16/bf16
        dram_bandwidth_gbs=2039.0,  # [A100] datasheet: 80GB SXM 2,039 GB/s (40GB SXM: 1,555 GB/s)
        fp16_tensor_tflops=312.0,  # [A100] datasheet: FP16/BF16 Tensor Core 312 TFLOPS (dense)
        tf32_tensor_tflops=156.0,  # [A100] datasheet: TF32 Tensor Core 156 TFLOPS (dense)
        fp32_tflops=19.5,  # [A100] datasheet: FP32 19.5 TFLOPS
        # [A100] whitepaper: 4 tensor cores per SM x 256 dense FP16 FMA per clock; 312 TFLOPS at 1,410 MHz
        fp16_flops_per_clk_sm=2048,
    ),
    "sm_89": HardwareProfile(
        name="NVIDIA L4",
        arch=89,
        num_sms=58,  # [L4] AD104 configuration of the L4: 58 SMs (7,424 CUDA cores / 128 per SM)
        warp_size=32,
        max_threads_per_block=1024,  # [CG] cc 8.9
        max_threads_per_sm=1536,  # [CG] cc 8.9: 48 resident warps per SM
        max_blocks_per_sm=24,  # [CG] cc 8.9
        smem_per_block=48 * KIB,  # [CG]
        smem_per_block_optin=99 * KIB,  # [CG] cc 8.6/8.9: 99 KB per block with opt-in
        smem_per_sm=100 * KIB,  # [CG] cc 8.6/8.9: max shared memory per SM 100 KB
        regs_per_sm=64 * KIB,  # [CG]
        regs_per_thread=255,  # [CG]
        mma_min_tile=(16, 8, 16),  # PTX ISA: mma.sync.m16n8k16
        dram_bandwidth_gbs=300.0,  # [L4] datasheet: GPU memory bandwidth 300 GB/s
        fp16_tensor_tflops=121.0,  # [L4] datasheet: FP16/BF16 Tensor Core 242 TFLOPS with sparsity
        tf32_tensor_tflops=60.0,  # [L4] datasheet: TF32 Tensor Core 120 TFLOPS with sparsity
        fp32_tflops=30.3,  # [L4] datasheet: FP32 30.3 TFLOPS
        # Ada's tensor cores run half the A100's dense FP16 rate per SM: 121 TFLOPS over 58 SMs is 1,024 FLOP
        # per clock per SM at the L4's 2,040 MHz boost clock
        fp16_flops_per_clk_sm=1024,
    ),
    "sm_90": HardwareProfile(
        name="NVIDIA H100 SXM5",
        arch=90,
        num_sms=132,  # [H100] datasheet / whitepaper: H100 SXM5 has 132 SMs
        warp_size=32,
        max_threads_per_block=1024,  # [CG] cc 9.0
        max_threads_per_sm=2048,  # [CG] cc 9.0
        max_blocks_per_sm=32,  # [CG] cc 9.0
        smem_per_block=48 * KIB,  # [CG]
        smem_per_block_optin=227 * KIB,  # [CG] cc 9.0: 227 KB per block with opt-in
        smem_per_sm=228 * KIB,  # [CG] cc 9.0: max shared memory per SM 228 KB
        regs_per_sm=64 * KIB,  # [CG]
        regs_per_thread=255,  # [CG]
        mma_min_tile=(16, 8, 16),  # PTX ISA: mma.sync.m16n8k16 (wgmma needs a 64-row warpgroup tile)
        dram_bandwidth_gbs=3350.0,  # [H100] datasheet: SXM 3.35 TB/s HBM3
        fp16_tensor_tflops=989.4,  # [H100] datasheet: FP16/BF16 Tensor Core 1,979 TFLOPS with sparsity
        tf32_tensor_tflops=494.7,  # [H100] datasheet: TF32 Tensor Core 989 TFLOPS with sparsity
        fp32_tflops=66.9,  # [H100] datasheet: FP32 67 TFLOPS
        wgmma=True,  # PTX ISA: wgmma.mma_async needs sm_90a (Triton compiles sm_90 as sm_90a)
        # [FA3] section 2.2: without wgmma, the older mma.sync reaches only about 2/3 of the H100's tensor-core
        # peak (it cites the microbenchmarks of [Luo]); the profile keeps one fp16 peak and scales it for
        # configs Triton lowers to mma.sync (cost_model.config_peak_flops).
        mma_sync_fraction=2 / 3,
        # [H100] whitepaper: twice the A100's dense MMA rate per SM, clock for clock; 989.4 TFLOPS over 132 SMs
        # is 4,096 FLOP per clock per SM at the 1,830 MHz boost clock its table 3 gives for tensor-core work
        fp16_flops_per_clk_sm=4096,
    ),
}

TARGETS: tuple[str, ...] = tuple(PROFILES)


def get_profile(target: str) -> HardwareProfile:
    """The profile of ``target`` ("sm_80", "sm_89", "sm_90")."""
    try:
        return PROFILES[target]
    except KeyError:
        raise DietcodeError(f"unknown target {target!r}; known targets: {', '.join(TARGETS)}") from None


@dataclass(frozen=True)
class Product:
    """A GPU of ``target``'s architecture whose datasheet figures differ from the target profile's product."""

    pattern: str  # a regular expression searched for in the CUDA device name, case-insensitive
    target: str
    name: str
    num_sms: int
    dram_bandwidth_gbs: float
    fp16_tensor_tflops: float  # dense
    tf32_tensor_tflops: float  # dense
    fp32_tflops: float
    fp16_flops_per_clk_sm: int = 0  # where the product's tensor cores differ from the target profile's (0: the same)


# The first product whose pattern the device name contains wins, so the more specific names come first. The
# device names are what the driver reports: "NVIDIA H100 80GB HBM3" (SXM5, the sm_90 profile itself),
# "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-40GB",
# "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S", "NVIDIA L40".
PRODUCTS: tuple[Product, ...] = (
    # [H100] datasheet, PCIe: 2 TB/s HBM2e, FP16 1,513 / TF32 756 TFLOPS with sparsity, FP32 51 TFLOPS;
    # whitepaper: 114 SMs
    Product(r"\bH100\b.*\bPCIe\b", "sm_90", "NVIDIA H100 PCIe", 114, 2000.0, 756.5, 378.0, 51.2),
    # [H100] datasheet, NVL: 3.9 TB/s, FP16 1,671 / TF32 835 TFLOPS with sparsity, FP32 60 TFLOPS; the SXM5's 132 SMs
    Product(r"\bH100\b.*\bNVL\b", "sm_90", "NVIDIA H100 NVL", 132, 3900.0, 835.5, 417.5, 60.0),
    # [H200] datasheet, NVL: 4.8 TB/s, FP16 1,671 / TF32 835 TFLOPS with sparsity, FP32 60 TFLOPS
    Product(r"\bH200\b.*\bNVL\b", "sm_90", "NVIDIA H200 NVL", 132, 4800.0, 835.5, 417.5, 60.0),
    # [H200] datasheet, SXM: 4.8 TB/s, FP16 1,979 / TF32 989 TFLOPS with sparsity, FP32 67 TFLOPS (the H100
    # SXM5's compute)
    Product(r"\bH200\b", "sm_90", "NVIDIA H200 SXM", 132, 4800.0, 989.4, 494.7, 66.9),
    # [A100] datasheet: 40GB (SXM and PCIe) 1,555 GB/s, 80GB PCIe 1,935 GB/s; the same SMs and peaks
    Product(r"\bA100\b.*\b40\s*GB\b", "sm_80", "NVIDIA A100 40GB", 108, 1555.0, 312.0, 156.0, 19.5),
    Product(r"\bA100\b.*\bPCIe\b", "sm_80", "NVIDIA A100 80GB PCIe", 108, 1935.0, 312.0, 156.0, 19.5),
    # [L40] L40S: FP16 362.05 / TF32 183 TFLOPS dense, FP32 91.6 TFLOPS; the L4's 1,024 FLOP per clock per SM
    # (362 TFLOPS over 142 SMs at its 2,520 MHz boost clock)
    Product(r"\bL40S\b", "sm_89", "NVIDIA L40S", 142, 864.0, 362.05, 183.0, 91.6),
    # [L40] L40: FP16 181.05 / TF32 90.5 TFLOPS dense, FP32 90.5 TFLOPS: half the L40S's tensor rate at the
    # same clock, 512 FLOP per clock per SM
    Product(r"\bL40\b", "sm_89", "NVIDIA L40", 142, 864.0, 181.05, 90.5, 90.5, fp16_flops_per_clk_sm=512),
)


def device_profile(device: str, target: str) -> HardwareProfile:
    """The profile of the GPU ``device`` (a CUDA device name, or a tuning database's device key) names, for
    ``target``: the first of ``PRODUCTS`` of that target whose pattern it contains, with its SM count,
    bandwidth and peaks over the target's limits; else the target's profile (its own product, or a GPU this
    module has no datasheet figures for)."""
    base = get_profile(target)
    for p in PRODUCTS:
        if p.target == target and re.search(p.pattern, device, re.IGNORECASE):
            return replace(base, name=p.name, num_sms=p.num_sms, dram_bandwidth_gbs=p.dram_bandwidth_gbs,
                           fp16_tensor_tflops=p.fp16_tensor_tflops, tf32_tensor_tflops=p.tf32_tensor_tflops,
                           fp32_tflops=p.fp32_tflops,
                           fp16_flops_per_clk_sm=p.fp16_flops_per_clk_sm or base.fp16_flops_per_clk_sm)
    return base


# the target profiles' own products, as a device name or a user names them (after the PRODUCTS of the target)
_OWN = {"sm_80": r"\bA100\b", "sm_89": r"\bL4\b", "sm_90": r"\bH100\b"}


def named_profile(name: str, target: str) -> HardwareProfile:
    """The profile of the GPU a user names for ``target`` (``optimize --analytic-gpu``: "NVIDIA H200", "H100 PCIe",
    "L40S"; a CUDA device name works too; "": the target's own): a product of ``PRODUCTS`` or the target
    profile's own; a name that is neither is a DietcodeError listing the known ones (no figures for it here, and
    a wrong guess would model the wrong GPU silently)."""
    if not name:
        return get_profile(target)
    profile = device_profile(name, target)
    if profile is not get_profile(target) or re.search(_OWN[target], name, re.IGNORECASE):
        return profile
    known = [get_profile(target).name] + [p.name for p in PRODUCTS if p.target == target]
    raise DietcodeError(f"{name!r} names no {target} GPU with datasheet figures here (known: {', '.join(known)})")


def resident_blocks(profile: HardwareProfile, threads: int, regs_per_thread: int, shared_bytes: int) -> int:
    """Blocks of one kernel that fit on one SM at once: the minimum over the thread, register, shared
    memory and block-count limits (the CUDA occupancy calculator's rules). 0 means it cannot launch."""
    if threads <= 0 or threads > profile.max_threads_per_block or regs_per_thread > profile.regs_per_thread:
        return 0
    warps = math.ceil(threads / profile.warp_size)
    by_threads = profile.max_threads_per_sm // (warps * profile.warp_size)
    if regs_per_thread > 0:
        unit = profile.reg_alloc_unit
        regs_per_warp = math.ceil(regs_per_thread * profile.warp_size / unit) * unit
        by_regs = profile.regs_per_sm // (regs_per_warp * warps)
    else:
        by_regs = profile.max_blocks_per_sm
    if shared_bytes > profile.smem_per_block_optin:
        return 0
    by_smem = profile.smem_per_sm // (shared_bytes + profile.smem_reserved_per_block)
    return max(0, min(by_threads, by_regs, by_smem, profile.max_blocks_per_sm))
