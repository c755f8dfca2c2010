"""The GGUF file llama.cpp, Ollama and LM Studio read, written from a loaded model and its tokenizer. The
`gguf` package writes it (GGUFWriter, the tensor-name map, numpy quantizers); what llama.cpp's converter
(convert_hf_to_gguf.py) adds per family comes from the registry in export.architectures (q/k row order, norm
shifts, the family's settings); the vocabulary is written with token types, and a byte-level BPE's
pre-tokenizer is named by the hash of a reference tokenization. Each quantization type carries the
tolerance its read-back check (export.readback) holds it to."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING

from tunekit.core import console
from tunekit.core.errors import TunekitError
from tunekit.export.architectures import Architecture, architecture, common_settings, rope_tensors

if TYPE_CHECKING:
    import torch

    from tunekit.export.source import Facts

# torch, numpy and gguf are imported where they are used: the CLI reads QUANTS for its --quant choices

log = logging.getLogger("tunekit")

@dataclass(frozen=True)
class Quant:
    ggml: str  # gguf.GGMLQuantizationType member
    file_type: str  # gguf.LlamaFileType member
    min_top1: float  # top-1 agreement with the source model's logits at least this
    max_diff: float | None  # and max |logit diff| at most this (None: not bounded; 4/5-bit shift logits freely)
    llama_cpp: str | None = None  # written by llama.cpp's quantizer from an f32 file (export.llamacpp): this ftype
    # (ggml and file_type then name the main type of llama.cpp's per-tensor mix; tunekit writes none of it itself)


# The tolerances: f16/bf16 round each weight once (logits bounded too); 8-bit blocks keep the argmax almost
# everywhere; 4/5-bit blocks move logits by whole units on a small model. Below 16 bits only the argmax is
# bounded (max |diff| is printed): SmolLM2-135M's q8_0 keeps 95.5% of argmaxes on the accent/CJK/emoji probes.
QUANTS = {
    "f32": Quant("F32", "ALL_F32", 1.0, 1e-3),
    "f16": Quant("F16", "MOSTLY_F16", 0.98, 0.25),
    "bf16": Quant("BF16", "MOSTLY_BF16", 0.95, 1.0),
    "q8_0": Quant("Q8_0", "MOSTLY_Q8_0", 0.9, None),
    "q5_0": Quant("Q5_0", "MOSTLY_Q5_0", 0.75, None),
    "q5_1": Quant("Q5_1", "MOSTLY_Q5_1", 0.75, None),
    "q4_0": Quant("Q4_0", "MOSTLY_Q4_0", 0.6, None),
    "q4_1": Quant("Q4_1", "MOSTLY_Q4_1", 0.6, None),
    # k-quants, the types llama.cpp, Ollama and LM Studio users pick, written by llama.cpp with its per-tensor mix.
    # SmolLM2-135M on the probe texts: q6_k 88.8%, q5_k_m 66.3%, q4_k_m 80.9% top-1 (its 576-wide rows are not
    # whole 256-blocks, so most tensors fall back to Q8_0 / Q5_1 / Q5_0; our own q5_0 gives 70.8% there)
    "q6_k": Quant("Q6_K", "MOSTLY_Q6_K", 0.85, None, "LLAMA_FTYPE_MOSTLY_Q6_K"),
    "q5_k_m": Quant("Q5_K", "MOSTLY_Q5_K_M", 0.6, None, "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
    "q4_k_m": Quant("Q4_K", "MOSTLY_Q4_K_M", 0.6, None, "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
}

# llama.cpp names a BPE pre-tokenizer by sha256(str(tokenizer.encode(CHECK_TEXT))) (convert_hf_to_gguf.py,
# get_vocab_base_pre); the hashes below are the ones it lists for these tokenizers.
CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis '
              'concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 '
              'កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български '
              '\'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
              '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3, 3.1, 3.2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5, Qwen2, Qwen2.5, Qwen3
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",  # OLMo 1.7 (allenai/OLMo-1.7-7B-hf)
}

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback tokens


def permute_for_llama_cpp(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection reordered from transformers' rotary layout (halves) to llama.cpp's
    (interleaved pairs); transformers' GGUF reader applies the inverse."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _weights(model, arch: Architecture):
    """(GGUF name, fp32 numpy data) for every weight as llama.cpp's converter writes it for this family, and the
    family's extra tensors (llama3 RoPE frequencies)."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.gguf_arch), cfg.num_hidden_layers)
    for hf_name, param in model.named_parameters():  # tied output weights appear once, as the embedding
        if hf_name.endswith("experts.gate_up_proj"):
            # a sparse block's experts in one 3-D tensor (experts x 2I x hidden: gate rows, then up rows), which
            # llama.cpp keeps as two (ffn_gate_exps, ffn_up_exps); transformers' reader joins them back
            gate, up = param.detach().float().chunk(2, dim=1)
            stem = hf_name.removesuffix("gate_up_proj")
            yield names.get_name(stem + "gate_proj") + ".weight", gate.contiguous().numpy()
            yield names.get_name(stem + "up_proj") + ".weight", up.contiguous().numpy()
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is not None and not hf_name.endswith((".weight", ".bias")):
            name += ".weight"  # a 3-D parameter of transformers 5's experts (down_proj): llama.cpp's tensor
        if name is None:
            raise TunekitError(f"export: no GGUF name for tensor {hf_name} of a {arch.families} model; "
                               "the model has a layer its family does not")
        w = param.detach().float()
        if arch.permute_qk and hf_name.endswith("q_proj.weight"):
            w = permute_for_llama_cpp(w, cfg.num_attention_heads)
        elif arch.permute_qk and hf_name.endswith("k_proj.weight"):
            w = permute_for_llama_cpp(w, cfg.num_key_value_heads)
        elif arch.norm_shift and hf_name.endswith("norm.weight"):
            w = w + arch.norm_shift
        yield name, w.numpy()
    yield from rope_tensors(cfg)


def _tensors(model, quant: Quant, arch: Architecture):
    """(GGUF name, numpy data, raw ggml type or None) for every weight, quantized."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, quant.ggml)
    for name, data in _weights(model, arch):
        # below 8 bits the embedding and output head stay at q8_0, as llama.cpp's quantizer keeps them higher
        # (the SmolLM2 Q4_1 file it made holds token_embd in Q8_0): 4-bit rows there cost most of the accuracy
        ttype = gguf.GGMLQuantizationType.Q8_0 if quant.ggml[1] in "45" and name.split(".")[0] in (
            "token_embd", "output") else qtype
        block = gguf.GGML_QUANT_SIZES[ttype][0]
        if data.ndim == 1 or quant.ggml == "F32" or data.shape[-1] % block:
            yield name, data.astype(np.float32), None  # norms (and rows that do not fill a block) stay fp32
        elif quant.ggml == "F16":
            yield name, data.astype(np.float16), None
        else:
            yield name, gguf.quants.quantize(data, ttype), ttype


def _vocab(writer, tokenizer, vocab_size: int) -> None:
    """The tokenizer as llama.cpp reads it: a byte-level BPE ("gpt2": tokens, types, merges, pre-tokenizer)
    or a SentencePiece-style BPE with byte fallback ("llama": tokens, types, scores), then the special ids,
    BOS/EOS flags and the chat template."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") == "BPE" and "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
        _byte_level_vocab(writer, tokenizer, vocab_size, model)
    elif model.get("type") == "BPE" and model.get("byte_fallback") and "\u2581" in json.dumps(spec, ensure_ascii=False):
        _sentencepiece_vocab(writer, tokenizer, vocab_size, spec)
    else:
        raise TunekitError(f"export: GGUF export supports byte-level BPE tokenizers (Llama 3.x, SmolLM2, Mistral Nemo) "
                           f"and SentencePiece BPE ones with byte fallback (Llama 2, Mistral 7B); this one is a "
                           f"{model.get('type', 'unknown')} tokenizer of another kind")
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None:
            getattr(writer, f"add_{key}_token_id")(token_id)
    ids = tokenizer("a")["input_ids"]  # what encoding adds, whichever attribute or post-processor says so
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _tokens_and_types(tokenizer, vocab_size: int, byte_tokens: bool) -> tuple[list[str], list]:
    import gguf

    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        if i == tokenizer.unk_token_id and byte_tokens:
            types.append(gguf.TokenType.UNKNOWN)
        elif added.get(token):
            types.append(gguf.TokenType.CONTROL)
        elif token in added:
            types.append(gguf.TokenType.USER_DEFINED)
        elif byte_tokens and BYTE_TOKEN.fullmatch(token):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _byte_level_vocab(writer, tokenizer, vocab_size: int, model: dict) -> None:
    tokens, types = _tokens_and_types(tokenizer, vocab_size, byte_tokens=False)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    found = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    pre = PRE_TOKENIZERS.get(found)
    if pre is None:
        log.warning("export: this tokenizer's pre-tokenizer is not one llama.cpp lists (hash %s); the file says "
                    "'default', and llama.cpp may split some text differently from transformers", found[:12])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


def _sentencepiece_vocab(writer, tokenizer, vocab_size: int, spec: dict) -> None:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose joined token scores highest, and
    ignores merges. tokenizer.json keeps no scores, only the merge list that transformers derived from them
    (highest score first), so each token scores minus the rank of the first merge that makes it; tokens no
    merge makes (characters, bytes, specials) score below every merge. The read-back check then rebuilds
    the merges from these scores, as transformers does for such files, and compares token ids."""
    tokens, types = _tokens_and_types(tokenizer, vocab_size, byte_tokens=True)
    merges = spec["model"].get("merges", [])
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(left + right, r)
    floor = len(merges) + 1
    scores = [-float(rank[t]) if t in rank else -float(floor + i) for i, t in enumerate(tokens)]
    pre, normalizer = json.dumps(spec.get("pre_tokenizer")), json.dumps(spec.get("normalizer"))
    # a space before the first word: Llama 2 / Mistral (Metaspace, prepend_scheme first) and Phi-3 (a Prepend
    # normalizer) add one; Gemma (spaces replaced, nothing prepended) does not
    prefix = '"Prepend"' in normalizer or ('"Metaspace"' in pre and '"prepend_scheme": "never"' not in pre)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(prefix)


def write_gguf(model, tokenizer, path: Path, quant: Quant, facts: Facts) -> None:
    if quant.llama_cpp is None:
        return _write(model, tokenizer, path, quant, facts)
    from tunekit.export import llamacpp

    f32 = path.with_name(path.name + ".f32")
    try:
        _write(model, tokenizer, f32, QUANTS["f32"], facts)
        llamacpp.quantize(f32, path, quant.llama_cpp)
    finally:
        f32.unlink(missing_ok=True)


def _write(model, tokenizer, path: Path, quant: Quant, facts: Facts) -> None:
    import gguf

    cfg = model.config
    arch = architecture(cfg, "export")
    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(facts.name)
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, facts.base_model)
    if facts.license:
        writer.add_license(facts.license)
    if facts.finetune:
        writer.add_string("tunekit.finetune", json.dumps(facts.finetune, sort_keys=True))
    common_settings(writer, cfg, "export")
    arch.settings(writer, cfg)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, quant.file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _vocab(writer, tokenizer, cfg.vocab_size)
    for name, data, raw in _tensors(model, quant, arch):
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=console.mode() == "bars")  # its bar is redrawn in place
    writer.close()
