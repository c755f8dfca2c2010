"""Recipe files: YAML read safely (a duplicated key is an error), dotted overrides, relative paths
resolved, and the schema's validation errors turned into one line that names the dotted key and suggests
the closest valid one."""

from __future__ import annotations

import difflib
import logging
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from tunekit.config import methods, shipped
from tunekit.config.modelsource import resolve_model
from tunekit.config.schema import DATA_SUFFIXES, Recipe
from tunekit.core.errors import TunekitError

# ---------------------------------------------------------------- errors


def _unwrap(annotation: Any) -> Any:
    """Optional[X] / X | None -> X, and the section inside a list of sections or a union with one
    (data.train: a file or a list of DataSource), for walking the schema by dotted path."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            return _unwrap(inner[0])
    if origin is not None:
        for arg in typing.get_args(annotation):
            found = _unwrap(arg)
            if isinstance(found, type) and issubclass(found, BaseModel):
                return found
    return annotation


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Recipe
    for part in (p for p in loc if not isinstance(p, int)):  # a list's items are sections of one kind
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _dotted(loc: tuple) -> str:
    """("data", "train", 1, "weight") -> data.train[1].weight"""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).removeprefix(".")


def _describe(error: dict) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    key = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        section = _section_at(loc[:-1])
        valid = list(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        prefix = _dotted(loc[:-1])
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else (
            f"; valid keys: {', '.join(valid)}" if valid else "")
        return f"unknown key {key}{hint}"
    if kind == "missing":
        return f"missing required key {key}"
    msg = error["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return msg if not key else f"{key}: {msg}"
    return f"{key}: {msg} (got {error.get('input')!r})" if key else msg


def format_validation_error(exc: ValidationError, source: str) -> str:
    errors = exc.errors()
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {_describe(errors[0])}{more}"


# ---------------------------------------------------------------- loading


def parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip() or any(not p for p in key.strip().split(".")):
        raise TunekitError(f"--set {item!r}: expected dotted.key=value, e.g. --set training.learning_rate=1e-4")
    try:
        value = safe_load_unique(raw, f"--set {item!r}") if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise TunekitError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _resolve_file(value: str, base: Path) -> Path | None:
    """A relative path is looked up in the current directory first, then beside the recipe, then (recipes/...,
    ds_configs/...) among the files tunekit ships."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for root in (Path.cwd(), base):
        if (root / p).exists():
            return (root / p).resolve()
    return shipped.find(value)


def _data_file(value: str, base: Path, key: str) -> str:
    """A data file's absolute path, or a hub name as given; a missing file (a name that looks like one) is an error."""
    found = _resolve_file(value, base)
    if found is not None:
        return str(found)
    if value.endswith(DATA_SUFFIXES) or value.startswith(("/", "./", "../", "~")):
        raise TunekitError(f"{key}: file {value!r} not found")
    return value


def _task_file(value: str, base: Path, key: str) -> str:
    if not value.endswith((".yaml", ".yml")):
        return value
    found = _resolve_file(value, base)
    if found is None or not found.is_file():
        raise TunekitError(f"{key}: task file {value!r} not found")
    return str(found)


def _check_files(recipe: Recipe, base: Path, source: str) -> Recipe:
    """Existence checks for local files, rewriting them to absolute paths so runs are reproducible
    from any directory."""
    updates: dict[str, dict[str, Any]] = {"data": {}, "training": {}, "eval": {}}
    for section, key, value in (
        ("data", "train", recipe.data.train),
        ("data", "eval", recipe.data.eval),
        ("eval", "data", recipe.eval.data if recipe.eval else None),
    ):
        if isinstance(value, list):  # a mixture's sources
            updates[section][key] = [s.model_copy(update={"path": _data_file(s.path, base, f"{source}: {section}.{key}"
                                                                               f"[{i}].path")})
                                     for i, s in enumerate(value)]
        elif value is not None:
            updates[section][key] = _data_file(value, base, f"{source}: {section}.{key}")
    bench = recipe.eval.benchmarks if recipe.eval else None
    if bench is not None:  # task files: absolute, as data files are; task names as given
        tasks = [_task_file(t, base, f"{source}: eval.benchmarks.tasks[{i}]") for i, t in enumerate(bench.tasks)]
        updates["eval"]["benchmarks"] = bench.model_copy(update={"tasks": tasks})
    ds = recipe.training.deepspeed
    if ds is not None:
        found = _resolve_file(ds, base)
        if found is None or not found.is_file():
            raise TunekitError(f"{source}: training.deepspeed: file {ds!r} not found (see ds_configs/)")
        from tunekit.config import dsconfig

        where = f"{source}: training.deepspeed {ds}"
        parsed = dsconfig.read(found, where)
        if recipe.lora is not None and recipe.lora.init != "default" and dsconfig.zero_stage(parsed) == 3:
            raise TunekitError(f"{source}: lora.init={recipe.lora.init} needs whole base weights at initialisation, "
                               f"which ZeRO-3 ({ds}) partitions; use ZeRO-2 or lora.init: default")
        if recipe.lora is not None and recipe.lora.lr_ratio is not None and "optimizer" in parsed:
            raise TunekitError(f"{source}: lora.lr_ratio (LoRA+) needs the Trainer's optimizer, but training.deepspeed "
                               f"{ds} defines DeepSpeed's own; use a config without an optimizer section "
                               "(ds_configs/zero2.json, zero3.json) or drop lora.lr_ratio")
        precision = None if recipe.training.precision == "auto" else recipe.training.precision
        # DeepSpeed's own check imports deepspeed and torch: train and validate --world-size run it (check_file)
        dsconfig.resolve(parsed, recipe, None, precision, where)
        updates["training"]["deepspeed"] = str(found)
    return recipe.model_copy(
        update={
            name: getattr(recipe, name).model_copy(update=changes)
            for name, changes in updates.items()
            if changes
        }
    )


def from_dict(raw: Any, source: str = "recipe", base: Path | None = None, name: str = "run") -> Recipe:
    if not isinstance(raw, dict):
        raise TunekitError(f"{source}: a recipe must be a YAML mapping of sections (model, data, training, ...)")
    for old, new in methods.renamed_sections(raw):
        if raw[old] is not None:
            logging.getLogger("tunekit").info("%s: the %s section is now named %s; read as %s (rename it)",
                                              source, old, new, new)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise TunekitError(format_validation_error(e, source)) from None
    recipe = _check_files(recipe, base or Path.cwd(), source)
    if recipe.output_dir is None:
        recipe = recipe.model_copy(update={"output_dir": str(Path("runs") / name)})
    try:
        resolve_model(recipe.model.name_or_path)
    except TunekitError as e:
        raise TunekitError(f"{source}: {e}") from None
    if raw.get("adapter") == "qlora":
        logging.getLogger("tunekit").info("%s: adapter: qlora is now written adapter: lora with a quantization "
                                          "section; read that way", source)
    return recipe


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise TunekitError(f"recipe {str(path)!r} is a directory; give a YAML recipe file, "
                           "e.g. recipes/smollm2_lora.yaml")
    if not path.is_file():
        raise TunekitError(f"recipe file {str(path)!r} not found")
    try:
        raw = safe_load_unique(path.read_text(encoding="utf-8"), str(path))
    except UnicodeDecodeError:
        raise TunekitError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TunekitError(f"{path}{where}: invalid YAML ({problem})") from None
    return {} if raw is None else raw


def safe_load_unique(text: str, where: str) -> Any:
    """yaml.safe_load, refusing a key given twice in one mapping at any depth."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, where: str, prefix: str = "") -> None:
    """PyYAML lets a repeated key silently replace the first; a recipe must say each thing once.
    Walks the composed node tree, so the error can name the dotted key and both lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            dotted = f"{prefix}.{key}" if prefix else key
            line = key_node.start_mark.line + 1
            if key in seen:
                raise TunekitError(f"{where} line {line}: duplicate key {dotted} (first set on line {seen[key]}); "
                                   "keep one")
            seen[key] = line
            _refuse_duplicate_keys(value_node, where, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, where, f"{prefix}[{i}]")


def load(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply `--set` overrides, validate, and check referenced files."""
    path = Path(path)
    raw = read_yaml(path)
    if isinstance(raw, dict):
        raw = apply_overrides(raw, overrides or [])
    return from_dict(raw, source=str(path), base=path.parent.resolve(), name=path.stem)


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def yaml_value(value: Any) -> str:
    """A setting's value as a recipe writes it, for messages (true, not Python's True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
