"""Runtime API: register the custom-op library with ONNX Runtime, and the C core through ctypes.

``register(sess_options)`` and ``InferenceSession(model)`` are what a deployment calls; ``Core`` exposes the
library's C ABI (bundle parsing, dispatch, image choice, CUDA probe and launch) for tests, the doctor and
code that drives kernels without a session.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from dietcode_ort.build import C_ABI_VERSION, library_path
from dietcode_ort.errors import DietcodeError

if TYPE_CHECKING:
    from dietcode_ort.bundle import Bundle, BundleKernel

__all__ = ["register", "InferenceSession", "provider_usable", "node_stats", "reset_node_stats", "Core",
           "CoreBundle", "LaunchArgs", "KernelMeta", "load_core"]


_REGISTERED_KEY = "dietcode_ort.library"  # session config entry marking options that carry the library
_log = logging.getLogger(__name__)


def register(sess_options: Any, build: bool = True) -> Path:
    """Build/locate the library and register its ops (domain ai.dietcode) with ``sess_options``.

    Idempotent per SessionOptions: options that already carry the library (registered here before, for
    reused options) are left as they are, since ORT refuses a second registration of the domain."""
    registered = _registered_library(sess_options)
    if registered is not None:
        return registered
    path = library_path(build=build)
    sess_options.register_custom_ops_library(str(path))
    sess_options.add_session_config_entry(_REGISTERED_KEY, str(path))
    _note_library(path)
    return path


_LIBRARIES: list[Path] = []  # the libraries this process registered or loaded, in order


def _note_library(path: Path) -> None:
    """Warn when this process uses a second copy of the library (``DIETCODE_ORT_LIBRARY`` changed, or custom_ops/
    edited in a checkout, since the first): each copy keeps its own bundles and counters, so ``node_stats()``,
    which reads the first the process loaded through ``load_core``, would count some sessions only."""
    if path in _LIBRARIES:
        return
    _LIBRARIES.append(path)
    if len(_LIBRARIES) > 1:
        _log.warning("this process now uses the custom-op library %s as well as %s (DIETCODE_ORT_LIBRARY changed, "
                     "or custom_ops/ was edited, since the first was loaded): each copy counts its own calls, so "
                     "node_stats() counts the sessions of %s only", path, _LIBRARIES[0],
                     _CORE.path if _CORE is not None else "the first library it loads")


def _registered_library(sess_options: Any) -> Path | None:
    try:
        value = sess_options.get_session_config_entry(_REGISTERED_KEY)
    except Exception:  # ORT raises when the key was never set
        return None
    return Path(value) if value else None


_USABLE: dict[str, bool] = {}
_USABLE_LOCK = threading.Lock()


def _provider_name(provider: Any) -> str:
    """A ``providers`` entry's name: the entry, or the first item of a (name, options) pair."""
    return provider[0] if isinstance(provider, (tuple, list)) else str(provider)


def provider_usable(provider: Any) -> bool:
    """Whether ONNX Runtime can really create ``provider`` (a name or (name, options)) on this machine:
    ``get_available_providers`` lists every provider the build has, even when its libraries (CUDA,
    cuDNN) are missing. Answered by a one-node session's ``get_providers()``, once per process."""
    import onnxruntime as ort

    name = _provider_name(provider)
    if name == "CPUExecutionProvider":
        return True
    if name not in ort.get_available_providers():
        return False
    key = repr(provider)
    with _USABLE_LOCK:
        if key not in _USABLE:
            from onnx import TensorProto, helper

            x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
            y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
            graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
            opts = ort.SessionOptions()
            opts.log_severity_level = 4  # the failure is the answer, not something to print
            try:
                with _native_stderr_discarded():  # ORT's default logger reports a provider library's failure
                    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                                providers=[provider, "CPUExecutionProvider"])
                _USABLE[key] = name in sess.get_providers()
            except Exception:  # noqa: BLE001 - a provider that cannot start is unusable
                _USABLE[key] = False
        return _USABLE[key]


@contextlib.contextmanager
def _native_stderr_discarded() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null while the block runs: what native code prints there is dropped
    (ORT writes a provider library that fails to load through its default logger, not the session's)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2: nothing to hide
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def library_needed(providers: Sequence[Any]) -> bool:
    """Whether a session on ``providers`` should run the library's kernels.

    Only GPU providers run dietcode kernels. On a CPU-only session the library is left out on purpose:
    ORT then inlines each node's model-local function (the original MatMul/Gemm/Conv and epilogue) and
    applies its usual fusions and weight prepacking, which is as fast as the original model; the library's
    CPU kernel (ORT's kernel called per node, plus the epilogue) is there for CPU nodes of GPU sessions and
    for models whose custom nodes have no fallback function.
    """
    names = [p[0] if isinstance(p, (tuple, list)) else str(p) for p in providers]
    return any(n != "CPUExecutionProvider" for n in names)


def _ort_format(model: Any) -> bool:
    """Whether ``model`` (bytes or a path) is an ORT-format model (``.ort``, from onnxruntime's
    ``convert_onnx_models_to_ort``): a flatbuffer whose file identifier, bytes 4 to 8, is ``ORTM``."""
    if isinstance(model, bytes):
        return model[4:8] == b"ORTM"
    try:
        with open(model, "rb") as fh:
            return fh.read(8)[4:8] == b"ORTM"
    except (OSError, TypeError):
        return False  # the ONNX reader names the problem


def _has_fallback(model: Any) -> bool:
    """Whether every ai.dietcode op type the model uses has a model-local function ORT can run instead (never for
    an ORT-format model: one converted with the library registered keeps the custom nodes without their functions,
    one converted without it has no custom node, so the library is registered for both).
    DietcodeError naming the file for a missing or unreadable model (as the CLI's commands say it)."""
    import onnx

    if _ort_format(model):
        return False
    if isinstance(model, bytes):
        try:
            proto = onnx.load_model_from_string(model)
        except Exception as exc:  # protobuf's DecodeError, onnx's own errors
            raise DietcodeError(f"the model bytes are not a readable ONNX model ({type(exc).__name__}: {exc})") \
                from None
    else:
        from dietcode_ort.inspect_model import load_optimized

        proto = load_optimized(model)  # inspect's reading, with its errors
    from dietcode_ort.bundle import dietcode_nodes

    functions = {(f.domain, f.name) for f in proto.functions}
    return all((n.domain, n.op_type) in functions for n in (d.node for d in dietcode_nodes(proto)))


def InferenceSession(path_or_bytes: Any, sess_options: Any = None, providers: Sequence[Any] | None = None,
                     provider_options: Sequence[dict] | None = None, **kwargs: Any) -> Any:
    """An ``onnxruntime.InferenceSession`` for an optimized model, with ORT's signature (a drop-in for it).

    ``path_or_bytes`` is a path, serialized bytes or an ``onnx.ModelProto``; ``providers`` defaults to CUDA then CPU
    when the CUDA provider can really be created (not merely listed), else CPU. The ai.dietcode ops are
    registered when the session really runs on a GPU provider (see ``library_needed``; a GPU provider ORT
    cannot start is dropped, since ORT would fall back to the CPU) or when a custom node has no fallback
    function; call ``register(sess_options)`` to register them in any case. Reused options that already
    carry the library through ``register`` are fine (options given it by ORT's own
    ``register_custom_ops_library`` are refused with a DietcodeError when the session needs the library: ORT
    takes no second registration). A ``provider_options`` list (ORT's, parallel to ``providers``) loses the
    entries of the providers dropped.
    """
    import onnxruntime as ort

    model = path_or_bytes
    if provider_options is not None:
        kwargs["provider_options"] = provider_options
    opts = sess_options if sess_options is not None else ort.SessionOptions()
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif isinstance(model, Path):
        model = str(model)
    asked = providers is not None
    if providers is None:
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    requested = list(providers)
    kept = [i for i, p in enumerate(requested) if provider_usable(p)]
    available = ort.get_available_providers()
    unknown = [_provider_name(p) for p in requested if _provider_name(p) not in available] if asked else []
    if unknown:  # a misspelled name, which ORT warns about too; one listed but unable to start is dropped quietly
        _log.warning(
            "provider(s) %s: not among this onnxruntime's (%s), left out", ", ".join(unknown), ", ".join(available))
    providers = [requested[i] for i in kept] or ["CPUExecutionProvider"]
    options = kwargs.get("provider_options")
    if options is not None and len(options) == len(requested):  # ORT's list parallel to providers: in step
        kwargs["provider_options"] = [options[i] for i in kept] or [{}]
    registered = library_needed(providers) or not _has_fallback(model)
    registered_here = registered and _registered_library(opts) is None
    if registered:
        register(opts)
    try:
        sess = ort.InferenceSession(model, sess_options=opts, providers=list(providers), **kwargs)
    except Exception as exc:  # ORT raises its own exception types; keep them but make the cause visible
        if registered_here and "Domain already set" in str(exc):
            raise DietcodeError(
                "the session options already carry a custom-op library with the ai.dietcode domain (registered with "
                "register_custom_ops_library), and ORT takes no second one: pass them to onnxruntime.InferenceSession, "
                "or register the library with dietcode_ort.register(options), which this function recognizes") from exc
        if "ai.dietcode" in str(exc):
            raise DietcodeError(f"cannot create the session: {exc}") from exc
        raise
    if registered and library_needed(providers) and not library_needed(sess.get_providers()) \
            and _has_fallback(model):
        # the GPU provider was dropped after all: the fallback functions beat the library's CPU kernel
        if sess_options is None:
            if kwargs.get("provider_options") is not None:  # the CPU provider's own entry, if it had one
                cpu = [o for p, o in zip(providers, kwargs["provider_options"]) if p == "CPUExecutionProvider"]
                kwargs["provider_options"] = cpu or [{}]
            return ort.InferenceSession(model, sess_options=ort.SessionOptions(),
                                        providers=["CPUExecutionProvider"], **kwargs)
        _log.warning(
            "the session runs on %s only, not on the GPU provider asked for: the custom-op library's CPU "
            "kernel runs the ai.dietcode nodes (pass options without the library to run the model's fallback "
            "functions instead)", ", ".join(sess.get_providers()))
    return sess


class LaunchArgs(ctypes.Structure):
    """Mirror of ``dc_launch_args`` in custom_ops/core.h."""

    _fields_ = [(n, ctypes.c_uint64) for n in ("a", "b", "bias", "c", "residual", "c_bytes")] + [
        (n, ctypes.c_int32) for n in ("M", "N", "K", "batch", "stride_a_batch", "stride_b_batch",
                                      "img_n", "img_h", "img_w", "out_h", "out_w")] + [
        (n, ctypes.c_uint64) for n in ("q", "k", "v", "mask", "out")] + [
        (n, ctypes.c_int32) for n in ("seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h", "stride_mask_q",
                                      "stride_mask_k")] + [
        (n, ctypes.c_uint64) for n in ("workspace", "workspace_bytes")] + [("sm_count", ctypes.c_int32),
                                                                          ("head_dim", ctypes.c_int32)]


class KernelMeta(ctypes.Structure):
    """Mirror of ``dc_kernel_meta`` in custom_ops/core.h."""

    _fields_ = [(n, ctypes.c_uint32) for n in ("num_warps", "block_m", "block_n", "split_k", "shared", "div16",
                                              "n_params", "n_images")] + [("params", ctypes.c_uint8 * 32)]


class Epilogue(ctypes.Structure):
    """Mirror of ``dc_epilogue`` in custom_ops/vendor.h: the vendor path's bias, activation and residual over
    the output as [rows, cols] (residual_first: the residual before the activation; residual_mul: multiplied
    after it)."""

    _fields_ = ([(n, ctypes.c_int32) for n in ("dtype", "has_bias", "activation", "has_residual", "residual_first",
                                               "residual_mul")]
                + [("bias_scale", ctypes.c_float)]
                + [(n, ctypes.c_int64) for n in ("rows", "cols", "bias_rows", "bias_rs", "bias_cs")])


class GemmPlan(ctypes.Structure):
    """Mirror of ``dc_gemm_plan``: a node call as one column-major cuBLAS call (first operand x = the node's
    B, second y = its A) plus its epilogue."""

    _fields_ = ([(n, ctypes.c_int32) for n in ("trans_x", "trans_y", "m", "n", "k", "ldx", "ldy", "ldc")]
                + [(n, ctypes.c_int64) for n in ("stride_x", "stride_y", "stride_c")]
                + [(n, ctypes.c_int32) for n in ("batch", "data_type", "compute_type")] + [("alpha", ctypes.c_float)]
                + [("epilogue", Epilogue)])


class GemmLt(ctypes.Structure):
    """Mirror of ``dc_gemm_lt``: a planned call as one cublasLtMatmul with its epilogue fused
    (``cublasLtEpilogue_t``), the bias as the epilogue's bias pointer, the residual as C with beta 1."""

    _fields_ = [(n, ctypes.c_int32) for n in ("epilogue", "has_bias", "residual_c")] + [("beta", ctypes.c_float)]


class ConvPlan(ctypes.Structure):
    """Mirror of ``dc_conv_plan``: a Conv call as one cuDNN convolution plus its epilogue."""

    _fields_ = [(n, ctypes.c_int32) for n in (
        "n", "c", "h", "w", "k", "kc", "kh", "kw", "group", "pad_h", "pad_w", "stride_h", "stride_w", "dil_h",
        "dil_w", "out_h", "out_w", "data_type", "math_type", "channels_last")] + [("epilogue", Epilogue)]


class ConvAlgo(ctypes.Structure):
    """Mirror of ``dc_conv_algo``: the cuDNN forward algorithm a conv plan runs with and its workspace."""

    _fields_ = [("algo", ctypes.c_int32), ("from_heuristic", ctypes.c_int32), ("math_type", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("workspace_bytes", ctypes.c_uint64)]


CONV_WORKSPACE_CAP = 256 << 20  # DC_CONV_WORKSPACE_CAP (custom_ops/vendor.h)


class ConvAlgoCache:
    """A node's per-shape algorithm choices (``dc_conv_algo_cache``), freed with the object."""

    def __init__(self, core: "Core") -> None:
        self.lib = core.lib
        self.handle = core.lib.dc_conv_algo_cache_new()

    @property
    def queries(self) -> int:
        """How many heuristic queries it has made: one per distinct shape."""
        return int(self.lib.dc_conv_algo_cache_queries(self.handle))

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.dc_conv_algo_cache_free(self.handle)
            self.handle = None


class Core:
    """ctypes binding of the library's C core (custom_ops/core.h)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        vp, i32, i64p = ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)
        lib.dc_abi_version.restype = ctypes.c_int
        lib.dc_abi_param_name.restype = ctypes.c_char_p
        lib.dc_abi_param_name.argtypes = [ctypes.c_int]
        lib.dc_last_error.restype = ctypes.c_char_p
        lib.dc_bundle_parse.restype = vp
        lib.dc_bundle_parse.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.dc_bundle_free.argtypes = [vp]
        lib.dc_bundle_acquire.restype = vp
        lib.dc_bundle_acquire.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.dc_bundle_release.argtypes = [vp]
        lib.dc_bundle_cache_stats.argtypes = [i64p, i64p]
        lib.dc_bundle_info.argtypes = [vp, ctypes.POINTER(i32), ctypes.POINTER(i32), ctypes.POINTER(i32)]
        lib.dc_bundle_select.restype = i32
        lib.dc_bundle_select.argtypes = [vp, i64p, ctypes.c_size_t]
        lib.dc_bundle_features.argtypes = [vp, ctypes.POINTER(i64p), ctypes.POINTER(ctypes.c_size_t),
                                           ctypes.c_size_t, i64p]
        lib.dc_bundle_kernel_is_vendor.argtypes = [vp, i32]
        lib.dc_bundle_max_feature_input.argtypes = [vp]
        lib.dc_bundle_kernel_takes_param.argtypes = [vp, i32, ctypes.c_char_p]
        lib.dc_bundle_kernel_view.argtypes = [vp, i32]
        lib.dc_bundle_pick_image.argtypes = [vp, i32, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.dc_cuda_probe.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int),
                                      ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.dc_launch.argtypes = [vp, i32, ctypes.POINTER(LaunchArgs), vp]
        lib.dc_kernel_accepts.argtypes = [vp, i32, ctypes.POINTER(LaunchArgs)]
        lib.dc_node_stats_count.restype = ctypes.c_int64
        lib.dc_node_stats_get.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t, i64p, i64p,
                                          ctypes.c_char_p, ctypes.c_size_t]
        lib.dc_kernel_fit.argtypes = [vp, i32, ctypes.POINTER(LaunchArgs)]
        lib.dc_kernel_workspace_bytes.restype = ctypes.c_int64
        lib.dc_kernel_workspace_bytes.argtypes = [vp, i32, ctypes.POINTER(LaunchArgs)]
        lib.dc_kernel_grid.argtypes = [vp, i32, ctypes.POINTER(LaunchArgs), ctypes.POINTER(ctypes.c_uint32)]
        lib.dc_cuda_sm_count.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
        lib.dc_fit_name.restype = ctypes.c_char_p
        lib.dc_bundle_image_shared.restype = ctypes.c_int64
        lib.dc_bundle_image_shared.argtypes = [vp, i32, ctypes.c_int, ctypes.c_int]
        lib.dc_kernel_fit_device.argtypes = [vp, i32, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.dc_bundle_fit_device.argtypes = [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                             ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t]
        lib.dc_bundle_image_count.argtypes = [vp, i32]
        lib.dc_bundle_image_toolchain.argtypes = [vp, i32, i32, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                                  ctypes.c_size_t, ctypes.POINTER(i32), ctypes.POINTER(i32)]
        lib.dc_bundle_image_scratch.argtypes = [vp, i32, i32, ctypes.POINTER(ctypes.c_uint32),
                                                ctypes.POINTER(ctypes.c_uint32)]
        lib.dc_kernel_scratch_pointer.argtypes = [vp, i32, i32, ctypes.POINTER(LaunchArgs),
                                                  ctypes.POINTER(ctypes.c_uint64)]
        lib.dc_cuda_driver_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.dc_cuda_device_limits.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3
        lib.dc_fit_name.argtypes = [ctypes.c_int]
        lib.dc_bench_select.argtypes = [vp, ctypes.POINTER(i64p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                        ctypes.POINTER(LaunchArgs), ctypes.c_int64, ctypes.POINTER(i32),
                                        ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_double)]
        lib.dc_bundle_check_node.argtypes = [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64p,
                                             ctypes.c_int, ctypes.c_int]
        lib.dc_bundle_check_scale.argtypes = [vp, ctypes.c_float]
        sz, fp = ctypes.c_size_t, ctypes.POINTER(ctypes.c_float)
        lib.dc_abi_view.argtypes = [ctypes.c_int, i64p, sz, i64p, sz, i64p, sz, i64p, sz, fp, sz, ctypes.c_int,
                                    ctypes.POINTER(LaunchArgs)]
        lib.dc_attention_view.argtypes = [i64p, sz, i64p, sz, i64p, sz, i64p, sz, ctypes.c_int64,
                                          ctypes.POINTER(LaunchArgs)]
        lib.dc_attention_view_layout.argtypes = [i64p, sz, i64p, sz, i64p, sz, i64p, sz, ctypes.c_int64,
                                                 ctypes.c_int, i64p, ctypes.POINTER(LaunchArgs)]
        lib.dc_bundle_check_attention.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        _bind_reading(lib)
        _bind_vendor(lib)
        self.lib = lib
        if lib.dc_abi_version() != C_ABI_VERSION:
            raise DietcodeError(f"{path} has C ABI version {lib.dc_abi_version()}, this package expects "
                                f"{C_ABI_VERSION}")

    def error(self) -> str:
        return (self.lib.dc_last_error() or b"").decode(errors="replace")

    def parse(self, data: bytes) -> "CoreBundle":
        """Parse a payload in C++; DietcodeError with the C++ reader's message when it is refused."""
        handle = self.lib.dc_bundle_parse(data, len(data))
        if not handle:
            raise DietcodeError(self.error())
        return CoreBundle(self, handle)

    def cache_stats(self) -> tuple[int, int]:
        """The shared bundle cache the custom ops use (``dc_bundle_acquire``): (distinct bundles alive now,
        parses since the library loaded). A session whose nodes share a bundle adds one parse for it."""
        live, parses = ctypes.c_int64(), ctypes.c_int64()
        self.lib.dc_bundle_cache_stats(ctypes.byref(live), ctypes.byref(parses))
        return live.value, parses.value

    def abi_view(self, op: str, a: Sequence[int], b: Sequence[int], c: Sequence[int] | None = None, *,
                 ints: Sequence[int] = (), floats: Sequence[float] = (), batched: bool = False,
                 channels_last: bool = False) -> LaunchArgs | None:
        """The launch arguments the CUDA path gives a compiled kernel for a node call with these input
        shapes (``dc_abi_view``); None when ORT's own kernel runs that call instead. ``channels_last`` (Conv
        only): a, b are NHWC X and [OC, KH, KW, C] W, passed as the 10th int after the 9 of ``ints``."""
        ops = {"MatMul": 0, "Gemm": 1, "Conv": 2}
        if op not in ops:
            raise DietcodeError(f"abi_view: op {op!r}, allowed: {', '.join(ops)}")
        if channels_last:
            if op != "Conv":
                raise DietcodeError("abi_view: channels_last applies to Conv only")
            ints = (*ints, 1)
        arr = lambda v, t=ctypes.c_int64: (t * max(1, len(v)))(*v)  # noqa: E731
        out = LaunchArgs()
        r = self.lib.dc_abi_view(ops[op], arr(a), len(a), arr(b), len(b), arr(c) if c is not None else None,
                                 len(c) if c is not None else 0, arr(ints), len(ints), arr(floats, ctypes.c_float),
                                 len(floats), int(batched), ctypes.byref(out))
        if r < 0:
            raise DietcodeError(self.error())
        return out if r == 1 else None

    def attention_view(self, q: Sequence[int], kt: Sequence[int], v: Sequence[int],
                       mask: Sequence[int] | None = None, head_dim: int = 0, layout: int = 0,
                       out_shape: list[int] | None = None) -> LaunchArgs | None:
        """The launch arguments of an Attention call with these input shapes (``dc_attention_view_layout``):
        seq_q, seq_k, heads, batch (= batch x heads) and the mask strides; None when the ABI cannot express the
        call (the reason in ``error()``). DietcodeError for invalid shapes. ``layout``: the node's operand
        layouts (tuner.attention.LAYOUT_BITS; the shapes are its inputs as given). ``out_shape`` (a list) receives
        the node's output shape for rank-4 inputs (or the packed layout's rank-3 projection), also when the call
        cannot be expressed."""
        arr = lambda s: (ctypes.c_int64 * max(1, len(s)))(*s)  # noqa: E731
        out = LaunchArgs()
        shape = (ctypes.c_int64 * 4)()
        r = self.lib.dc_attention_view_layout(arr(q), len(q), arr(kt), len(kt), arr(v), len(v),
                                              arr(mask) if mask is not None else None,
                                              len(mask) if mask is not None else 0, head_dim, layout, shape,
                                              ctypes.byref(out))
        if out_shape is not None and (len(q) == 4 or layout & 16):  # rank 4, or the packed projection's output
            out_shape[:] = list(shape)
        if r < 0:
            raise DietcodeError(self.error())
        return out if r == 1 else None

    def gemm_plan(self, op: str, a: Sequence[int], b: Sequence[int], c: Sequence[int] | None = None, *,
                  trans_a: bool = False, trans_b: bool = False, alpha: float = 1.0, beta: float = 1.0,
                  dtype: str = "float32", activation: str = "none", tf32: bool = True) -> GemmPlan | None:
        """The vendor path's cuBLAS call for a MatMul/Gemm node call (``dc_gemm_plan_make``); None when the
        call has no cuBLAS form there (the reason in ``error()``). DietcodeError for invalid shapes."""
        from dietcode_ort.bundle import ACTIVATION_CODES as acts, DTYPE_CODES as dtypes

        ops = {"MatMul": 0, "Gemm": 1}
        if op not in ops or dtype not in dtypes or activation not in acts:
            raise DietcodeError(f"gemm_plan: op {op!r} (MatMul, Gemm), dtype {dtype!r} ({', '.join(dtypes)}), "
                                f"activation {activation!r} ({', '.join(acts)})")
        arr = lambda v: (ctypes.c_int64 * max(1, len(v)))(*v)  # noqa: E731
        out = GemmPlan()
        r = self.lib.dc_gemm_plan_make(ops[op], arr(a), len(a), arr(b), len(b), arr(c) if c is not None else None,
                                       len(c) if c is not None else 0, int(trans_a), int(trans_b), alpha, beta,
                                       dtypes.index(dtype), acts.index(activation), int(tf32), ctypes.byref(out))
        if r < 0:
            raise DietcodeError(self.error())
        return out if r == 1 else None

    def conv_plan(self, x: Sequence[int], w: Sequence[int], b: Sequence[int] | None = None, *,
                  strides: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                  dilations: Sequence[int] = (1, 1), group: int = 1, auto_pad: str = "NOTSET",
                  dtype: str = "float32", activation: str = "none", tf32: bool = True,
                  channels_last: bool = False) -> ConvPlan | None:
        """The vendor path's cuDNN call for a 2-D Conv node call (``dc_conv_plan_make``); None when the call
        has no cuDNN form there (the reason in ``error()``). DietcodeError for invalid shapes. ``channels_last``:
        x [N, H, W, C], w [OC, KH, KW, C] (group 1), cuDNN's NHWC formats, B indexed per output column."""
        from dietcode_ort.bundle import ACTIVATION_CODES as acts, DTYPE_CODES as dtypes

        pads_modes = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
        if auto_pad not in pads_modes or dtype not in dtypes or activation not in acts:
            raise DietcodeError(f"conv_plan: auto_pad {auto_pad!r} ({', '.join(pads_modes)}), dtype {dtype!r}, "
                                f"activation {activation!r}")
        arr = lambda v: (ctypes.c_int64 * max(1, len(v)))(*v)  # noqa: E731
        out = ConvPlan()
        r = self.lib.dc_conv_plan_make(arr(x), len(x), arr(w), len(w), arr(b) if b is not None else None,
                                       len(b) if b is not None else 0, arr(strides), arr(pads), arr(dilations), group,
                                       pads_modes.index(auto_pad), dtypes.index(dtype), acts.index(activation),
                                       int(tf32), int(channels_last), ctypes.byref(out))
        if r < 0:
            raise DietcodeError(self.error())
        return out if r == 1 else None

    def vendor_cudnn_load(self, path: str | Path | None = None) -> None:
        """Point the vendor path at a cuDNN: None = the one this process loaded (ONNX Runtime's CUDA EP)."""
        if self.lib.dc_vendor_cudnn_load(None if path is None else str(path).encode()) != 0:
            raise DietcodeError(self.error())

    def vendor_conv_algo(self, plan: ConvPlan, handle: int, cache: ConvAlgoCache | None = None,
                         cap: int = CONV_WORKSPACE_CAP) -> tuple[ConvAlgo, str]:
        """The algorithm a plan runs with (``dc_vendor_conv_algo``) and, for the IMPLICIT_GEMM fallback, why
        ("" when cuDNN's heuristic chose it). DietcodeError when no cuDNN or handle is there."""
        out = ConvAlgo()
        r = self.lib.dc_vendor_conv_algo(cache.handle if cache is not None else None, ctypes.byref(plan), handle,
                                         cap, ctypes.byref(out))
        if r < 0:
            raise DietcodeError(self.error())
        return out, "" if r == 1 else self.error()

    def vendor_conv(self, plan: ConvPlan, x: int, w: int, y: int, handle: int, stream: int = 0,
                    algo: ConvAlgo | None = None, workspace: int = 0) -> None:
        """Run a plan's convolution (``dc_vendor_conv``) on raw pointers: X, W, output, cuDNN handle, stream,
        with ``algo`` (None: IMPLICIT_GEMM) and its workspace."""
        if self.lib.dc_vendor_conv(ctypes.byref(plan), ctypes.byref(algo) if algo is not None else None,
                                   workspace or None, x, w, y, handle, stream) != 0:
            raise DietcodeError(self.error())

    def vendor_cublas_load(self, path: str | Path | None = None) -> None:
        """Point the vendor path at a cuBLAS: None = the one this process loaded (ONNX Runtime's CUDA EP)."""
        if self.lib.dc_vendor_cublas_load(None if path is None else str(path).encode()) != 0:
            raise DietcodeError(self.error())

    def vendor_gemm(self, plan: GemmPlan, a: int, b: int, c: int, handle: int, stream: int = 0) -> None:
        """Run a plan's GEMM (``dc_vendor_gemm``) on raw pointers: inputs A, B, output, cuBLAS handle, stream."""
        if self.lib.dc_vendor_gemm(ctypes.byref(plan), a, b, c, handle, stream) != 0:
            raise DietcodeError(self.error())

    def gemm_lt_plan(self, plan: GemmPlan) -> GemmLt | None:
        """The cuBLASLt form of a plan whose epilogue has its residual flags set (``dc_gemm_lt_plan``); None
        when the call keeps cuBLAS + the PTX epilogue (the reason in ``error()``)."""
        out = GemmLt()
        r = self.lib.dc_gemm_lt_plan(ctypes.byref(plan), ctypes.byref(out))
        if r < 0:
            raise DietcodeError(self.error())
        return out if r == 1 else None

    def vendor_cublaslt_load(self, path: str | Path | None = None) -> None:
        """Point the fused path at a cuBLASLt: None = the one this process loaded (ONNX Runtime's CUDA EP)."""
        if self.lib.dc_vendor_cublaslt_load(None if path is None else str(path).encode()) != 0:
            raise DietcodeError(self.error())

    def vendor_cublaslt_handle(self, stream: int) -> int:
        """The process's cuBLASLt handle for ``stream``'s CUDA context (``dc_vendor_cublaslt_handle``)."""
        handle = ctypes.c_void_p()
        if self.lib.dc_vendor_cublaslt_handle(stream or None, ctypes.byref(handle)) != 0:
            raise DietcodeError(self.error())
        return handle.value or 0

    def vendor_gemm_lt(self, plan: GemmPlan, lt: GemmLt, a: int, b: int, d: int, *, bias: int = 0,
                       residual: int = 0, handle: int, stream: int = 0, workspace: int = 0,
                       workspace_bytes: int = 0) -> None:
        """Run a plan as one cublasLtMatmul (``dc_vendor_gemm_lt``) on raw pointers: A, B, the output, the bias,
        the residual, a workspace, on a cuBLASLt handle and stream."""
        if self.lib.dc_vendor_gemm_lt(ctypes.byref(plan), ctypes.byref(lt), a, b, d, bias or None, residual or None,
                                      workspace or None, workspace_bytes, handle, stream or None) != 0:
            raise DietcodeError(self.error())

    def vendor_gemm_call(self, plan: GemmPlan, lt: GemmLt | None, a: int, b: int, c: int, *, bias: int = 0,
                         residual: int = 0, handle: int, lt_handle: int = 0, stream: int = 0, workspace: int = 0,
                         workspace_bytes: int = 0) -> tuple[bool, str]:
        """The GEMM part of a node call as the CUDA EP runs it (``dc_vendor_gemm_call``): the fused cuBLASLt call
        when ``lt`` is given and it succeeds, else cuBLAS. (fused, why the fused call was not taken)."""
        r = self.lib.dc_vendor_gemm_call(ctypes.byref(plan), ctypes.byref(lt) if lt is not None else None, a, b, c,
                                         bias or None, residual or None, handle, lt_handle or None, workspace or None,
                                         workspace_bytes, stream or None)
        if r < 0:
            raise DietcodeError(self.error())
        return r == 1, "" if r == 1 else self.error()

    def vendor_lt_stats(self) -> tuple[int, int]:
        """Process-wide (fused cuBLASLt calls run, heuristic queries made)."""
        calls, queries = ctypes.c_int64(), ctypes.c_int64()
        self.lib.dc_vendor_lt_stats(ctypes.byref(calls), ctypes.byref(queries))
        return calls.value, queries.value

    def vendor_epilogue_ptx(self, dtype: str) -> str:
        """The vendor epilogue kernel's PTX for float32, float16 or bfloat16."""
        dtypes = ("float32", "float16", "bfloat16")
        if dtype not in dtypes:
            raise DietcodeError(f"vendor_epilogue_ptx: dtype {dtype!r}, allowed: {', '.join(dtypes)}")
        return bytes(self.lib.dc_vendor_epilogue_ptx(dtypes.index(dtype))).decode()

    def node_stats(self) -> dict[str, dict[str, Any]]:
        """Per node name, process-wide: ``launches`` of compiled (Triton) kernels, ``fallbacks`` to ONNX
        Runtime's kernel (every call of the library's CPU kernel is one) and the last fallback ``reason``.
        Nodes with no call since the last reset are left out."""
        out: dict[str, dict[str, Any]] = {}
        for i in range(self.lib.dc_node_stats_count()):
            name, reason = ctypes.create_string_buffer(1024), ctypes.create_string_buffer(1024)
            launches, fallbacks = ctypes.c_int64(), ctypes.c_int64()
            size = self.lib.dc_node_stats_get(i, name, 1024, ctypes.byref(launches), ctypes.byref(fallbacks),
                                              reason, 1024)
            if size < 0:
                continue
            if size >= 1024:  # a longer name than the buffer: read it again in full
                name = ctypes.create_string_buffer(size + 1)
                self.lib.dc_node_stats_get(i, name, size + 1, None, None, None, 0)
            if launches.value or fallbacks.value:
                out[name.value.decode(errors="replace")] = {
                    "launches": launches.value, "fallbacks": fallbacks.value,
                    "reason": reason.value.decode(errors="replace")}
        return out

    def cuda_probe(self, device: int = 0) -> dict[str, Any]:
        """libcuda + cuInit + device name and compute capability; DietcodeError when any is missing."""
        name = ctypes.create_string_buffer(256)
        major, minor, drv = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if self.lib.dc_cuda_probe(device, name, 256, ctypes.byref(major), ctypes.byref(minor), ctypes.byref(drv)):
            raise DietcodeError(self.error())
        return {"name": name.value.decode(errors="replace"), "major": major.value, "minor": minor.value,
                "driver_version": drv.value}

    def driver_version(self) -> int:
        """The CUDA driver's version (cuDriverGetVersion: 13000 = 13.0); DietcodeError when libcuda does not
        load (a machine without the NVIDIA driver)."""
        version = ctypes.c_int()
        if self.lib.dc_cuda_driver_version(ctypes.byref(version)):
            raise DietcodeError(self.error())
        return version.value

    def sm_count(self, stream: int | None = None) -> int:
        """The multiprocessor count of ``stream``'s device (None: the current context's), which sizes persistent
        kernels' grids (``dc_cuda_sm_count``, cached per context); DietcodeError without a driver or context."""
        count = ctypes.c_int()
        if self.lib.dc_cuda_sm_count(stream, ctypes.byref(count)):
            raise DietcodeError(self.error())
        return count.value


def _bind_reading(lib: ctypes.CDLL) -> None:
    """Signatures of the reading accessors (custom_ops/bundle_read.cc)."""
    vp, i32, i32p, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t
    for name in ("dc_bundle_feature_name", "dc_bundle_kernel_name"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [vp, i32]
    lib.dc_bundle_feature_terms.argtypes = [vp, i32, i32p, i32p, sz]
    lib.dc_bundle_tree.argtypes = [vp, i32p, ctypes.POINTER(ctypes.c_int64), i32p, i32p, i32p, sz]
    lib.dc_bundle_kernel_meta.argtypes = [vp, i32, ctypes.POINTER(KernelMeta)]
    lib.dc_bundle_kernel_image.restype = ctypes.c_void_p
    u32p = ctypes.POINTER(ctypes.c_uint32)
    lib.dc_bundle_kernel_image.argtypes = [vp, i32, i32, u32p, i32p, u32p, ctypes.POINTER(sz)]
    lib.dc_bundle_kernel_ptx.restype = ctypes.c_void_p
    lib.dc_bundle_kernel_ptx.argtypes = [vp, i32, ctypes.POINTER(sz)]
    lib.dc_bundle_kernel_built_for.argtypes = [vp, i32, i32p, i32p, i32p, i32p]
    lib.dc_bundle_kernel_alpha.argtypes = [vp, i32, ctypes.POINTER(ctypes.c_float)]
    lib.dc_bundle_kernel_causal.argtypes = [vp, i32]
    lib.dc_bundle_kernel_tf32.argtypes = [vp, i32]
    lib.dc_bundle_kernel_layout.argtypes = [vp, i32]
    lib.dc_bundle_kernel_layout.restype = i32
    lib.dc_bundle_kernel_persistent.argtypes = [vp, i32]
    lib.dc_bundle_kernel_persistent.restype = i32
    lib.dc_bundle_kernel_residual_first.argtypes = [vp, i32]
    lib.dc_bundle_kernel_residual_first.restype = i32
    lib.dc_bundle_kernel_attention.argtypes = [vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32), ctypes.POINTER(i32)]
    lib.dc_bundle_kernel_attention.restype = i32
    lib.dc_bundle_kernel_residual_mul.argtypes = [vp, i32]
    lib.dc_bundle_kernel_residual_mul.restype = i32
    lib.dc_bundle_kernel_grouped.argtypes = [vp, i32]
    lib.dc_bundle_kernel_grouped.restype = i32
    lib.dc_bundle_kernel_channels_last.argtypes = [vp, i32]
    lib.dc_bundle_kernel_channels_last.restype = i32


def _bind_vendor(lib: Any) -> None:
    """Signatures of the vendor path's C functions (custom_ops/vendor.h)."""
    vp, i64p, sz, ci = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_int
    lib.dc_gemm_plan_make.argtypes = [ci, i64p, sz, i64p, sz, i64p, sz, ci, ci, ctypes.c_float, ctypes.c_float,
                                      ci, ci, ci, ctypes.POINTER(GemmPlan)]
    lib.dc_vendor_cublas_load.argtypes = [ctypes.c_char_p]
    lib.dc_vendor_gemm.argtypes = [ctypes.POINTER(GemmPlan), vp, vp, vp, vp, vp]
    lib.dc_gemm_lt_plan.argtypes = [ctypes.POINTER(GemmPlan), ctypes.POINTER(GemmLt)]
    lib.dc_vendor_cublaslt_load.argtypes = [ctypes.c_char_p]
    lib.dc_vendor_cublaslt_handle.argtypes = [vp, ctypes.POINTER(vp)]
    lib.dc_vendor_gemm_lt.argtypes = [ctypes.POINTER(GemmPlan), ctypes.POINTER(GemmLt), vp, vp, vp, vp, vp, vp,
                                      ctypes.c_uint64, vp, vp]
    lib.dc_vendor_gemm_call.argtypes = [ctypes.POINTER(GemmPlan), ctypes.POINTER(GemmLt), vp, vp, vp, vp, vp, vp, vp,
                                        vp, ctypes.c_uint64, vp]
    lib.dc_vendor_lt_stats.restype = None
    lib.dc_vendor_lt_stats.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    lib.dc_vendor_epilogue_ptx.restype = ctypes.c_char_p
    lib.dc_vendor_epilogue_ptx.argtypes = [ci]
    lib.dc_conv_plan_make.argtypes = [i64p, sz, i64p, sz, i64p, sz, i64p, i64p, i64p, ctypes.c_int64, ci, ci, ci,
                                      ci, ci, ctypes.POINTER(ConvPlan)]
    lib.dc_vendor_cudnn_load.argtypes = [ctypes.c_char_p]
    lib.dc_vendor_conv.argtypes = [ctypes.POINTER(ConvPlan), ctypes.POINTER(ConvAlgo), vp, vp, vp, vp, vp, vp]
    lib.dc_vendor_conv_algo.argtypes = [vp, ctypes.POINTER(ConvPlan), vp, ctypes.c_uint64,
                                        ctypes.POINTER(ConvAlgo)]
    lib.dc_conv_algo_cache_new.restype = vp
    lib.dc_conv_algo_cache_free.argtypes = [vp]
    lib.dc_conv_algo_cache_queries.restype = ctypes.c_int64
    lib.dc_conv_algo_cache_queries.argtypes = [vp]


class CoreBundle:
    """A bundle parsed by the C++ core (freed with the object)."""

    def __init__(self, core: Core, handle: int) -> None:
        self.core, self.handle = core, handle
        nf, nk, nn = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        core.lib.dc_bundle_info(handle, ctypes.byref(nf), ctypes.byref(nk), ctypes.byref(nn))
        self.n_features, self.n_kernels, self.n_nodes = nf.value, nk.value, nn.value

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.core.lib.dc_bundle_free(self.handle)
            self.handle = 0

    def select(self, features: Sequence[int]) -> int:
        arr = (ctypes.c_int64 * max(1, len(features)))(*features)
        k = self.core.lib.dc_bundle_select(self.handle, arr, len(features))
        if k < 0:
            raise DietcodeError(self.core.error())
        return int(k)

    def features(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        dims = [(ctypes.c_int64 * max(1, len(s)))(*s) for s in shapes]
        ptrs = (ctypes.POINTER(ctypes.c_int64) * max(1, len(shapes)))(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
        ranks = (ctypes.c_size_t * max(1, len(shapes)))(*[len(s) for s in shapes])
        out = (ctypes.c_int64 * max(1, self.n_features))()
        if self.core.lib.dc_bundle_features(self.handle, ptrs, ranks, len(shapes), out):
            raise DietcodeError(self.core.error())
        return list(out[:self.n_features])

    def bench_select(self, shapes: Sequence[Sequence[int]], args: LaunchArgs, n_iter: int) -> tuple[int, int, float]:
        """Time a CUDA node call's host decision (features, tree walk, vendor check, ``dc_kernel_fit``) in a C
        loop of ``n_iter`` (``dc_bench_select``): (kernel id, fit code, ns per decision)."""
        dims = [(ctypes.c_int64 * max(1, len(s)))(*s) for s in shapes]
        ptrs = (ctypes.POINTER(ctypes.c_int64) * max(1, len(shapes)))(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
        ranks = (ctypes.c_size_t * max(1, len(shapes)))(*[len(s) for s in shapes])
        k, fit, ns = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_double()
        if self.core.lib.dc_bench_select(self.handle, ptrs, ranks, len(shapes), ctypes.byref(args), n_iter,
                                         ctypes.byref(k), ctypes.byref(fit), ctypes.byref(ns)):
            raise DietcodeError(self.core.error())
        return k.value, fit.value, ns.value

    def decode(self) -> "Bundle":
        """The whole bundle as ``dietcode_ort.bundle.Bundle``, read field by field from this parse (the
        accessors of custom_ops/bundle_read.cc): Python writes bundles, the C core reads them."""
        from dietcode_ort import bundle as fmt

        lib, h = self.core.lib, self.handle
        features = []
        for j in range(self.n_features):
            cap = fmt.LIMITS["terms"]
            inputs, dims = (ctypes.c_int32 * cap)(), (ctypes.c_int32 * cap)()
            n = lib.dc_bundle_feature_terms(h, j, inputs, dims, cap)
            name = lib.dc_bundle_feature_name(h, j)
            if n < 0 or name is None:
                raise DietcodeError(self.core.error())
            features.append(fmt.Feature(name.decode(), tuple((inputs[t], dims[t]) for t in range(n))))
        kernels = [self._kernel(k) for k in range(self.n_kernels)]
        n = self.n_nodes
        feature, threshold, left, right, leaf = ((ctypes.c_int32 * n)(), (ctypes.c_int64 * n)(),
                                                 (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)())
        if lib.dc_bundle_tree(h, feature, threshold, left, right, leaf, n):
            raise DietcodeError(self.core.error())
        tree = fmt.DispatchTree(tuple(feature), tuple(threshold), tuple(left), tuple(right), tuple(leaf))
        return fmt.Bundle(tuple(features), tuple(kernels), tree)

    def _kernel(self, k: int) -> "BundleKernel":
        from dietcode_ort import bundle as fmt

        lib, h = self.core.lib, self.handle
        name, meta = lib.dc_bundle_kernel_name(h, k), KernelMeta()
        if name is None or lib.dc_bundle_kernel_meta(h, k, ctypes.byref(meta)):
            raise DietcodeError(self.core.error())
        images, image_shared = [], []
        for i in range(meta.n_images):
            cc, specific, shared, size = ctypes.c_uint32(), ctypes.c_int32(), ctypes.c_uint32(), ctypes.c_size_t()
            ptr = lib.dc_bundle_kernel_image(h, k, i, ctypes.byref(cc), ctypes.byref(specific), ctypes.byref(shared),
                                             ctypes.byref(size))
            if not ptr:
                raise DietcodeError(self.core.error())
            arch = f"sm_{cc.value}{'a' if specific.value else ''}"
            images.append((arch, ctypes.string_at(ptr, size.value)))
            image_shared.append(shared.value)
        ptx_size = ctypes.c_size_t()
        ptx = lib.dc_bundle_kernel_ptx(h, k, ctypes.byref(ptx_size))
        dtype, act, trans_b, conv = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32(), (ctypes.c_int32 * 9)()
        if not ptx or lib.dc_bundle_kernel_built_for(h, k, ctypes.byref(dtype), ctypes.byref(act),
                                                     ctypes.byref(trans_b), conv):
            raise DietcodeError(self.core.error())
        alpha = ctypes.c_float()
        if lib.dc_bundle_kernel_alpha(h, k, ctypes.byref(alpha)):
            raise DietcodeError(self.core.error())
        causal, tf32 = lib.dc_bundle_kernel_causal(h, k), lib.dc_bundle_kernel_tf32(h, k)
        layout, persistent = lib.dc_bundle_kernel_layout(h, k), lib.dc_bundle_kernel_persistent(h, k)
        residual_first, residual_mul = lib.dc_bundle_kernel_residual_first(h, k), lib.dc_bundle_kernel_residual_mul(h, k)
        grouped, channels_last = lib.dc_bundle_kernel_grouped(h, k), lib.dc_bundle_kernel_channels_last(h, k)
        if min(causal, tf32, layout, persistent, residual_first, residual_mul, grouped, channels_last) < 0:
            raise DietcodeError(self.core.error())
        head_dim, mask_rows, nan_to_zero = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        if lib.dc_bundle_kernel_attention(h, k, ctypes.byref(head_dim), ctypes.byref(mask_rows),
                                          ctypes.byref(nan_to_zero)):
            raise DietcodeError(self.core.error())
        return fmt.BundleKernel(
            name=name.decode(), kind="vendor" if self.is_vendor(k) else "triton", images=tuple(images), image_shared=tuple(image_shared),
            ptx=ctypes.string_at(ptx, ptx_size.value).decode(), params=tuple(fmt.PARAM_NAMES[p] for p in
                                                                             meta.params[:meta.n_params]),
            num_warps=meta.num_warps, shared=meta.shared, block_m=meta.block_m, block_n=meta.block_n,
            split_k=meta.split_k, causal=bool(causal), tf32=bool(tf32), layout=layout, persistent=persistent,
            residual_first=bool(residual_first), residual_mul=bool(residual_mul), head_dim=head_dim.value,
            mask_rows=bool(mask_rows.value), nan_to_zero=bool(nan_to_zero.value), grouped=bool(grouped),
            channels_last=bool(channels_last),
            div16=tuple(p for i, p in enumerate(fmt.PARAM_NAMES) if meta.div16 >> i & 1),
            dtype=fmt.DTYPE_CODES[dtype.value], activation=fmt.ACTIVATION_CODES[act.value], trans_b=bool(trans_b.value),
            conv=tuple(conv) if any(conv) else (), alpha=alpha.value, **self._toolchains(k, len(images)))

    def _toolchains(self, k: int, n_images: int) -> dict[str, Any]:
        """``image_toolchains`` and ``ptx_toolchain`` of kernel k, for ``BundleKernel`` (vendor kernels: none)."""
        from dietcode_ort import bundle as fmt

        if self.is_vendor(k):
            return {}
        chains = {c["image"]: fmt.Toolchain(c["triton"], c["ptxas"], c["ptx_isa"], c["min_driver"])
                  for c in self.image_toolchains(k)}
        scratch = {i: self.image_scratch(k, i) for i in [*range(n_images), *([-1] if -1 in chains else [])]}
        return {"image_toolchains": tuple(chains[i] for i in range(n_images)),
                "ptx_toolchain": chains.get(-1, fmt.Toolchain()),
                "image_scratch": tuple(scratch[i] for i in range(n_images)), "ptx_scratch": scratch.get(-1, (0, 1))}

    def scratch_pointer(self, k: int, image: int, args: LaunchArgs) -> int:
        """The global-scratch pointer a launch of kernel k's image ``image`` (-1: the PTX) with ``args`` passes
        (``dc_kernel_scratch_pointer``; 0 for an image without scratch)."""
        pointer = ctypes.c_uint64()
        if self.core.lib.dc_kernel_scratch_pointer(self.handle, k, image, ctypes.byref(args), ctypes.byref(pointer)):
            raise DietcodeError(self.core.error())
        return pointer.value

    def image_scratch(self, k: int, image: int) -> tuple[int, int]:
        """Kernel k's image ``image`` (-1: the PTX) global scratch per program: (bytes, alignment)."""
        size, align = ctypes.c_uint32(), ctypes.c_uint32()
        if self.core.lib.dc_bundle_image_scratch(self.handle, k, image, ctypes.byref(size), ctypes.byref(align)):
            raise DietcodeError(self.core.error())
        return size.value, align.value

    def is_vendor(self, k: int) -> bool:
        r = self.core.lib.dc_bundle_kernel_is_vendor(self.handle, k)
        if r < 0:
            raise DietcodeError(self.core.error())
        return bool(r)

    def pick_image(self, k: int, major: int, minor: int) -> tuple[str, str]:
        """("cubin", "sm_90a") or ("ptx", "sm_80"); DietcodeError when the device can run neither."""
        desc = ctypes.create_string_buffer(64)
        r = self.core.lib.dc_bundle_pick_image(self.handle, k, major, minor, desc, 64)
        if r < 0:
            raise DietcodeError(self.core.error())
        kind, arch = desc.value.decode().split()
        return kind, arch

    def check_node(self, dtype: str, op: str, activation: str = "none", trans_b: bool = False,
                   conv: Sequence[int] = (1, 1, 0, 0, 1, 1, 0, 0), explicit_pads: bool = True, group: int = 1,
                   channels_last: bool = False) -> None:
        """Whether the compiled kernels fit a node (what the CUDA path checks at session creation);
        DietcodeError naming the first that does not. ``conv``: strides h, w, pads top, left, dilations
        h, w, kernel_shape h, w (0 = not given); ``group``: the Conv's (above 1, only kernels compiled for a
        grouped conv fit); ``channels_last``: the node's attribute (every compiled kernel's flag must equal it)."""
        from dietcode_ort.bundle import ACTIVATION_CODES, DTYPE_CODES

        if len(conv) != 8:
            raise DietcodeError(f"check_node: conv takes 8 values (strides, pads top/left, dilations, kernel_shape), "
                                f"got {len(conv)}")
        arr = (ctypes.c_int64 * 9)(*conv, group)
        if self.core.lib.dc_bundle_check_node(self.handle, DTYPE_CODES.index(dtype), ("MatMul", "Gemm", "Conv", "Attention").index(op),
                                              ACTIVATION_CODES.index(activation), int(trans_b), arr,
                                              int(explicit_pads), int(channels_last)):
            raise DietcodeError(self.core.error())

    def check_scale(self, scale: float) -> None:
        """Whether every compiled kernel's alpha is a node's ``scale`` (what both EPs check at session
        creation); DietcodeError naming the first kernel that differs and both values."""
        if self.core.lib.dc_bundle_check_scale(self.handle, scale):
            raise DietcodeError(self.core.error())

    def check_attention(self, layout: int, head_dim: int = 0, mask_rows: bool = True,
                        nan_to_zero: bool = False) -> None:
        """Whether every compiled kernel was compiled for an Attention node's operand ``layout``, ``head_dim``
        (when > 0), ``mask_rows`` (kernels taking the mask) and ``nan_to_zero`` (what both EPs check at session
        creation); DietcodeError naming the first kernel that differs and both values."""
        if self.core.lib.dc_bundle_check_attention(self.handle, layout, head_dim, int(mask_rows), int(nan_to_zero)):
            raise DietcodeError(self.core.error())

    def accepts(self, k: int, args: LaunchArgs) -> tuple[bool, str]:
        """Whether ``args`` meet kernel k's div16 assumptions, and if not, why."""
        r = self.core.lib.dc_kernel_accepts(self.handle, k, ctypes.byref(args))
        if r < 0:
            raise DietcodeError(self.core.error())
        return bool(r), "" if r else self.core.error()

    def fit(self, k: int, args: LaunchArgs) -> tuple[str, str]:
        """Whether one call fits kernel k (``dc_kernel_fit``): ("fits", "") or the reason's name ("empty
        output", "K is 0", "batch above grid z", "tiles above grid x", "int32 offsets", "div16 assumption",
        "negative size", "workspace size") and the message."""
        r = self.core.lib.dc_kernel_fit(self.handle, k, ctypes.byref(args))
        if r < 0:
            raise DietcodeError(self.core.error())
        return self.core.lib.dc_fit_name(r).decode(), "" if r == 0 else self.core.error()

    def workspace_bytes(self, k: int, args: LaunchArgs) -> int:
        """The split-K workspace bytes one call of kernel k with ``args`` needs (``dc_kernel_workspace_bytes``;
        0 without split-K); DietcodeError when the size overflows."""
        r = self.core.lib.dc_kernel_workspace_bytes(self.handle, k, ctypes.byref(args))
        if r < 0:
            raise DietcodeError(self.core.error())
        return int(r)

    def persistent(self, k: int) -> int:
        """Kernel k's programs per SM (``dc_bundle_kernel_persistent``): 0 for one program per tile."""
        r = self.core.lib.dc_bundle_kernel_persistent(self.handle, k)
        if r < 0:
            raise DietcodeError(self.core.error())
        return int(r)

    def grid(self, k: int, args: LaunchArgs) -> tuple[int, int, int]:
        """The launch grid of one call of kernel k with ``args`` (``dc_kernel_grid``: the ABI's grid rule; a
        persistent kernel's follows ``args.sm_count``, 0 for one program per tile); DietcodeError for a call
        that does not fit or the vendor kind."""
        grid = (ctypes.c_uint32 * 3)()
        if self.core.lib.dc_kernel_grid(self.handle, k, ctypes.byref(args), grid):
            raise DietcodeError(self.core.error())
        return grid[0], grid[1], grid[2]

    def image_shared(self, k: int, major: int, minor: int) -> int:
        """The shared memory bytes kernel k launches with on a device of compute capability major.minor
        (those of the image ``pick_image`` names)."""
        r = self.core.lib.dc_bundle_image_shared(self.handle, k, major, minor)
        if r < 0:
            raise DietcodeError(self.core.error())
        return int(r)

    def fit_device(self, major: int, minor: int, smem_optin: int, driver: int = 0) -> tuple[list[bool], list[str]]:
        """Which kernels can run on a device of compute capability major.minor with ``smem_optin`` bytes of
        opt-in shared memory per block under a CUDA driver of version ``driver`` (cuDriverGetVersion's
        encoding, 13000 = 13.0; 0 = not checked) (``dc_bundle_fit_device``, what a CUDA session decides at
        creation), and for each that cannot, why (``dc_kernel_fit_device``; "" for those that can)."""
        mask = (ctypes.c_uint8 * max(1, self.n_kernels))()
        lib = self.core.lib
        if lib.dc_bundle_fit_device(self.handle, major, minor, smem_optin, driver, mask, self.n_kernels) < 0:
            raise DietcodeError(self.core.error())
        why = []
        for k in range(self.n_kernels):
            r = self.core.lib.dc_kernel_fit_device(self.handle, k, major, minor, smem_optin, driver)
            if r < 0:
                raise DietcodeError(self.core.error())
            why.append("" if r else self.core.error())
        return [bool(mask[k]) for k in range(self.n_kernels)], why

    def image_toolchains(self, k: int) -> list[dict[str, Any]]:
        """Kernel k's toolchain records as the C core reads them (``dc_bundle_image_toolchain``): one per
        cubin in bundle order, then the PTX's when it has PTX; each {"image", "triton", "ptxas", "ptx_isa",
        "min_driver"} ("image": the cubin's index or -1 for the PTX)."""
        lib = self.core.lib
        count = lib.dc_bundle_image_count(self.handle, k)
        if count < 0:
            raise DietcodeError(self.core.error())
        out = []
        for image in [*range(count), -1]:
            triton, ptxas = ctypes.create_string_buffer(128), ctypes.create_string_buffer(128)
            isa, driver = ctypes.c_int32(), ctypes.c_int32()
            if lib.dc_bundle_image_toolchain(self.handle, k, image, triton, 128, ptxas, 128, ctypes.byref(isa),
                                             ctypes.byref(driver)) < 0:
                if image == -1:
                    break  # no PTX
                raise DietcodeError(self.core.error())
            out.append({"image": image, "triton": triton.value.decode(), "ptxas": ptxas.value.decode(),
                        "ptx_isa": isa.value, "min_driver": driver.value})
        return out

    def launch(self, k: int, args: LaunchArgs, stream: int = 0) -> None:
        """Launch kernel k with raw device pointers on a CUstream handle (0 = legacy default stream)."""
        if self.core.lib.dc_launch(self.handle, k, ctypes.byref(args), ctypes.c_void_p(stream)):
            raise DietcodeError(self.core.error())


def node_stats() -> dict[str, dict[str, Any]]:
    """Launches of compiled kernels and fallbacks to ONNX Runtime's kernel (with the last reason) per
    ai.dietcode node name, counted by the library in this process across sessions: {node: {"launches": n,
    "fallbacks": n, "reason": str}}. See ``Core.node_stats``."""
    return load_core().node_stats()


def reset_node_stats() -> None:
    """Zero every node's counters (``node_stats``)."""
    load_core().lib.dc_node_stats_reset()


_CORE: Core | None = None
_CORE_LOCK = threading.Lock()


def _new_locks() -> None:
    """In a forked child: fresh locks. A lock another thread of the parent held at the fork (``load_core``'s first
    call runs the compiler and hashes the sources under it) stays held in the child, where no thread will release
    it, and the child's first ``node_stats()`` would wait for ever."""
    global _CORE_LOCK, _USABLE_LOCK
    _CORE_LOCK, _USABLE_LOCK = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_new_locks)


def load_core(build: bool = True) -> Core:
    """The process-wide ctypes binding of the library (built on first use; the lock only until then)."""
    global _CORE
    if _CORE is not None:
        return _CORE
    with _CORE_LOCK:
        if _CORE is None:
            _CORE = Core(library_path(build=build))
            _note_library(_CORE.path)
        return _CORE
