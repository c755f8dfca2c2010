"""tunekit's shipped configs of well-known models (for `tunekit plan` before a download): the parameter
count built from each equals the count its publisher states, to the digits published."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tunekit.config.schema import ModelConfig
from tunekit.models import info

# Published sizes, as printed on each model's Hugging Face page ("Model size", counted from its
# safetensors files), except Qwen3, whose pages count a tied output head twice: there, the model card's
# "Number of Parameters". Given to the precision published (3 significant digits, 2 for Qwen3's cards).
PUBLISHED = {
    "meta-llama/Llama-3.2-1B": "1.24B", "meta-llama/Llama-3.2-3B": "3.21B", "meta-llama/Llama-3.1-8B": "8.03B",
    "meta-llama/Llama-3.1-70B": "70.6B", "meta-llama/Llama-3.1-405B": "406B",
    "Qwen/Qwen2.5-0.5B": "0.494B", "Qwen/Qwen2.5-1.5B": "1.54B", "Qwen/Qwen2.5-3B": "3.09B",
    "Qwen/Qwen2.5-7B": "7.62B", "Qwen/Qwen2.5-14B": "14.8B", "Qwen/Qwen2.5-32B": "32.8B", "Qwen/Qwen2.5-72B": "72.7B",
    "Qwen/Qwen3-0.6B": "0.6B", "Qwen/Qwen3-1.7B": "1.7B", "Qwen/Qwen3-4B": "4.0B", "Qwen/Qwen3-8B": "8.2B",
    "Qwen/Qwen3-14B": "14.8B", "Qwen/Qwen3-32B": "32.8B",
    "Qwen/Qwen3-30B-A3B": "30.5B",  # a mixture of experts, its total (3.3B active: tests/models/test_experts.py)
    "mistralai/Mistral-7B-v0.3": "7.25B",
    "google/gemma-2-2b": "2.61B", "google/gemma-2-9b": "9.24B", "google/gemma-2-27b": "27.2B",
    "google/gemma-3-1b-pt": "1.0B", "google/gemma-3-4b-pt": "4.3B", "google/gemma-3-12b-pt": "12.2B",
    "google/gemma-3-27b-pt": "27.4B",
    # a vision-language model (its tower and merger included): its safetensors index's total_size, 7,509,245,952
    # bytes in bf16
    "Qwen/Qwen2.5-VL-3B-Instruct": "3.75B",
}
TABLE = json.loads(info.SHIPPED.read_text())


def test_every_shipped_config_has_a_published_count():
    assert sorted(TABLE["configs"]) == sorted(PUBLISHED)
    assert set(TABLE["aliases"].values()) <= set(TABLE["configs"])


def rounded(n: int, published: str) -> str:
    digits = len(published.rstrip("B").split(".")[1]) if "." in published else 0
    return f"{n / 1e9:.{digits}f}B"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_gives_the_published_parameter_count(name):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = info.shipped_config(name)
    auto = AutoModelForImageTextToText if getattr(cfg, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() counts a tied head once
    assert rounded(total, PUBLISHED[name]) == PUBLISHED[name], f"{name}: {total:,}"


def test_aliases_resolve_and_unknown_models_do_not():
    assert info.shipped_config("meta-llama/Llama-3.1-8B-Instruct").hidden_size == 4096
    assert info.shipped_config("Qwen/Qwen2.5-7B-Instruct").intermediate_size == 18944
    assert info.shipped_config("org/unknown") is None


def test_the_shipped_config_is_used_only_where_allowed(monkeypatch):
    from tunekit.models import hub

    def unavailable(*a, **k):
        raise hub.Unavailable("model.name_or_path: offline", "offline")

    monkeypatch.setattr(info, "_read_config", unavailable)
    cfg = ModelConfig(name_or_path="meta-llama/Llama-3.1-8B-Instruct")
    assert info.model_config(cfg, shipped=True).num_hidden_layers == 32
    with pytest.raises(hub.Unavailable):  # training needs the weights: no fallback
        info.model_config(cfg)
    with pytest.raises(hub.Unavailable):
        info.model_config(ModelConfig(name_or_path="org/unknown"), shipped=True)


def test_model_config_file(tmp_path):
    from tunekit.core.errors import TunekitError

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TABLE["configs"]["Qwen/Qwen2.5-0.5B"]))
    assert info.config_file(str(path)).hidden_size == 896
    path.write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(TunekitError, match=r"--model-config .*: model_type 'no-such-arch' is not an architecture"):
        info.config_file(str(path))
    path.write_text("{oops")
    with pytest.raises(TunekitError, match=r"--model-config .*: not JSON"):
        info.config_file(str(path))
    with pytest.raises(TunekitError, match="file not found"):
        info.config_file(str(tmp_path / "missing.json"))


def test_plan_reads_a_config_file_for_a_model_not_here(tmp_path, capsys):
    from conftest import tiny_recipe, write_recipe
    from tunekit.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TABLE["configs"]["Qwen/Qwen2.5-0.5B"]))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe("org/private-model", tmp_path / "d.jsonl", tmp_path / "run"))
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    assert main.main(["plan", str(recipe), "--model-config", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("parameters:"))
    total, trainable = (int(w.replace(",", "")) for w in re.findall(r"[\d,]{5,}", line))
    assert total - trainable == 494_032_768  # the base, from the file; the rest is the LoRA adapter
