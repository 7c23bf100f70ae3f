"""The one error type users see: a message naming the problem, printed on one line by the CLI."""
from __future__ import annotations

import os

__all__ = ["DietcodeError", "check_model_file"]


class DietcodeError(Exception):
    """Bad input or an unmet requirement; the CLI prints ``error: <message>`` and exits non-zero."""


def check_model_file(path: "str | os.PathLike[str]") -> None:
    """DietcodeError unless ``path`` is a file: a folder is named as one (a model file was meant), not as missing."""
    from pathlib import Path

    if Path(path).is_dir():
        raise DietcodeError(f"{path} is a directory, not a model file")
    if not Path(path).is_file():
        raise DietcodeError(f"model file not found: {path}")
