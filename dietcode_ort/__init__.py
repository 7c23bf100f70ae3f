"""dietcode-ort: shape-generic (DietCode) kernels for dynamic-shape ONNX models in ONNX Runtime.

This package is what a deployment imports. It must not import triton, torch or scikit-learn: those
belong to the offline tuner (the ``tuner`` package).
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
