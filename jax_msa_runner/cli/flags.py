"""Command-line flag checking: bounded argparse types and a parser whose errors are one line.

A bad flag ends the process before any work starts with exit status 2 and one line on
stderr that names the flag and its bound, e.g.
``jax-msa-runner demo: error: argument --seed: must be >= 0, got -1``.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable


class FlagError(ValueError):
    """A bad combination of flags; ``str()`` names the flag and the bound."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


class FlagParser(argparse.ArgumentParser):
    """ArgumentParser whose error is one line on stderr (no usage block), exit status 2.

    Subparsers made by ``add_subparsers`` are FlagParsers too.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _bounds(lo, hi) -> str:
    lo, hi = (f"{b:g}" if isinstance(b, float) else b for b in (lo, hi))
    if lo is not None and hi is not None:
        return f"must be in [{lo}, {hi}]"
    return f"must be >= {lo}" if lo is not None else f"must be <= {hi}"


def bounded_int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """argparse ``type=``: an int in [lo, hi] (None: unbounded on that side)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer{_bounds(lo, hi)[7:] if (lo, hi) != (None, None) else ''}, "
                f"got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{_bounds(lo, hi)}, got {value}")
        return value

    return parse


def bounded_float(lo: float | None = None, hi: float | None = None) -> Callable[[str], float]:
    """argparse ``type=``: a finite float in [lo, hi] (None: unbounded on that side)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{_bounds(lo, hi)}, got {value:g}")
        return value

    return parse
