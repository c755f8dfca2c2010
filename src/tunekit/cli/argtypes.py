"""The command line's argument types: each refuses a bad value with a message argparse prefixes with the
argument's name, so that a bad flag is one line."""

from __future__ import annotations

import argparse

from tunekit.core.errors import TunekitError


def _whole(text: str, least: int, bound: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _whole(text, 1, "at least 1")


def non_negative_int(text: str) -> int:
    return _whole(text, 0, "0 or more")


def _finite(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def size(text: str) -> int:
    from tunekit.plan.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def override(text: str) -> str:
    from tunekit.config.recipefile import parse_override

    try:
        parse_override(text)
    except TunekitError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--set {text!r}: ")) from None
    return text
