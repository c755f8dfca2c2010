"""Vision-language models (models.vision): read from a config with a vision_config, loaded with
AutoModelForImageTextToText; their parts found from the model itself (language model, vision tower, projector);
LoRA aimed at the language model alone unless the recipe trains the tower, the projector trained in full when
asked; full fine-tuning freezes the tower and projector unless asked."""

from __future__ import annotations

import pytest
from peft import LoraConfig

from tunekit.config.schema import ModelConfig, VisionConfig
from tunekit.core.errors import TunekitError
from tunekit.models import vision


@pytest.fixture(scope="module")
def llava(tiny_vision_model):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vision_model)


def test_a_config_with_a_vision_config_reads_images(tiny_vision_model, tiny_model):
    assert vision.reads_images(ModelConfig(name_or_path=str(tiny_vision_model)))
    assert not vision.reads_images(ModelConfig(name_or_path=str(tiny_model)))


def test_parts_are_found_from_the_model(llava):
    found = vision.parts(llava)
    assert found == vision.Parts("model.language_model", "model.vision_tower", ("model.multi_modal_projector",))


def lora(llava, targets="all-linear", **settings):
    return vision.scope_lora(llava, LoraConfig(r=4, target_modules=targets), VisionConfig(**settings))


def test_lora_targets_the_language_model_unless_the_tower_trains(llava):
    plain = lora(llava)
    assert plain.target_modules and all(n.startswith("model.language_model.") for n in plain.target_modules)
    assert len(plain.target_modules) == 2 * 7 and not plain.modules_to_save  # 2 layers x q k v o gate up down
    tower = lora(llava, train_tower=True, train_projector=True)
    in_tower = [n for n in tower.target_modules if n.startswith("model.vision_tower.encoder.layers.")]
    assert len(in_tower) == 2 * 6 and tower.modules_to_save == ["model.multi_modal_projector"]  # q k v out fc1 fc2
    assert lora(llava, ["q_proj", "v_proj"]).target_modules == [
        f"model.language_model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    with pytest.raises(TunekitError, match="lora.target_modules: fc1 names no linear layer of the language"):
        lora(llava, ["fc1"])


def test_full_finetuning_freezes_tower_and_projector_unless_asked(tiny_vision_model):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vision_model)
    vision.freeze_for_full(model, None)
    trained = {n.split(".")[1] for n, p in model.named_parameters() if p.requires_grad and n.startswith("model.")}
    assert trained == {"language_model"}
    assert vision.describe(model, VisionConfig(train_projector=True), "none") == (
        "vision: training the language model (model.language_model, in full), the projector (multi_modal_projector, "
        "in full); frozen: the vision tower (vision_tower)")


def test_a_processor_that_needs_a_missing_package_is_refused_in_one_line(tmp_path):
    """Qwen2.5-VL's processor (its preprocessor_config.json as the Hub has it) loads a video processor that needs
    torchvision, which tunekit does not install: one line naming the package and the fix."""
    import importlib.util
    import json

    from vision_families import qwen2_5_vl

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the processor loads")
    qwen2_5_vl().tokenizer.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))
    with pytest.raises(TunekitError) as refused:
        vision.load_processor(ModelConfig(name_or_path=str(tmp_path)), str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and "torchvision" in message and "pip install torchvision" in message
