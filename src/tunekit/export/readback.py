"""The read-back check of a written GGUF file: transformers loads it (`gguf_file=`), its logits are compared
with the source model's on a few real prompts (the run's own data where there is a run) and its
tokenizer's ids with the source tokenizer's on text with accents, CJK and emoji; the file passes only
within the tolerance of its quantization type."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tunekit.export.architectures import ARCHITECTURES, architecture
from tunekit.export.gguf import CHECK_TEXT, Quant
from tunekit.models.ggufread import one_reader

# Text the read-back tokenizer must split exactly as the source one does: accents, CJK, emoji.
TOKENIZER_PROBES = ["Crème brûlée, naïve façade, Ångström, São Paulo.", "東京で寿司を食べました。北京欢迎你。",
                    "Emoji: 🚀🦙😶\u200d🌫️ ✅ and 👩🏽\u200d💻.", CHECK_TEXT,
                    "The lazy dog reverses words; instructions, responses and requests were translated."]


@dataclass
class Check:
    parity: object  # merge.Parity: the file's logits against the source model's
    token_mismatches: list[str]

    def line(self) -> str:
        return ("GGUF check: " + self.parity.line().removeprefix("parity: ") + "; tokenizer ids "
                + ("identical" if not self.token_mismatches else f"differ on {len(self.token_mismatches)} texts"))

    def passes(self, quant: Quant) -> bool:
        p = self.parity
        return (p.top1_agreement >= quant.min_top1 and not self.token_mismatches
                and (quant.max_diff is None or p.max_abs_diff <= quant.max_diff))


def prompts(recipe, tokenizer) -> dict:
    """The batch both models are compared on: a few examples of the run's own data, else the probes."""
    from tunekit.export import merge

    if recipe is not None:
        return merge.parity_batch(recipe, tokenizer)
    tokenizer.padding_side = "right"
    pad = tokenizer.pad_token
    if pad is None:  # Llama 2 has none; any id serves behind the attention mask
        tokenizer.pad_token = tokenizer.eos_token
    try:
        return tokenizer(TOKENIZER_PROBES[:3], return_tensors="pt", padding=True)
    finally:
        tokenizer.pad_token = pad


def check(source_model, source_tokenizer, gguf_file: Path, batch) -> Check:
    with one_reader(), registered(architecture(source_model.config, "export")):
        return _check(source_model, source_tokenizer, gguf_file, batch)


@contextmanager
def registered(arch):
    """transformers' GGUF reader is table-driven (config keys and the supported list by the file's architecture
    name, a tensor processor per name) and lists only the families it was given; a family it lacks whose file
    reads as a listed one's (OLMoE's keys and expert tensors are Qwen3-MoE's) is added to its tables for the
    read-back, and the tables are left as they were after. A family transformers lists is read as it is."""
    from transformers import modeling_gguf_pytorch_utils as reader

    name = arch.gguf_name
    if arch.read_back_like is None or name in reader.GGUF_SUPPORTED_ARCHITECTURES:
        yield
        return
    like = arch.read_back_like
    configs, processors = reader.GGUF_TO_TRANSFORMERS_MAPPING["config"], reader.TENSOR_PROCESSORS
    before = [(table, dict(table)) for table in (configs, processors)]
    try:
        configs[name] = dict(configs[like])  # the config table goes by transformers' name of the listed family
        processors[name] = processors[ARCHITECTURES[like].gguf_name]
        reader.GGUF_SUPPORTED_ARCHITECTURES.append(name)
        yield
    finally:
        if name in reader.GGUF_SUPPORTED_ARCHITECTURES:
            reader.GGUF_SUPPORTED_ARCHITECTURES.remove(name)
        for table, kept in before:
            table.clear()
            table.update(kept)


def _check(source_model, source_tokenizer, gguf_file: Path, batch) -> Check:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tunekit.export import merge

    # the config read once and handed to both loads
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    arch = architecture(source_model.config, "export")
    if arch.read_back_as and config.model_type != arch.read_back_as:
        config = AutoConfig.for_model(arch.read_back_as,
                                      **{k: v for k, v in config.to_dict().items() if k != "model_type"})
    if arch.read_back_keys:
        # transformers' header reader: gguf's GGUFReader spends ~30 s on a large vocabulary's arrays
        from transformers.integrations.gguf.reader import read_gguf_metadata

        meta, _ = read_gguf_metadata(str(gguf_file))
        for key, attribute in arch.read_back_keys:
            setattr(config, attribute, meta[f"{meta['general.architecture']}.{key}"])
    for attribute, value in arch.read_back_set:
        setattr(config, attribute, value)
    back = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, config=config,
                                                dtype=torch.float32)
    parity = merge.compare(merge.logits(source_model, batch), merge.logits(back, batch), batch["attention_mask"])
    back_tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, config=config)
    texts = [source_tokenizer.decode(row[mask.bool()]) for row, mask in
             zip(batch["input_ids"], batch["attention_mask"])] + TOKENIZER_PROBES
    mismatches = [t for t in texts if back_tok(t, add_special_tokens=False)["input_ids"] !=
                  source_tokenizer(t, add_special_tokens=False)["input_ids"]]
    return Check(parity, mismatches)
