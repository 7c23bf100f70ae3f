"""``python -m models``: write a benchmark model to a file, or list the models and presets.

Bad input (unknown model, preset or dtype, missing options) prints one ``error: ...`` line naming the
allowed values and exits 2, like the ``dietcode-ort`` CLI.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from dietcode_ort.errors import DietcodeError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line instead of argparse's usage block: the message is what the user needs."""
        raise DietcodeError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m models", description="Build a seeded benchmark ONNX model.")
    p.add_argument("name", nargs="?", help="model name (see --list)")
    p.add_argument("--preset", help="size preset of the model (see --list)")
    p.add_argument("-o", "--output", help="ONNX file to write (weights over 2 GB go to FILE.data)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or float16")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    p.add_argument("--list", action="store_true", help="list models and presets, then exit")
    return p


def _list() -> None:
    import models

    for name, builder in models.MODELS.items():
        print(f"{name}: presets {', '.join(builder.presets)}; symbols {', '.join(builder.symbols)}; "
              f"{builder.summary}")


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        _list()
        return 0
    import models
    from models.graph import check_dtype

    if args.name is None:
        raise DietcodeError(f"missing model name; allowed: {', '.join(models.MODELS)}")
    builder = models.get(args.name)
    if args.preset is None:
        allowed = ", ".join(builder.presets)
        raise DietcodeError(f"missing --preset for model {args.name!r}; allowed: {allowed}")
    builder.config(args.preset)  # bad preset or dtype is reported before a missing -o
    check_dtype(args.dtype)
    if args.seed < 0:
        raise DietcodeError(f"--seed must be >= 0, got {args.seed}")
    if args.output is None:
        raise DietcodeError("missing -o FILE (where to write the model)")
    model = builder(args.preset, args.dtype, args.seed)
    try:
        path = models.save_model(model, args.output)
    except OSError as exc:
        raise DietcodeError(f"cannot write {args.output}: {exc.strerror or exc}") from exc
    print(f"wrote {path} ({args.name} {args.preset} {args.dtype}, seed {args.seed})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
