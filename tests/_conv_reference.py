"""The reference conv of the runtime tests: ONNX Runtime's own CPU Conv (NCHW, float32)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def ort_conv(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """ONNX Runtime's CPU Conv of float32 X [N, C, H, W] and W [OC, C / group, KH, KW] with ``attrs``."""
    graph = helper.make_graph([helper.make_node("Conv", ["X", "W"], ["Y"], **attrs)], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("W", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": x, "W": w})[0]
