"""The documentation stays true to the code: in README.md and every page under docs/,

- every relative link points to a file that exists (and a heading, for `#anchor` links); pages under
  docs/ link only inside docs/, so the built site has no dead links;
- every `tunekit` command in a bash block parses with the real CLI parser, and the recipe it names,
  when the repository has it, validates with its `--set` overrides; commands named in prose or in a
  synopsis name a real subcommand, real flags and real choices; `--set` keys exist in the schema;
- every YAML block that is a recipe, or a part of one, validates;
- every `make` target, `python` script or module, `tunekit[extra]` and repository path shown exists;
- mkdocs.yml's nav lists every page, and the generated reference pages are up to date.

The checkers return their findings, so the last tests can show that each one catches a bad snippet."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import unicodedata
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from conftest import split_markdown
from tunekit.cli import main  # the parser (main.build_parser)
from tunekit.config import recipefile, schema

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# top-level folders of the repository whose paths, shown in the docs, must exist
REPO_PATH = re.compile(r"^(?:src|tests|bench|recipes|ds_configs|docs)/[\w./-]*$")
# flags shown in prose that belong to other tools
OTHER_TOOLS_FLAGS = {"--no-deps"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- reading markdown


def code_spans(prose: str) -> list[tuple[int, str]]:
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"`([^`\n]+)`", prose)]


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) and GitHub give a heading of plain words."""
    text = re.sub(r"<[^>]+>", "", heading.replace("`", ""))
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    prose, _ = split_markdown(text)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M)}


# ---------------------------------------------------------------- links


def check_links(path: Path, text: str) -> list[str]:
    prose, _ = split_markdown(text)
    without_code = re.sub(r"`[^`\n]+`", lambda m: " " * len(m.group(0)), prose)
    problems = []
    for m in re.finditer(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_code):
        where = f"{_rel(path)}:{prose.count(chr(10), 0, m.start()) + 1}"
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: link to {target}: no such file")
            continue
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where}: link to {target} leaves the repository")
        elif path.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
            problems.append(f"{where}: link to {target} leaves docs/ (the built site would not have it); "
                            "name the file in `code` instead")
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where}: link to {target}: no heading #{anchor} in {_rel(dest)}")
    return problems


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------- commands


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def _schema_has(dotted: str) -> bool:
    model = schema.Recipe
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        model = next((a for a in (annotation, *getattr(annotation, "__args__", ())) if isinstance(a, type)
                      and issubclass(a, BaseModel)), None)
    return True


def check_launch(args: list[str], where: str, validate: bool) -> list[str]:
    """`tunekit launch [torchrun options] COMMAND`: torchrun's own parser takes the options, then the command."""
    from tunekit.cli import launch
    from tunekit.core.errors import TunekitError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed = launch._parse(args)
    except (SystemExit, TunekitError) as e:
        return [f"{where}: `tunekit launch {shlex.join(args)}` does not parse: {err.getvalue().strip() or e}"]
    return check_tunekit(parsed.training_script_args, where, validate)


def check_tunekit(args: list[str], where: str, validate: bool = True) -> list[str]:
    """A full command line: it must parse; a recipe it names that the repository has must validate."""
    if args[:1] == ["launch"]:
        return check_launch(args[1:], where, validate)
    parser = main.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed = parser.parse_args(args)
    except SystemExit as e:
        if e.code in (0, None):  # --help, --version
            return []
        return [f"{where}: `tunekit {shlex.join(args)}` does not parse: {err.getvalue().strip()}"]
    if not validate:
        return []
    overrides = getattr(parsed, "overrides", None) or []
    path = getattr(parsed, "recipe", None)
    if path and (ROOT / path).is_file():
        try:
            recipefile.load(ROOT / path, overrides)
        except Exception as e:  # any failure means the docs show a command that fails
            return [f"{where}: `tunekit {shlex.join(args)}`: {e}"]
        return []
    key = next((k for k in (o.partition("=")[0] for o in overrides) if not k.isupper() and not _schema_has(k)), None)
    return [f"{where}: --set {key}: no such recipe key"] if key else []


def check_mention(text: str, where: str) -> list[str]:
    """A command named in prose or a synopsis (`tunekit eval TARGET [--limit N]`): subcommand, flags and
    the choices written as a|b|c must exist."""
    m = re.match(r"^tunekit\s+([\w-]+)", text)
    if not m or m.group(1).isupper():  # no command, or a placeholder: tunekit COMMAND
        return []
    subs = _subparsers(main.build_parser())
    if m.group(1) not in subs:
        return [f"{where}: `{text}`: no command tunekit {m.group(1)}"]
    if m.group(1) == "launch":  # torchrun's options, then a tunekit command
        from torch.distributed.run import get_args_parser

        options = _options(get_args_parser()) | _options(subs["launch"])
    else:
        options = _options(subs[m.group(1)])
    problems = [f"{where}: `{text}`: tunekit {m.group(1)} has no {flag}"
                for flag in re.findall(r"(?<![\w-])--[\w-]+", text) if flag not in options]
    for flag, alternatives in re.findall(r"(--[\w-]+)[ =]\[?([\w.]+(?:\|[\w.]+)+)", text):
        known = options[flag].choices if flag in options else None
        unknown = [a for a in alternatives.split("|") if known is not None and a not in known]
        if unknown:
            problems.append(f"{where}: `{text}`: {flag} has no choice {', '.join(unknown)}")
    return problems


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _commands(line: str) -> list[list[str]]:
    """A shell line as simple commands (split at && || ; | &), comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def check_command_words(words: list[str], where: str) -> list[str]:
    """make targets, python scripts and modules, extras and repository paths anywhere in a command."""
    problems = []
    if words[0] == "make":
        targets = _makefile_targets()
        problems += [f"{where}: make {w}: no such Makefile target" for w in words[1:]
                     if not w.startswith("-") and "=" not in w and w not in targets]
    if Path(words[0]).name.startswith("python") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2].startswith("tunekit"):
            if importlib.util.find_spec(words[2]) is None:
                problems.append(f"{where}: python -m {words[2]}: no such module")
        elif words[1].endswith(".py") and not (ROOT / words[1]).is_file():
            problems.append(f"{where}: python {words[1]}: no such script")
    for word in words:
        for extra in re.findall(r"(?:tunekit|^\.)\[([\w,-]+)\]", word):
            problems += [f"{where}: {word}: no extra {e!r} in pyproject.toml" for e in extra.split(",")
                         if e not in _extras()]
        if REPO_PATH.match(word) and "*" not in word and not (ROOT / word).exists():
            problems.append(f"{where}: {word}: no such file in the repository")
    return problems


def check_shell_block(body: str, where_line: int, path: Path) -> list[str]:
    problems = []
    lines = body.replace("\\\n", " ").splitlines()
    for offset, line in enumerate(lines):
        where = f"{_rel(path)}:{where_line + 1 + offset}"
        for words in _commands(line.removeprefix("$ ")):
            problems += check_command_words(words, where)
            if words[0] == "tunekit":
                problems += check_tunekit(words[1:], where)
            elif "-m" in words[:-1] and words[words.index("-m") + 1] == "tunekit":  # under a launcher
                problems += check_tunekit(words[words.index("-m") + 2:], where)
    return problems


def check_text_block(body: str, where_line: int, path: Path) -> list[str]:
    """Transcripts (`$ tunekit ...`, errors shown on purpose: they must parse) and synopses."""
    problems = []
    for offset, line in enumerate(body.splitlines()):
        where = f"{_rel(path)}:{where_line + 1 + offset}"
        if line.startswith("$ tunekit "):
            problems += check_tunekit(shlex.split(line[len("$ tunekit "):], comments=True), where, validate=False)
        elif line.startswith("tunekit "):
            problems += check_mention(line.split("  #")[0].strip(), where)
    return problems


def check_yaml_block(body: str, where_line: int, path: Path) -> list[str]:
    """A recipe, or a part of one (top-level recipe keys only), must validate; a part is laid over a
    minimal recipe."""
    try:
        raw = yaml.safe_load(body)
    except yaml.YAMLError as e:
        return [f"{_rel(path)}:{where_line}: invalid YAML: {e}"]
    if not isinstance(raw, dict) or not set(raw) <= set(schema.Recipe.model_fields):
        return []
    full = {"model": {"name_or_path": "org/model"}, "data": {"train": "recipes/data/extract_train.jsonl"}, **raw}
    try:
        recipefile.from_dict(full, source="recipe", base=ROOT)
    except Exception as e:
        return [f"{_rel(path)}:{where_line}: recipe does not validate: {e}"]
    return []


def check_page(path: Path, text: str) -> list[str]:
    prose, blocks = split_markdown(text)
    problems = check_links(path, text)
    for lang, line, body in blocks:
        if lang in ("bash", "sh", "shell", "console"):
            problems += check_shell_block(body, line, path)
        elif lang in ("text", ""):
            problems += check_text_block(body, line, path)
        elif lang in ("yaml", "yml"):
            problems += check_yaml_block(body, line, path)
    from torch.distributed.run import get_args_parser  # `tunekit launch` takes torchrun's options

    flags = ({f for sub in _subparsers(main.build_parser()).values() for f in _options(sub)}
             | set(_options(get_args_parser())) | OTHER_TOOLS_FLAGS)
    for line, span in code_spans(prose):
        where = f"{_rel(path)}:{line}"
        if span.startswith("tunekit "):
            problems += check_mention(span, where)
        elif span.startswith("--"):
            flag = re.match(r"--[\w-]+", span)
            if flag and flag.group(0) not in flags:
                problems.append(f"{where}: `{span}`: no tunekit command has {flag.group(0)}")
            problems += [f"{where}: --set {key}: no such recipe key"
                         for key in re.findall(r"--set\s+([a-z_][\w.]*)=", span) if not _schema_has(key)]
        else:
            words = [w for c in _commands(span) for w in c] if re.match(r"^(make|python|pip)\b", span) else [span]
            problems += check_command_words(words, where) if words else []
    return problems


# ---------------------------------------------------------------- the tests


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes resolve relative paths from the current directory first


@pytest.mark.parametrize("path", PAGES, ids=lambda p: _rel(p))
def test_links_commands_and_paths_in_the_docs_are_valid(path, at_root):
    problems = check_page(path, path.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


# what a user runs, in order: the README shows each on a shipped recipe (and under each launcher)
MISSION = ["validate", "plan", "data", "train", "eval", "merge", "export", "chat", "launch"]
LAUNCHERS_SHOWN = {"accelerate", "torchrun"}


def test_the_readme_is_a_front_door_of_one_screen():
    """Install, the mission's commands in the order a user runs them on a shipped recipe shown whole, several
    GPUs, the demo and the tests, then links into every docs page; each command parses and each recipe it names
    validates (test_links_commands_and_paths_in_the_docs_are_valid[README.md])."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make setup" in text and "pip install" in text and "make demo" in text and "make test" in text
    assert len(text.splitlines()) <= 85, "the README is one screen; topics belong in docs/"
    linked = {(ROOT / m).resolve() for m in re.findall(r"\]\((docs/[^)#\s]+)", text)}
    topics = {p for p in DOCS.glob("*.md") if p.name != "index.md"}
    assert topics <= linked, f"README links none of: {sorted(_rel(p) for p in topics - linked)}"
    prose, blocks = split_markdown(text)
    shell = [words for lang, _, body in blocks if lang == "bash" for line in body.splitlines()
             for words in _commands(line)]
    shown = [w[1] for w in shell if w[0] == "tunekit"]
    assert [m for m in shown if m in MISSION] == MISSION, shown
    assert LAUNCHERS_SHOWN <= {w[0] for w in shell if w[-2:] == ["train", "recipes/llama_qlora.yaml"]}, shell
    named = re.search(r"`(recipes/[\w.]+\.yaml)`'s settings, all of them", prose)
    shown_recipe = [body for lang, _, body in blocks if lang == "yaml"]
    assert named and len(shown_recipe) == 1, "the README shows one shipped recipe whole"
    assert yaml.safe_load(shown_recipe[0]) == yaml.safe_load((ROOT / named.group(1)).read_text(encoding="utf-8"))


def test_mkdocs_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def entries(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from entries(value) if isinstance(value, list) else [value]

    listed = list(entries(config["nav"]))
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, f"in nav but missing: {set(listed) - set(pages)}; " \
                                    f"pages not in nav: {set(pages) - set(listed)}"
    assert len(listed) == len(set(listed))


def test_the_generated_reference_pages_are_up_to_date():
    generator = _load_generator()
    for rel, make in generator.PAGES.items():
        committed = (DOCS / rel).read_text(encoding="utf-8")
        assert committed == make(), f"docs/{rel} is out of date with the code; run `make docs` and commit it"


def test_the_recipe_reference_names_every_key_of_the_schema():
    text = (DOCS / "reference" / "recipe.md").read_text(encoding="utf-8")

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            yield prefix + name
            sub = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                        if isinstance(a, type) and issubclass(a, BaseModel)), None)
            if sub is not None:
                yield from keys(sub, f"{prefix}{name}.")

    missing = [k for k in keys(schema.Recipe) if f"| `{k}` |" not in text]
    assert not missing, missing


BAD_PAGE = """# A page

[gone](no-such-page.md) and [anchor](index.md#no-such-heading) and [outside](../Makefile).

```bash
tunekit train recipes/smollm2_lora.yaml --no-such-flag
tunekit fly recipes/smollm2_lora.yaml
tunekit train recipes/smollm2_lora.yaml --set training.learnig_rate=1e-4
tunekit train RECIPE --set lora.rank=8
make no-such-target
python bench/no_such_script.py
```

```text
tunekit merge RUN_DIR [--dtype bf16|fp8] [--no-such-option]
```

```yaml
training: {learning_rate: 2.0e-4, no_such_key: 1}
```

Run `tunekit eval TARGET --no-such-eval-flag`, see `src/tunekit/no_such_module.py`, try `--frobnicate`,
install `pip install 'tunekit[no-such-extra]'`.
"""


def test_the_checker_catches_broken_links_unknown_commands_flags_keys_and_paths(at_root):
    problems = "\n".join(check_page(DOCS / "bad.md", BAD_PAGE))
    for expected in ["no-such-page.md: no such file",
                     "no heading #no-such-heading",
                     "leaves docs/",
                     "unrecognized arguments: --no-such-flag",
                     "invalid choice: 'fly'",
                     "unknown key training.learnig_rate; did you mean training.learning_rate?",
                     "--set lora.rank: no such recipe key",
                     "make no-such-target: no such Makefile target",
                     "bench/no_such_script.py: no such script",
                     "tunekit merge has no --no-such-option",
                     "--dtype has no choice fp8",
                     "unknown key training.no_such_key",
                     "tunekit eval has no --no-such-eval-flag",
                     "src/tunekit/no_such_module.py: no such file",
                     "no tunekit command has --frobnicate",
                     "no extra 'no-such-extra'"]:
        assert expected in problems, f"not caught: {expected}\n{problems}"


def test_the_checker_passes_a_good_page(at_root):
    good = ("[Recipes](recipes.md#shipped-recipes)\n\n```bash\ntunekit validate recipes/smollm2_lora.yaml "
            "--set lora.r=8\nmake docs\n```\n\n`tunekit plan RECIPE --world-size N`\n")
    assert check_page(DOCS / "good.md", good) == []
