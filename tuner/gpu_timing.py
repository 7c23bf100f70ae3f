"""Timing what ships: the AOT cubins, launched by the custom-op library's C core, in a child process.

Triton's JIT specializes every int argument on divisibility by 16 and on being 1, and may be another Triton
than the one that compiled the bundle; the shipped kernel is ``tuner.aot``'s cubin launched by ``dc_launch``.
So ``GpuMeasurer`` (tuner.measure) compiles each config exactly as ``optimize`` ships it (same function, same
kernel cache, same ``div16`` assumptions), wraps it in a one-kernel bundle, and hands it here:

- ``ChildTimer`` (the parent's side) sends batches of ``TimingItem`` to one child process (multiprocessing,
  spawn) and collects one ``MeasureResult`` per item, in order. The child times one item at a time and
  answers each before the next, so a failure belongs to the item in flight. When the child dies (a signal,
  ``os._exit``, an error that poisons its CUDA context) or does not answer within ``timeout_s``, the item
  in flight is recorded as failed with the reason, a new child starts, and the rest of the batch goes to
  it; after ``max_restarts`` deaths in one batch the rest are recorded as failed for the last reason.
  Such failures are ``transient``: they may come from the context rather than the config, so the
  database never stores them (``tuner.database``), and a rerun measures them again. A child that cannot
  even start (no driver, no GPU) is a DietcodeError. The child is reused across batches while it lives; ``shared_timer`` gives every measurer of a process
  the same one.
- In the child, a backend times each item. ``CudaBackend`` (the default) loads the custom-op library,
  makes the device's primary context current (``dc_timing_open``), takes the launch arguments of the node
  call the problem stands for from ``dc_abi_view`` (what the CUDA path passes the kernel), checks the kernel
  against the device (``dc_kernel_fit_device``) and the call (``dc_kernel_fit``), and times it with
  ``dc_time_kernel`` (custom_ops/timing.cc): ``warmup`` launches, then ``repeats`` launches each after an
  L2 flush of ``flush_bytes`` and between CUDA events; the result is the median. Operands are random values
  of the dtype in device memory from ``dc_mem_alloc``: the child needs no torch (no multi-second import,
  no second allocator or context beside the driver's) and reaches the GPU only through the driver calls
  the runtime itself makes. Only the vendor baseline uses torch, in the parent (tuner.measure).

The hook: ``backend`` is a ``"module:Name"`` reference to a ``TimingBackend`` subclass, imported in the child
(and in the parent, for ``device_key``). The default is ``CUDA_BACKEND``; tests name a fake backend of
their own to rehearse the protocol and crash recovery without a GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import math
import os
import signal
import statistics
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from dietcode_ort.errors import DietcodeError
from tuner.measure import REFUSED, MeasureResult
from tuner.workload import ConvParams, Problem

__all__ = ["TimingSettings", "TimingItem", "TimingBackend", "CudaBackend", "ContextLost", "ChildTimer",
           "CUDA_BACKEND", "node_call", "load_backend", "shared_timer"]

CUDA_BACKEND = "tuner.gpu_timing:CudaBackend"
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TimingSettings:
    """How a kernel is timed; every field is part of the database key (``key``)."""

    warmup: int = 3  # untimed launches first (the first loads the module)
    repeats: int = 20  # timed launches; the result is their median
    flush_bytes: int = 256 * 1024 * 1024  # written before each timed launch (evicts L2; 0: no flush)
    timeout_s: float = 30.0  # per item: a child that does not answer in time is stopped

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.repeats < 1 or self.flush_bytes < 0 or not self.timeout_s > 0:
            raise DietcodeError(f"timing settings: warmup and repeats must be >= 1, flush_bytes >= 0 and timeout_s "
                                f"> 0; got {self.warmup}, {self.repeats}, {self.flush_bytes}, {self.timeout_s}")

    def key(self) -> str:
        return f"w{self.warmup}r{self.repeats}flush{self.flush_bytes}"


@dataclass(frozen=True)
class TimingItem:
    """One measurement: a bundle whose kernel 0 is the compiled config, and the problem to run it on."""

    index: int  # position in its batch
    config: str  # the config's key (for messages)
    bundle: bytes
    op: str  # gemm | bmm | conv
    dtype: str
    problem: Problem
    bias: bool = False
    trans_b: bool = False
    conv: ConvParams | None = None
    residual: bool = False  # the kernel adds a second tensor of the output's shape (gemm, conv)
    # attention (op "attention"): the problem is m = seq_q, n = seq_k, k = head dim, batch = z (batch x heads);
    # the mask: None (no mask), "row" (one row for every query, [z, 1, seq_k]) or "rows" ([z, seq_q, seq_k])
    mask: str | None = None


def node_call(item: TimingItem) -> dict[str, Any]:
    """The ONNX node call the item's problem stands for, as ``Core.abi_view`` arguments: gemm is a MatMul
    ``[M, K] x [K, N]`` (a Gemm with transB for ``trans_b``), bmm a batched MatMul ``[batch, M, K] x
    [batch, K, N]``, conv a Conv of the image ``problem.image`` with the layer's weights (NHWC X and
    [OC, KH, KW, C] W, ``channels_last``, for a channels-last layer)."""
    p = item.problem
    if item.op == "gemm":
        if item.trans_b:
            return dict(op="Gemm", a=(p.m, p.k), b=(p.n, p.k), c=(p.n,) if item.bias else None, ints=(0, 1),
                        floats=(1.0, 1.0))
        return dict(op="MatMul", a=(p.m, p.k), b=(p.k, p.n))
    if item.op == "bmm":
        if item.trans_b:
            raise DietcodeError("bmm with trans_b is no ONNX node call: MatMul does not transpose")
        return dict(op="MatMul", a=(p.batch, p.m, p.k), b=(p.batch, p.k, p.n), batched=True)
    if item.op == "conv":
        c = item.conv
        if c is None or p.image is None:
            raise DietcodeError("conv items need ConvParams and Problem.image")
        n_img, h, w = p.image
        if c.channels_last:  # a node with channels_last=1: X [n, H, W, C], W [OC, KH, KW, C] (ungrouped)
            return dict(op="Conv", a=(n_img, h, w, c.in_channels), b=(c.out_channels, *c.kernel, c.in_channels),
                        ints=(*c.strides, *c.pads, *c.dilations, c.groups), channels_last=True)
        return dict(op="Conv", a=(n_img, c.in_channels, h, w),
                    b=(c.out_channels, c.in_channels // c.groups, *c.kernel),
                    ints=(*c.strides, *c.pads, *c.dilations, c.groups))
    if item.op == "attention":
        if item.mask not in (None, "row", "rows"):
            raise DietcodeError(f"attention mask kind {item.mask!r}; allowed: None, row, rows")
        mask = None if item.mask is None else (p.batch, p.m if item.mask == "rows" else 1, p.n)
        return dict(q=(p.batch, p.m, p.k), kt=(p.batch, p.k, p.n), v=(p.batch, p.n, p.k), mask=mask, head_dim=p.k)
    raise DietcodeError(f"unknown op {item.op!r}; allowed: gemm, bmm, conv, attention")


class ContextLost(Exception):
    """Raised by a backend when its CUDA context is poisoned: the child reports it and exits."""


class TimingBackend(ABC):
    """What the child process times with (see the module docstring for the hook that picks one)."""

    def __init__(self, settings: TimingSettings) -> None:
        self.settings = settings

    @abstractmethod
    def device_key(self) -> str:
        """The device identity (``tuner.measure.make_device_key``); called in the parent, cheap."""

    @abstractmethod
    def open(self) -> None:
        """Set up in the child before the first item (context, buffers); raise to refuse to start."""

    @abstractmethod
    def time(self, item: TimingItem) -> MeasureResult:
        """Time one item. A failure that follows from the item (refused launch, no fit) is a result with
        ``transient=False``; a poisoned context raises ContextLost; any other exception is recorded as a
        transient failure."""


def load_backend(ref: str) -> type[TimingBackend]:
    """The TimingBackend subclass ``ref`` ("module:Name") names."""
    module, _, name = ref.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise DietcodeError(f"timing backend {ref!r} cannot be loaded: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, TimingBackend)):
        raise DietcodeError(f"timing backend {ref!r} is not a TimingBackend subclass")
    return cls


class CudaBackend(TimingBackend):
    """Times the bundle's cubin with ``dc_time_kernel`` on device 0 (see the module docstring)."""

    def __init__(self, settings: TimingSettings) -> None:
        super().__init__(settings)
        self._core: Any = None
        self._stream = ctypes.c_void_p()
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (address, bytes)
        self._bundles: OrderedDict[bytes, Any] = OrderedDict()  # the last few parsed (their modules stay loaded)
        self._device: tuple[int, int, int] = (0, 0, 0)

    def _lib(self) -> Any:
        from dietcode_ort.runtime import load_core

        if self._core is None:
            self._core = load_core()
            lib, u64, vp = self._core.lib, ctypes.c_uint64, ctypes.c_void_p
            lib.dc_timing_open.argtypes = [ctypes.c_int, ctypes.POINTER(vp)]
            lib.dc_mem_alloc.argtypes = [u64, ctypes.POINTER(u64)]
            lib.dc_mem_free.argtypes = [u64]
            lib.dc_mem_upload.argtypes = [u64, vp, u64]
            from dietcode_ort.runtime import LaunchArgs

            lib.dc_time_kernel.argtypes = [vp, ctypes.c_int32, ctypes.POINTER(LaunchArgs), vp, ctypes.c_int,
                                           ctypes.c_int, u64, u64, ctypes.POINTER(ctypes.c_float)]
        return self._core.lib

    def device_key(self) -> str:
        import triton

        from tuner.measure import make_device_key

        self._lib()
        probe = self._core.cuda_probe(0)  # DietcodeError naming what is missing (driver, device)
        return make_device_key(probe["name"], f"sm_{probe['major']}{probe['minor']}", str(probe["driver_version"]),
                               triton.__version__)

    def open(self) -> None:
        lib = self._lib()
        if lib.dc_timing_open(0, ctypes.byref(self._stream)):
            raise DietcodeError(self._core.error())
        major, minor, optin = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if self._core.lib.dc_cuda_device_limits(0, ctypes.byref(major), ctypes.byref(minor), ctypes.byref(optin)):
            raise DietcodeError(self._core.error())
        self._device = (major.value, minor.value, optin.value)
        if self.settings.flush_bytes:
            self._buffer("flush", self.settings.flush_bytes)

    def _buffer(self, name: str, size: int, fill_dtype: str | None = None) -> int:
        """Device memory of at least ``size`` bytes, kept and grown (doubling) across items; filled with
        random values of ``fill_dtype`` when it is (re)allocated, if given."""
        lib = self._lib()
        address, have = self._buffers.get(name, (0, 0))
        if have >= size:
            return address
        if address:
            lib.dc_mem_free(address)
        size = max(size, 2 * have, 1 << 20)
        ptr = ctypes.c_uint64()
        if lib.dc_mem_alloc(size, ctypes.byref(ptr)):
            self._buffers.pop(name, None)
            raise RuntimeError(self._core.error())
        self._buffers[name] = (ptr.value, size)
        if fill_dtype is not None:
            self._fill(ptr.value, size, fill_dtype)
        return ptr.value

    def _fill(self, address: int, size: int, dtype: str) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        chunk = 1 << 26  # bytes per upload
        for offset in range(0, size, chunk):
            n = min(chunk, size - offset) // _DTYPE_BYTES[dtype]
            values = rng.standard_normal(n, dtype=np.float32)
            if dtype == "float16":
                data = values.astype(np.float16).tobytes()
            elif dtype == "bfloat16":
                data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
            else:
                data = values.tobytes()
            if self._core.lib.dc_mem_upload(address + offset, data, len(data)):
                raise RuntimeError(self._core.error())

    def time(self, item: TimingItem) -> MeasureResult:
        core = self._core
        bundle = self._bundles.get(item.bundle)
        if bundle is None:
            bundle = self._bundles[item.bundle] = core.parse(item.bundle)
            if len(self._bundles) > 16:
                self._bundles.popitem(last=False)  # freed: its CUDA module is unloaded
        self._bundles.move_to_end(item.bundle)
        fits, why = bundle.fit_device(*self._device)
        if not fits[0]:
            return MeasureResult(math.inf, f"does not fit this GPU: {why[0]}")
        if item.op == "attention":
            return self._time_attention(bundle, item)
        args = core.abi_view(**node_call(item))
        if args is None:
            return MeasureResult(math.inf, "the kernel ABI cannot express this problem's node call")
        elem = _DTYPE_BYTES[item.dtype]
        call = node_call(item)
        out_bytes = item.problem.m * item.problem.n * item.problem.batch * elem
        sizes = [math.prod(call["a"]) * elem, math.prod(call["b"]) * elem, out_bytes if item.residual else 0,
                 item.problem.n * (item.problem.batch if item.op == "conv" else 1) * elem if item.bias else 0]
        # (a grouped conv's bias has every group's n channels; a bmm's is broadcast over the batch)
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + -(-size // 256) * 256)  # operands apart, 256-byte aligned
        base = self._buffer(f"operands-{item.dtype}", offsets[-1] + max(sizes[-1], 256), fill_dtype=item.dtype)
        args.a, args.b = base + offsets[0], base + offsets[1]
        args.residual = base + offsets[2] if item.residual else 0
        args.bias = base + offsets[3] if item.bias else 0
        args.c, args.c_bytes = self._buffer("output", out_bytes), out_bytes
        return self._launch_timed(bundle, args)

    def _time_attention(self, bundle: Any, item: TimingItem) -> MeasureResult:
        """An Attention node call: the launch arguments from ``dc_attention_view`` (what the CUDA node passes)."""
        call = node_call(item)
        args = self._core.attention_view(**call)
        if args is None:
            return MeasureResult(math.inf, "the attention view cannot express this problem's node call")
        elem = _DTYPE_BYTES[item.dtype]
        shapes = [call["q"], call["kt"], call["v"]] + ([call["mask"]] if call["mask"] is not None else [])
        # Q, K and V get three times their size: a packed-layout kernel reads rows of 3 * heads * d from each
        sizes = [math.prod(s) * elem * (3 if i < 3 else 1) for i, s in enumerate(shapes)]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // 256) * 256)
        base = self._buffer(f"operands-{item.dtype}", offsets[-1] + 256, fill_dtype=item.dtype)
        args.q, args.k, args.v = base + offsets[0], base + offsets[1], base + offsets[2]
        args.mask = base + offsets[3] if call["mask"] is not None else 0
        out_bytes = sizes[0]
        args.out, args.c_bytes = self._buffer("output", out_bytes), out_bytes
        return self._launch_timed(bundle, args)

    def _launch_timed(self, bundle: Any, args: Any) -> MeasureResult:
        core = self._core
        fit, message = bundle.fit(0, args)  # what the runtime checks before each launch (dc_launch again)
        if fit != "fits":
            return MeasureResult(math.inf, f"{REFUSED}: {fit}: {message}")
        if bundle.persistent(0):  # the grid dc_launch runs, its scratch sized as the custom op sizes it
            args.sm_count = core.sm_count(self._stream)
        workspace = bundle.workspace_bytes(0, args)  # split-K, TMA scratch: what the custom op allocates per call
        if workspace:
            args.workspace, args.workspace_bytes = self._buffer("workspace", workspace), workspace
        s = self.settings
        times = (ctypes.c_float * s.repeats)()
        flush = self._buffers["flush"][0] if s.flush_bytes else 0
        rc = core.lib.dc_time_kernel(bundle.handle, 0, ctypes.byref(args), self._stream, s.warmup, s.repeats,
                                     flush, s.flush_bytes, times)
        if rc == -2:
            raise ContextLost(core.error())
        if rc != 0:
            return MeasureResult(math.inf, core.error())
        return MeasureResult(statistics.median(list(times)) / 1e3)


# --- the child process ---------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _child_main(conn: Any, backend_ref: str, settings: TimingSettings, parent: int) -> None:
    """The child: set up the backend, say "ready", then answer each item of each batch as it is timed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the child
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    try:
        backend = load_backend(backend_ref)(settings)
        backend.open()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] != "items":
            return
        for item in message[1]:
            try:
                result = backend.time(item)
            except ContextLost as exc:
                conn.send(("lost", item.index, str(exc)))
                os._exit(3)  # the context is gone: nothing else may run in this process
            except Exception as exc:  # noqa: BLE001 - recorded, and not cached (it may not be the config's)
                result = MeasureResult(math.inf, f"{type(exc).__name__}: {str(exc)[:300]}", transient=True)
            conn.send(("result", item.index, result))


class ChildTimer:
    """The parent's side of the timing child (see the module docstring)."""

    def __init__(self, backend: str = CUDA_BACKEND, settings: TimingSettings = TimingSettings(),
                 max_restarts: int = 3, start_timeout_s: float = 300.0) -> None:
        self.backend, self.settings = backend, settings
        self.max_restarts, self.start_timeout_s = max_restarts, start_timeout_s
        self._process: Any = None
        self._conn: Any = None
        self._lock = threading.RLock()  # one batch at a time (threads of one process share a timer)
        self.started = 0  # children started so far
        self.pids: list[int] = []

    def device_key(self) -> str:
        return load_backend(self.backend)(self.settings).device_key()

    def _start(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_child_main, args=(theirs, self.backend, self.settings, os.getpid()),
                                  daemon=True, name="dietcode-timing")
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        self.started += 1
        try:
            ready = ours.poll(self.start_timeout_s)
            message = ours.recv() if ready else ("failed", f"no answer within {self.start_timeout_s:.0f} s")
        except EOFError:
            message = ("failed", self._death())
        if message[0] != "ready":
            self._stop()
            raise DietcodeError(f"the GPU timing process could not start: {message[1]}")
        self.pids.append(int(message[1]))

    def _death(self) -> str:
        """Why the child ended (after its pipe closed)."""
        process = self._process
        process.join(5)
        code = process.exitcode
        if code is None:
            return "the timing process stopped answering"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"the timing process died of {signal.Signals(-code).name}"
        return f"the timing process exited with status {code}"

    def close(self) -> None:
        """Stop the child (if any); the next batch starts another."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()
        if process is not None and process.is_alive():
            process.kill()
        if process is not None:
            process.join(5)

    def time(self, items: Sequence[TimingItem]) -> list[MeasureResult]:
        """One result per item, in order (see the module docstring for failures)."""
        with self._lock:
            return self._time(items)

    def _time(self, items: Sequence[TimingItem]) -> list[MeasureResult]:
        results: dict[int, MeasureResult] = {}
        pending = list(items)
        deaths, reason = 0, ""
        while pending:
            if deaths > self.max_restarts:
                for item in pending:
                    results[item.index] = MeasureResult(
                        math.inf, f"not measured: the timing process died {deaths} times in this batch; last: "
                                  f"{reason}", transient=True)
                break
            if self._process is None or not self._process.is_alive():
                self._start()
            self._conn.send(("items", pending))
            reason = self._collect(pending, results)
            if reason:
                deaths += 1
                results[pending[0].index] = MeasureResult(math.inf, reason, transient=True)
                pending.pop(0)
                self._stop()
        return [results[item.index] for item in items]

    def _collect(self, pending: list[TimingItem], results: dict[int, MeasureResult]) -> str:
        """Take the child's answers for ``pending`` (removing each answered item); "" when all came, else
        why the child was lost while ``pending[0]`` was in flight."""
        while pending:
            try:
                if not self._conn.poll(self.settings.timeout_s):
                    return f"timed out: no answer within {self.settings.timeout_s:g} s (the timing process was stopped)"
                message = self._conn.recv()
            except (EOFError, OSError):
                return self._death()
            if message[0] == "lost":
                return f"context lost: {message[2]}"
            _, index, result = message
            if index != pending[0].index:
                return f"the timing process answered item {index} while {pending[0].index} was in flight"
            results[index] = result
            pending.pop(0)
        return ""

    def __enter__(self) -> "ChildTimer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[tuple[str, TimingSettings], ChildTimer] = {}
_SHARED_LOCK = threading.Lock()


def shared_timer(backend: str, settings: TimingSettings) -> ChildTimer:
    """The process's timer for ``backend`` and ``settings``: every measurer of the process (one per workload)
    times through one child, so one CUDA context and one set of buffers serve them all, and batches from
    concurrent searches run one after another instead of disturbing each other's timings."""
    with _SHARED_LOCK:
        timer = _SHARED.get((backend, settings))
        if timer is None:
            timer = _SHARED[(backend, settings)] = ChildTimer(backend, settings)
        return timer
