"""Model files: write a model whose weights may still be in its input's external data files.

A model loaded with ``load_external_data=False`` holds only the graph; its external tensors name the
input's data files. ``write_model`` writes it as its own: the bytes of every external tensor are
streamed (in chunks, never through numpy or protobuf) from the input's files into the output's
``NAME.data``, and the written tensors point there, so the output never depends on the input's files.
The protobuf itself is written field by field (the graph's initializers one at a time), so writing holds
no serialized copy of the weights, and ``read_model`` reads a file the same way (no copy of the file in
memory). A model that would pass protobuf's 2 GB limit gets its inline tensors appended to the data file
too. The caller's model is not modified.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import onnx

from dietcode_ort.errors import DietcodeError

__all__ = ["copy_without", "external_source", "is_external", "inline_tensor", "read_model", "write_model", "TWO_GB"]

TWO_GB = 2 * 1024 ** 3
_CHUNK = 16 * 1024 ** 2
_SMALL = 1024  # inline tensors below this stay in the protobuf even when it is large
_ALIGN_LARGE, _LARGE = 4096, 1024 ** 2  # tensors from 1 MiB start on a page (mmap-friendly), others on 64 B


def is_external(t: onnx.TensorProto) -> bool:
    """Whether ``t``'s value is in a file (HasField: reading ``raw_data`` would copy the bytes)."""
    return t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data")


def _refs(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def external_source(t: onnx.TensorProto, base_dir: Path | None) -> tuple[Path, int, int | None]:
    """The file, offset and length (None: to the end of the file) of an external tensor's bytes."""
    refs = _refs(t)
    location = refs.get("location")
    if not location:
        raise DietcodeError(f"tensor {t.name!r} is external data without a location")
    if base_dir is None:
        raise DietcodeError(f"tensor {t.name!r} is external data ({location}) and no folder to read it from "
                            "was given")
    path = Path(base_dir) / location
    inside = Path(base_dir).resolve()
    if Path(location).is_absolute() or not path.resolve().is_relative_to(inside):
        # ONNX's rule (onnx.load and ORT refuse the same): a model names files beside it, never elsewhere
        raise DietcodeError(f"external data of tensor {t.name!r} ({location}) points outside the model's "
                            f"folder {inside}")
    if not path.is_file():
        raise DietcodeError(f"external data of tensor {t.name!r} not found: {path}")
    try:
        offset = int(refs.get("offset", "0"))
        length = int(refs["length"]) if "length" in refs else None
    except ValueError:
        raise DietcodeError(f"tensor {t.name!r} has a malformed external data offset or length") from None
    size = path.stat().st_size
    if offset < 0 or offset > size or (length is not None and (length < 0 or offset + length > size)):
        raise DietcodeError(f"external data of tensor {t.name!r} lies outside {path} ({size} bytes)")
    return path, offset, length


def inline_tensor(t: onnx.TensorProto, base_dir: Path | None) -> onnx.TensorProto:
    """A copy of ``t`` holding its value (read from its external data file when it has one)."""
    out = onnx.TensorProto()
    out.CopyFrom(t)
    if not is_external(t):
        return out
    path, offset, length = external_source(t, base_dir)
    with open(path, "rb") as f:
        f.seek(offset)
        out.raw_data = f.read() if length is None else f.read(length)
    del out.external_data[:]
    out.data_location = onnx.TensorProto.DEFAULT
    return out


@dataclass
class _DataFile:
    """The output's data file, written sequentially; opened on first use."""

    path: Path
    location: str  # as the written tensors name it (relative to the model file)
    base_dir: Path | None
    file: BinaryIO | None = None
    size: int = 0
    copied: dict[tuple[Path, int, int | None], tuple[int, int]] = field(default_factory=dict)

    def _start(self, nbytes: int) -> int:
        if self.file is None:
            self.file = open(self.path, "wb")
        align = _ALIGN_LARGE if nbytes >= _LARGE else 64
        pad = -self.size % align
        if pad:
            self.file.write(b"\0" * pad)
            self.size += pad
        return self.size

    def copy_external(self, t: onnx.TensorProto) -> None:
        """Stream ``t``'s bytes from its file into this one (once per distinct source range) and point
        ``t`` here."""
        key = external_source(t, self.base_dir)
        if key not in self.copied:
            path, offset, length = key
            total = path.stat().st_size - offset if length is None else length
            start = self._start(total)
            assert self.file is not None
            with open(path, "rb") as src:
                src.seek(offset)
                left = total
                while left:
                    chunk = src.read(min(_CHUNK, left))
                    if not chunk:
                        raise DietcodeError(f"external data of tensor {t.name!r} ends early in {path}")
                    self.file.write(chunk)
                    left -= len(chunk)
            self.size += total
            self.copied[key] = (start, total)
        self._point(t, *self.copied[key])

    def move_inline(self, t: onnx.TensorProto) -> onnx.TensorProto:
        """A copy of the inline tensor ``t`` whose value is appended here (``t`` keeps its value)."""
        data = t.raw_data
        start = self._start(len(data))
        assert self.file is not None
        self.file.write(data)
        self.size += len(data)
        out = copy_without(t, "raw_data")
        self._point(out, start, len(data))
        return out

    def _point(self, t: onnx.TensorProto, offset: int, length: int) -> None:
        kept = [(k, v) for k, v in _refs(t).items() if k not in ("location", "offset", "length", "checksum")]
        del t.external_data[:]
        for k, v in [("location", self.location), ("offset", str(offset)), ("length", str(length))] + kept:
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        t.data_location = onnx.TensorProto.EXTERNAL

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _repeated(desc) -> bool:
    is_repeated = getattr(desc, "is_repeated", None)  # protobuf >= 6; older ones only have the label
    return bool(is_repeated) if is_repeated is not None else desc.label == desc.LABEL_REPEATED


def copy_without(message, *skip: str):
    """A copy of ``message`` without the fields ``skip`` (those are never copied)."""
    out = type(message)()
    for desc, value in message.ListFields():
        if desc.name in skip:
            continue
        if _repeated(desc):
            getattr(out, desc.name).extend(value)
        elif desc.type == desc.TYPE_MESSAGE:
            getattr(out, desc.name).CopyFrom(value)
        else:
            setattr(out, desc.name, value)
    return out


def _graph_tensors(graph: onnx.GraphProto, initializers: bool = True) -> Iterator[onnx.TensorProto]:
    if initializers:
        yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensors(graph.node)


def _node_tensors(nodes) -> Iterator[onnx.TensorProto]:
    for n in nodes:
        for a in n.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values
                yield a.sparse_tensor.indices
            if a.HasField("g"):
                yield from _graph_tensors(a.g)
            for g in a.graphs:
                yield from _graph_tensors(g)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, size: int) -> bytes:
    """The header of a length-delimited field."""
    return _varint(number << 3 | 2) + _varint(size)


_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data


def _tensor_size(t: onnx.TensorProto) -> int:
    """``t``'s serialized size, as ``_write_tensor`` writes it. (upb's ByteSize serializes the message to
    size it: for a large tensor, twice its size on top of the model.)"""
    if not t.HasField("raw_data"):
        return t.ByteSize()
    n = len(t.raw_data)
    return copy_without(t, "raw_data").ByteSize() + len(_field(_RAW_DATA, n)) + n


def _write_tensor(f: BinaryIO, t: onnx.TensorProto) -> None:
    """``t`` serialized, its ``raw_data`` last and written as it is (serializing a large tensor whole
    builds it in a growing buffer, then copies it out)."""
    if not t.HasField("raw_data"):
        f.write(t.SerializeToString())
        return
    f.write(copy_without(t, "raw_data").SerializeToString())
    raw = t.raw_data
    f.write(_field(_RAW_DATA, len(raw)))
    f.write(raw)

def write_model(model: onnx.ModelProto, path: Path, data_path: Path, base_dir: Path | None,
                limit: int = TWO_GB) -> bool:
    """Write ``model`` to ``path``; tensor bytes that live outside the protobuf go to ``data_path``, which
    the written tensors name by its file name (it must end up beside the model file). ``base_dir``: the
    folder the model's external tensors are read from; ``limit``: the protobuf size from which inline
    tensors go to the data file too. Returns whether ``data_path`` was written."""
    assert model.graph.DESCRIPTOR.fields_by_name["initializer"].number == _INITIALIZER
    assert onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number == _RAW_DATA
    head = copy_without(model, "graph")
    graph = copy_without(model.graph, "initializer")
    inline = {i: _tensor_size(t) for i, t in enumerate(model.graph.initializer) if not is_external(t)}
    large = sum(inline.values()) + head.ByteSize() + graph.ByteSize() + (64 << 20) > limit  # margin: headers
    data = _DataFile(data_path, data_path.name, base_dir)
    try:
        for t in _graph_tensors(graph, initializers=False):
            if is_external(t):
                data.copy_external(t)
        for t in _node_tensors([n for f in head.functions for n in f.node]):
            if is_external(t):
                data.copy_external(t)
        entries: list[tuple[onnx.TensorProto, int]] = []
        for i, t in enumerate(model.graph.initializer):
            if i not in inline:
                entry = onnx.TensorProto()
                entry.CopyFrom(t)
                data.copy_external(entry)
            elif large and inline[i] >= _SMALL and t.HasField("raw_data"):  # typed fields stay inline
                entry = data.move_inline(t)
            else:
                entries.append((t, inline[i]))
                continue
            entries.append((entry, entry.ByteSize()))  # a small tensor pointing at the data file
    finally:
        data.close()
    sizes = [size for _, size in entries]
    graph_size = graph.ByteSize() + sum(len(_field(_INITIALIZER, s)) + s for s in sizes)
    if graph_size + head.ByteSize() >= TWO_GB:
        raise DietcodeError(f"cannot write {path}: its graph is {graph_size} bytes without the weights, past "
                            "protobuf's 2 GB limit")
    with open(path, "wb") as f:
        f.write(head.SerializeToString())
        f.write(_field(_GRAPH, graph_size))
        f.write(graph.SerializeToString())
        for entry, size in entries:
            f.write(_field(_INITIALIZER, size))
            _write_tensor(f, entry)
    return data.file is not None


def _read_varint(f: BinaryIO) -> tuple[int, bytes]:
    """A varint from ``f``: its value and its bytes."""
    raw = bytearray()
    value = shift = 0
    while True:
        b = f.read(1)
        if not b:
            raise ValueError("truncated protobuf (a varint runs past the end of the file)")
        raw += b
        value |= (b[0] & 0x7F) << shift
        shift += 7
        if not b[0] & 0x80:
            return value, bytes(raw)
        if shift > 63:
            raise ValueError("malformed protobuf varint")


def _read_field(f: BinaryIO, end: int) -> tuple[int, bytes, int]:
    """The next field of a message that ends at ``end``: (number, its header bytes, its value's length
    for a length-delimited field, else -1 with the value already in the header bytes)."""
    tag, raw = _read_varint(f)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
        return number, raw + _read_varint(f)[1], -1
    if wire in (1, 5):
        value = f.read(8 if wire == 1 else 4)
        if len(value) != (8 if wire == 1 else 4):
            raise ValueError("truncated protobuf (a fixed-size field runs past the end of the file)")
        return number, raw + value, -1
    if wire != 2:
        raise ValueError(f"unsupported protobuf wire type {wire}")
    length, header = _read_varint(f)
    if f.tell() + length > end:
        raise ValueError("truncated protobuf (a field runs past the end of its message)")
    return number, raw + header, length


def _read_field_bytes(f: BinaryIO, header: bytes, length: int) -> bytearray:
    """``header`` followed by the next ``length`` bytes of ``f``, read in place (no second copy)."""
    buf = bytearray(len(header) + length)
    buf[:len(header)] = header
    if f.readinto(memoryview(buf)[len(header):]) != length:  # type: ignore[attr-defined]
        raise ValueError("truncated protobuf")
    return buf


def read_model(path: Path) -> onnx.ModelProto:
    """Parse a binary ONNX model file without its external data, one field at a time (the graph's
    fields, initializers included, one by one): memory holds the model and at most one field's bytes,
    never a copy of the file. Parsing the fields in order equals parsing the whole message."""
    model = onnx.ModelProto()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while f.tell() < size:
            number, header, length = _read_field(f, size)
            if length < 0:
                model.MergeFromString(header)
            elif number == _GRAPH:
                end = f.tell() + length
                while f.tell() < end:
                    _, field_header, field_length = _read_field(f, end)
                    model.graph.MergeFromString(field_header if field_length < 0 else
                                                _read_field_bytes(f, field_header, field_length))
                if f.tell() != end:
                    raise ValueError("malformed protobuf (a graph field runs past the graph)")
            else:
                model.MergeFromString(_read_field_bytes(f, header, length))
    return model
