"""Exact masks on real vision-language families (tests/vision_families.py: each family's processor, TRL's copy of
its chat template, its real vocabulary, a tiny random model from its config class): what trains is exactly the
assistant's text, every image token is the processor's own and carries no loss, and the model takes the batch."""

from __future__ import annotations

import pytest
import torch

from conftest import write_jsonl, write_recipe
from tunekit.config.schema import DataConfig
from tunekit.data.formats import Record
from tunekit.data.imagetokens import ImageTokens
from tunekit.data.rendering import Renderer
from tunekit.data.tokenizing import IGNORE, tokenize

vision_families = pytest.importorskip("vision_families")  # tests/ is on sys.path (conftest), as chat_templates is
ANSWERS = ("Red.", "A blue square, twice.")


@pytest.fixture(scope="module", params=sorted(vision_families.FAMILIES))
def family(request):
    return vision_families.FAMILIES[request.param]()


def _images(tmp_path):
    from PIL import Image

    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.new("RGB", (40, 30), (220, 30, 30)).save(red)
    Image.new("RGB", (100, 400), (30, 30, 220)).save(blue)  # another shape: Idefics3 splits it in other tiles
    return red, blue


def _conversation(red, blue) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "path": str(red)}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": ANSWERS[0]},
            {"role": "user", "content": [{"type": "text", "text": "And this one, what shape?"},
                                         {"type": "image", "path": str(blue)}]},
            {"role": "assistant", "content": ANSWERS[1]}]


def _runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    runs, current = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE:
            current.append(i)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def test_trained_tokens_are_the_answers_and_image_tokens_the_processors(family, tmp_path):
    from PIL import Image

    red, blue = _images(tmp_path)
    tok, image_tokens = family.tokenizer, ImageTokens(family.processor)
    renderer = Renderer(DataConfig(train="x.jsonl", format="chat", max_length=8192), tok, image_tokens=image_tokens)
    (rendered,) = renderer.examples(Record({"messages": _conversation(red, blue)}, "x.jsonl line 1"))
    ex, truncated = tokenize(rendered, tok, 8192, True, image_tokens)
    assert not truncated and len(ex.images) == 2
    # every trained token, and only those, spells an answer as the model writes it after its generation prompt
    assert [tok.decode(run) for run in _runs(ex.input_ids, ex.labels)] == [family.turn.format(a) for a in ANSWERS]
    # the ids are those the family's processor makes of the conversation its template renders, images included
    parts = [dict(m, content=[{"type": "image"} if p["type"] == "image" else p for p in m["content"]])
             if isinstance(m["content"], list) else dict(m, content=[{"type": "text", "text": m["content"]}])
             for m in _conversation(red, blue)]
    text = tok.apply_chat_template(parts, tokenize=False)
    own = family.processor(text=text, images=[Image.open(p).convert("RGB") for p in (red, blue)],
                           add_special_tokens=False)
    assert ex.input_ids == list(own["input_ids"][0])
    image = image_tokens.image_id
    assert sum(i == image for i in ex.input_ids) > 2 * 16
    assert all(label == IGNORE for i, label in zip(ex.input_ids, ex.labels) if i == image)
    # the family's model takes the batch: as many image features as image tokens, a finite loss on the answers
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(family.config)
    ids = torch.tensor([ex.input_ids])
    pixels = image_tokens.pixels([list(ex.images)], ids)
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([ex.labels]), **pixels).loss
    assert torch.isfinite(loss) and loss.item() > 0


def test_tunekit_data_shows_a_real_familys_images_with_their_token_counts(tmp_path):
    from transformers import AutoModelForImageTextToText

    from tunekit import api

    family = vision_families.idefics3()
    folder = tmp_path / "idefics3"
    AutoModelForImageTextToText.from_config(family.config).save_pretrained(folder)
    family.processor.save_pretrained(folder)
    red, blue = _images(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"messages": _conversation(red, blue)}])
    raw = {"model": {"name_or_path": str(folder)}, "adapter": "lora", "lora": {"r": 4, "alpha": 8},
           "data": {"train": str(tmp_path / "train.jsonl"), "format": "chat", "max_length": 8192},
           "training": {"max_steps": 1}, "output_dir": str(tmp_path / "run")}
    shown = api.data(write_recipe(tmp_path / "r.yaml", raw), show=1)
    image_tokens = ImageTokens(family.processor)
    from tunekit.data.images import Image as Found

    sizes = [len(image_tokens.ids(Found("path", str(p), "x"))) for p in (red, blue)]
    assert sizes[0] != sizes[1] and min(sizes) > 2 * 169  # tiles of 169 tokens each, as many as the shape asks
    (example,) = shown.preview.shown
    images = [s for s in example.segments if s["role"] == "image"]
    assert images == [{"text": f"[image {k + 1}: {n} tokens]", "trained": False, "role": "image", "tokens": n}
                      for k, n in enumerate(sizes)]
    assert shown.preview.roles["image"] == {"trained": 0, "untrained": sum(sizes)}
    trained = "".join(s["text"] for s in example.segments if s["trained"])
    assert trained == "".join(family.turn.format(a) for a in ANSWERS)
