"""Image tokens of a vision-language model: where its chat template puts an image, the tokens its processor turns
each image into, and the pixel inputs of a batch.

Why not the processor's own text path: a processor expands each image's marker inside the text before tokenizing,
so the character offsets that label masking reads (data.tokenizing) no longer match the rendered text. Here the
rendered text is tokenized as any other (its marker is a special token, or a few), then each image's marker tokens
are replaced by the tokens the processor makes for that image alone, labelled IGNORE: image tokens never carry
loss. The pixel inputs come from the same processor at batch time, so the counts agree."""

from __future__ import annotations

import collections
import functools
import json

from tunekit.config.schema import ModelConfig
from tunekit.core.errors import TunekitError
from tunekit.data.images import Image
from tunekit.data.tokenizing import IGNORE

_MADE: dict[int, tuple] = {}  # id(processor) -> (processor, its ImageTokens); the processor kept alive with it


def of(cfg: ModelConfig) -> ImageTokens | None:
    """The image tokens of the model `cfg` names, None for a text-only model."""
    from tunekit.models import vision

    if not vision.reads_images(cfg):
        return None
    processor = vision.load_processor(cfg, vision.location(cfg))  # cached: one per model in a process
    if id(processor) not in _MADE:  # one ImageTokens per processor, so that each image is expanded once
        _MADE[id(processor)] = (processor, ImageTokens(processor))
    return _MADE[id(processor)][1]


def template_marker(tokenizer, image_token: str) -> str:
    """The text the chat template writes for an image part: the difference between a user message rendered with
    and without one ("<|vision_start|><|image_pad|><|vision_end|>" for Qwen2.5-VL); the processor's image token
    where the template renders no image parts (a text template, as a model composed as LLaVA has)."""
    def rendered(content):
        try:
            return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        except Exception:  # noqa: BLE001 -- a template that cannot render parts: the fallback below
            return None

    text = [{"type": "text", "text": "\x00"}]
    with_image, without = rendered([{"type": "image"}, *text]), rendered(text)
    if with_image is None or without is None:
        return image_token
    start = 0
    while start < min(len(with_image), len(without)) and with_image[start] == without[start]:
        start += 1
    end = 0
    while end < len(without) - start and with_image[len(with_image) - 1 - end] == without[len(without) - 1 - end]:
        end += 1
    marker = with_image[start:len(with_image) - end]
    return marker.strip("\n") if image_token in marker else image_token


class ImageTokens:
    """A vision-language model's processor, for rendering (`marker`), tokenizing (`expand`) and batching
    (`pixels`)."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        token = getattr(processor, "image_token", None)
        self.marker = template_marker(self.tokenizer, getattr(processor, "boi_token", None) or token)
        self.marker_ids = self.tokenizer(self.marker, add_special_tokens=False)["input_ids"]
        self._ids: dict[tuple[str, str], list[int]] = {}

    def ids(self, image: Image) -> list[int]:
        """The tokens the processor makes for `image` where its marker stands (their number can depend on the
        image's size)."""
        key = (image.kind, image.value)
        if key not in self._ids:
            out = self.processor(text=self.marker, images=[image.load()], add_special_tokens=False)
            self._ids[key] = list(out["input_ids"][0])
        return self._ids[key]

    def places(self, ids: list[int], found: tuple[Image, ...], where: str | None) -> list[int]:
        """Where each image's marker starts in `ids`, in order (one per image)."""
        starts, i, n = [], 0, len(self.marker_ids)
        while i < len(ids) and len(starts) < len(found):
            if ids[i:i + n] == self.marker_ids:
                starts.append(i)
                i += n
            else:
                i += 1
        if len(starts) != len(found):
            raise TunekitError(f"{where or 'a record'}: {len(found)} image(s) but {len(starts)} place(s) for them in "
                               "the rendered text; an image's text must not be cut or rewritten by the chat template")
        return starts

    def expand(self, ids: list, labels: list, found: tuple[Image, ...], where: str | None,
               image_label=lambda k, size: [IGNORE] * size) -> tuple[list, list, list[int]]:
        """`ids`/`labels` with each image's marker tokens, in order, replaced by that image's tokens, and where each
        image's tokens end. The image tokens' labels come from `image_label(k, size)` (IGNORE: never trained);
        `labels` may be any list kept in step with the ids (`tunekit data` passes its token texts and roles)."""
        out_ids, out_labels, ends, done = [], [], [], 0
        for k, start in enumerate(self.places(ids, found, where)):
            image = self.ids(found[k])
            out_ids += ids[done:start] + image
            out_labels += labels[done:start] + image_label(k, len(image))
            ends.append(len(out_ids))
            done = start + len(self.marker_ids)
        return out_ids + ids[done:], out_labels + labels[done:], ends

    def pixels(self, per_example: list[list[Image]], input_ids=None) -> dict:
        """The image processor's inputs (pixel_values and what goes with them: grids, sizes, masks) for a batch,
        images grouped by example, and where the model reads token types (Gemma 3's token_type_ids, Qwen2.5-VL's
        mm_token_type_ids) those of `input_ids`: 1 on image tokens. The image processor is called alone: the
        processor's text outputs would be those of the markers, not of the batch's tokens."""
        if not any(per_example):
            return {}
        out = dict(self.processor.image_processor([[image.load() for image in found] for found in per_example],
                                                  return_tensors="pt"))
        for key in self.type_keys if input_ids is not None else ():
            out[key] = (input_ids == self.image_id).long()
        return out

    @functools.cached_property
    def image_id(self) -> int:
        """The token an image's tokens repeat (the processor's own image_token_id can name its marker's first)."""
        probe = self._probe()["input_ids"][0]
        return collections.Counter(probe).most_common(1)[0][0]

    @functools.cached_property
    def type_keys(self) -> tuple[str, ...]:
        """The token-type inputs the processor makes beside the ids (none for most models)."""
        return tuple(k for k in self._probe() if k.endswith("token_type_ids"))

    def _probe(self) -> dict:
        from PIL import Image as PILImage

        return self.processor(text=self.marker, images=[PILImage.new("RGB", (64, 64))], add_special_tokens=False)


def stored(found: tuple[Image, ...]) -> list[str]:
    """Images as the prepared data set keeps them (a JSON object each)."""
    return [json.dumps({"kind": i.kind, "value": i.value, "where": i.where}) for i in found]


def restored(column: list[str]) -> list[Image]:
    return [Image(**json.loads(text)) for text in column]

