"""Command line: parse argv, call one library function per verb, turn known errors into one line.

Heavy libraries are imported inside the verbs so that `tunekit --help` stays instant."""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .errors import TunekitError


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field by dotted key, e.g. --set training.learning_rate=1e-4 (repeatable)")


def cmd_validate(a) -> int:
    from . import recipe as recipe_mod

    recipe = recipe_mod.load(a.recipe, a.overrides)
    print(recipe_mod.to_yaml(recipe), end="")
    return 0


def cmd_train(a) -> int:
    from . import recipe as recipe_mod

    recipe = recipe_mod.load(a.recipe, a.overrides)
    from . import train

    train.run(recipe, force=a.force)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunekit", description="Fine-tune causal language models from one YAML recipe.")
    parser.add_argument("--version", action="version", version=f"tunekit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("validate", help="check a recipe and print it with every default filled")
    _recipe_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("train", help="train a recipe into its run directory")
    _recipe_args(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    p.set_defaults(func=cmd_train)
    return parser


def _setup_logging() -> None:
    log = logging.getLogger("tunekit")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tunekit: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    try:
        return args.func(args)
    except TunekitError as e:
        print(f"tunekit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tunekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
