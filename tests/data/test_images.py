"""Images in chat records (data.images): OpenAI-style parts (a path, a base64 data URL, {"url": ...}) and the LLaVA
shape (field `images`, one `<image>` per image) parse into text with a placeholder where each image stands and the
images in order; each image is read before weights load, and a missing, empty or unreadable file, bad base64, an
unreachable URL or a placeholder count that does not match is one line naming the file, line and message. A model
that reads text only refuses image records in one line."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from conftest import refused_in_process, tiny_recipe, write_jsonl, write_recipe
from tunekit.config.schema import FieldMap
from tunekit.core.errors import TunekitError
from tunekit.data import images
from tunekit.data.formats import FORMATS, Record


def png(path, colour=(200, 30, 30), size=(8, 6)):
    Image.new("RGB", size, colour).save(path)
    return str(path)


def parse(values: dict, **fields):
    return FORMATS["chat"].parse(Record(values, "data.jsonl line 3"), FieldMap(**fields))


def chat(*user_parts, answer="red"):
    return {"messages": [{"role": "user", "content": list(user_parts)}, {"role": "assistant", "content": answer}]}


def test_parts_become_placeholders_and_images_in_order(tmp_path):
    red, blue = png(tmp_path / "red.png"), png(tmp_path / "blue.png", (0, 0, 255))
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 255, 0)).save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parsed = parse(chat({"type": "text", "text": "Colours? "}, {"type": "image", "image": red},
                        {"type": "image_url", "image_url": {"url": data_url}},
                        {"type": "image", "path": f"file://{blue}"}, {"type": "text", "text": " Name them."}))
    assert images.PLACEHOLDER == "<image>"
    assert parsed.messages[0]["content"] == f"Colours? {images.PLACEHOLDER * 3} Name them."
    assert [(i.kind, i.value) for i in parsed.images] == [("path", red), ("base64", data_url.split(",")[1]),
                                                         ("path", blue)]
    assert [i.load().getpixel((0, 0)) for i in parsed.images] == [(200, 30, 30), (0, 255, 0), (0, 0, 255)]
    assert parsed.images[0].where == "data.jsonl line 3: message 0"


def test_llava_shape_counts_its_placeholders(tmp_path):
    a, b = png(tmp_path / "a.png"), png(tmp_path / "b.png")
    record = {"messages": [{"role": "user", "content": "<image> and <image>: same colour?"},
                           {"role": "assistant", "content": "yes"}], "images": [a, b]}
    assert [i.value for i in parse(record).images] == [a, b]
    renamed = {"messages": record["messages"], "pictures": [a, b]}
    assert len(parse(renamed, images="pictures").images) == 2
    with pytest.raises(TunekitError, match=r"data.jsonl line 3: 2 <image> placeholder\(s\) in the messages but 1 "
                                           r"image\(s\) in field 'images'"):
        parse({**record, "images": [a]})
    assert parse({"messages": record["messages"][1:]}).images == ()  # no images: a text record


@pytest.mark.parametrize("case, message", [
    ("missing", r"data.jsonl line 3: message 0: image file .*nowhere.png not found"),
    ("empty", r"data.jsonl line 3: message 0: image .*empty.png is empty \(0 bytes\)"),
    ("garbage", r"data.jsonl line 3: message 0: image .*garbage.png is not a readable image"),
    ("truncated", r"data.jsonl line 3: message 0: image .*truncated.png is not a readable image"),
    ("base64", r"data.jsonl line 3: message 0: the image's base64 data does not decode"),
    ("url", r"data.jsonl line 3: message 0: cannot fetch image http://127.0.0.1:9/x.png"),
    ("no value", r"data.jsonl line 3: message 0: an image needs a path, a URL or base64 data"),
])
def test_bad_images_are_one_line_naming_file_line_and_message(tmp_path, case, message):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "garbage.png").write_bytes(b"not an image at all" * 10)
    whole = (tmp_path / "whole.png").read_bytes() if png(tmp_path / "whole.png", size=(64, 64)) else b""
    (tmp_path / "truncated.png").write_bytes(whole[: len(whole) // 2])
    value = {"missing": str(tmp_path / "nowhere.png"), "empty": str(tmp_path / "empty.png"),
             "garbage": str(tmp_path / "garbage.png"), "truncated": str(tmp_path / "truncated.png"),
             "base64": "data:image/png;base64,@@not base64@@", "url": "http://127.0.0.1:9/x.png", "no value": ""}[case]
    with pytest.raises(TunekitError, match=message) as e:
        parse(chat({"type": "image", "image": value}))
    assert "\n" not in str(e.value)


def test_images_in_parts_and_field_at_once_or_in_a_prompt_format_are_refused(tmp_path):
    a = png(tmp_path / "a.png")
    with pytest.raises(TunekitError, match="images both in message parts and in field 'images'"):
        parse({**chat({"type": "image", "image": a}), "images": [a]})
    prompt = {"messages": [{"role": "user", "content": [{"type": "image", "image": a}]}], "answer": "red"}
    with pytest.raises(TunekitError, match="message 0: images are read in data.format chat only"):
        FORMATS["prompt"].parse(Record(prompt, "p.jsonl line 1"), FieldMap())
    with pytest.raises(TunekitError, match="a content part must be"):
        parse(chat({"type": "image", "image": a}, {"type": "audio", "audio": "x.wav"}))


def test_a_text_model_refuses_image_records_before_weights_load(tmp_path, tiny_model, capsys, monkeypatch):
    a = png(tmp_path / "a.png")
    rows = [chat({"type": "image", "image": a}, {"type": "text", "text": "Colour?"})] * 4
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    raw = tiny_recipe(tiny_model, train, tmp_path / "run", data={"format": "chat", "train": str(train)})
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    line = refused_in_process(["train", str(recipe)], tmp_path, capsys, monkeypatch)
    assert "train.jsonl line 1: message 0: the record has 1 image(s)" in line and "text-only" in line, line


def test_a_method_that_trains_on_text_only_refuses_image_records(tmp_path, tiny_vision_model, capsys, monkeypatch):
    a = png(tmp_path / "a.png")
    train = write_jsonl(tmp_path / "train.jsonl", [chat({"type": "image", "image": a}, {"type": "text", "text": "?"})])
    raw = tiny_recipe(tiny_vision_model, train, tmp_path / "run", data={"format": "chat", "train": str(train)},
                      training={"method": "grpo"}, grpo={"rewards": [{"reward": "chrf"}]})
    line = refused_in_process(["train", str(write_recipe(tmp_path / "r.yaml", raw))], tmp_path, capsys, monkeypatch)
    assert "train.jsonl line 1: message 0: the record has images, and training.method: grpo trains on text only; " \
           "images train with method sft" in line, line
