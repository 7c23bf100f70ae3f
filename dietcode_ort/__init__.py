"""dietcode-ort: shape-generic (DietCode) kernels for dynamic-shape ONNX models in ONNX Runtime.

This package is what a deployment imports. It must not import triton, torch or scikit-learn: those
belong to the offline tuner (the ``tuner`` package). ``register``/``InferenceSession`` load the custom-op
library (built from custom_ops/ on first use, see ``library_path``).
"""
from __future__ import annotations

from dietcode_ort.build import library_path
from dietcode_ort.runtime import InferenceSession, node_stats, register, reset_node_stats

__version__ = "0.1.0"

__all__ = ["__version__", "register", "InferenceSession", "library_path", "node_stats", "reset_node_stats"]
