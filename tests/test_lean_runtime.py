"""The runtime needs none of the tuner's dependencies (issue: "install it as users do").

A child Python process is started with triton, scikit-learn, sympy, torch and the ``tuner`` package made
unimportable (a ``sys.meta_path`` finder refusing them, as on a machine with ``pip install dietcode-ort``
only). There it imports ``dietcode_ort``, runs an optimized model (built here, in the parent, by the tuner)
with ``dietcode_ort.InferenceSession`` on the CPU EP, runs ``dietcode-ort inspect`` and ``doctor``, and
checks that each tuner command refuses with one line naming the ``tune`` extra. The same work in a child
without the blocker must leave those modules out of ``sys.modules`` (nothing imports them and swallows the
failure).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

BLOCKED = ("triton", "sklearn", "sympy", "torch", "tuner")

_BLOCKER = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""

# Runs in the child; prints one JSON line of findings.
_BODY = """
import contextlib, io, json, sys
import numpy as np

import dietcode_ort
import dietcode_ort.cli
import dietcode_ort.doctor
from dietcode_ort.cli import main

found = {}
data = np.load(DATA)
sess = dietcode_ort.InferenceSession(OPT, providers=["CPUExecutionProvider"])
found["max_error"] = float(np.abs(sess.run(None, {"x": data["x"]})[0] - data["want"]).max())


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


rc, out, err = cli("inspect", OPT, "--json")
nodes = json.loads(out)["nodes"]
found["inspect"] = {"rc": rc, "err": err, "nodes": len(nodes), "kernels": [k["name"] for k in nodes[0]["kernels"]],
                    "if_chain": nodes[0]["tree"]["if_chain"]}
rc, out, err = cli("inspect", OPT)
found["inspect_table"] = {"rc": rc, "err": err, "has_node": "ai.dietcode nodes" in out}
rc, out, err = cli("doctor", "--json", "--no-build")
found["doctor"] = {"rc": rc, "err": err, "checks": {c["name"]: c["status"] for c in json.loads(out)}}
found["loaded_before_tuner"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
found["tuner_commands"] = {}
for argv in () if not BLOCK else (("scan", SRC, "--dim", "n=1:4"), ("space", "--target", "sm_90", "--op", "gemm"),
             ("optimize", SRC, "-o", OUT_DIR + "/x.onnx", "--dim", "n=1:4"),
             ("bench", SRC, "--optimized", OPT, "--dim", "n=1,2")):
    rc, out, err = cli(*argv)
    found["tuner_commands"][argv[0]] = {"rc": rc, "out": out, "err": err}
found["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from _bad_models import matmul_model, save

    import dietcode_ort
    from tuner.optimize import OptimizeOptions, optimize

    work = tmp_path_factory.mktemp("lean")
    src = save(matmul_model(), work / "tiny.onnx")
    out = work / "tiny.opt.onnx"
    optimize(src, out, OptimizeOptions(dims=("n=1:16",), measure="analytic", budget=8, db=work / "t.db",
                                       cache_dir=work / "kernels", progress=False), log=lambda _: None)
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.savez(work / "io.npz", x=x, want=want)
    # a serving machine has a prebuilt library (no compiler, no triton for cuda.h): build it here, point to it
    return {"SRC": str(src), "OPT": str(out), "DATA": str(work / "io.npz"), "OUT_DIR": str(work),
            "library": str(dietcode_ort.library_path())}


def _child(optimized: dict[str, str], block: bool) -> dict:
    consts = "".join(f"{k} = {optimized[k]!r}\n" for k in ("SRC", "OPT", "DATA", "OUT_DIR"))
    code = f"BLOCKED = {BLOCKED!r}\nBLOCK = {block!r}\n" + (_BLOCKER if block else "") + consts + textwrap.dedent(_BODY)
    env = dict(os.environ, DIETCODE_ORT_LIBRARY=optimized["library"], PYTHONPATH=str(Path(__file__).parents[1]))
    env.pop("DIETCODE_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=optimized["OUT_DIR"])
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CACHE: dict[str, dict] = {}


def _blocked(optimized: dict[str, str]) -> dict:
    """The child with the blocker, run once for the tests below."""
    if "blocked" not in _CACHE:
        _CACHE["blocked"] = _child(optimized, block=True)
    return _CACHE["blocked"]


def test_runtime_runs_without_the_tuner_dependencies(optimized) -> None:
    found = _blocked(optimized)
    assert found["max_error"] < 1e-4
    inspect = found["inspect"]
    assert inspect["rc"] == 0 and inspect["err"] == "" and inspect["nodes"] == 1
    assert inspect["kernels"] and inspect["if_chain"].split()[0] in ("if", "always")
    assert found["inspect_table"] == {"rc": 0, "err": "", "has_node": True}
    doctor = found["doctor"]
    assert doctor["checks"]["custom-op library"] == "ok" and doctor["checks"]["onnxruntime"] == "ok"
    assert doctor["checks"]["triton"] == "warn" and "Traceback" not in doctor["err"]
    assert found["loaded"] == []


@pytest.mark.parametrize("command", ["scan", "space", "optimize", "bench"])
def test_tuner_commands_name_the_tune_extra(optimized, command: str) -> None:
    result = _blocked(optimized)["tuner_commands"][command]
    assert result["rc"] == 2 and result["out"] == ""
    lines = result["err"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result["err"], result["err"]
    assert f"`dietcode-ort {command}`" in lines[0] and "pip install 'dietcode-ort[tune]'" in lines[0]
    assert "triton" in lines[0] and "sympy" in lines[0]


def test_runtime_imports_nothing_of_the_tuner(optimized) -> None:
    """Unblocked, the same work (without the tuner commands) leaves the tuner and its dependencies out of
    sys.modules: nothing imports one and swallows the failure."""
    found = _child(optimized, block=False)
    assert found["max_error"] < 1e-4 and found["inspect"]["rc"] == 0 and found["doctor"]["rc"] in (0, 1)
    assert found["loaded_before_tuner"] == []

