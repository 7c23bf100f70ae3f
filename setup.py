"""The two build steps pyproject.toml cannot declare (its metadata stays there):

- ``build_py`` also compiles the custom-op library into the package, ``dietcode_ort/_lib/libdietcode_ort.so``,
  through dietcode_ort.build (the one build entry point: same sources, flags and header lookup as a checkout's
  first-use build), so a serving machine needs no compiler, no ONNX Runtime headers and no triton;
- ``bdist_wheel`` tags the wheel ``py3-none-manylinux_2_<N>_<machine>``, N being the newest glibc version the
  built library needs (measured with readelf; it links nothing but the system C runtime).

Build needs: g++, the ORT C/C++ headers (``bash scripts/fetch_ort_headers.sh .deps/onnxruntime``, or
``DIETCODE_ORT_INCLUDE``) and cuda.h (from the triton wheel, a build requirement, or ``DIETCODE_CUDA_INCLUDE``).
An editable install (``pip install -e``, what ./dev.sh does) skips the library: a checkout builds its own on
first use.
"""
from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dietcode_ort import build as library  # noqa: E402


class BuildPyWithLibrary(build_py):
    """build_py, then the custom-op library into ``<build_lib>/dietcode_ort/_lib``."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        dest = Path(self.build_lib) / "dietcode_ort" / library.PACKAGED_DIR.name
        dest.mkdir(parents=True, exist_ok=True)
        info = library.build_packaged(dest)
        print(f"custom-op library: {dest} ({info.platform_tag}; needs {', '.join(info.symbol_versions)}; "
              f"links {', '.join(info.needed)})")


class BinaryDistribution(Distribution):
    """Carries a native library: installs into platlib, and the wheel is not pure."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """A wheel whose tag says what the packaged library needs: any Python 3 (it links no libpython), no Python
    ABI, and the manylinux glibc level measured on the built library."""

    def get_tag(self) -> tuple[str, str, str]:
        build_lib = Path(self.get_finalized_command("build_py").build_lib)
        info = build_lib / "dietcode_ort" / library.PACKAGED_DIR.name / "build_info.json"
        if not info.is_file():  # an editable wheel: no library inside
            return super().get_tag()
        import json

        return "py3", "none", json.loads(info.read_text())["platform_tag"]


setup(cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
