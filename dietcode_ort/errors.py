"""The one error type users see: a message naming the problem, printed on one line by the CLI."""
from __future__ import annotations

import os

__all__ = ["DietcodeError", "check_model_file", "note_stop", "raise_if_stopped"]


class DietcodeError(Exception):
    """Bad input or an unmet requirement; the CLI prints ``error: <message>`` and exits non-zero."""


def check_model_file(path: "str | os.PathLike[str]") -> None:
    """DietcodeError unless ``path`` is a file: a folder is named as one (a model file was meant), not as missing."""
    from pathlib import Path

    if Path(path).is_dir():
        raise DietcodeError(f"{path} is a directory, not a model file")
    if not Path(path).is_file():
        raise DietcodeError(f"model file not found: {path}")


# The exception a signal handler raised (the CLI's: KeyboardInterrupt for SIGINT, its own for SIGTERM), kept because
# the raise can be lost: a handler that runs inside a callback whose exceptions Python ignores (the at-fork hooks
# logging registers, run as a compile pool forks its workers; a finalizer) has its exception printed as "ignored"
# and the program goes on. ``raise_if_stopped`` raises it again where that must not happen: before a command
# writes its result, and when it returns.
_stopped: "type[BaseException] | None" = None


def note_stop(kind: "type[BaseException] | None") -> None:
    """Record that a signal asked this process to stop with ``kind`` (the handler then raises it); None forgets it
    (a new command starts)."""
    global _stopped
    _stopped = kind


def raise_if_stopped() -> None:
    """Raise the recorded stop again, if a signal asked for one (whether or not its first raise got through)."""
    if _stopped is not None:
        raise _stopped()

