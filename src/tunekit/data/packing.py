"""Whether a micro-batch is packed: `data.packing` true, false, or auto (the default).

`DataCollatorWithFlattening` packs a micro-batch into one row with position ids restarting per example;
attention keeps the examples apart with a block-diagonal mask that transformers' masking utilities
build from those position ids (or with flash-attention's sequence boundaries). That holds only for
models whose tokens meet nowhere but in attention, hence the checked list below.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tunekit")

# Architectures whose packed forward equals each example's own forward, checked on tiny random models
# by tests/data/test_packing.py::test_packable_architectures. Not listed: models that mix tokens outside
# attention (Mamba, convolution or recurrent layers: Lfm2, Granite hybrids, Jamba...), softcapped
# attention (Gemma 2, whose eager path is its only one), and anything not yet checked.
PACKABLE = frozenset({
    "apertus", "arcee", "cohere", "exaone4", "gemma", "gemma3_text", "glm", "glm4", "gpt2", "granite", "helium",
    "hunyuan_v1_dense", "llama", "ministral", "mistral", "mixtral", "olmo2", "olmo3", "phi", "phi3", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "starcoder2",
})


def use(model, setting: bool | str, images: bool = False) -> bool:
    """Whether to pack. auto packs the architectures in PACKABLE: on the bench's real data sets packed
    batches were never slower than padded ones (bench/RESULTS.md); true packs any model, with a warning
    when its architecture is not in the list. A vision-language model's batches (`images`) are never packed."""
    if setting is False:
        return False
    if images:
        log.info("packing: off for a vision-language model (its image examples are padded, never packed)")
        return False
    kind = getattr(model.config, "model_type", "?")
    if kind in PACKABLE:
        return True
    if setting == "auto":
        log.info("packing: off for %s (not among the architectures checked to keep packed examples apart); "
                 "padded batches", kind)
        return False
    log.warning("data.packing: true on %s, which is not among the architectures checked to keep packed "
                "examples apart; data.packing: auto would use padded batches", kind)
    return True
