"""The Python API's own arguments, checked as the command line checks its options (tunekit.cli.main's argument
types): a value of the wrong type or out of range is one TunekitError naming the argument and what it takes,
raised before anything is read, loaded or written."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Iterable

from tunekit.core.errors import TunekitError


def _got(value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"got {type(value).__name__} {shown}" if not isinstance(value, (str, int, float)) else f"got {shown}"


def _a(value: Any) -> str:
    """'a set', 'an object': the value's type with its article."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _refuse(name: str, wanted: str, value: Any) -> None:
    raise TunekitError(f"{name}: expected {wanted}, {_got(value)}")


def whole(name: str, value: Any, least: int = 1, optional: bool = False) -> None:
    """A whole number of at least `least` (None too where `optional`)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        wanted = "a whole number of at least 1" if least == 1 else f"a whole number, {least} or more"
        _refuse(name, wanted + (" or None" if optional else ""), value)
    if value < least:
        raise TunekitError(f"{name}: must be {'at least 1' if least == 1 else f'{least} or more'}, got {value}")


def number(name: str, value: Any, most: float | None = None, optional: bool = False) -> None:
    """A finite number above 0 (and at most `most`; None too where `optional`)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        _refuse(name, "a finite number" + (" or None" if optional else ""), value)
    if value <= 0 or (most is not None and value > most):
        raise TunekitError(f"{name}: must be " + (f"in (0, {most:g}]" if most is not None else "greater than 0")
                           + f", got {value!r}")


def flag(name: str, value: Any) -> None:
    """True or False: a string such as "no" would read as True."""
    if not isinstance(value, bool):
        _refuse(name, "True or False", value)


def text(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        _refuse(name, "a non-empty string" + (" or None" if optional else ""), value)


def path(name: str, value: Any, optional: bool = False) -> None:
    """A path (a str or os.PathLike); whether it exists is the command's own check."""
    if value is None and optional:
        return
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        _refuse(name, "a path (str or os.PathLike)" + (" or None" if optional else ""), value)


def choice(name: str, value: Any, choices: Iterable[str], optional: bool = False) -> None:
    if value is None and optional:
        return
    choices = list(choices)
    if not isinstance(value, str) or value not in choices:
        raise TunekitError(f"{name}: choose one of {', '.join(choices)}{' or None' if optional else ''}, "
                           f"{_got(value)}")


def size(name: str, value: Any) -> int | None:
    """Bytes: a whole number above 0 or a size such as "24GiB" (None: none given)."""
    if value is None:
        return None
    if isinstance(value, str):
        from tunekit.plan.sizes import parse_size

        try:
            return parse_size(value)
        except ValueError as e:
            raise TunekitError(f"{name}: {e}") from None
    whole(name, value)
    return int(value)


YAML_SCALARS = (str, int, float, bool, type(None))


def yaml_value(name: str, value: Any, at: str = "") -> None:
    """What YAML writes: a scalar (str, number, bool, None), or a list or dict of them (keys strings). `at`: the
    place inside `name` (dotted keys, [index]), for the message."""
    where = f"{name}: {at}" if at else name
    if isinstance(value, float) and not math.isfinite(value):
        raise TunekitError(f"{where}: {value!r} is not a finite number; give one, or a string such as 'auto'")
    if isinstance(value, YAML_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yaml_value(name, item, f"{at}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TunekitError(f"{where}: key {key!r} is {_a(key)}; a recipe's keys are strings")
            yaml_value(name, item, f"{at}.{key}" if at else key)
        return
    raise TunekitError(f"{where}: {_a(value)} is not a recipe value; give a string, number, bool, None, or a list or "
                       "dict of them")
