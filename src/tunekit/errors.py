"""The one exception type the CLI turns into a one-line message and exit code 2."""


class TunekitError(Exception):
    """A problem the user can fix: bad recipe, bad data, missing file, refused overwrite."""

    exit_code = 2
