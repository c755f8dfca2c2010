"""Plugins: packages installed beside tunekit that add training methods, data formats, metrics, reward kinds or
export formats, found through the entry point group `tunekit.plugins` (docs/extending.md).

An entry point names a module. Its optional hooks are called once each: `declare()` before the recipe schema is
built (it declares names in tunekit.config: data formats, metrics, reward kinds, methods), and `register_formats`,
`register_metrics`, `register_rewards`, `register_methods`, `register_exports` when the registry of that kind
first loads (they register the implementations). A plugin that fails to import or whose hook raises is named in
one warning line and left out; tunekit goes on without it."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from importlib import metadata
from types import ModuleType

GROUP = "tunekit.plugins"
HOOKS = ("declare", "register_formats", "register_metrics", "register_rewards", "register_methods",
         "register_exports")

log = logging.getLogger("tunekit")
_failed: set[str] = set()  # plugins left out (named once)
_ran: set[str] = set()  # hooks called


def _skip(name: str, what: str, e: BaseException) -> None:
    _failed.add(name)
    line = (f"plugin {name}: {what} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it is "
            "left out: fix or uninstall the package that provides it")
    if log.hasHandlers():
        log.warning("%s", line)
    else:  # found as tunekit is imported, before a command sets up its output
        print(f"tunekit: {line}", file=sys.stderr)


@functools.cache
def modules() -> tuple[tuple[str, ModuleType], ...]:
    """(entry point name, module) of every installed plugin that imports, in the order of their names."""
    found = []
    for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name):
        try:
            found.append((ep.name, importlib.import_module(ep.value.split(":")[0])))
        except Exception as e:  # a broken plugin must not break tunekit
            _skip(f"{ep.name} ({ep.value})", "import", e)
    return tuple(found)


def run(hook: str) -> None:
    """Call `hook` of every plugin that has it and has not failed, once; the declarations come first, whichever
    registry loads first."""
    assert hook in HOOKS, hook
    if hook in _ran:
        return
    _ran.add(hook)
    if hook != "declare":
        run("declare")
    for name, module in modules():
        fn = getattr(module, hook, None)
        if fn is None or name in _failed:
            continue
        try:
            fn()
        except Exception as e:
            _skip(name, f"{hook}()", e)
