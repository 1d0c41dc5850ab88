"""Pieces every subcommand's arguments share: count types and where progress goes."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


def progress(msg: str) -> None:
    print(f"flashgen: {msg}", file=sys.stderr, flush=True)


def progress_of(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Where a command's progress goes: stderr, or nowhere under ``-q``."""
    return None if args.quiet else progress


def positive_int(text: str) -> int:
    """argparse type of counts like ``-j``: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n
