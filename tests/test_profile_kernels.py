"""benchmarks/profile_kernels.py: kernel names into categories, Kineto's and ORT's traces into events, events into
per-iteration figures, a shape's first call against its steady runs, the JSON and the table; end to end on the CPU
EP (ORT's profiler) with a custom-op model, and the cupti path with a stand-in torch."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from _scripts import load_script
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
from dietcode_ort.errors import DietcodeError

pk = load_script("profile_kernels")

# real names: cuBLAS (Hopper's nvjet and xmma), cutlass, ORT's CUDA kernels and fused attention, cuDNN, Kineto's
# memcpy/memset, the project's Triton kernels and vendor epilogue; then ORT's profiler's op types
NAMES = {
    "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "GEMM",
    "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN": "GEMM",
    "void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_64x4_nn_align8>(Params)": "GEMM",
    "void splitKreduce_kernel<32, 16, int, __half, __half, float, __half, true, false, false>(...)": "GEMM",
    "fmha_cutlassF_f16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t>::Params)":
        "attention",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::half_t>>()":
        "attention",
    "void onnxruntime::contrib::attention_softmax_cuda::SoftmaxKernelSmall<__half, 256>(int, const __half*)":
        "attention",
    "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "conv",
    "void cudnn::cnn::conv2d_grouped_direct_kernel<false, true, false, false, 0, 0, int, __half>(...)": "conv",
    "void onnxruntime::contrib::cuda::SkipLayerNormKernelSmall<__half, float, __half, 256, 8, true>(...)":
        "layernorm",
    "void onnxruntime::cuda::cuApplyLayerNorm<__half, float, __half, false>(...)": "layernorm",
    "void onnxruntime::cuda::softmax_warp_forward<__half, __half, float, 9, false>(...)": "softmax",
    "void onnxruntime::cuda::_BinaryElementWiseSimple<true, true, __half, __half, __half, OP_Add<__half>>(...)":
        "elementwise",
    "void onnxruntime::contrib::cuda::FastGeluKernel2<256>(const __half2*, __half2*)": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(...)": "elementwise",
    "void onnxruntime::cuda::Transpose3DKernel<__half>(...)": "other",
    "void at::native::convert_kernel<float>(...)": "other",
    "Memcpy HtoD (Pageable -> Device)": "memcpy/memset",
    "Memset (Device)": "memcpy/memset",
    "gemm_kernel": "dietcode triton", "bmm_kernel": "dietcode triton", "attention_kernel": "dietcode triton",
    "conv_kernel": "dietcode triton",
    "dc_epilogue": "dietcode epilogue",
    "MatMul": "GEMM", "FusedMatMul": "GEMM", "Gemm": "GEMM",
    "LayerNormalization": "layernorm", "SkipLayerNormalization": "layernorm",
    "SimplifiedLayerNormalization": "layernorm", "Softmax": "softmax", "Attention": "attention",
    "MultiHeadAttention": "attention", "Conv": "conv", "Add": "elementwise", "Cast": "elementwise",
    "QuickGelu": "elementwise", "BiasGelu": "elementwise", "Transpose": "other", "Gather": "other",
    "ai.dietcode::MatMulBias": "dietcode op", "ai.dietcode::Attention": "dietcode op",
    "MemcpyToHost": "memcpy/memset",
}


@pytest.mark.parametrize("name", NAMES)
def test_kernel_names_fall_into_their_categories(name: str) -> None:
    assert pk.categorize(name) == NAMES[name]


def test_the_category_table_is_one_ordered_list_ending_in_other() -> None:
    names = [c for c, _ in pk.CATEGORIES]
    assert len(set(names)) == len(names) and names[-1] == "other"
    assert set(NAMES.values()) <= set(names)
    # a Triton kernel of ours carries GEMM's word and ORT's cutlass attention GEMM's: the order decides
    assert names.index("dietcode triton") < names.index("GEMM") and names.index("attention") < names.index("GEMM")


def _x(cat: str, name: str, ts: float, dur: float, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": args}


def test_kineto_trace_gives_device_work_and_the_cuda_calls() -> None:
    trace = {"traceEvents": [
        _x("cuda_runtime", "cudaLaunchKernel", 0, 4, correlation=1),
        _x("kernel", "nvjet_hsh_128x256", 5, 20, grid=[8, 4, 1], block=[384, 1, 1], correlation=1,
           **{"shared memory": 1024}),
        _x("cuda_driver", "cuLaunchKernel", 6, 3),
        _x("Kernel", "gemm_kernel", 30, 10, grid=[16, 1, 1], block=[128, 1, 1]),  # the older capitalised name
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 41, 2, bytes=64),
        _x("gpu_memset", "Memset (Device)", 44, 1),
        _x("cpu_op", "aten::empty", 0, 50),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "ts": 5, "id": 1},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 50},
    ]}
    device, api = pk.kineto_events(trace)
    assert [e.name for e in device] == ["nvjet_hsh_128x256", "gemm_kernel", "Memcpy DtoD (Device -> Device)",
                                        "Memset (Device)"]
    assert device[0].launch == "grid 8x4x1 block 384x1x1 smem 1024"
    assert device[1].launch == "grid 16x1x1 block 128x1x1" and device[2].launch == ""
    assert [(e.name, e.dur_us) for e in api] == [("cudaLaunchKernel", 4.0), ("cuLaunchKernel", 3.0)]
    # the launch and its kernel share Kineto's correlation id; an event without one has 0
    assert (api[0].correlation, device[0].correlation, api[1].correlation, device[1].correlation) == (1, 1, 0, 0)


def test_ort_profile_is_split_by_run_and_names_the_custom_nodes() -> None:
    def node(name: str, op: str, ts: float, dur: float, provider: str = "CUDAExecutionProvider") -> dict:
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "ph": "X",
                "args": {"op_name": op, "provider": provider}}

    trace = [
        {"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 90},
        node("early", "MatMul", 50, 5),  # before any run: left out
        {"cat": "Session", "name": "model_run", "ts": 100, "dur": 50},
        node("/mm", "MatMulBias", 101, 20), node("/ln", "LayerNormalization", 122, 5),
        {"cat": "Node", "name": "/mm_fence_before", "ts": 100, "dur": 1, "args": {"op_name": "MatMulBias"}},
        {"cat": "Session", "name": "model_run", "ts": 200, "dur": 50},
        node("/mm", "MatMulBias", 201, 22), node("/shape", "Shape", 224, 1, "CPUExecutionProvider"),
    ]
    runs = pk.ort_events(trace, {"/mm"}, "CUDAExecutionProvider")
    assert [[(e.name, e.dur_us) for e in run] for run in runs] == [
        [("ai.dietcode::MatMulBias", 20.0), ("LayerNormalization", 5.0)],
        [("ai.dietcode::MatMulBias", 22.0), ("Shape [CPUExecutionProvider]", 1.0)]]
    # the session-level events inside each run (the initialization before them left out)
    trace += [{"cat": "Session", "name": "SequentialExecutor::Execute", "ts": 101, "dur": 40},
              {"cat": "Session", "name": "SequentialExecutor::Execute", "ts": 202, "dur": 30}]
    assert pk.ort_run_spans(trace) == [(50.0, {"SequentialExecutor::Execute": 40.0}),
                                       (50.0, {"SequentialExecutor::Execute": 30.0})]


def _events() -> list:
    E = pk.Event
    # two iterations: a GEMM (twice per iteration, two grids), an epilogue overlapping it by 2 us, a memcpy
    out = []
    for it in range(2):
        t = it * 100.0
        out += [E("gemm_kernel", t, 30, "grid 8x1x1 block 128x1x1"), E("gemm_kernel", t + 30, 10, "grid 4x1x1 block 128x1x1"),
                E("dc_epilogue", t + 38, 6), E("Memcpy HtoD (Pageable -> Device)", t + 50, 4)]
    return out


def test_summaries_per_iteration_with_overlaps_counted_once() -> None:
    api = [pk.Event("cuLaunchKernel", 0, 3), pk.Event("cuLaunchKernel", 1, 3), pk.Event("cudaMemcpyAsync", 2, 1)]
    s = pk.summarize(_events(), 2, wall_ms=0.07, profiled_wall_ms=0.08, api=api)
    assert s.kernel_sum_ms == pytest.approx(0.050)  # (30 + 10 + 6 + 4) us per iteration
    assert s.busy_ms == pytest.approx(0.048)         # the epilogue's first 2 us overlap the GEMM
    assert s.host_gap_ms == pytest.approx(0.032)
    gemm, epi, copy = s.kernels
    assert (gemm.name, gemm.calls, gemm.ms, gemm.mean_us) == ("gemm_kernel", 2.0, pytest.approx(0.040), pytest.approx(20))
    assert gemm.share == pytest.approx(0.8) and gemm.category == "dietcode triton"
    assert gemm.launches == (("grid 8x1x1 block 128x1x1", 1.0), ("grid 4x1x1 block 128x1x1", 1.0))
    assert (epi.category, copy.category) == ("dietcode epilogue", "memcpy/memset")
    cats = s.categories()
    assert list(cats) == ["memcpy/memset", "dietcode triton", "dietcode epilogue"]  # CATEGORIES' order
    assert cats["dietcode triton"] == {"calls_per_iter": 2.0, "ms_per_iter": pytest.approx(0.040),
                                       "share": pytest.approx(0.8)}
    assert s.host_api == (("cuLaunchKernel", 1.0, pytest.approx(0.003)), ("cudaMemcpyAsync", 0.5, pytest.approx(0.0005)))
    E = pk.Event
    assert pk.busy_us([E("a", 0, 10), E("b", 2, 3), E("c", 12, 2), E("d", 13, 4)]) == 15  # b inside a, d past c
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        pk.summarize([], 0, 1.0, 1.0)


def _first_call_cupti() -> tuple:
    """A first call (6 ms under the profiler) whose kernel launch takes 4 ms (a module loaded lazily at its first
    launch) after two cudaMalloc (the arena growing), against two steady iterations of 0.05 ms."""
    E = pk.Event
    first = pk.Recording(
        [E("nvjet_hsh_128x256", 4700, 20, "grid 8x4x1 block 384x1x1", 9), E("Memset (Device)", 4720, 1, "", 10)],
        [E("cudaMalloc", 0, 500), E("cudaMalloc", 510, 300), E("cudaLaunchKernel", 900, 4000, "", 9),
         E("cudaMemsetAsync", 4905, 5, "", 10), E("cudaStreamSynchronize", 4910, 30)])
    device, api = [], []
    for it in range(2):
        t = 10_000.0 + it * 100
        device += [E("nvjet_hsh_128x256", t + 10, 20, "", 20 + it), E("Memset (Device)", t + 30, 1, "", 30 + it)]
        api += [E("cudaLaunchKernel", t, 3, "", 20 + it), E("cudaMemsetAsync", t + 3, 2, "", 30 + it),
                E("cudaStreamSynchronize", t + 5, 20)]
    return first, pk.Recording(device, api)


def test_first_call_against_the_steady_runs_from_cuptis_events() -> None:
    first, steady = _first_call_cupti()
    fc = pk.summarize_first(first, 6.0, steady, 2, 0.05)
    figures = {name: (f, s) for name, f, s in fc.figures}
    assert list(figures) == ["busy_ms", "kernel_sum_ms", "events", "api_calls", "host_in_calls_ms", "host_sync_ms",
                             "host_outside_calls_ms"]
    approx = pytest.approx
    assert figures["busy_ms"] == (approx(0.021), approx(0.021)) and figures["events"] == (2.0, 2.0)
    assert figures["api_calls"] == (5.0, 3.0)
    assert figures["host_in_calls_ms"] == (approx(4.835), approx(0.025))   # the union of the calls
    assert figures["host_sync_ms"] == (approx(0.030), approx(0.020))
    assert figures["host_outside_calls_ms"] == (approx(6.0 - 4.835), approx(0.025))
    assert fc.ratio == approx(120.0)
    launch, malloc, sync, memset = fc.host_api
    assert (launch.name, launch.calls, launch.ms, launch.steady_calls, launch.steady_ms) == (
        "cudaLaunchKernel", 1, approx(4.0), 1.0, approx(0.003))
    assert (malloc.name, malloc.calls, malloc.ms, malloc.max_ms, malloc.steady_calls) == (
        "cudaMalloc", 2, approx(0.8), approx(0.5), 0.0)
    assert (sync.name, memset.name) == ("cudaStreamSynchronize", "cudaMemsetAsync")
    # the longest single calls, each with the kernel it launched (by correlation id)
    assert [(n, round(ms, 3), k) for n, ms, k in fc.slowest] == [
        ("cudaLaunchKernel", 4.0, "nvjet_hsh_128x256"), ("cudaMalloc", 0.5, ""), ("cudaMalloc", 0.3, ""),
        ("cudaStreamSynchronize", 0.03, ""), ("cudaMemsetAsync", 0.005, "Memset (Device)")]
    js = json.loads(json.dumps(fc.as_json()))
    assert js["figures"]["host_in_calls_ms"] == {"first": approx(4.835), "steady": approx(0.025)}
    assert js["excess_ms"] == approx(5.95) and js["ratio"] == approx(120.0)
    assert [a["name"] for a in js["host_api"]] == ["cudaLaunchKernel", "cudaMalloc", "cudaStreamSynchronize",
                                                    "cudaMemsetAsync"]
    assert js["kernels"][0]["category"] == "GEMM" and js["excess_kernels"] == []  # no kernel slower than steady
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        pk.summarize_first(first, 6.0, steady, 0, 0.05)


def test_first_call_against_the_steady_runs_from_orts_profile() -> None:
    """ORT's profiler: the first run's model_run span, its time outside the nodes and its session events."""
    def run(ts: float, dur: float, execute: float, nodes: list) -> list:
        return [{"cat": "Session", "name": "model_run", "ts": ts, "dur": dur},
                {"cat": "Session", "name": "SequentialExecutor::Execute", "ts": ts + 5, "dur": execute},
                *({"cat": "Node", "name": f"/{op}_kernel_time", "ts": ts + 10 + 110 * k, "dur": d,
                   "args": {"op_name": op, "provider": "CPUExecutionProvider"}} for k, (op, d) in enumerate(nodes))]

    trace = [{"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 90},
             *run(100, 500, 450, [("MatMul", 100), ("Relu", 50)]),
             *run(1000, 200, 180, [("MatMul", 80), ("Relu", 40)]), *run(2000, 200, 180, [("MatMul", 80), ("Relu", 40)])]
    nodes, spans = pk.ort_events(trace, (), "CPUExecutionProvider"), pk.ort_run_spans(trace)
    first = pk.Recording(nodes[0], (), spans[:1])
    steady = pk.Recording([e for r in nodes[1:] for e in r], (), spans[1:])
    fc = pk.summarize_first(first, 0.7, steady, 2, 0.25)
    figures = {name: (round(f, 6), round(s, 6)) for name, f, s in fc.figures}
    assert figures == {"busy_ms": (0.15, 0.12), "kernel_sum_ms": (0.15, 0.12), "events": (2.0, 2.0),
                       "outside_run_ms": (0.2, 0.05), "run_ms": (0.5, 0.2), "non_node_ms": (0.35, 0.08),
                       "session:SequentialExecutor::Execute": (0.45, 0.18)}
    assert fc.host_api == () and fc.slowest == ()
    assert [(k.name, round(k.excess_ms, 6)) for k in fc.kernels] == [("MatMul", 0.02), ("Relu", 0.01)]
    js = fc.as_json()
    assert [k["name"] for k in js["excess_kernels"]] == ["MatMul", "Relu"]
    assert js["excess_kernels"][0]["category"] == "GEMM"


def test_report_json_and_table() -> None:
    E = pk.Event
    stock = pk.summarize([E("nvjet_hsh_128x256", 0, 30), E("void onnxruntime::cuda::softmax_warp_forward<>", 30, 10)],
                         1, 0.05, 0.06)
    ours = pk.summarize(_events()[:4], 1, 0.07, 0.08)
    shape = pk.ShapeProfile({"batch": 32, "seq": 256}, {"stock": stock, "dietcode": ours}, {"y": 0.01})
    env = {"device": "NVIDIA H100 80GB HBM3", "onnxruntime": "1.31.1", "torch": "2.11.0", "date": "today",
           "command": "python benchmarks/profile_kernels.py --suite bert"}
    settings = {"model": "bert.onnx", "optimized": "bert.dietcode.onnx", "provider": "cuda", "source": "cupti",
                "clock": "device", "iters": 1, "warmup": 0}
    report = json.loads(json.dumps(pk.report_json(env, settings, [shape], complete=True)))
    assert report["schema"] == pk.SCHEMA and report["categories"][-1] == ["other", ""]
    (got,) = report["shapes"]
    assert got["label"] == "batch=32 seq=256" and got["max_abs_error"] == {"y": 0.01}
    ses = got["sessions"]["dietcode"]
    assert ses["kernels"][0]["name"] == "gemm_kernel" and ses["kernels"][0]["launches"][0]["calls_per_iter"] == 1.0
    assert ses["host_gap_ms"] == pytest.approx(0.08 - 0.048)
    assert got["sessions"]["stock"]["categories"]["GEMM"]["share"] == pytest.approx(0.75)

    text = pk.render(report, top=2)
    lines = text.splitlines()
    assert "source cupti (device time of each kernel, CUPTI)" in lines[1]
    assert "INCOMPLETE" not in text
    wall = next(line for line in lines if line.startswith("wall ms/iter (no profiler"))
    assert wall.split()[-5:] == ["0.050", "0.070", "+0.020", "(stock/dietcode", "0.71x)"]
    gemm = next(line for line in lines if line.startswith("GEMM "))
    assert gemm.split() == ["GEMM", "0.030", "75.0%", "0.000", "0.0%", "-0.030"]
    triton = next(line for line in lines if line.startswith("dietcode triton"))
    assert triton.split()[-1] == "+0.040"
    assert sum("top kernels" in line for line in lines) == 2
    assert sum(line.endswith("gemm_kernel") for line in lines) == 1
    assert "dc_epilogue" in text and "Memcpy" not in text  # top 2 of the dietcode side only

    report["complete"] = False
    report["shapes"][0]["disagreement"] = "optimized model disagrees with the original at shape batch=32 seq=256"
    text = pk.render(report)
    assert "INCOMPLETE" in text and "!! optimized model disagrees" in text


def test_first_call_in_the_json_and_the_table() -> None:
    E = pk.Event
    first, steady = _first_call_cupti()
    ours = pk.summarize_first(first, 6.0, steady, 2, 0.05)
    stock = pk.summarize_first(pk.Recording([E("nvjet_hsh_128x256", 0, 30)], [E("cudaLaunchKernel", 0, 2)]), 0.1,
                               pk.Recording([E("nvjet_hsh_128x256", 0, 30)], [E("cudaLaunchKernel", 0, 2)]), 1, 0.06)
    sessions = {"stock": pk.summarize([E("nvjet_hsh_128x256", 0, 30)], 1, 0.05, 0.06),
                "dietcode": pk.summarize(steady.device, 2, 0.04, 0.05, api=steady.api)}
    shapes = [pk.ShapeProfile({"batch": 4, "seq": 256}, dict(sessions), first_calls={"stock": stock, "dietcode": ours}),
              pk.ShapeProfile({"batch": 1, "seq": 16}, dict(sessions), first_call_note="the warm-up shape failed")]
    env = {"device": "NVIDIA H100 80GB HBM3", "onnxruntime": "1.31.1", "torch": "2.11.0", "date": "today",
           "command": "python benchmarks/profile_kernels.py --suite bert"}
    settings = {"model": "bert.onnx", "optimized": "bert.dietcode.onnx", "provider": "cuda", "source": "cupti",
                "clock": "device", "iters": 2, "warmup": 0, "warmup_shape": {"batch": 33, "seq": 15}}
    report = json.loads(json.dumps(pk.report_json(env, settings, shapes, complete=True)))
    got, skipped = report["shapes"]
    # additive: the steady figures where they were, the first call beside them
    assert got["sessions"]["dietcode"]["busy_ms"] == pytest.approx(0.021)
    assert got["sessions"]["dietcode"]["first_call"]["wall_ms"] == 6.0 and got["first_call_note"] is None
    assert got["sessions"]["stock"]["first_call"]["ratio"] == pytest.approx(0.1 / 0.06)
    assert "first_call" not in skipped["sessions"]["stock"] and skipped["first_call_note"] == "the warm-up shape failed"

    lines = pk.render(report).splitlines()
    assert any("sessions warm on batch=33 seq=15" in line for line in lines[:6])
    start = lines.index(next(line for line in lines if line.startswith("first call vs steady")))
    wall = lines[start + 1].split()
    assert wall[:6] == ["wall", "ms", "0.100", "0.060", "6.000", "0.050"] and wall[-2:] == ["dietcode", "120.00x"]
    rows = {line[:34].strip(): line[34:].split() for line in lines[start + 2:start + 9]}
    assert rows["host in CUDA calls ms"] == ["0.002", "0.002", "4.835", "0.025"]
    assert rows["of it synchronize ms"] == ["0.000", "0.000", "0.030", "0.020"]
    assert rows["host outside CUDA calls ms"] == ["0.098", "0.058", "1.165", "0.025"]
    assert rows["events"] == ["1.0", "1.0", "2.0", "2.0"] and "event sum ms" not in rows
    text = "\n".join(lines)
    assert ("dietcode CUDA calls beyond steady: cudaLaunchKernel 1x 4.000 ms (steady 1.0x 0.003), "
            "cudaMalloc 2x 0.800 ms (steady 0.0x 0.000)") in text
    assert "dietcode longest CUDA calls: cudaLaunchKernel 4.000 ms (nvjet_hsh_128x256), cudaMalloc 0.500 ms" in text
    assert "stock CUDA calls beyond" not in text  # nothing beyond its steady run
    assert "first call: none (the warm-up shape failed)" in text


def test_shapes_from_points_and_a_sweep() -> None:
    symbols = ["batch", "seq"]
    got = pk.profile_shapes(symbols, ["batch=1", "seq=128,256"], ["batch=32,seq=256", "batch=1,seq=128"])
    assert got == [{"batch": 32, "seq": 256}, {"batch": 1, "seq": 128}, {"batch": 1, "seq": 256}]
    assert pk.profile_shapes(symbols, [], ["batch=4"]) == [{"batch": 4, "seq": 128}]  # bench's default seq
    assert pk.profile_shapes(symbols, [], []) == [{"batch": 1, "seq": 128}]
    with pytest.raises(DietcodeError, match="bad --shape 'batch=4,8'"):
        pk.profile_shapes(symbols, [], ["batch=4,8"])
    with pytest.raises(DietcodeError, match="names 2 shapes"):
        pk.profile_shapes(symbols, [], ["batch=1:2"])
    with pytest.raises(DietcodeError, match="not a dim|symbol"):
        pk.profile_shapes(symbols, [], ["tokens=4"])


# --- end to end on the CPU EP --------------------------------------------------------------------------

def _bundle() -> bytes:
    """A vendor leaf and a compiled kernel (the CPU EP validates the bundle and runs ORT's op)."""
    gemm = BundleKernel(name="k", images=(("sm_90a", b"\x7fELF"),), ptx=".version 8.0\n.target sm_80\n",
                        params=("a", "b", "bias", "c", "M", "N", "K"), block_m=64, block_n=64)
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), gemm), tree).to_bytes()


def _models(tmp_path: Path) -> tuple[Path, Path]:
    """x [tokens, 16] -> MatMul + bias -> Relu as stock nodes, and as one ai.dietcode MatMulBiasRelu node."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", 16])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", 8])])
    stock = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["mm"], name="/mm"),
                               helper.make_node("Add", ["mm", "b"], ["pre"], name="/add"),
                               helper.make_node("Relu", ["pre"], ["y"], name="/relu")], "stock", *io, [w, b])
    bundle = numpy_helper.from_array(np.frombuffer(_bundle(), np.uint8), "bundle")
    ours = helper.make_graph([helper.make_node("MatMulBiasRelu", ["x", "w", "b", "bundle"], ["y"], name="/fused",
                                               domain="ai.dietcode")], "ours", *io, [w, b, bundle])
    paths = []
    for graph, name in ((stock, "m.onnx"), (ours, "m.dietcode.onnx")):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.dietcode", 2)])
        model.ir_version = 10
        onnx.save(model, str(tmp_path / name))
        paths.append(tmp_path / name)
    return paths[0], paths[1]


def test_cli_profiles_both_sessions_on_the_cpu_with_orts_profiler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, optimized = _models(tmp_path)
    out, js = tmp_path / "prof.txt", tmp_path / "prof.json"
    rc = pk.main([str(model), "--optimized", str(optimized), "--provider", "cpu", "--shape", "tokens=7",
                  "--dim", "tokens=7,64", "--iters", "3", "--warmup", "1", "--json", str(js), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(js.read_text())
    assert report["complete"] and report["settings"]["source"] == "ort" and report["settings"]["clock"] == "cpu"
    assert [s["dims"] for s in report["shapes"]] == [{"tokens": 7}, {"tokens": 64}]
    assert report["environment"]["provider"] == "cpu" and "--shape tokens=7" in report["environment"]["command"]
    for shape in report["shapes"]:
        stock, ours = shape["sessions"]["stock"], shape["sessions"]["dietcode"]
        assert {k["name"]: k["calls_per_iter"] for k in ours["kernels"]} == {"ai.dietcode::MatMulBiasRelu": 1.0}
        assert ours["categories"]["dietcode op"]["share"] == 1.0
        # ORT fuses stock's MatMul + Add (+ Relu) on the CPU EP: what ran is what the profile names
        assert stock["categories"] and all(k["calls_per_iter"] == 1.0 for k in stock["kernels"])
        assert "dietcode op" not in stock["categories"]
        for ses in (stock, ours):
            assert ses["iterations"] == 3 and 0 < ses["busy_ms"] <= ses["profiled_wall_ms"] and ses["wall_ms"] > 0
            # the shape's first run in ORT's profile (one node, the run's span and its executor), its steady runs
            first = ses["first_call"]
            assert first["wall_ms"] > 0 and first["steady_wall_ms"] == ses["profiled_wall_ms"]
            assert first["ratio"] == pytest.approx(first["wall_ms"] / first["steady_wall_ms"])
            figures = first["figures"]
            assert figures["events"] == {"first": 1.0, "steady": 1.0}
            assert figures["kernel_sum_ms"]["steady"] == pytest.approx(ses["kernel_sum_ms"])
            for key in ("run_ms", "session:SequentialExecutor::Execute"):
                assert figures[key]["first"] > 0 and figures[key]["steady"] > 0
            assert figures["non_node_ms"]["first"] == pytest.approx(figures["run_ms"]["first"]
                                                                    - figures["kernel_sum_ms"]["first"])
            assert figures["run_ms"]["first"] <= first["wall_ms"] and first["host_api"] == []
            assert [k["name"] for k in first["kernels"]] == [k["name"] for k in ses["kernels"]]
        assert shape["max_abs_error"]["y"] < 1e-4 and shape["disagreement"] is None
        assert shape["first_call_note"] is None
    assert report["settings"]["warmup_shape"] == {"tokens": 6}  # bench's: below every profiled value
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "## tokens=64" in text and "ai.dietcode::MatMulBiasRelu" in text
    assert text.count("first call vs steady (profiled)") == 2 and "  SequentialExecutor::Execute ms" in text
    assert pk.main(["--from-json", str(js)]) == 0 and capsys.readouterr().out == text


def test_a_rejected_warm_up_shape_leaves_the_first_shapes_first_call_out(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """As bench: a model that rejects the warm-up shape warms up on the first shape, whose first call is then
    no first call; the later shapes keep theirs, and ORT's profile still splits into the runs made."""
    model, optimized = _models(tmp_path)
    make = pk.bench.make_feeds

    def feeds(info: object, shape: dict, seed: int) -> dict:
        if shape["tokens"] == 6:  # the warm-up shape of tokens 7, 64: x [6, 15] against a [16, 8] weight
            return {"x": np.zeros((6, 15), np.float32)}
        return make(info, shape, seed)  # type: ignore[arg-type]

    monkeypatch.setattr(pk.bench, "make_feeds", feeds)
    got = pk.profile(model, optimized, "cpu", [{"tokens": 7}, {"tokens": 64}], source="ort", iters=2, warmup=1,
                     warm_shape={"tokens": 6})
    assert got[0].first_calls == {} and got[0].first_call_note.startswith("the warm-up shape tokens=6 failed (")
    assert set(got[1].first_calls) == {"stock", "dietcode"} and got[1].first_call_note is None
    assert all(set(shape.sessions) == {"stock", "dietcode"} for shape in got)


def test_cli_refuses_what_it_cannot_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, optimized = _models(tmp_path)
    assert pk.main([str(model), "--optimized", str(optimized), "--provider", "cpu", "--iters", "0"]) == 2
    assert "--iters must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pk.main([str(model), "--optimized", str(optimized), "--provider", "cpu", "--source", "cupti"])
    assert "--source cupti reads CUDA kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pk.main([str(model)])
    assert "give MODEL --optimized OPT" in capsys.readouterr().err
    assert pk.main([str(model), "--optimized", str(tmp_path / "missing.onnx"), "--provider", "cpu"]) == 2
    assert "model file not found" in capsys.readouterr().err


# --- the cupti path with a stand-in torch (no GPU here) ------------------------------------------------

KINETO = {"traceEvents": [_x("cuda_runtime", "cudaLaunchKernel", 0, 2),
                          _x("kernel", "nvjet_hsh_128x256", 3, 20, grid=[8, 4, 1], block=[384, 1, 1]),
                          _x("gpu_memset", "Memset (Device)", 24, 1)]}


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch):
    """torch whose profiler "records" ``state["trace"]`` (what Kineto would write) around the profiled loop."""
    import sys
    import types

    state: dict = {"trace": KINETO, "queue": [], "profiled": 0, "synchronized": 0, "active": False}

    class Profile:
        def __init__(self, activities: list) -> None:
            assert activities == ["CUDA"]

        def __enter__(self) -> "Profile":
            state["profiled"] += 1
            state["active"] = True
            return self

        def __exit__(self, *exc: object) -> None:
            state["active"] = False

        def export_chrome_trace(self, path: str) -> None:  # the next queued trace, else the same one
            Path(path).write_text(json.dumps(state["queue"].pop(0) if state["queue"] else state["trace"]))

    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-standin"  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, init=lambda: None,  # type: ignore[attr-defined]
                                       synchronize=lambda: state.__setitem__("synchronized", state["synchronized"] + 1))
    profiler = types.ModuleType("torch.profiler")
    profiler.ProfilerActivity = types.SimpleNamespace(CUDA="CUDA")  # type: ignore[attr-defined]
    profiler.profile = Profile  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    return state


# a first call as Kineto writes it: the arena growing (cudaMalloc), a launch that loads its module lazily
FIRST = {"traceEvents": [_x("cuda_runtime", "cudaMalloc", 0, 300),
                         _x("cuda_runtime", "cudaLaunchKernel", 310, 2000, correlation=5),
                         _x("kernel", "nvjet_hsh_128x256", 2320, 20, grid=[8, 4, 1], block=[384, 1, 1], correlation=5),
                         _x("gpu_memset", "Memset (Device)", 2341, 1),
                         _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 2343, 3)]}


def test_cupti_source_reads_the_trace_of_each_profiled_loop(tmp_path: Path, fake_torch: dict,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """profile() with the cupti source on the CPU EP's sessions: the figures are the trace's (one kernel and a
    memset per "iteration" here, as the stand-in writes the same trace for every steady loop), each shape's
    first call is its own loop (its own trace, in nothing of the steady figures), the traces kept; the runs
    go warm-up shape, both first calls, then per session warm-up, timed and profiled runs."""
    model, optimized = _models(tmp_path)
    runs: list[tuple[str, int, str]] = []
    init, prepare = pk.bench.OrtRunner.__init__, pk.bench.OrtRunner.prepare

    def named(self: object, path: Path, *args: object, **kw: object) -> None:
        init(self, path, *args, **kw)  # type: ignore[arg-type]
        self.side = "d" if "dietcode" in str(path) else "s"  # type: ignore[attr-defined]

    def logged(self: object, feeds: dict) -> object:
        call = prepare(self, feeds)  # type: ignore[arg-type]
        side = self.side  # type: ignore[attr-defined]

        class Logged:
            def run(self) -> None:
                runs.append((side, len(feeds["x"]), "P" if fake_torch["active"] else "-"))
                call.run()

            def outputs(self) -> dict:
                return call.outputs()
        return Logged()

    monkeypatch.setattr(pk.bench.OrtRunner, "__init__", named)
    monkeypatch.setattr(pk.bench.OrtRunner, "prepare", logged)
    shapes = [{"tokens": 7}, {"tokens": 64}]
    fake_torch["queue"] = [FIRST, FIRST, KINETO, KINETO] * 2  # per shape: two first calls, two steady loops
    seen: list[int] = []
    got = pk.profile(model, optimized, "cpu", shapes, source="cupti", iters=1, warmup=1, traces=tmp_path / "tr",
                     warm_shape={"tokens": 6}, done=lambda done: seen.append(len(done)))
    assert seen == [1, 2]  # written after every shape
    assert fake_torch["profiled"] == 8 and fake_torch["synchronized"] == 8
    assert runs == [("s", 6, "-"), ("d", 6, "-"),
                    ("s", 7, "P"), ("d", 7, "P"), ("s", 7, "-"), ("s", 7, "-"), ("s", 7, "P"),
                    ("d", 7, "-"), ("d", 7, "-"), ("d", 7, "P"),
                    ("d", 64, "P"), ("s", 64, "P"), ("d", 64, "-"), ("d", 64, "-"), ("d", 64, "P"),
                    ("s", 64, "-"), ("s", 64, "-"), ("s", 64, "P")]
    for shape in got:
        assert shape.first_call_note is None and set(shape.first_calls) == {"stock", "dietcode"}
        for side, ses in shape.sessions.items():
            assert [k.name for k in ses.kernels] == ["nvjet_hsh_128x256", "Memset (Device)"]
            assert ses.busy_ms == pytest.approx(0.021) and ses.host_api == (("cudaLaunchKernel", 1.0, 0.002),)
            first = shape.first_calls[side]
            assert first.steady_wall_ms == ses.profiled_wall_ms
            assert [(a.name, a.calls, a.steady_calls) for a in first.host_api] == [("cudaLaunchKernel", 1, 1.0),
                                                                                 ("cudaMalloc", 1, 0.0)]
            assert first.slowest[0] == ("cudaLaunchKernel", 2.0, "nvjet_hsh_128x256")
            assert {k.name: (k.calls, k.steady_calls) for k in first.kernels} == {
                "nvjet_hsh_128x256": (1, 1.0), "Memset (Device)": (1, 1.0), "Memcpy HtoD (Pageable -> Device)": (1, 0.0)}
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == [
        "0-dietcode.first.json.gz", "0-dietcode.json.gz", "0-stock.first.json.gz", "0-stock.json.gz",
        "1-dietcode.first.json.gz", "1-dietcode.json.gz", "1-stock.first.json.gz", "1-stock.json.gz"]
    # without a warm-up shape the first shape's first run warms the sessions: its first call is left out
    got = pk.profile(model, optimized, "cpu", shapes, source="cupti", iters=1, warmup=0)
    assert got[0].first_calls == {} and "no warm-up shape" in (got[0].first_call_note or "")
    assert set(got[1].first_calls) == {"stock", "dietcode"}
    fake_torch["trace"] = {"traceEvents": [_x("cuda_runtime", "cudaLaunchKernel", 0, 2)]}
    with pytest.raises(pk.ProfileError, match="CUPTI recorded no kernel"):
        pk.profile(model, optimized, "cpu", shapes, source="cupti", iters=1, warmup=0)


def test_auto_falls_back_to_orts_profiler_when_cupti_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    model, optimized = _models(tmp_path)
    sources: list[str] = []

    def fake_profile(*args: object, source: str, done, **kw: object) -> list:
        sources.append(source)
        if source == "cupti":
            raise pk.ProfileError("torch 0.0 sees no CUDA device")
        done([])
        return []

    monkeypatch.setattr(pk, "profile", fake_profile)
    js = tmp_path / "p.json"
    assert pk.main([str(model), "--optimized", str(optimized), "--provider", "cuda", "--json", str(js)]) == 0
    assert sources == ["cupti", "ort"]
    settings = json.loads(js.read_text())["settings"]
    assert settings["source"] == "ort" and settings["clock"] == "host"
    assert "CUPTI could not be used (torch 0.0 sees no CUDA device)" in settings["fallback"]
    out = capsys.readouterr()
    assert "host time of each node's launches" in out.out and "CUPTI could not be used" in out.err
    sources.clear()  # asked for by name, cupti is not replaced
    assert pk.main([str(model), "--optimized", str(optimized), "--provider", "cuda", "--source", "cupti"]) == 2
    assert sources == ["cupti"] and "sees no CUDA device" in capsys.readouterr().err


def test_a_shape_a_model_rejects_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model, optimized = _models(tmp_path)
    # x [tokens, 15] against a [16, 8] weight
    monkeypatch.setattr(pk.bench, "make_feeds", lambda info, shape, seed: {"x": np.zeros((shape["tokens"], 15),
                                                                                         np.float32)})
    assert pk.main([str(model), "--optimized", str(optimized), "--provider", "cpu", "--shape", "tokens=3"]) == 2
    assert "error: the stock model fails at shape tokens=3:" in capsys.readouterr().err
