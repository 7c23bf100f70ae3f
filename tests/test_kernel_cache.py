"""A damaged kernel-cache entry (truncated, edited, or the record of another kernel) is rebuilt, never
used; an intact one is used without compiling."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tuner import aot
from tuner.aot import compile_kernel
from tuner.space import Family, MicroKernel

FAMILY = Family("gemm", "float32", "sm_80")
TILE = MicroKernel(32, 32, 32, 4, 2)
OTHER = MicroKernel(64, 32, 32, 4, 2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("kernel_cache")
    compile_kernel(FAMILY, TILE, cache_dir=folder)
    compile_kernel(FAMILY, OTHER, cache_dir=folder)
    return folder


def _entry(cache: Path, config: MicroKernel) -> Path:
    return cache / f"{aot.cache_key(FAMILY, config, epilogue=aot.Epilogue(), trans_b=False, conv=None, div16=(), allow_tf32=False)}.json"


def _flip_cubin_byte(text: str) -> str:
    entry = json.loads(text)
    cubin = bytearray(base64.b64decode(entry["kernel"]["cubin"]))
    cubin[len(cubin) // 2] ^= 0xFF
    entry["kernel"]["cubin"] = base64.b64encode(bytes(cubin)).decode()
    return json.dumps(entry)


DAMAGE = {
    "truncated": lambda text, other: text[: len(text) // 2],
    "cubin edited": lambda text, other: _flip_cubin_byte(text),
    "another kernel's record": lambda text, other: other,
    "not an object": lambda text, other: "[1, 2, 3]",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_rebuilt(cache, monkeypatch, damage):
    path, other = _entry(cache, TILE), _entry(cache, OTHER)
    good = compile_kernel(FAMILY, TILE, cache_dir=cache)
    path.write_text(DAMAGE[damage](path.read_text(), other.read_text()))
    calls = []
    real = aot._triton_compile
    monkeypatch.setattr(aot, "_triton_compile", lambda *a, **k: calls.append(1) or real(*a, **k))
    rebuilt = compile_kernel(FAMILY, TILE, cache_dir=cache)
    assert calls == [1] and rebuilt == good
    assert compile_kernel(FAMILY, TILE, cache_dir=cache) == good and calls == [1]  # the rewrite is intact
