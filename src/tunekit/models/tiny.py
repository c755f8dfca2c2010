"""A tiny random Llama and a small byte-level BPE tokenizer with a ChatML template, built locally in
seconds: what the tests and benchmarks train when they need a model but not a pretrained one."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Translate to French: good morning. Bonjour.",
    "Reverse the word: cat -> tac. Reverse the word: dog -> god.",
    "café straße naïve façade 東京 北京 上海",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "0 1 2 3 4 5 6 7 8 9 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer(path: Path):
    """Train a 400-token byte-level BPE on a fixed corpus and save it to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def build_sentencepiece_tokenizer(path: Path):
    """A Llama 2-style tokenizer: a 420-piece SentencePiece BPE with byte fallback trained on the same corpus
    (needs the `sentencepiece` package), converted by transformers as it converts Llama 2's, saved to `path`."""
    import io
    import tempfile

    import sentencepiece
    from transformers import LlamaTokenizer

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=proto, model_type="bpe", vocab_size=420,
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tokenizer.model").write_bytes(proto.getvalue())
        tok = LlamaTokenizer.from_pretrained(tmp, legacy=False)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return tok


def llama_config(tokenizer, context: int = 512):
    """A 2-layer, 64-wide Llama's config for `tokenizer`'s vocabulary and special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)


def build_model(path: Path, tokenizer, seed: int = 0, context: int = 512) -> None:
    """Save a 2-layer, 64-wide random Llama (a 512-token context unless `context` says) and `tokenizer` to `path`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config(tokenizer, context)).save_pretrained(path)
    tokenizer.save_pretrained(path)


IMAGE_TOKEN = "<image>"


def build_vision_model(path: Path, tokenizer, seed: int = 0, image_size: int = 32, patch: int = 8) -> None:
    """Save a tiny random vision-language model composed as LLaVA composes one (a 2-layer SigLIP vision tower, a
    projector, the 2-layer Llama of build_model) with its processor (SigLIP's image processor at `image_size`, each
    image (image_size / patch)^2 tokens) to `path`; `tokenizer` gains the image token."""
    import torch
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    torch.manual_seed(seed)
    tower = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=image_size, patch_size=patch)
    cfg = LlavaConfig(vision_config=tower, text_config=llama_config(tokenizer),
                      image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
                      vision_feature_select_strategy="full", projector_hidden_act="gelu")
    LlavaForConditionalGeneration(cfg).save_pretrained(path)
    processor = LlavaProcessor(image_processor=SiglipImageProcessor(size={"height": image_size, "width": image_size}),
                               tokenizer=tokenizer, patch_size=patch, vision_feature_select_strategy="full",
                               num_additional_image_tokens=0, chat_template=tokenizer.chat_template)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
