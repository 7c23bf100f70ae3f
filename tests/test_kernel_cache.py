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


def test_compiles_leave_no_triton_files_in_home_or_the_cache(tmp_path):
    """GEMM and attention compiles send Triton's working files to a temporary folder removed afterwards: nothing
    under ~/.triton (attention compiles wrote there, so a read-only ~/.triton failed optimize on a model with
    attention) and nothing but the kernel records in the kernel cache (GEMM compiles kept ~330 KB per kernel of
    files nothing read again)."""
    import os
    import subprocess
    import sys

    from _bad_models import ROOT

    home, cache = tmp_path / "home", tmp_path / "kernels"
    home.mkdir()
    script = ("from pathlib import Path\n"
              "import sys\n"
              "from tuner.aot import compile_kernel\n"
              "from tuner.attention import AttentionConfig, attention_space, compile_attention\n"
              "from tuner.space import Family, MicroKernel\n"
              "compile_kernel(Family('gemm', 'float16', 'sm_90'), MicroKernel(64, 64, 32, 4, 3), "
              "cache_dir=Path(sys.argv[1]))\n"
              "config = sorted(attention_space('float16', 'sm_90', 64), key=lambda c: c.key())[0]\n"
              "compile_attention(config, 'float16', 'sm_90', 64, scale=0.125, has_mask=False)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "XDG_"))}
    res = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=600,
                         env=dict(env, HOME=str(home), PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (home / ".triton" / "cache").exists(), list((home / ".triton").rglob("*"))[:5]
    assert not (cache / "triton").exists()
