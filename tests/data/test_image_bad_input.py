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
from tunekit import api
from tunekit.config import recipefile
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


def _vision_recipe(tmp, model, **sections) -> dict:
    """A chat recipe on `model` whose records each hold an image."""
    train = write_jsonl(tmp / "train.jsonl", [chat(png(tmp / "a.png"))] * 2)
    return tiny_recipe(model, train, tmp / "run", data={"format": "chat", "train": str(train)}, **sections)


def _text_recipe(tmp, model, **sections) -> dict:
    train = write_jsonl(tmp / "train.jsonl", [{"instruction": "Say red.", "output": "red"}] * 2)
    return tiny_recipe(model, train, tmp / "run", **sections)


def _tokenizer_moved(tmp, vlm) -> str:
    """A copy of the vision model whose tokenizer holds its image token at another id (a token added before it)."""
    import shutil

    from transformers import AutoTokenizer

    from conftest import build_tokenizer

    copy = tmp / "moved"
    shutil.copytree(vlm, copy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).unlink()
    tokenizer = build_tokenizer(copy)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra>", "<image>"]})
    tokenizer.save_pretrained(copy)
    assert AutoTokenizer.from_pretrained(copy).convert_tokens_to_ids("<image>") == 401
    return str(copy)


def _missing_base(name: str):
    def make(tmp, vlm, text):
        (tmp / "runs").mkdir(exist_ok=True)  # a runs/ directory is here, the model's directory in it is not
        return {**_vision_recipe(tmp, vlm), "model": {"name_or_path": name}}
    return make


# case -> (the recipe from (tmp_path, tiny vision model, tiny text model), the whole line expected)
RECIPES = {
    "a text tokenizer beside a vision model": (
        lambda tmp, vlm, text: {**_vision_recipe(tmp, vlm), "model": {"name_or_path": str(vlm),
                                                                      "tokenizer": str(text)}},
        "model.tokenizer: {text} has no <image> token, the image token of the vision-language model {vlm}; leave "
        "model.tokenizer out (the model's own tokenizer has it), or give a tokenizer that holds <image>"),
    "a text tokenizer beside a vision model, records without images": (
        lambda tmp, vlm, text: {**_text_recipe(tmp, vlm), "model": {"name_or_path": str(vlm),
                                                                    "tokenizer": str(text)}},
        "model.tokenizer: {text} has no <image> token, the image token of the vision-language model {vlm}; leave "
        "model.tokenizer out (the model's own tokenizer has it), or give a tokenizer that holds <image>"),
    "a tokenizer with the image token at another id": (
        lambda tmp, vlm, text: {**_vision_recipe(tmp, vlm), "model": {"name_or_path": str(vlm),
                                                                      "tokenizer": _tokenizer_moved(tmp, vlm)}},
        "model.tokenizer: {tmp}/moved has <image> as token 401, and the vision-language model {vlm} reads images at "
        "token 400; leave model.tokenizer out (the model's own tokenizer has it), or give one with the same ids"),
    "a base model under runs/ that was not built": (
        _missing_base("runs/smollm2_vision_base"),
        "model.name_or_path: runs/smollm2_vision_base does not exist (no such directory; paths are relative to the "
        "working directory); build or copy the model there, or fix the path"),
    "a base model under the recipe's runs/, none run yet": (
        lambda tmp, vlm, text: {**_vision_recipe(tmp, vlm), "model": {"name_or_path": "runs/smollm2_vision_base"},
                                "output_dir": "runs/smollm2_vision"},
        "model.name_or_path: runs/smollm2_vision_base does not exist (no such directory; paths are relative to the "
        "working directory); build or copy the model there, or fix the path"),
    "a base model path that does not exist": (
        _missing_base("./vision_base"),
        "model.name_or_path: no such model directory './vision_base'"),
    "vision.train_projector on a text model": (
        lambda tmp, vlm, text: _text_recipe(tmp, text, vision={"train_projector": True}),
        "vision.train_projector: {text} is a text-only language model (its config has no vision_config), so it has "
        "no vision tower or projector for the vision section to train; remove the vision section, or train a "
        "vision-language model"),
    "vision.train_tower on a text model": (
        lambda tmp, vlm, text: _text_recipe(tmp, text, vision={"train_tower": True}),
        "vision.train_tower: {text} is a text-only language model (its config has no vision_config)"),
    "an empty vision section on a text model": (
        lambda tmp, vlm, text: _text_recipe(tmp, text, vision={}),
        "vision: {text} is a text-only language model (its config has no vision_config)"),
    "a vision section on a shipped text model's config": (
        lambda tmp, vlm, text: {**_text_recipe(tmp, text, vision={"train_projector": True}),
                                "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}},
        "vision.train_projector: Qwen/Qwen2.5-0.5B-Instruct is a text-only language model (its config has no "
        "vision_config)"),
}


def _expected(case: str, tmp, vlm, text) -> str:
    return RECIPES[case][1].format(tmp=tmp, vlm=vlm, text=text)


@pytest.mark.parametrize("case", RECIPES)
@pytest.mark.parametrize("verb", ["validate", "train"])
def test_a_recipe_the_model_cannot_serve_is_refused_by_the_api(tmp_path, tiny_vision_model, tiny_model, monkeypatch,
                                                               no_weights, case, verb):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    raw = RECIPES[case][0](tmp_path, tiny_vision_model, tiny_model)
    with pytest.raises(TunekitError) as refused:
        getattr(api, verb)(raw)
    message = str(refused.value)
    expected = _expected(case, tmp_path, tiny_vision_model, tiny_model)
    assert expected in message and "\n" not in message, message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", RECIPES)
def test_a_recipe_the_model_cannot_serve_is_refused_by_the_command_line(tmp_path, tiny_vision_model, tiny_model,
                                                                        capsys, monkeypatch, no_weights, case):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    recipe = write_recipe(tmp_path / "r.yaml", RECIPES[case][0](tmp_path, tiny_vision_model, tiny_model))
    expected = _expected(case, tmp_path, tiny_vision_model, tiny_model)
    for verb in ("validate", "train"):  # nothing written: not even the runs/ folder output_dir's lock would need
        line = refused_in_process([verb, str(recipe)], tmp_path, capsys, monkeypatch)
        assert expected in line, line


# case -> the recipe from (tmp_path, tiny vision model, tiny text model): each validates, and so does the recipe.yaml
# a run of it writes (every default spelled out)
TAKEN = {
    "a text model, no vision section": lambda tmp, vlm, text: _text_recipe(tmp, text),
    "a vision model with its vision section": lambda tmp, vlm, text: _vision_recipe(
        tmp, vlm, vision={"train_projector": True, "train_tower": True}),
    "a vision model with its own tokenizer named": lambda tmp, vlm, text: {
        **_vision_recipe(tmp, vlm), "model": {"name_or_path": str(vlm), "tokenizer": str(vlm)}},
    "a text model with another text tokenizer": lambda tmp, vlm, text: {
        **_text_recipe(tmp, text), "model": {"name_or_path": str(text), "tokenizer": str(text)}},
}


@pytest.mark.parametrize("case", TAKEN)
def test_recipes_the_model_serves_validate_and_reload_from_a_run(tmp_path, tiny_vision_model, tiny_model,
                                                                 monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    loaded = api.validate(TAKEN[case](tmp_path, tiny_vision_model, tiny_model)).recipe
    saved = tmp_path / "recipe.yaml"
    saved.write_text(recipefile.to_yaml(loaded))
    assert recipefile.load(saved).model_dump() == loaded.model_dump()
    api.validate(saved)


def test_a_vision_model_that_cannot_be_had_here_is_not_called_text_only(tmp_path, tiny_vision_model, monkeypatch,
                                                                        caplog, no_weights):
    """A hub model neither cached nor reachable: validate warns that the images were not checked against it, train
    refuses it as unavailable; neither takes it for a text-only model."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    raw = {**_vision_recipe(tmp_path, tiny_vision_model), "model": {"name_or_path": "someone/missing-vlm"}}
    api.validate(raw)
    assert "the records' images were not checked against the model: model.name_or_path: 'someone/missing-vlm' is " \
           "not in the local Hugging Face cache" in caplog.text
    with pytest.raises(TunekitError) as refused:
        api.train(raw)
    assert str(refused.value).startswith("model.name_or_path: 'someone/missing-vlm' is not in the local Hugging Face "
                                         "cache and HF_HUB_OFFLINE=1"), str(refused.value)
    assert "text-only" not in caplog.text + str(refused.value) and not (tmp_path / "run").exists()
