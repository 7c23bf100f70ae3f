"""The conv template's channels-last (NHWC) form: what it compiles to on sm_90 against the NCHW form of the same
layer and tile, and how the compile path keys and refuses it. Its numerics are tests/_template_cases.py's
``conv_nhwc_*`` cases (the interpreter against torch)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from dietcode_ort.errors import DietcodeError
from tuner.aot import cache_key, compile_kernel, shipped_div16
from tuner.space import Family, MicroKernel
from tuner.workload import ConvParams, Epilogue

pytestmark = pytest.mark.ptx

FP16_H100 = Family("conv", "float16", "sm_90")
TILE = MicroKernel(128, 64, 64, 4, 3)  # a wgmma tile that BERT-sized GEMMs pick; NCHW conv spills on it
RESNET_3X3 = ConvParams(64, 64, (3, 3), pads=(1, 1, 1, 1))  # ResNet-50's first-stage 3x3 conv
EPILOGUE = Epilogue(bias=True, activation="relu", residual=True, residual_first=True)  # Conv -> Add -> Relu
_COPY = re.compile(r"cp\.async\.c[ag]\.shared\.global\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)")


def _ops(ptx: str) -> Counter[str]:
    return Counter(re.findall(r"\b((?:ld|st)\.global[.\w]*)", ptx))


def test_channels_last_loads_in_vectors_without_spills(tmp_path: Path) -> None:
    """NCHW gathers X element by element: every element of the A tile has its own 64-bit address and predicate,
    so the 128x64 tile runs out of registers and spills. NHWC reads a K slice as a run of one pixel's channels:
    16-byte cp.async copies, no scalar loads, no spills, and the output, bias and residual in vectors too."""
    div16 = shipped_div16("conv", True, 64, 64 * 9, residual=True)
    assert "N" in div16 and "K" in div16  # the output's rows are N elements long (NHWC): vector stores
    nchw, nhwc = (compile_kernel(FP16_H100, TILE, epilogue=EPILOGUE, conv=layer, div16=div16, cache_dir=tmp_path)
                  for layer in (RESNET_3X3, ConvParams(**{**RESNET_3X3.__dict__, "channels_last": True})))
    ops = _ops(nhwc.ptx)
    assert nhwc.n_spills == 0 and nhwc.mma == "wgmma"
    assert ops["ld.global.b16"] == 0 and ops["st.global.b16"] == 0 and ops["st.global.v4.b32"] > 0
    assert set(_COPY.findall(nhwc.ptx)) == {"0x10"}
    # the NCHW form of the same tile: scalar gathers (at least one per A element a thread holds) and stores
    threads = TILE.num_warps * 32
    assert _ops(nchw.ptx)["ld.global.b16"] >= TILE.block_m * TILE.block_k // threads
    assert _ops(nchw.ptx)["st.global.b16"] > 0
    assert nhwc.n_regs < nchw.n_regs


def test_channels_last_is_its_own_kernel_and_ungrouped_only(tmp_path: Path) -> None:
    nhwc = ConvParams(64, 64, (3, 3), pads=(1, 1, 1, 1), channels_last=True)
    keys = {cache_key(FP16_H100, TILE, epilogue=Epilogue(), trans_b=False, conv=c, div16=(), allow_tf32=False)
            for c in (RESNET_3X3, nhwc)}
    assert len(keys) == 2  # an NCHW compile never answers for an NHWC one
    with pytest.raises(DietcodeError, match="channels-last form is ungrouped only, got groups=2"):
        compile_kernel(FP16_H100, TILE, conv=ConvParams(64, 64, (3, 3), groups=2, channels_last=True),
                       cache_dir=tmp_path)


def test_channels_last_space_admits_the_tiles_nchw_gathers_cannot():
    """The registers rule charges the NHWC form a 64-bit address and a predicate per 16-byte vector, not per
    element: its space holds every NCHW config and the large wgmma tiles the NCHW gather spills on."""
    from tuner.space import enumerate_space

    nchw, nhwc = (set(enumerate_space(FP16_H100, channels_last=cl)) for cl in (False, True))
    assert nchw < nhwc and len(nhwc) > 2 * len(nchw)
    assert TILE in nhwc and TILE not in nchw
    assert MicroKernel(128, 128, 64, 8, 5) in nhwc and MicroKernel(128, 128, 64, 8, 5) not in nchw
