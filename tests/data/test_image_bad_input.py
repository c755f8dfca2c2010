"""Bad image input, each class one table (issue 70, point 2): an image file that is there but cannot be read as
an image, an image whose header declares more pixels than Pillow's decompression-bomb limit (in training and in
`tunekit chat --image`), a text tokenizer given beside a vision-language model, a vision model that is not there,
an image in an assistant message, and vision settings in a text model's recipe. Each is one line naming the key,
file, line or value and the fix, exit code 2, nothing written, found before weights load."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from PIL import Image

from conftest import refused_in_process, tiny_recipe, write_jsonl, write_recipe
from tunekit.config.schema import FieldMap
from tunekit.core.errors import TunekitError
from tunekit.data.formats import FORMATS, Record


def png(path, size=(8, 6), colour=(200, 30, 30)):
    Image.new("RGB", size, colour).save(path)
    return str(path)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height grey pixels, with almost no pixel data behind it (as a
    decompression bomb's header reads; the pixels are never decoded)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def chat(image, answer="red"):
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "Colour?"}]},
                         {"role": "assistant", "content": answer}]}


def parse(values: dict):
    return FORMATS["chat"].parse(Record(values, "data.jsonl line 3"), FieldMap())


def _unreadable(tmp_path, monkeypatch):
    path = png(tmp_path / "locked.png")
    real = type(tmp_path).read_bytes

    def read_bytes(self):
        if self.name == "locked.png":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    monkeypatch.setattr(type(tmp_path), "read_bytes", read_bytes)
    return path


def _lowered_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    return png(tmp_path / "small.png", size=(12, 12))


def _written(name: str, content: bytes):
    def make(tmp_path, monkeypatch):
        (tmp_path / name).write_bytes(content)
        return str(tmp_path / name)
    return make


# case -> (makes the image value, the error's expected text after "data.jsonl line 3: message 0: ")
FILES = {
    "a directory": (lambda tmp, mp: str((tmp / "dir.png").mkdir() or tmp / "dir.png"),
                    "image {path} is a directory, not an image file; give the path of the image file"),
    "unreadable": (_unreadable, "cannot read image file {path} (Permission denied); make it readable or leave the "
                                "record out"),
    "not an image": (_written("text.png", b"plain text, no image" * 5),
                     "image {path} is not a readable image (Pillow recognises no image format in it); replace it"),
    "header past twice the limit": (
        _written("bomb.png", png_header(30_000, 30_000)),
        "image {path} declares 900,000,000 pixels in its header, more than the limit of 89,478,485 (Pillow's "
        "decompression-bomb guard, PIL.Image.MAX_IMAGE_PIXELS); scale it down or leave it out"),
    "header past the limit": (
        _written("big.png", png_header(10_000, 10_000)),
        "image {path} declares 10000x10000, 100,000,000 pixels in its header, more than the limit of 89,478,485"),
    "past a lowered limit": (_lowered_limit, "image {path} declares 12x12, 144 pixels in its header, more than the "
                                             "limit of 100 (Pillow's"),
    "base64 past the limit": (lambda tmp, mp: "data:image/png;base64," + base64.b64encode(
        png_header(30_000, 30_000)).decode(), "image base64 image declares 900,000,000 pixels in its header"),
}


@pytest.mark.parametrize("case", FILES)
def test_an_image_that_cannot_be_read_is_one_line_naming_file_line_and_message(tmp_path, monkeypatch, case):
    make, expected = FILES[case]
    value = make(tmp_path, monkeypatch)
    with pytest.raises(TunekitError) as refused:
        parse(chat(value))
    message = str(refused.value)
    assert message.startswith(f"data.jsonl line 3: message 0: {expected.format(path=value)}"), message
    assert "\n" not in message and "<_io" not in message


def test_an_image_within_the_limit_reads(tmp_path):
    path = png(tmp_path / "ok.png", size=(64, 48))
    assert parse(chat(path)).images[0].load().size == (64, 48)


def _answer_with(image_content):
    def make(image):
        return {"messages": [{"role": "user", "content": "Draw a red square."},
                             {"role": "assistant", "content": image_content(image)}]}
    return make


# case -> a record with an image in its assistant message (message 1), from an image path
IN_ANSWERS = {
    "an image part": _answer_with(lambda a: [{"type": "text", "text": "Here: "}, {"type": "image", "image": a}]),
    "an image_url part": _answer_with(lambda a: [{"type": "image_url", "image_url": {"url": a}}]),
    "a placeholder, images in field images": lambda a: {**_answer_with(lambda _: "Here: <image>")(a), "images": [a]},
    "after an image the user gave": lambda a: {"messages": [
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "Same again?"}]},
        {"role": "assistant", "content": [{"type": "image", "image": a}]}]},
}


@pytest.mark.parametrize("case", IN_ANSWERS)
def test_an_image_in_an_assistant_message_is_refused(tmp_path, case):
    record = IN_ANSWERS[case](png(tmp_path / "a.png"))
    with pytest.raises(TunekitError) as refused:
        parse(record)
    assert str(refused.value) == ("data.jsonl line 3: message 1: an image in an assistant message; a model reads "
                                  "images and writes text only, so put the image in the user message before it")


@pytest.fixture()
def no_weights(monkeypatch):
    """Loading any weights fails the test: each refusal here comes before."""
    from tunekit.models import loader

    def refused(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")
    monkeypatch.setattr(loader, "load_base", refused)


def _bomb(tmp_path) -> str:
    (tmp_path / "bomb.png").write_bytes(png_header(30_000, 30_000))
    return str(tmp_path / "bomb.png")


# case -> (argv from (tmp_path, tiny vision model, tiny text model), the line's expected text)
def _train_bomb(tmp, vlm, text):
    train = write_jsonl(tmp / "train.jsonl", [chat(_bomb(tmp))] * 2)
    raw = tiny_recipe(vlm, train, tmp / "run", data={"format": "chat", "train": str(train)})
    return ["train", str(write_recipe(tmp / "r.yaml", raw))]


def _train_answer_image(tmp, vlm, text):
    train = write_jsonl(tmp / "train.jsonl", [IN_ANSWERS["an image part"](png(tmp / "a.png"))] * 2)
    raw = tiny_recipe(vlm, train, tmp / "run", data={"format": "chat", "train": str(train)})
    return ["train", str(write_recipe(tmp / "r.yaml", raw))]


COMMANDS = {
    "train, an image in an assistant message": (_train_answer_image, "train.jsonl line 1: message 1: an image in an "
                                                                     "assistant message"),
    "train, an image past the limit": (_train_bomb, "train.jsonl line 1: message 0: image {tmp}/bomb.png declares "
                                                    "900,000,000 pixels in its header, more than the limit of "
                                                    "89,478,485"),
    "chat --image past the limit": (lambda tmp, vlm, text: ["chat", str(vlm), "--image", _bomb(tmp), "--once", "hi"],
                                    "--image {tmp}/bomb.png: image {tmp}/bomb.png declares 900,000,000 pixels in its "
                                    "header, more than the limit of 89,478,485 (Pillow's decompression-bomb guard"),
    "chat --image a directory": (lambda tmp, vlm, text: ["chat", str(vlm), "--image", str(tmp), "--once", "hi"],
                                 "--image {tmp}: image {tmp} is a directory, not an image file"),
    "chat --image with a text model": (
        lambda tmp, vlm, text: ["chat", str(text), "--image", png(tmp / "a.png"), "--once", "hi"],
        "--image {tmp}/a.png: {text} is a text-only language model (its config has no vision_config); leave --image "
        "out or chat with a vision-language model"),
}


@pytest.mark.parametrize("case", COMMANDS)
def test_a_bad_image_is_refused_by_the_command_before_weights_load(tmp_path, tiny_vision_model, tiny_model, capsys,
                                                                   monkeypatch, no_weights, case):
    argv, expected = COMMANDS[case]
    line = refused_in_process(argv(tmp_path, tiny_vision_model, tiny_model), tmp_path, capsys, monkeypatch)
    assert expected.format(tmp=tmp_path, text=tiny_model) in line, line
