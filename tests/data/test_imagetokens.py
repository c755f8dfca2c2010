"""Image tokens of a vision-language model (data.imagetokens): an image's marker becomes the processor's tokens for
that image, which never carry loss; the trained tokens decode to exactly the assistant's text; truncation never
cuts an image in two; a batch carries the pixel inputs of its examples' images; the marker is what the model's own
chat template writes for an image (templates shipped in TRL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import colour_rows, tiny_recipe, write_jsonl, write_recipe
from tunekit.config.schema import DataConfig
from tunekit.data import imagetokens
from tunekit.data.collating import collator
from tunekit.data.formats import Record
from tunekit.data.rendering import Renderer
from tunekit.data.tokenizing import IGNORE, tokenize

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"


@pytest.fixture(scope="module")
def vision(tiny_vision_model):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vision_model)
    return processor.tokenizer, imagetokens.ImageTokens(processor)


def rendered(vision, row, max_length=512):
    tok, tokens = vision
    renderer = Renderer(DataConfig(train="x.jsonl", format="chat", max_length=max_length), tok, image_tokens=tokens)
    (out,) = renderer.examples(Record(row, "train.jsonl line 1"))
    return out, tokenize(out, tok, max_length, mask_prompt=True, image_tokens=tokens)


def test_image_tokens_carry_no_loss_and_trained_tokens_are_the_answer(vision, tmp_path):
    tok, tokens = vision
    row = colour_rows(tmp_path, 1)[0]
    row["messages"][0]["content"].append({"type": "image", "path": row["messages"][0]["content"][0]["path"]})
    out, (example, truncated) = rendered(vision, row)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert tokens.marker == "<image>" and out.text.count("<image>") == 2 and not truncated
    assert example.input_ids.count(image_id) == 2 * 16  # 32x32 images in 8x8 patches, each
    assert all(label == IGNORE for i, label in zip(example.input_ids, example.labels) if i == image_id)
    trained = [i for i, label in zip(example.input_ids, example.labels) if label != IGNORE]
    assert tok.decode(trained) == "red<|im_end|>"
    assert len(example.images) == 2


def test_truncation_never_cuts_an_image(vision, tmp_path):
    tok, _ = vision
    row = colour_rows(tmp_path, 1)[0]
    _, (whole, _) = rendered(vision, row)
    start = whole.input_ids.index(tok.convert_tokens_to_ids("<image>"))
    _, (cut, truncated) = rendered(vision, row, max_length=start + 10)  # 10 of the image's 16 tokens would fit
    assert truncated and cut.input_ids == whole.input_ids[:start] and cut.images == ()
    _, (kept, truncated) = rendered(vision, row, max_length=start + 16)
    assert truncated and kept.input_ids == whole.input_ids[:start + 16] and len(kept.images) == 1


def test_a_batch_carries_its_images_pixels(vision, tmp_path):
    tok, tokens = vision
    rows = colour_rows(tmp_path, 2)
    examples = [rendered(vision, row)[1][0] for row in rows]
    collate = collator(tok, image_tokens=tokens)
    batch = collate([{"input_ids": e.input_ids, "labels": e.labels, "images": imagetokens.stored(e.images)}
                     for e in examples])
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    red, blue = batch["pixel_values"][:, :, 0, 0]  # SigLIP's normalisation: (x / 255 - 0.5) / 0.5
    assert red.tolist() == pytest.approx([220 / 127.5 - 1, 30 / 127.5 - 1, 30 / 127.5 - 1], abs=1e-3)
    assert blue.tolist() == pytest.approx([30 / 127.5 - 1, 30 / 127.5 - 1, 220 / 127.5 - 1], abs=1e-3)
    assert "images" not in batch and batch["input_ids"].shape == batch["labels"].shape


@pytest.mark.parametrize("template,image_token,marker", [
    ("qwen2_5_vl", "<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>"),
    ("smolvlm", "<image>", "<image>"),
    ("gemma3", "<start_of_image>", "<start_of_image>"),
    ("llava_next", "<image>", "<image>"),
])
def test_the_marker_is_what_the_model_template_writes_for_an_image(tiny_tokenizer, template, image_token, marker):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = (TRL_TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    assert imagetokens.template_marker(tok, image_token) == marker


def test_a_text_template_falls_back_to_the_processor_image_token(tiny_tokenizer):
    assert imagetokens.template_marker(tiny_tokenizer, "<image>") == "<image>"


def test_tunekit_data_shows_each_image_as_a_placeholder_with_its_token_count(tmp_path, tiny_vision_model):
    from tunekit import api

    rows = colour_rows(tmp_path / "img", 5)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    raw = tiny_recipe(tiny_vision_model, train, tmp_path / "run", data={"format": "chat"})
    shown = api.data(write_recipe(tmp_path / "r.yaml", raw), show=1).preview
    assert shown.roles["image"] == {"trained": 0, "untrained": 5 * 16}
    assert shown.roles["assistant"]["trained"] == shown.stats.trained_tokens
    (example,) = shown.shown
    texts = [s["text"] for s in example.segments]
    assert "[image 1: 16 tokens]" in "".join(texts)
    image = next(s for s in example.segments if s["role"] == "image")
    assert image == {"text": "[image 1: 16 tokens]", "trained": False, "role": "image", "tokens": 16}
    assert "".join(s["text"] for s in example.segments if s["trained"]) == "red<|im_end|>"


@pytest.mark.parametrize("template", ["smolvlm", "llava_next", "idefics3"])
def test_a_template_that_reads_only_content_parts_gets_text_and_image_parts(tiny_tokenizer, template):
    """TRL's copies of these templates iterate content parts: a string content renders as nothing (or raises), so
    the chat renderer gives each text as a text part and each image marker as an image part."""
    from tunekit.data.chattemplate import Chat, as_parts

    assert as_parts("a<image>b<image>", "<image>") == [{"type": "text", "text": "a"}, {"type": "image"},
                                                       {"type": "text", "text": "b"}, {"type": "image"}]
    assert as_parts("", "<image>") == [{"type": "text", "text": ""}]
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = (TRL_TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    chat = Chat(tok, "all_assistant", False, image_marker="<image>")
    assert not chat.strings and Chat(tiny_tokenizer, "all_assistant", False).strings
    text = chat.apply([{"role": "user", "content": "<image>What colour?"},
                       {"role": "assistant", "content": "Red."}], None, "x")
    assert text.count("<image>") == 1 and "What colour?" in text.split("<image>")[1] and "Red." in text
