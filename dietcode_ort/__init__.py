"""dietcode-ort: shape-generic (DietCode) kernels for dynamic-shape ONNX models in ONNX Runtime.

This package is what a deployment imports (``pip install dietcode-ort``). It must import nothing of the
offline tuner (the ``tuner`` package, ``pip install 'dietcode-ort[tune]'``) nor its dependencies: triton,
scikit-learn, sympy, torch (tests/test_lean_runtime.py checks it). ``register``/``InferenceSession`` load the custom-op
library (built from custom_ops/ on first use, see ``library_path``).
"""
from __future__ import annotations

from dietcode_ort.build import library_path
from dietcode_ort.runtime import InferenceSession, node_stats, register, reset_node_stats

__version__ = "0.1.0"

__all__ = ["__version__", "register", "InferenceSession", "library_path", "node_stats", "reset_node_stats"]
