"""What a command shows while it works, on stderr: tunekit's log lines and one progress display per phase.

On a terminal a phase is a bar redrawn in place, and log lines are written above the bars; in a Jupyter
notebook (an IPython kernel) with ipywidgets installed a phase is a notebook bar (tqdm.notebook); elsewhere (CI,
a pipe, `| tee`, a notebook without ipywidgets) there are no carriage returns, only lines. TUNEKIT_PROGRESS=bars
or =lines chooses instead of these tests. Nothing here imports a heavy library: tqdm is imported only to draw a
bar."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

MODE_VAR = "TUNEKIT_PROGRESS"
MODES = ("bars", "lines")

log = logging.getLogger("tunekit")


def in_notebook() -> bool:
    """Running in an IPython kernel (Jupyter, JupyterLab, VS Code's notebooks, Colab): IPython is imported and its
    shell is a kernel's, not the terminal's. Imports nothing."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    if shell is None:
        return False
    try:
        kernel = "IPKernelApp" in shell.config
    except Exception:
        kernel = False
    return kernel or type(shell).__name__ == "ZMQInteractiveShell" or "google.colab" in sys.modules


def notebook_bars() -> bool:
    """A notebook that can draw a notebook bar (tqdm.notebook needs ipywidgets)."""
    return in_notebook() and importlib.util.find_spec("ipywidgets") is not None


def mode() -> str:
    """'bars' when stderr is a terminal or in a notebook that can draw bars, else 'lines'; TUNEKIT_PROGRESS
    (bars|lines) overrides."""
    chosen = os.environ.get(MODE_VAR, "").strip().lower()
    if chosen in MODES:
        return chosen
    return "bars" if sys.stderr.isatty() or notebook_bars() else "lines"


def bar_class():
    """tqdm's notebook bar (a widget, no carriage returns) in a notebook that can draw one, else its text bar."""
    if notebook_bars():
        from tqdm.notebook import tqdm
    else:
        from tqdm import tqdm
    return tqdm


def attach(stream=None, when_unconfigured: bool = False) -> None:
    """tunekit's log lines ("tunekit: ...") on `stream` (default stderr), above any bar; INFO on the main process,
    only problems on the others. Once: nothing is done when tunekit's logger has a handler already.
    `when_unconfigured` (the Python API): nothing either when the application configured logging (the root
    logger has handlers), so that its own configuration decides."""
    if log.handlers or (when_unconfigured and logging.getLogger().handlers):
        return
    handler = LogHandler(stream or sys.stderr)  # above any progress bar
    handler.setFormatter(logging.Formatter("tunekit: %(message)s"))
    log.addHandler(handler)
    # one voice in multi-process runs: other ranks report only problems
    log.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    log.propagate = False


def duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class LogHandler(logging.StreamHandler):
    """A stream handler whose lines go above any progress bar being drawn instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None:  # no bar can be on screen
            super().emit(record)
            return
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class Progress:
    """One phase's progress. Bars mode: a bar on stderr (`keep`: left on screen when closed); lines mode: a
    line through tunekit's log each time another `every` fraction of `total` is done (none if `every` is 0).
    Shows nothing where tunekit's log is quieter than INFO (the processes other than the main one)."""

    def __init__(self, desc: str, total: int, unit: str = "", every: float = 0.25, keep: bool = False,
                 initial: int = 0, rate: bool = True):
        """`rate`: the bar shows tqdm's rate and time left (off where the caller puts its own in the postfix)."""
        self.desc, self.total, self.unit, self.every = desc, max(total, 0), unit, every
        self.done, self.bar, self.lines, self.said = initial, None, False, -1
        self.next_line = self._next_mark(initial)
        if not log.isEnabledFor(logging.INFO):
            return
        if mode() == "bars":
            tqdm = bar_class()
            fmt = ("{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} [{elapsed}"
                   + ("<{remaining}, {rate_fmt}" if rate else "") + "{postfix}]")
            self.bar = tqdm(total=self.total, desc=desc, unit=f" {unit}" if unit else "it", initial=initial,
                            leave=keep, file=sys.stderr, dynamic_ncols=True, bar_format=fmt)
        else:
            self.lines = every > 0

    def _next_mark(self, done: int) -> int:
        """The count at which the next line is due."""
        step = max(int(self.total * self.every), 1) if self.every > 0 else self.total + 1
        return (done // step + 1) * step

    def update_to(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done
        if self.lines and (done >= self.next_line or done >= self.total) and self.said != done:
            self.said = done
            log.info("%s %d/%d%s", self.desc, done, self.total, f" {self.unit}" if self.unit else "")
            self.next_line = self._next_mark(done)

    def update(self, n: int = 1) -> None:
        self.update_to(self.done + n)

    def postfix(self, text: str) -> None:
        """Facts shown after the bar (bars mode only)."""
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
