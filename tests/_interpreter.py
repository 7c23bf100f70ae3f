"""Run a case script under TRITON_INTERPRET=1 in a child process and return the JSON it prints last.

The interpreter flag must be set before triton is imported and switches every @triton.jit in the process,
so interpreted cases never run inside the pytest process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: float = 300) -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case_main(cases: Mapping[str, tuple[Any, ...]], run: Callable[..., dict], extra: Mapping[str, Callable[[], Any]]
              ) -> int:
    """A case script's main under the interpreter: ``run(*case)`` per case (an exception is that case's
    error), then each ``extra`` entry, printed as one JSON line; exit 2 without TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from _splitk_cases import _exact_bf16_dot

    _exact_bf16_dot()
    out: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            out[name] = run(*case)
        except Exception as exc:  # noqa: BLE001 - reported per case to the parent test
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out.update({name: fn() for name, fn in extra.items()})
    print(json.dumps(out))
    return 0
