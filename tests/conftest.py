"""Fixtures shared by several test files."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def pytest_report_header(config: pytest.Config) -> str:
    """Which Triton compiles the kernels (``./dev.sh ptx`` runs the compile tests under another one)."""
    try:
        import triton
    except ImportError:
        return "triton: not installed"
    return f"triton {triton.__version__} ({Path(triton.__file__).parent})"


def _unwritable(path: Path) -> bool:
    try:
        fd, probe = tempfile.mkstemp(dir=path)
    except OSError:
        return True
    os.close(fd)
    os.unlink(probe)
    return False


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """An existing folder nothing can be written to: a chmod 0555 folder, or, for root (whom permission
    bits do not stop), /sys (a read-only filesystem for every user)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if _unwritable(folder):
            yield folder
        elif Path("/sys").is_dir() and _unwritable(Path("/sys")):
            yield Path("/sys")
        else:
            pytest.skip("no read-only folder available to this user")
    finally:
        folder.chmod(0o755)
