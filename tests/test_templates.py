"""The Triton templates against torch references, run under TRITON_INTERPRET=1 (no GPU needed).

The interpreter flag must be set before triton is imported and switches every @triton.jit in the
process, so the cases (tests/_template_cases.py) run in one child process and each test here checks
one case's result. Input validation of the launcher runs in-process (no kernel is launched).
"""
from __future__ import annotations

from typing import Any

import pytest

from _interpreter import run_interpreted
from _template_cases import CASES


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_interpreted("_template_cases.py")


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_template_matches_torch(interpreted: dict[str, Any], name: str) -> None:
    outcome = interpreted[name]
    assert outcome["ok"], outcome.get("error")
    for result in outcome["results"]:
        assert result["shape_ok"] and result["dtype_ok"] and result["nan_ok"], result
        assert result["excess"] <= 0.0, f"{name} {result['config']}: max error {result['max_err']}"


def test_cases_cover_the_brief() -> None:
    """The case table keeps the coverage the templates promise (ragged, epilogues, split-K, conv)."""
    ops = {case.op for case in CASES}
    assert ops == {"gemm", "bmm", "conv"}
    assert {case.activation for case in CASES} == {"none", "relu", "gelu", "gelu_tanh", "silu", "relu6"}
    assert {case.dtype for case in CASES} == {"float32", "float16", "bfloat16"}
    for act in ("gelu_tanh", "silu", "relu6"):  # each new activation in the three dtypes
        assert {case.dtype for case in CASES if case.activation == act} == {"float32", "float16", "bfloat16"}
    assert any(len(cfg) == 7 and cfg[6] > 1 for case in CASES for cfg in case.configs)
    assert any(case.op == "gemm" and case.a[0] == 1 for case in CASES)
    assert any(case.op == "conv" and case.conv.get("dilations", (1, 1)) != (1, 1) for case in CASES)
    assert any(case.residual and case.activation == "gelu" for case in CASES)  # act(alpha*acc+bias)+residual
    assert any(case.residual and len(cfg) == 7 and cfg[6] > 1 for case in CASES for cfg in case.configs)
    # act(acc + bias + residual): ResNet's Conv -> Add -> Relu, also under split-K, and on gemm
    assert any(case.op == "conv" and case.residual_first and case.activation == "relu" and len(cfg) == 7
               and cfg[6] > 1 for case in CASES for cfg in case.configs)
    assert any(case.op == "gemm" and case.residual_first for case in CASES)
    # act(alpha * acc + bias) * residual: LLaMA's SwiGLU gate in the three dtypes, under split-K, and on conv
    assert {case.dtype for case in CASES if case.residual_mul and case.activation == "silu"} == \
        {"float32", "float16", "bfloat16"}
    assert any(case.residual_mul and len(cfg) == 7 and cfg[6] > 1 for case in CASES for cfg in case.configs)
    assert any(case.op == "conv" and case.residual_mul for case in CASES)
    assert any(case.op == "bmm" and case.alpha != 1.0 for case in CASES)
    assert {case.activation for case in CASES if case.nan_rows} == {"relu", "relu6"}  # NaN passes both
    # channels-last conv: the vector path (channels a multiple of BLOCK_K) and the per-element one, split-K
    # whose last slices lie past K, every residual form
    nhwc = [case for case in CASES if case.conv.get("channels_last")]
    assert any(case.a[1] % cfg[2] == 0 for case in nhwc for cfg in case.configs)
    assert any(case.a[1] % cfg[2] for case in nhwc for cfg in case.configs)
    assert any(len(cfg) == 7 and -(-case.a[1] * case.b[2] * case.b[3] // (cfg[2] * cfg[6])) * cfg[2] * cfg[6]
               > case.a[1] * case.b[2] * case.b[3] + cfg[2] for case in nhwc for cfg in case.configs)
    assert {(c.residual_first, c.residual_mul) for c in nhwc if c.residual} == {(False, False), (True, False),
                                                                               (False, True)}


def test_launcher_rejects_bad_epilogues() -> None:
    torch = pytest.importorskip("torch")
    from dietcode_ort.errors import DietcodeError
    from tuner.space import MicroKernel
    from tuner.templates import run
    from tuner.workload import ConvParams, Epilogue

    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    with pytest.raises(DietcodeError, match="allowed: none, relu, gelu, gelu_tanh, silu, relu6"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, epilogue=Epilogue(False, "tanh"))
    with pytest.raises(DietcodeError, match="split_k must be a positive int, got 0"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2, 8, 0), a, b, epilogue=Epilogue(False, "relu"))
    with pytest.raises(DietcodeError, match="bias tensor missing"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, epilogue=Epilogue(True, "none"))
    with pytest.raises(DietcodeError, match="residual tensor missing"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, epilogue=Epilogue(residual=True))
    with pytest.raises(DietcodeError, match="the output's shape"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, residual=torch.zeros(1, 4), epilogue=Epilogue(residual=True))
    with pytest.raises(DietcodeError, match="only the gemm and conv templates add a residual"):
        run("bmm", MicroKernel(16, 16, 16, 2, 2), a[None], b[None], residual=torch.zeros(1, 4, 4),
            epilogue=Epilogue(residual=True))
    with pytest.raises(DietcodeError, match="residual_first orders a residual before an activation: it needs both"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, residual=torch.zeros(4, 4),
            epilogue=Epilogue(residual=True, residual_first=True))
    for bad in (Epilogue(activation="silu", residual_mul=True), Epilogue(residual=True, residual_mul=True),
                Epilogue(False, "silu", 1.0, True, residual_first=True, residual_mul=True)):
        with pytest.raises(DietcodeError, match="residual_mul multiplies an activation's result by a residual: it "
                                                "needs both and no residual_first"):
            run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, residual=torch.zeros(4, 4), epilogue=bad)
    with pytest.raises(DietcodeError, match=r"conv: the residual must have the output's shape \(1, 4, 3, 3\)"):
        run("conv", MicroKernel(16, 16, 16, 2, 2), torch.zeros(1, 3, 5, 5), torch.zeros(4, 3, 3, 3),
            conv=ConvParams(3, 4, (3, 3)), residual=torch.zeros(1, 4, 9), epilogue=Epilogue(residual=True))
    with pytest.raises(DietcodeError, match="finite, non-zero float"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, b, epilogue=Epilogue(alpha=float("inf")))
    with pytest.raises(DietcodeError, match="allowed: gemm, bmm, conv"):
        run("attention", MicroKernel(16, 16, 16, 2, 2), a, b)
    with pytest.raises(DietcodeError, match="inner dims"):
        run("gemm", MicroKernel(16, 16, 16, 2, 2), a, torch.zeros(5, 4))
    conv = ConvParams(3, 4, (3, 3))
    with pytest.raises(DietcodeError, match=r"W \[4, 3, 3, 3\]"):
        run("conv", MicroKernel(16, 16, 16, 2, 2), torch.zeros(1, 3, 5, 5), torch.zeros(4, 3, 1, 1), conv=conv)
    with pytest.raises(DietcodeError, match="smaller than the dilated kernel"):
        run("conv", MicroKernel(16, 16, 16, 2, 2), torch.zeros(1, 3, 2, 5), torch.zeros(4, 3, 3, 3), conv=conv)
    nhwc = ConvParams(3, 4, (3, 3), channels_last=True)
    with pytest.raises(DietcodeError, match=r"channels-last expects X \[n, H, W, 3\] and W \[4, 3, 3, 3\]"):
        run("conv", MicroKernel(16, 16, 16, 2, 2), torch.zeros(1, 3, 5, 5), torch.zeros(4, 3, 3, 3), conv=nhwc)
    with pytest.raises(DietcodeError, match="channels-last form is ungrouped only, got groups=3"):
        run("conv", MicroKernel(16, 16, 16, 2, 2), torch.zeros(1, 5, 5, 3), torch.zeros(3, 3, 3, 1),
            conv=ConvParams(3, 3, (3, 3), groups=3, channels_last=True))
