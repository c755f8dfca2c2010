"""Training a vision-language model on image chat records (tiny random LLaVA): the loss falls, what the recipe
freezes stays bit-for-bit as loaded (the vision tower always here, the projector unless vision.train_projector),
the run says what trains and that batches are not packed, and the adapter carries the projector it trained."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import colour_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipes
from tunekit.training import runner


def run(tmp_path, model, caplog, **sections):
    data = write_jsonl(tmp_path / "train.jsonl", colour_rows(tmp_path / "img", 32))
    raw = tiny_recipe(model, data, tmp_path / "run", data={"format": "chat", "packing": True}, **sections)
    with caplog.at_level("INFO", logger="tunekit"):
        result = runner.run(recipes.load(write_recipe(tmp_path / "r.yaml", raw)))
    history = [json.loads(line) for line in (result.run_dir / "loss_history.jsonl").read_text().splitlines()]
    return result, [r["loss"] for r in history if "loss" in r]


def changed(model_dir, state: dict, prefix: str) -> set[bool]:
    from transformers import AutoModelForImageTextToText

    before = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()  # its names as loaded
    names = [n for n in before if n.startswith(prefix)]
    assert names, prefix
    return {not torch.equal(before[n], state[n].cpu()) for n in names}


@pytest.mark.parametrize("projector", [True, False], ids=["projector-trained", "projector-frozen"])
def test_lora_on_image_records_learns_and_freezes_what_the_recipe_says(tmp_path, tiny_vision_model, caplog,
                                                                         projector):
    result, losses = run(tmp_path, tiny_vision_model, caplog, vision={"train_projector": projector})
    assert losses[-1] < losses[0] - 0.5, losses
    base = result.trainer.model.get_base_model()
    state = {k.replace(".base_layer", "").replace(".original_module", ""): v for k, v in base.state_dict().items()
             if "lora_" not in k and ".modules_to_save." not in k}
    assert changed(tiny_vision_model, state, "model.vision_tower.") == {False}
    assert changed(tiny_vision_model, state, "model.language_model.") == {False}  # LoRA beside it
    adapter = load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))
    saved = {k for k in adapter if "multi_modal_projector" in k}
    assert bool(saved) == projector
    if projector:
        trained = {k.replace(".modules_to_save.default", ""): v for k, v in base.state_dict().items()
                   if ".modules_to_save." in k}
        assert changed(tiny_vision_model, trained, "model.multi_modal_projector.") == {True}
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert ("the projector (multi_modal_projector, in full)" in said) == projector
    frozen = said.split("frozen: ", 1)[1].split("\n", 1)[0]
    assert frozen == "the vision tower (vision_tower)" if projector else \
        frozen == "the projector (multi_modal_projector), the vision tower (vision_tower)"
    assert "packing: off for a vision-language model" in said and "batches: padded" in said
    assert json.loads((result.run_dir / "run.json").read_text())["data"]["packed"] is False
