"""Measurers: who answers "how long does micro-kernel m take on problem p".

One small interface, ``Measurer.measure(family, [(config, problem), ...]) -> [MeasureResult, ...]``, and
``device_key()`` naming the device every answer belongs to (the database never mixes devices). A
failed or timed-out kernel is data (``seconds = inf`` plus an error), never an exception that ends a
tuning run.

- ``GpuMeasurer`` times the kernels that ship: each config compiled ahead of time as ``optimize`` ships it
  (``tuner.aot``), launched by the custom-op library's C core in a child process (``tuner.gpu_timing``: L2
  flush before each repeat, CUDA events, median); ``measure_vendor`` times torch.matmul / torch.bmm /
  conv2d on the same problems, with TF32 for float32 as ONNX Runtime's CUDA EP uses it
  (``ORT_CUDA_USES_TF32``).
- ``ReplayMeasurer`` answers from a recorded table (CSV or CSV.gz); missing rows are an error naming them.
- ``AnalyticMeasurer`` needs no hardware: a roofline with occupancy (``tuner.roofline``).

A call the runtime's per-call fit check refuses (``dc_kernel_fit``: e.g. a TMA kernel's div16 assumption on an
N that is not a multiple of 16) is not a failure of the config: the custom op runs the vendor path for that call
and the kernel still serves the instances it fits. Such a result's error starts with ``REFUSED``
(``MeasureResult.refused``), and ``Measurer.refusals`` says, without timing anything, which calls a measurer
knows the runtime refuses (a replay table's recorded ones, the GPU measurer's div16 ones).

``MeasurerSpec`` names a measurer without building it (a small picklable value), so a measurer can be
built where the batch runs: in this process, or on a cluster worker with the GPU (tuner.distributed).
"""
from __future__ import annotations

import csv
import gzip
import math
import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dietcode_ort.errors import DietcodeError
from tuner.space import Family, MicroKernel
from tuner.workload import ConvParams, Epilogue, Problem

if TYPE_CHECKING:
    from tuner.aot import CompileToolchain
    from tuner.hardware import HardwareProfile
    from tuner.roofline import RooflineTerms

__all__ = ["MeasureResult", "Measurer", "MeasurerSpec", "GpuMeasurer", "ReplayMeasurer", "AnalyticMeasurer", "make_device_key",
           "device_model", "tuning_profile", "check_analytic_gpu", "problem_key", "VENDOR_KEY", "REFUSED", "div16_refusals"]

VENDOR_KEY = "vendor"
# How a result's error starts when the runtime's per-call fit check refuses the call (tuner.gpu_timing writes it,
# recorded tables carry it): the custom op would run the vendor path for that instance.
REFUSED = "the runtime would not launch it"
# ONNX Runtime's CUDA EP runs float32 MatMul/Gemm (cuBLAS) and Conv (cuDNN) with TF32 unless its provider
# option use_tf32 is 0 (the default is 1): the vendor baseline a dietcode kernel must beat does the same.
ORT_CUDA_USES_TF32 = True
Pair = tuple[MicroKernel, Problem]


@dataclass(frozen=True)
class MeasureResult:
    """Median seconds of one (config, problem); ``inf`` with an error message when it failed.

    ``transient``: the failure may not be the config's own (its timing process died or lost its CUDA
    context, possibly through another kernel, or timed out): the database does not store it, so a rerun
    measures it again. Failures that follow from the config (compile errors, resource limits) are not."""

    seconds: float
    error: str | None = None
    transient: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.seconds)

    @property
    def refused(self) -> bool:
        """The runtime refuses this call of the kernel (its per-call fit check), so the instance runs the
        vendor path; the config may fit other instances."""
        return self.error is not None and self.error.startswith(REFUSED)


def make_device_key(model: str, arch: str, driver: str, triton: str) -> str:
    """The database's device identity: every field that changes a timing."""
    return f"model={model};arch={arch};driver={driver};triton={triton}"


def device_model(key: str) -> str:
    """The device name in a device key (``make_device_key``'s model field); the whole key when it has none."""
    for field in key.split(";"):
        if field.startswith("model="):
            return field[len("model="):]
    return key


def tuning_profile(measurer: "Measurer", target: str) -> "HardwareProfile":
    """The hardware a search over ``measurer``'s timings models (the roofline prior, f_adapt's waves and
    occupancy): the GPU product its device key names (``hardware.device_profile``: an H200's bandwidth, an
    H100 PCIe's 114 SMs), else ``target``'s profile."""
    from tuner.hardware import device_profile

    return device_profile(device_model(measurer.device_key()), target)


def check_analytic_gpu(gpu: str, measure: str) -> None:
    """``optimize --analytic-gpu`` names the GPU analytic tuning models; refused with ``measure`` (a --measure
    value, or what auto resolved to) other than analytic: measured tuning models the GPU its timings come from."""
    if gpu and measure != "analytic":
        raise DietcodeError(f"--analytic-gpu names the GPU analytic tuning models; --measure {measure} models the "
                            "GPU its timings come from")


def problem_key(problem: Problem) -> tuple[int, int, int, int]:
    return (problem.m, problem.n, problem.k, problem.batch)


class Measurer(ABC):
    """Times micro-kernels; see the module docstring."""

    @abstractmethod
    def device_key(self) -> str:
        """Identity of the device the answers come from (model, arch, driver, triton version)."""

    @abstractmethod
    def measure(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[MeasureResult]:
        """One result per pair, in order; failures are results with seconds = inf."""

    def context(self) -> str:
        """What besides the family and the problem fixes the timed kernel (epilogue, trans_b, conv
        geometry); the database keys rows by it. Measurers whose answers do not depend on it return ""."""
        return ""

    def refusals(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[str | None]:
        """Without timing anything: per pair, why the runtime would refuse that call of the config (a
        ``REFUSED`` error, as ``measure`` would answer), or None where it would launch it or this measurer
        cannot tell before measuring (here: always None)."""
        return [None] * len(configs_and_problems)

    def refusal_matrix(self, family: Family, configs: Sequence[MicroKernel], problems: Sequence[Problem]) -> Any:
        """``refusals`` of every config on every problem as a bool array [configs, problems] (True: refused). A
        measurer that keeps the base class's ``refusals`` foresees none and answers without forming a pair per
        config and problem (a million at 1,024 shapes)."""
        import numpy as np

        if type(self).refusals is Measurer.refusals:
            return np.zeros((len(configs), len(problems)), dtype=bool)
        answers = self.refusals(family, [(c, p) for c in configs for p in problems])
        return np.array([a is not None for a in answers], dtype=bool).reshape(len(configs), len(problems))

    def measure_vendor(self, family: Family, problems: Sequence[Problem]) -> list[MeasureResult]:
        """The stock library's time per problem; measurers without one say so."""
        raise DietcodeError(f"{type(self).__name__} has no vendor timings; use GpuMeasurer or a replay table "
                            f"with '{VENDOR_KEY}' rows")

    def measure_each(self, family: Family, configs_and_problems: Sequence[Pair],
                     store: Callable[[Sequence[Pair], list[MeasureResult]], None]) -> list[MeasureResult]:
        """``measure``, handing each finished part of the batch to ``store`` as soon as it is done (the
        database writes it then). Here the batch is one part; a distributed measurer has many."""
        results = self.measure(family, configs_and_problems)
        store(configs_and_problems, results)
        return results


@dataclass(frozen=True)
class MeasurerSpec:
    """Which measurer to build, and for what kernel: ``kind`` is "gpu", "analytic" or "replay" (``path``
    the table). Hashable and picklable; ``build()`` constructs it where it will run."""

    kind: str
    target: str = "sm_90"  # analytic: the profile it models
    dtype: str = "float16"
    path: str = ""  # replay: the table
    conv: ConvParams | None = None
    epilogue: Epilogue = Epilogue()
    trans_b: bool = False
    div16: tuple[str, ...] = ()  # gpu: the divisibility the shipped kernels assume (tuner.aot)
    cache_dir: Path | None = None  # gpu: the kernel cache (tuner.aot's default when None)
    toolchain: "CompileToolchain | None" = None  # gpu: how the shipped kernels are compiled (tuner.aot)
    allow_tf32: bool = False  # float32 kernels with TF32 dots (gpu: as compiled; analytic: the TF32 peak)
    gpu: str = ""  # analytic: the GPU of ``target`` it models, by name (hardware.named_profile; "": the target's)

    def build(self) -> "Measurer":
        if self.kind == "gpu":
            return GpuMeasurer(conv=self.conv, epilogue=self.epilogue, trans_b=self.trans_b, div16=self.div16,
                               cache_dir=self.cache_dir, toolchain=self.toolchain, allow_tf32=self.allow_tf32)
        if self.kind == "analytic":
            from tuner.hardware import named_profile

            return AnalyticMeasurer(named_profile(self.gpu, self.target), self.dtype, tf32=self.allow_tf32)
        if self.kind == "replay" and self.path:
            return ReplayMeasurer(self.path)
        raise DietcodeError(f"unknown measurer kind {self.kind!r}; allowed: gpu, analytic, replay (with a path)")

    @property
    def label(self) -> str:
        """How reports name the timings' source."""
        return {"gpu": "gpu", "analytic": "analytic (no GPU timing)"}.get(self.kind, f"replay of {self.path}")


def div16_refusals(family: Family, configs_and_problems: Sequence[Pair], epilogue: Epilogue, div16: Sequence[str]
                   ) -> list[str | None]:
    """Per pair, a ``REFUSED`` error where the problem breaks the div16 assumptions the config's kernel is
    compiled with for a workload's ``epilogue`` and ``div16`` (``aot.div16_refusal`` on ``aot.kernel_div16``:
    e.g. a TMA config on an N or K that is not a multiple of 16), else None."""
    from tuner.aot import div16_refusal, kernel_div16

    assumed = {c: kernel_div16(family.op, c, epilogue, div16) for c in {c for c, _ in configs_and_problems}}
    out: list[str | None] = []
    for config, p in configs_and_problems:
        why = div16_refusal(family.op, assumed[config], p)
        out.append(None if why is None else f"{REFUSED}: {why} (foreseen)")
    return out


class ReplayMeasurer(Measurer):
    """Answers from a recorded table: CSV/CSV.gz with columns config, m, n, k, batch, seconds, device
    (optional: error, synthetic, family). Rows whose config is "vendor" are the vendor library's times.

    A table holding several devices needs ``device=`` to pick one. Asking for a (config, problem) the
    table lacks raises DietcodeError listing the missing instances.
    """

    def __init__(self, path: str | Path, device: str | None = None, family: str | None = None) -> None:
        self.path = Path(path)
        self._rows: dict[tuple[str, tuple[int, int, int, int]], MeasureResult] = {}
        self.synthetic = False
        try:
            opener = gzip.open if self.path.suffix == ".gz" else open
            with opener(self.path, "rt", newline="") as fh:  # type: ignore[operator]
                reader = csv.DictReader(fh)
                need = {"config", "m", "n", "k", "batch", "seconds", "device"}
                missing = need - set(reader.fieldnames or ())
                if missing:
                    raise DietcodeError(f"replay table {self.path} lacks columns {sorted(missing)}; "
                                        f"expected {sorted(need)}")
                devices: dict[str, list[dict[str, str]]] = {}
                for row in reader:
                    if family is not None and row.get("family") not in (None, "", family):
                        continue
                    devices.setdefault(row["device"], []).append(row)
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError, csv.Error) as exc:
            raise DietcodeError(f"cannot read replay table {self.path}: {exc}") from None
        if device is None:
            if len(devices) != 1:
                raise DietcodeError(f"replay table {self.path} holds {len(devices)} devices "
                                    f"({sorted(devices)}); pass device= to pick one")
            device = next(iter(devices))
        if device not in devices:
            raise DietcodeError(f"replay table {self.path} has no rows for device {device!r}; "
                                f"it has {sorted(devices)}")
        self._device = device
        for row in devices[device]:
            try:
                key = (row["config"], (int(row["m"]), int(row["n"]), int(row["k"]), int(row["batch"])))
                seconds = float(row["seconds"])
            except ValueError as exc:
                raise DietcodeError(f"replay table {self.path}: bad row {row}: {exc}") from None
            error = row.get("error") or None
            self._rows[key] = MeasureResult(seconds if error is None else math.inf, error)
            self.synthetic = self.synthetic or row.get("synthetic", "0") in ("1", "true", "True")

    def device_key(self) -> str:
        return self._device

    def _lookup(self, keys: Sequence[tuple[str, tuple[int, int, int, int]]]) -> list[MeasureResult]:
        missing = [k for k in keys if k not in self._rows]
        if missing:
            shown = ", ".join(f"{c} on m={p[0]} n={p[1]} k={p[2]} batch={p[3]}" for c, p in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise DietcodeError(f"replay table {self.path} has no row for {len(missing)} requested "
                                f"instance(s): {shown}{more}")
        return [self._rows[k] for k in keys]

    def measure(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[MeasureResult]:
        return self._lookup([(c.key(), problem_key(p)) for c, p in configs_and_problems])

    def refusals(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[str | None]:
        """The table's recorded refusals (the recorder's runtime fit check ran before timing); None for the
        other pairs, a missing row included."""
        out: list[str | None] = []
        for c, p in configs_and_problems:
            row = self._rows.get((c.key(), problem_key(p)))
            out.append(row.error if row is not None and row.refused else None)
        return out

    def measure_vendor(self, family: Family, problems: Sequence[Problem]) -> list[MeasureResult]:
        return self._lookup([(VENDOR_KEY, problem_key(p)) for p in problems])


class AnalyticMeasurer(Measurer):
    """No hardware: a roofline with occupancy (``tuner.roofline``): the busiest SM's MMAs at its share of the
    config's peak (sm_90's mma.sync configs below its wgmma rate, ``cost_model.config_peak_flops``) and its
    loads at a per-SM share of DRAM bandwidth or at the rate its pipelines' bytes in flight allow over a DRAM
    round trip (Little's law), the bytes that cross DRAM at the device's, split-K's fp32 workspace and its last
    split's reduction, TMA's cheaper load issue on sm_90, persistent kernels' grid, and a launch (plus split-K's
    fixed cost, fitted when the launcher zeroed its counters per call). It ranks configs sensibly but knows nothing of the real kernel's efficiency: use it on
    machines without a GPU, never to report speed. ``tf32``: float32 kernels run their dots in TF32 on the
    tensor cores (the peak is the TF32 rate), and the database keeps those answers apart (``context``).
    """

    def __init__(self, profile: Any, dtype: str, tf32: bool = False) -> None:
        self.profile = profile
        self.dtype = dtype
        self.tf32 = tf32 and dtype == "float32"

    def context(self) -> str:
        return "dot=tf32" if self.tf32 else ""

    def device_key(self) -> str:
        """Names the model's version (``roofline.MODEL_VERSION``): a database never answers from another's."""
        from tuner.roofline import MODEL_VERSION

        rates = f";mma.sync={self.profile.mma_sync_fraction:g}" if self.profile.mma_sync_fraction != 1.0 else ""
        return make_device_key(f"analytic-v{MODEL_VERSION}:{self.profile.name}{rates}", f"sm_{self.profile.arch}",
                               "none", "none")

    def terms(self, config: MicroKernel, problem: Problem) -> "RooflineTerms | None":
        """The prediction's terms (``tuner.roofline``); None when ``config`` cannot launch."""
        from tuner.cost_model import blocks_per_sm, config_peak_flops
        from tuner.roofline import roofline

        return roofline(config, problem, self.profile, self.dtype,
                        config_peak_flops(config, self.profile, self.dtype, self.tf32),
                        blocks_per_sm(config, self.profile, self.dtype))

    def measure(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[MeasureResult]:
        out = []
        for config, p in configs_and_problems:
            terms = self.terms(config, p)
            out.append(MeasureResult(math.inf, "cannot launch: 0 resident blocks per SM") if terms is None
                       else MeasureResult(terms.seconds))
        return out


_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def lt_fuses(op: str, epilogue: Epilogue) -> bool:
    """Whether the CUDA vendor path runs a call of family ``op`` with ``epilogue`` as one cuBLASLt call with the
    epilogue fused (custom_ops/vendor.h, dc_gemm_lt_plan, which this follows for the tuner's families): a single
    GEMM (the gemm family; bmm is a batch), an epilogue of a bias and/or relu or the tanh GELU, a residual only
    where cuBLASLt adds C, inside the activation (none, or residual_first), never multiplying."""
    e = epilogue
    if op != "gemm" or e.activation not in ("none", "relu", "gelu_tanh") or e.residual_mul:
        return False
    if e.residual and e.activation != "none" and not e.residual_first:
        return False
    return e.bias or e.activation != "none" or e.residual


class GpuMeasurer(Measurer):
    """Times the kernels that ship on the CUDA device: per config, ``tuner.aot.compile_kernel`` with the
    workload's epilogue, ``trans_b``, conv geometry and ``div16`` assumptions (the same call, cache and
    Triton as ``optimize``'s bundles), then the cubin launched through the custom-op library's C core in a
    child process (``tuner.gpu_timing``: ``warmup`` launches, ``repeats`` timed ones each after an L2 flush
    of ``flush_bytes``, CUDA events, median). A config that does not compile, does not fit the GPU or is
    refused by the runtime's launch checks is a failed result (inf); one whose timing process died or lost
    its context, or that ran past ``timeout_s``, is a transient failure (never stored in the database).
    Constructing one needs the CUDA driver and a GPU (the backend's ``device_key``), not torch.

    ``conv`` / ``epilogue`` / ``trans_b`` / ``div16`` describe the workload's kernels; ``cache_dir`` is the
    kernel cache. ``allow_tf32``: float32 kernels are compiled with TF32 dots (``tuner.aot``; it changes the
    kernel, so it is part of ``context``; a measurer with it measures 16-bit families as without). ``vendor_tf32``: whether the vendor baseline (cuBLAS / cuDNN through torch, timed in this
    process) runs float32 with TF32 (torch's ``backends.cuda.matmul.allow_tf32`` / ``backends.cudnn.allow_tf32``
    while it is timed; default: as ONNX Runtime's CUDA EP does). ``backend``: the timing backend of the child
    (``tuner.gpu_timing``'s hook; the default times on CUDA). The timing process is the one every
    GpuMeasurer of this process with the same settings shares (``tuner.gpu_timing.shared_timer``); ``close``
    (or ``with``) stops it (the next measurement starts another); it also ends with this process.
    """

    def __init__(self, warmup: int = 3, repeats: int = 20, timeout_s: float = 30.0,
                 conv: ConvParams | None = None, epilogue: Epilogue = Epilogue(), trans_b: bool = False,
                 div16: Sequence[str] = (), cache_dir: Path | None = None, flush_bytes: int = 256 * 1024 * 1024,
                 vendor_tf32: bool = ORT_CUDA_USES_TF32, backend: str | None = None,
                 compile_workers: int | None = None, toolchain: "CompileToolchain | None" = None,
                 allow_tf32: bool = False) -> None:
        from tuner.aot import CompileToolchain
        from tuner.gpu_timing import CUDA_BACKEND, TimingSettings, shared_timer

        self.settings = TimingSettings(warmup=warmup, repeats=repeats, flush_bytes=flush_bytes, timeout_s=timeout_s)
        self.warmup, self.repeats, self.timeout_s = warmup, repeats, timeout_s
        self.conv, self.epilogue, self.trans_b = conv, epilogue, trans_b
        self.div16 = tuple(sorted(set(div16)))
        self.cache_dir, self.compile_workers = cache_dir, compile_workers
        self.toolchain = toolchain if toolchain is not None else CompileToolchain()  # as optimize compiles
        self.vendor_tf32 = vendor_tf32
        self.allow_tf32 = allow_tf32
        self._timer = shared_timer(backend or CUDA_BACKEND, self.settings)
        self._device = self._timer.device_key()  # DietcodeError without a driver or GPU
        self._torch: Any = None
        self._flush: Any = None
        # what this measurer spent, for reports of the tuning cost (benchmarks/record_table.py): wall seconds
        # compiling (``compiled`` configs, in parallel, cached ones included) and timing (``timed`` launches)
        self.compile_seconds, self.compiled, self.timing_seconds, self.timed = 0.0, 0, 0.0, 0

    def device_key(self) -> str:
        return self._device

    def refusals(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[str | None]:
        """The calls whose shipped kernel's div16 assumptions the problem breaks (``div16_refusals``); the
        runtime's other per-call checks show only when measured."""
        return div16_refusals(family, configs_and_problems, self.epilogue, self.div16)

    def close(self) -> None:
        self._timer.close()

    def __enter__(self) -> "GpuMeasurer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def context(self) -> str:
        """The kernel's build facts, plus what else changes a timing here: the templates' and the AOT
        compiler's source (a timing of an edited template or compile path is another kernel's), the
        divisibility the kernel assumes, and the timing settings."""
        from tuner.aot import aot_hash, template_hash

        c = self.conv
        conv = "" if c is None else (f";conv={c.in_channels}x{c.out_channels}k{c.kernel}s{c.strides}"
                                     f"p{c.pads}d{c.dilations}" + (f"g{c.groups}" if c.groups > 1 else "")
                                     + ("nhwc" if c.channels_last else ""))
        e = self.epilogue
        scale = (f";alpha={e.alpha!r}" if e.alpha != 1.0 else "") + (";residual=1" if e.residual else "") \
            + (";residual_first=1" if e.residual_first else "") + (";residual_mul=1" if e.residual_mul else "")
        return (f"bias={int(e.bias)};act={e.activation};trans_b={int(self.trans_b)}" + scale
                + conv + f";templates={template_hash()[:16]};aot={aot_hash()[:16]};div16={','.join(self.div16)}"
                f";timing=aot-cubin-{self.settings.key()};vendor_tf32={int(self.vendor_tf32)};vendor={self._vendor_form()}"
                f";min_driver={self.toolchain.min_driver};ptxas={self.toolchain.ptxas or 'triton'}"
                + (";dot=tf32" if self.allow_tf32 else "")).replace(" ", "")

    def _vendor_form(self) -> str:
        """How the vendor baseline runs this epilogue, for ``context``: "addmm" where it is timed as before the
        runtime fused epilogues into cuBLASLt (a bias alone was already in addmm), "lt" where ``vendor_call``
        now times one fused call instead of addmm and passes after it (an activation, a residual)."""
        e = self.epilogue
        fused = self.conv is None and lt_fuses("gemm", e) and (e.activation != "none" or e.residual)
        return "lt" if fused else "addmm"

    def _compile(self, family: Family, configs: Sequence[MicroKernel]) -> dict[MicroKernel, bytes | str]:
        """Each config's one-kernel bundle as it ships, or its compile error."""
        from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
        from tuner import aot

        tf32 = self.allow_tf32 and family.dtype == "float32"
        jobs = [aot.CompileJob(family, c, epilogue=self.epilogue, trans_b=self.trans_b, conv=self.conv,
                               div16=self.div16, allow_tf32=tf32, cache_dir=self.cache_dir, toolchain=self.toolchain)
                for c in configs]
        out: dict[MicroKernel, bytes | str] = {}
        for job, r in zip(jobs, aot.compile_many(jobs, workers=self.compile_workers)):
            if r.kernel is None:
                out[job.config] = f"compile error: {r.error}"[:2000]
                continue
            bundle = Bundle((), (BundleKernel.from_compiled([r.kernel]),), DispatchTree.single(0))
            out[job.config] = bundle.to_bytes()
        return out

    def measure(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[MeasureResult]:
        from tuner.gpu_timing import TimingItem

        configs = list(dict.fromkeys(c for c, _ in configs_and_problems))
        started = time.perf_counter()
        built = self._compile(family, configs)
        self.compile_seconds += time.perf_counter() - started
        self.compiled += len(configs)
        out: list[MeasureResult | None] = [None] * len(configs_and_problems)
        items = []
        for i, (config, problem) in enumerate(configs_and_problems):
            bundle = built[config]
            if isinstance(bundle, str):
                out[i] = MeasureResult(math.inf, bundle)
                continue
            items.append(TimingItem(i, config.key(), bundle, family.op, family.dtype, problem,
                                    bias=self.epilogue.bias, trans_b=self.trans_b, conv=self.conv,
                                    residual=self.epilogue.residual))
        started = time.perf_counter()
        for item, result in zip(items, self._timer.time(items)):
            out[item.index] = result
        self.timing_seconds += time.perf_counter() - started
        self.timed += len(items)
        missing = [i for i, r in enumerate(out) if r is None]
        if missing:  # cannot happen: the timer answers every item
            raise DietcodeError(f"GpuMeasurer: {len(missing)} measurements came back without a result")
        return [r for r in out if r is not None]

    def _vendor_torch(self) -> Any:
        """torch and the vendor timer's flush buffer, on first use (only the vendor baseline needs torch)."""
        if self._torch is None:
            try:
                import torch
            except ImportError as exc:
                raise DietcodeError(f"the vendor baseline is timed through torch with CUDA: {exc}") from None
            if not torch.cuda.is_available():
                raise DietcodeError("the vendor baseline needs torch with CUDA, and torch sees no GPU")
            self._torch = torch
            self._flush = torch.empty(max(1, self.settings.flush_bytes), dtype=torch.int8, device="cuda")
        return self._torch

    def _operands(self, family: Family, p: Problem) -> tuple[Any, Any, Any, Any]:
        """A, B, the bias (or None) and the residual (or None) of ``p``, on the GPU."""
        torch = self._torch
        dtype = getattr(torch, _TORCH_DTYPES[family.dtype])
        make = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)  # noqa: E731
        bias = make(p.n) if self.epilogue.bias else None
        if family.op == "conv":
            if self.conv is None or p.image is None:
                raise DietcodeError("GpuMeasurer: conv problems need ConvParams and Problem.image")
            n_img, h, w = p.image
            c = self.conv
            # the output's [n, OC, OH, OW] with its spatial dims as one (M = n * OH * OW): vendor_call views it;
            # channels-last: [n, OH * OW, OC], and X and W in torch's channels_last memory format (cuDNN's NHWC)
            residual = None
            if self.epilogue.residual:
                residual = make(n_img, p.m // n_img, c.out_channels) if c.channels_last else \
                    make(n_img, c.out_channels, p.m // n_img)
            bias = make(c.out_channels) if self.epilogue.bias else None  # every group's (p.n is one group's)
            x, w = make(n_img, c.in_channels, h, w), make(c.out_channels, c.in_channels // c.groups, *c.kernel)
            if c.channels_last:
                x, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
            return x, w, bias, residual
        b_shape = (p.n, p.k) if self.trans_b else (p.k, p.n)
        residual = make(p.batch, p.m, p.n) if family.op == "bmm" else make(p.m, p.n)
        residual = residual if self.epilogue.residual else None
        if family.op == "bmm":
            return make(p.batch, p.m, p.k), make(p.batch, *b_shape), bias, residual
        return make(p.m, p.k), make(*b_shape), bias, residual

    def vendor_call(self, family: Family, a: Any, b: Any, bias: Any, residual: Any) -> Callable[[], Any]:
        """What the vendor baseline times: ``act(alpha * A @ B + bias) + residual`` (with residual_first
        ``act(alpha * A @ B + bias + residual)``, with residual_mul ``act(alpha * A @ B + bias) * residual``) in
        the passes the CUDA vendor path (custom_ops/vendor.h) runs it in:

        - where it fuses the epilogue into one cuBLASLt call (``lt_fuses``: the gemm family with a bias and/or
          relu / the tanh GELU, a residual only before the activation), one torch call that does the same:
          ``addmm`` (bias: cuBLASLt's BIAS epilogue), ``torch._addmm_activation`` (its RELU_BIAS / GELU_BIAS; a
          zero bias where the node has none; its CPU kernel computes the erf GELU, so on the CPU the tanh GELU
          follows ``addmm``), or with a residual an in-place ``addmm_`` into a copy of the residual plus the bias
          made beforehand (one GEMM reading C, as cuBLASLt reads the residual; the value is right at the first
          call, later calls accumulate: only the time counts), then for residual_first an activation pass the
          runtime does not run (no torch call fuses it);
        - else one cuBLAS call carrying alpha, then the PTX epilogue's pass over the output, here addmm/baddbmm
          with the bias in it, then the activation and the residual (a bmm's bias alone makes its pass too:
          baddbmm copies the broadcast bias into the output before the GEMM reads it back as C);

        conv: cuDNN's conv2d with the bias, then the residual and the activation in the epilogue's order; a
        channels-last layer's on torch's channels_last tensors (cuDNN's NHWC, as the CUDA vendor path runs it)."""
        import torch

        fn = torch.nn.functional
        fn_act = {"none": lambda x: x, "relu": torch.relu, "gelu": fn.gelu,
                  "gelu_tanh": lambda x: fn.gelu(x, approximate="tanh"), "silu": fn.silu, "relu6": fn.relu6}
        e = self.epilogue
        act = fn_act[e.activation]
        first = e.residual_first

        def finish(y: Any) -> Any:
            if residual is None:
                return act(y)
            res = residual
            if family.op == "conv" and self.conv is not None and self.conv.channels_last:  # y: NCHW dims, NHWC memory
                res = residual.view(y.shape[0], y.shape[2], y.shape[3], y.shape[1]).permute(0, 3, 1, 2)
            elif family.op == "conv":
                res = residual.view(y.shape)
            if e.residual_mul:
                return act(y).mul_(res)
            return act(y.add_(res)) if first else act(y).add_(res)

        if family.op == "conv":
            c = self.conv
            if c is None:
                raise DietcodeError("GpuMeasurer: conv problems need ConvParams")
            top, left, bottom, right = c.pads
            if (top, left) == (bottom, right):
                return lambda: finish(torch.nn.functional.conv2d(a, b, bias, stride=c.strides, padding=(top, left),
                                                                 dilation=c.dilations, groups=c.groups))
            # conv2d pads symmetrically: pad the input explicitly, as ORT does
            return lambda: finish(torch.nn.functional.conv2d(torch.nn.functional.pad(a, (left, right, top, bottom)),
                                                             b, bias, stride=c.strides, dilation=c.dilations,
                                                             groups=c.groups))
        bb = b.transpose(-1, -2) if self.trans_b else b
        alpha = e.alpha
        mm = torch.baddbmm if family.op == "bmm" else torch.addmm
        if lt_fuses(family.op, e):
            if residual is not None:  # C = the residual: one GEMM reading it
                c_in = residual + bias if bias is not None else residual.clone()
                return lambda: act(c_in.addmm_(a, bb, alpha=alpha))
            if e.activation == "none":
                return lambda: torch.addmm(bias, a, bb, alpha=alpha)
            base = bias if bias is not None else torch.zeros(bb.shape[-1], dtype=a.dtype, device=a.device)
            if e.activation == "gelu_tanh" and not a.is_cuda:
                return lambda: act(torch.addmm(base, a, bb, alpha=alpha))
            gelu = e.activation == "gelu_tanh"
            return lambda: torch._addmm_activation(base, a, bb, alpha=alpha, use_gelu=gelu)
        # beta=0 ignores the (broadcast) input: no bias costs no read
        base, beta = (bias, 1) if bias is not None else (torch.zeros(1, dtype=a.dtype, device=a.device), 0)
        return lambda: finish(mm(base, a, bb, beta=beta, alpha=alpha))

    def _time(self, fn: Callable[[], Any]) -> float:
        torch = self._torch
        started = time.perf_counter()
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        if time.perf_counter() - started > self.timeout_s:
            raise TimeoutError(f"warm-up took more than {self.timeout_s} s")
        times = []
        for _ in range(self.repeats):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def measure_vendor(self, family: Family, problems: Sequence[Problem]) -> list[MeasureResult]:
        """cuBLAS (torch.matmul / torch.bmm) or cuDNN (conv2d) on the same problems and epilogue, float32
        with TF32 when ``vendor_tf32`` (torch's global flags are set while timing and restored after)."""
        flags = self._vendor_torch().backends
        saved = (flags.cuda.matmul.allow_tf32, flags.cudnn.allow_tf32)
        flags.cuda.matmul.allow_tf32 = flags.cudnn.allow_tf32 = self.vendor_tf32
        try:
            return self._measure_vendor(family, problems)
        finally:
            flags.cuda.matmul.allow_tf32, flags.cudnn.allow_tf32 = saved

    def _measure_vendor(self, family: Family, problems: Sequence[Problem]) -> list[MeasureResult]:
        out = []
        for problem in problems:
            try:
                fn = self.vendor_call(family, *self._operands(family, problem))
                out.append(MeasureResult(self._time(fn)))
            except Exception as exc:
                out.append(MeasureResult(math.inf, f"{type(exc).__name__}: {str(exc)[:300]}"))
        return out
