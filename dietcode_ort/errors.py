"""The one error type users see: a message naming the problem, printed on one line by the CLI."""
from __future__ import annotations

__all__ = ["DietcodeError"]


class DietcodeError(Exception):
    """Bad input or an unmet requirement; the CLI prints ``error: <message>`` and exits non-zero."""
