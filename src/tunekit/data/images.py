"""Images in chat records (data.format: chat), read and checked: OpenAI-style content parts and the LLaVA shape
(a record field `images` with one `<image>` placeholder per image). A message's text marks each image with
PLACEHOLDER where it stands; the record's images come in that order as Image values. The shapes, sources and
checks: docs/data.md, "Images in chat records"."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from tunekit.core.errors import TunekitError

PLACEHOLDER = "<image>"  # the LLaVA placeholder; vision-language renderers put the processor's image tokens here
IMAGE_PARTS = ("image", "image_url")
URL_TIMEOUT = 10  # seconds to fetch one image URL


@dataclass(frozen=True)
class Image:
    kind: str  # "path", "url" or "base64"
    value: str  # the path, the URL, or the base64 payload
    where: str  # "FILE line N: message M" for error messages

    def data(self) -> bytes:
        """The image file's bytes (a URL fetched, base64 decoded); a one-line error when there are none."""
        if self.kind == "base64":
            try:
                return base64.b64decode(self.value, validate=True)
            except (binascii.Error, ValueError):
                raise TunekitError(f"{self.where}: the image's base64 data does not decode; give the file's bytes "
                                   "base64-encoded (data:image/png;base64,...)") from None
        if self.kind == "url":
            try:
                with urllib.request.urlopen(self.value, timeout=URL_TIMEOUT) as response:
                    return response.read()
            except (OSError, ValueError) as e:
                raise TunekitError(f"{self.where}: cannot fetch image {self.value} ({e}); download it and give its "
                                   "path") from None
        path = Path(self.value)
        if path.is_dir():
            raise TunekitError(f"{self.where}: image {self.value} is a directory, not an image file; give the path of "
                               "the image file")
        if not path.is_file():
            raise TunekitError(f"{self.where}: image file {self.value} not found (paths are relative to the "
                               "working directory); fix the path or leave the record out")
        try:
            return path.read_bytes()
        except OSError as e:
            raise TunekitError(f"{self.where}: cannot read image file {self.value} ({e.strerror or e}); make it "
                               "readable or leave the record out") from None

    def digest(self) -> str:
        """A short digest of the image's bytes: the same picture under two names is one image."""
        return hashlib.blake2b(self.data(), digest_size=8).hexdigest()

    def load(self):
        """The image as a PIL image in RGB. One whose header declares more pixels than Pillow's decompression-bomb
        limit (PIL.Image.MAX_IMAGE_PIXELS, about 89 million) is refused before its pixels are decoded."""
        try:
            from PIL import Image as PILImage
            from PIL import UnidentifiedImageError
        except ImportError:
            raise TunekitError(f"{self.where}: reading images needs Pillow: pip install 'tunekit[vision]'") from None

        raw = self.data()
        name = self.value if self.kind != "base64" else "base64 image"
        if not raw:
            raise TunekitError(f"{self.where}: image {name} is empty (0 bytes); replace it or leave the record out")
        try:
            with warnings.catch_warnings():  # Pillow warns between its limit and twice it: refused below instead
                warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
                with PILImage.open(io.BytesIO(raw)) as probe:
                    width, height = probe.size
                    limit = PILImage.MAX_IMAGE_PIXELS
                    if limit is not None and width * height > limit:
                        raise self._too_large(name, f"{width}x{height}, {width * height:,} pixels")
                    probe.verify()  # the whole file, not only its header
                return PILImage.open(io.BytesIO(raw)).convert("RGB")
        except PILImage.DecompressionBombError as e:  # past twice the limit Pillow refuses at its header
            found = re.search(r"\((\d+) pixels\)", str(e))
            raise self._too_large(name, f"{int(found.group(1)):,} pixels" if found else
                                  f"more than {2 * PILImage.MAX_IMAGE_PIXELS:,} pixels") from None
        except UnidentifiedImageError:
            raise TunekitError(f"{self.where}: image {name} is not a readable image (Pillow recognises no image "
                               "format in it); replace it or leave the record out") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise TunekitError(f"{self.where}: image {name} is not a readable image ({e}); replace it or leave the "
                               "record out") from None

    def _too_large(self, name: str, declared: str) -> TunekitError:
        from PIL import Image as PILImage

        return TunekitError(f"{self.where}: image {name} declares {declared} in its header, more than the limit of "
                            f"{PILImage.MAX_IMAGE_PIXELS:,} (Pillow's decompression-bomb guard, "
                            "PIL.Image.MAX_IMAGE_PIXELS); scale it down or leave it out")


def source(value, where: str) -> Image:
    """An Image from a part's or an `images` entry's value: a path, a URL, a data URL, or {"url": ...}."""
    if isinstance(value, dict):
        value = value.get("url", value.get("path"))
    if not isinstance(value, str) or not value.strip():
        raise TunekitError(f"{where}: an image needs a path, a URL or base64 data (a text value)")
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if not header.endswith(";base64") or not payload:
            raise TunekitError(f"{where}: a data URL image must be base64 (data:image/png;base64,...)")
        return Image("base64", payload, where)
    if value.startswith(("http://", "https://")):
        return Image("url", value, where)
    return Image("path", value.removeprefix("file://"), where)


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PARTS


def part_source(part: dict, where: str) -> Image:
    value = part.get("image_url") if part["type"] == "image_url" else next(
        (part[k] for k in ("image", "url", "path") if k in part), None)
    return source(value, where)


def content(parts: list, where: str) -> tuple[str, list[Image]]:
    """A message's parts as text with PLACEHOLDER at each image, and the images in order."""
    text, found = [], []
    for part in parts:
        if is_image_part(part):
            found.append(part_source(part, where))
            text.append(PLACEHOLDER)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise TunekitError(f"{where}: a content part must be {{\"type\": \"text\", \"text\": ...}} or an image "
                               f"part ({', '.join(IMAGE_PARTS)}); got {str(part)[:60]!r}")
    return "".join(text), found


def listed(value, messages: list[dict], where: str, key: str) -> list[Image]:
    """The LLaVA shape: a record's `images` list, one per PLACEHOLDER in the messages' text, in order."""
    if not isinstance(value, list):
        value = [value]
    for i, m in enumerate(messages):
        if PLACEHOLDER in m["content"]:
            refuse_in_answer(m["role"], f"{where}: message {i}")
    marks = sum(m["content"].count(PLACEHOLDER) for m in messages)
    if marks != len(value):
        raise TunekitError(f"{where}: {marks} {PLACEHOLDER} placeholder(s) in the messages but {len(value)} "
                           f"image(s) in field {key!r}; put one {PLACEHOLDER} where each image belongs")
    return [source(v, f"{where}: field {key!r} [{i}]") for i, v in enumerate(value)]


def refuse_in_answer(role: str, where: str) -> None:
    """Images go in what the model reads, never in an answer it learns to write (it writes text only)."""
    if role == "assistant":
        raise TunekitError(f"{where}: an image in an assistant message; a model reads images and writes text only, "
                           "so put the image in the user message before it")


def checked(found: list[Image]) -> tuple[Image, ...]:
    """The images, each read and verified once per process (records are parsed more than once, and many records
    may share an image); a failure is raised again, naming its own record, wherever the image recurs."""
    for image in found:
        if (image.kind, image.value) not in _VERIFIED:
            image.load()
            _VERIFIED.add((image.kind, image.value))
    return tuple(found)


_VERIFIED: set[tuple[str, str]] = set()


def refuse_text_only(found: tuple[Image, ...], model: str) -> None:
    """Images reach only a model that reads them (a vision-language model, models.vision)."""
    if found:
        raise TunekitError(f"{found[0].where}: the record has {len(found)} image(s), and {model} is a text-only "
                           "language model (its config has no vision_config); leave the images out or train a "
                           "vision-language model")
