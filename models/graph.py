"""Shared pieces of the model builders: a small graph builder with seeded weights, and saving.

The builders emit graphs the way exporters do (opset 17, named nodes, readable initializer names) so
that the scanner and the rewriter see the same patterns they will meet in exported models. Weights are
drawn in float32 from one seeded ``numpy.random.Generator`` in a fixed order and cast afterwards, so the
float16 model of a seed holds the float32 model's weights rounded to float16.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dietcode_ort.errors import DietcodeError

__all__ = ["OPSET", "IR_VERSION", "DTYPES", "PROTO_LIMIT", "GraphBuilder", "ModelBuilder", "check_dtype", "classifier_model", "image_feeds",
           "initializer_bytes", "save_model", "tensor_input"]

OPSET = 17  # LayerNormalization exists from 17; the Gelu op needs 20, so Gelu is emitted in its Erf form
IR_VERSION = 10  # onnx 1.23 writes 14 by default; onnxruntime 1.31 accepts at most 13
DTYPES = ("float32", "float16")
PROTO_LIMIT = 2**31 - 1  # protobuf cannot serialize a message past 2 GiB: larger models use external data

_ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
_NP = {"float32": np.float32, "float16": np.float16}


def check_dtype(dtype: str) -> str:
    """Return ``dtype`` if the builders support it, else raise a DietcodeError naming the allowed ones."""
    if dtype not in DTYPES:
        raise DietcodeError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    return dtype


def tensor_input(name: str, elem_type: int, dims: Sequence[int | str]) -> onnx.ValueInfoProto:
    """A graph input/output with concrete (int) and symbolic (str) dims."""
    return helper.make_tensor_value_info(name, elem_type, list(dims))


class GraphBuilder:
    """Collects nodes and initializers of one graph; weights come from a seeded generator.

    Nodes are named like exporter output (``/encoder/layer.0/attention/query/MatMul``) and their
    outputs ``<node name>_output_<i>``, so names are unique as long as node names are.
    """

    def __init__(self, dtype: str, seed: int) -> None:
        self.dtype = check_dtype(dtype)
        self.elem_type = _ELEM[dtype]
        self._np_dtype = _NP[dtype]
        self._rng = np.random.default_rng(seed)
        self._nodes: list[onnx.NodeProto] = []
        self._initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def _claim(self, name: str) -> str:
        """Reserve a node/value name; a duplicate is a bug in the builder, not bad user input."""
        if name in self._names:
            raise ValueError(f"duplicate name in graph: {name}")
        self._names.add(name)
        return name

    def _add_initializer(self, name: str, array: np.ndarray) -> str:
        self._initializers.append(numpy_helper.from_array(array, self._claim(name)))
        return name

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        """A weight drawn from N(0, std^2) in float32, stored in the model dtype."""
        values = self._rng.standard_normal(tuple(shape), dtype=np.float32)
        values *= np.float32(std)
        return self._add_initializer(name, values.astype(self._np_dtype, copy=False))

    def fill(self, name: str, shape: Sequence[int], value: float) -> str:
        """A constant-valued weight in the model dtype (LayerNorm scale/bias, for instance)."""
        return self._add_initializer(name, np.full(tuple(shape), value, dtype=self._np_dtype))

    def scalar(self, name: str, value: float) -> str:
        """A 0-d constant in the model dtype, for elementwise arithmetic."""
        return self._add_initializer(name, np.array(value, dtype=self._np_dtype))

    def ints(self, name: str, values: Sequence[int] | int) -> str:
        """An int64 constant (shape pieces, gather indices, axes): 0-d for an int, 1-d for a list."""
        return self._add_initializer(name, np.array(values, dtype=np.int64))

    def op(self, op_type: str, inputs: Sequence[str], name: str, output: str | None = None,
           **attrs: Any) -> str:
        """Append a single-output node and return its output name (``output`` names a graph output)."""
        output = self._claim(output or f"{name}_output_0")
        self._nodes.append(helper.make_node(op_type, list(inputs), [output], name=self._claim(name), **attrs))
        return output

    def model(self, graph_name: str, inputs: Sequence[onnx.ValueInfoProto],
              outputs: Sequence[onnx.ValueInfoProto]) -> onnx.ModelProto:
        """Finish the graph (opset 17, IR version 10); the outputs must have been produced by ``op``."""
        graph = helper.make_graph(self._nodes, graph_name, list(inputs), list(outputs), self._initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="dietcode-ort.models")
        model.ir_version = IR_VERSION
        return model


def classifier_model(g: GraphBuilder, x: str, channels: int, classes: int, head: str, weight_std: float,
                     bias_std: float, graph_name: str) -> onnx.ModelProto:
    """An image classifier's end (GlobalAveragePool, Flatten, a Gemm with transposed weights ``head``.weight
    and ``head``.bias, output ``logits`` [batch, classes]) and the model of ``image`` [batch, 3, height, width]."""
    x = g.op("GlobalAveragePool", [x], "/avgpool/GlobalAveragePool")
    x = g.op("Flatten", [x], "/Flatten", axis=1)
    w = g.normal(f"{head}.weight", (classes, channels), weight_std)
    b = g.normal(f"{head}.bias", (classes,), bias_std)
    g.op("Gemm", [x, w, b], f"/{head}/Gemm", output="logits", alpha=1.0, beta=1.0, transB=1)
    return g.model(graph_name, [tensor_input("image", g.elem_type, ["batch", 3, "height", "width"])],
                   [tensor_input("logits", g.elem_type, ["batch", classes])])


def image_feeds(cfg: Any, dims: Mapping[str, int], dtype: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A standard-normal ``image`` (what a normalized photo looks like to the first conv) of ``dims``' batch,
    height and width: the image models' ``make_feeds``."""
    image = rng.standard_normal((dims["batch"], 3, dims["height"], dims["width"]), dtype=np.float32)
    return {"image": image.astype(dtype)}


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of weight data held inside the model (what decides whether it fits in one protobuf)."""
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_model(model: onnx.ModelProto, path: str | os.PathLike[str],
               external_threshold: int = PROTO_LIMIT) -> Path:
    """Save with IR version 10; weights go to ``<file>.data`` beside it when the model would not fit.

    ``external_threshold`` is the size of the weights (bytes) from which external data is used; it
    defaults to the protobuf limit. The caller's model is left unchanged. Returns the model path.
    """
    path = Path(path)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = IR_VERSION
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()  # onnx appends to an existing external-data file
    if initializer_bytes(out) + 1_000_000 > external_threshold:  # margin for the graph itself
        onnx.save_model(out, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
    else:
        onnx.save_model(out, str(path))
    return path


@dataclass(frozen=True)
class ModelBuilder:
    """One benchmark model: its presets (name -> config record) and how to build it and feed it.

    ``graph`` builds the model of a config; ``feeds`` draws inputs for given symbol values.
    """

    name: str
    summary: str
    symbols: tuple[str, ...]
    presets: Mapping[str, Any]
    graph: Callable[[Any, str, int], onnx.ModelProto]
    feeds: Callable[[Any, Mapping[str, int], str, np.random.Generator], dict[str, np.ndarray]]

    def config(self, preset: str) -> Any:
        """The config record of ``preset``; a DietcodeError names the allowed presets otherwise."""
        if preset not in self.presets:
            raise DietcodeError(f"unknown preset {preset!r} for model {self.name!r}; "
                                f"allowed: {', '.join(self.presets)}")
        return self.presets[preset]

    def __call__(self, preset: str, dtype: str = "float32", seed: int = 0) -> onnx.ModelProto:
        """Build the model of ``preset``; bad preset or dtype raise a DietcodeError."""
        config = self.config(preset)
        return self.graph(config, check_dtype(dtype), seed)

    def example_inputs(self, preset: str, dims: Mapping[str, int], dtype: str = "float32",
                       seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs for the model of ``preset`` at the symbol values ``dims``."""
        missing = [s for s in self.symbols if s not in dims]
        if missing:
            raise DietcodeError(f"model {self.name!r} needs values for symbols {', '.join(missing)}")
        return self.feeds(self.config(preset), dims, check_dtype(dtype), np.random.default_rng(seed))
