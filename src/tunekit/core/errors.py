"""The one exception type the CLI turns into a one-line message and exit code 2."""


class TunekitError(Exception):
    """A problem the user can fix: bad recipe, bad data, missing file, refused overwrite."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type name when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
