"""Where the project writes by default, and the one check that a folder can be written.

Every default location (tuning database, kernel cache, custom-op library cache) lives under
``user_cache_dir()``: ``$XDG_CACHE_HOME/dietcode-ort``, else ``~/.cache/dietcode-ort``. Each is created on
first use by ``writable_dir``, which names the folder and the option or environment variable that moves
it when it cannot be created or written.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Mapping

from dietcode_ort.errors import DietcodeError

__all__ = ["user_cache_dir", "writable_dir"]


def user_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/dietcode-ort``, else ``~/.cache/dietcode-ort`` (not created here). As the XDG spec
    says, a relative XDG_CACHE_HOME is ignored; an empty or relative HOME falls back to the password entry's
    home (a cache under the current folder would move with ``cd``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME")
    if base and Path(base).expanduser().is_absolute():
        return Path(base).expanduser() / "dietcode-ort"
    home = env.get("HOME", "")
    if not Path(home).is_absolute():
        try:
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        except (KeyError, ImportError):  # no password entry (a container's anonymous uid), no pwd module
            home = ""
    if not Path(home).is_absolute():
        raise DietcodeError("cannot locate the user cache folder: set XDG_CACHE_HOME or HOME to an absolute "
                            "folder") from None
    return Path(home) / ".cache" / "dietcode-ort"


def writable_dir(path: Path, what: str, override: str) -> Path:
    """Create ``path`` (and its parents) if missing and check that files can be created in it.

    ``what`` names the folder's role ("kernel cache"), ``override`` how to choose another one
    ("--cache-dir or DIETCODE_CACHE"); both appear in the DietcodeError raised when it is unusable.
    The check writes and removes a probe file: permission bits alone do not tell (root, read-only mounts).
    """
    path = Path(path)
    hint = f"; use {override} to choose a writable folder"
    if path.exists() and not path.is_dir():
        raise DietcodeError(f"the {what} folder {path} is not a folder{hint}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DietcodeError(f"cannot create the {what} folder {path} ({exc.strerror or exc}){hint}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DietcodeError(f"the {what} folder {path} is not writable ({exc.strerror or exc}){hint}") from None
    return path


def process_gone(pid: int) -> bool:
    """True when no process ``pid`` exists (a file named after it was left by a run that was killed); False for
    a live one, another user's included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False
