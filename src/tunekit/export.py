"""`tunekit export TARGET --format gguf`: one GGUF file for llama.cpp, Ollama and LM Studio, checked
against the model it came from before it is kept.

TARGET is a run directory (merged first, exactly as `tunekit merge` merges, parity check included), a
merged directory or a base model. The `gguf` package writes the file (GGUFWriter, the tensor-name map,
numpy quantizers); what llama.cpp's converter (convert_hf_to_gguf.py) adds for Llama models is done here
too: the q/k projection rows reordered for llama.cpp's rotary layout (transformers' GGUF reader undoes
it), the vocabulary with token types, and the BPE pre-tokenizer named by the hash of a reference
tokenization. Then the file is read back with transformers (`gguf_file=`): its logits are compared with
the source model's on a few real prompts and its tokenizer's ids with the source tokenizer's, and the file
is refused above the tolerance of its quantization type.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from . import outputs
from .errors import TunekitError

# torch, numpy and gguf are imported where they are used: the CLI reads QUANTS for its --quant choices

log = logging.getLogger("tunekit")

# model types llama.cpp reads as "llama" (transformers' GGUF reader maps them back to LlamaForCausalLM)
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass(frozen=True)
class Quant:
    ggml: str  # gguf.GGMLQuantizationType member
    file_type: str  # gguf.LlamaFileType member
    min_top1: float  # top-1 agreement with the source model's logits at least this
    max_diff: float | None  # and max |logit diff| at most this (None: not bounded; 4/5-bit shift logits freely)


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
}

# llama.cpp names a BPE pre-tokenizer by sha256(str(tokenizer.encode(CHECK_TEXT))) (convert_hf_to_gguf.py,
# get_vocab_base_pre); the hashes below are the ones it lists for these tokenizers.
CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
              '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
              '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
              '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3, 3.1, 3.2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
}

# Text the read-back tokenizer must split exactly as the source one does: accents, CJK, emoji.
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback tokens
TOKENIZER_PROBES = ["Crème brûlée, naïve façade, Ångström, São Paulo.", "東京で寿司を食べました。北京欢迎你。",
                    "Emoji: 🚀🦙😶\u200d🌫️ ✅ and 👩🏽\u200d💻.", CHECK_TEXT,
                    "The lazy dog reverses words; instructions, responses and requests were translated."]


def permute_for_llama_cpp(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection reordered from transformers' rotary layout (halves) to llama.cpp's
    (interleaved pairs); transformers' GGUF reader applies the inverse."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _check_architecture(config, where: str) -> None:
    if config.model_type not in SUPPORTED:
        found = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise TunekitError(f"{where}: export --format gguf supports Llama-architecture models "
                           f"({', '.join(SUPPORTED.values())}: Llama 2/3, SmolLM2, Mistral); this one is {found}")


def _tensors(model, quant: Quant):
    """(GGUF name, numpy data, raw ggml type or None) for every weight, q/k rows permuted, quantized."""
    import gguf
    import numpy as np

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    qtype = getattr(gguf.GGMLQuantizationType, quant.ggml)
    for hf_name, param in model.named_parameters():  # tied output weights appear once, as the embedding
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise TunekitError(f"export: no GGUF name for tensor {hf_name}; the model is not a plain Llama")
        # below 8 bits the embedding and output head stay at q8_0, as llama.cpp's quantizer keeps them higher
        # (the SmolLM2 Q4_1 file it made holds token_embd in Q8_0): 4-bit rows there cost most of the accuracy
        ttype = gguf.GGMLQuantizationType.Q8_0 if quant.ggml[1] in "45" and name.split(".")[0] in (
            "token_embd", "output") else qtype
        block = gguf.GGML_QUANT_SIZES[ttype][0]
        w = param.detach().float()
        if hf_name.endswith("q_proj.weight"):
            w = permute_for_llama_cpp(w, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = permute_for_llama_cpp(w, cfg.num_key_value_heads)
        data = w.numpy()
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
    prepend = json.dumps(spec.get("pre_tokenizer")) + json.dumps(spec.get("normalizer"))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix('"prepend_scheme": "never"' not in prepend)


@dataclass
class Facts:
    """What the file says about where it came from (general.* and tunekit.* keys)."""
    name: str
    base_model: str
    license: str | None = None
    finetune: dict | None = None  # training method, adapter, steps, data, from the run


def write_gguf(model, tokenizer, path: Path, quant: Quant, facts: Facts) -> None:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(facts.name)
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, facts.base_model)
    if facts.license:
        writer.add_license(facts.license)
    if facts.finetune:
        writer.add_string("tunekit.finetune", json.dumps(facts.finetune, sort_keys=True))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", None)
    if theta:
        writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, quant.file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _vocab(writer, tokenizer, cfg.vocab_size)
    for name, data, raw in _tensors(model, quant):
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


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


@dataclass
class Source:
    kind: str  # run | merged | base
    path: Path  # the run directory, the merged directory, or the base model's directory
    recipe: object | None  # the recipe of a run or merged model
    facts: Facts


def _source(target: str) -> Source:
    """What TARGET is (rundir.resolve_target tells runs and merged directories apart), and what the file
    will say about it."""
    from . import models, rundir

    def finetune(run: Path, recipe) -> dict:
        record = rundir.RunRecord.load(run)
        return {"run": run.resolve().name, "training_method": record.training_method, "adapter": record.adapter,
                "steps": record.global_step, "data": recipe.data.train}

    path = Path(target)
    if not (rundir.is_run(path) or (path / rundir.MERGED_MARKER).is_file()):
        return Source("base", Path(models.materialize(target, key="export target")), None, Facts(path.stem, target))
    t = rundir.resolve_target(target)
    if t.kind == "run":
        return Source("run", path, t.recipe, Facts(path.resolve().name, t.recipe.model.name_or_path, None,
                                                   finetune(path, t.recipe)))
    run = Path(json.loads((path / rundir.MERGED_MARKER).read_text())["source_run"])
    facts = finetune(run, t.recipe) if rundir.is_run(run) else {"merged_from": str(run)}
    name = path.resolve().parent.name if path.name == "merged" else path.resolve().name
    return Source("merged", path, t.recipe, Facts(name, t.recipe.model.name_or_path, None, facts))


def _config(source: Source):
    """The model's config, read before anything is merged or loaded."""
    if source.recipe is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(source.path))
    from .modelinfo import model_config

    return model_config(source.recipe.model)


def license_of(spec: str) -> str | None:
    """The base model's license where it says one: a GGUF's general.license, or the `license:` line of a
    model directory's README front matter (the Hub's model card). Hub ids are not fetched for it."""
    import re

    from .sources import resolve_model

    try:
        source = resolve_model(spec)
    except TunekitError:
        return None
    if source.kind == "gguf":
        import gguf

        field = gguf.GGUFReader(source.location).fields.get("general.license")
        return field.contents() if field is not None else None
    card = Path(source.location) / "README.md"
    if source.kind == "dir" and card.is_file():
        found = re.search(r"^license:\s*(\S+)", card.read_text(encoding="utf-8", errors="replace"), re.M)
        return found.group(1) if found else None
    return None


@contextlib.contextmanager
def _model_dir(source: Source):
    """The directory holding the weights to export: a LoRA run is merged into a temporary directory
    (with `tunekit merge`'s parity check), a full fine-tuning run's model/ is used as it is."""
    from . import merge, rundir

    if source.kind != "run":
        yield source.path
    elif (source.path / rundir.MODEL_DIR).is_dir():
        yield source.path / rundir.MODEL_DIR
    else:
        with tempfile.TemporaryDirectory(prefix=".export-merge-", dir=source.path) as tmp:
            yield merge.merge(source.path, Path(tmp) / "merged", dtype="fp32")


def _prompts(recipe, tokenizer) -> dict:
    from . import merge

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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import merge

    back = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    parity = merge.compare(merge.logits(source_model, batch), merge.logits(back, batch), batch["attention_mask"])
    back_tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    texts = [source_tokenizer.decode(row[mask.bool()]) for row, mask in
             zip(batch["input_ids"], batch["attention_mask"])] + TOKENIZER_PROBES
    mismatches = [t for t in texts if back_tok(t, add_special_tokens=False)["input_ids"] !=
                  source_tokenizer(t, add_special_tokens=False)["input_ids"]]
    return Check(parity, mismatches)


def modelfile(gguf_name: str, tokenizer, recipe) -> str:
    """An Ollama Modelfile: the file, its chat template in Ollama's Go syntax (ChatML and Llama 3; other
    templates are left to the one stored in the GGUF), stop tokens and the recipe's greedy generation."""
    template = tokenizer.chat_template or ""
    lines = [f"FROM ./{gguf_name}", ""]
    stops = [tokenizer.eos_token]
    if "<|im_start|>" in template:
        lines.append('TEMPLATE """{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
                     '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
                     '<|im_start|>assistant\n"""')
        stops.append("<|im_end|>")
    elif "<|start_header_id|>" in template:
        lines.append('TEMPLATE """<|begin_of_text|>{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n'
                     '{{ .System }}<|eot_id|>{{ end }}{{- range .Messages }}<|start_header_id|>{{ .Role }}'
                     '<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant'
                     '<|end_header_id|>\n\n"""')
        stops.append("<|eot_id|>")
    else:
        lines.append("# chat template: Ollama reads the one stored in the GGUF file (tokenizer.chat_template)")
    if recipe is not None and recipe.data.system_prompt:
        lines.append(f'SYSTEM """{recipe.data.system_prompt}"""')
    lines += [f'PARAMETER stop "{s}"' for s in dict.fromkeys(s for s in stops if s)]
    lines.append("PARAMETER temperature 0")  # greedy, as `tunekit eval` generates
    if recipe is not None and recipe.eval is not None:
        lines.append(f"PARAMETER num_predict {recipe.eval.max_new_tokens}")
    return "\n".join(lines) + "\n"


def export(target: str, quant_name: str = "q8_0", out: Path | None = None, force: bool = False) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quant_name not in QUANTS:
        raise TunekitError(f"--quant {quant_name}: choose one of {', '.join(QUANTS)}")
    quant = QUANTS[quant_name]
    source = _source(target)
    recipe, facts = source.recipe, source.facts
    facts.license = license_of(facts.base_model)
    out = Path(out) if out else (source.path if source.kind != "base" else Path.cwd()) / \
        f"{facts.name}-{quant_name}.gguf"
    if not out.name.endswith(".gguf"):
        raise TunekitError(f"--out {out}: give a file name ending in .gguf")
    _check_architecture(_config(source), target)
    with outputs.exclusive(out, "export output"):
        if out.exists() and not (force and out.is_file()):
            raise TunekitError(f"export output {out} exists; pass --force to replace it, or --out another file")
        with _model_dir(source) as model_dir:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            batch = _prompts(recipe, tokenizer)
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.partial-", suffix=".gguf", dir=out.parent)
            os.close(fd)
            tmp = Path(tmp_name)
            try:
                log.info("writing %s (%s) from %s", out.name, quant_name, model_dir)
                write_gguf(model, tokenizer, tmp, quant, facts)
                result = check(model, tokenizer, tmp, batch)
                log.info(result.line())
                if not result.passes(quant):
                    raise TunekitError(
                        f"export refused: {result.line()}; {quant_name} needs top-1 >= {100 * quant.min_top1:g}%"
                        + (f", max diff <= {quant.max_diff:g}" if quant.max_diff is not None else "")
                        + " and identical token ids; nothing written to " + str(out))
                tmp.chmod(0o644)
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
            (out.parent / f"{out.stem}.Modelfile").write_text(modelfile(out.name, tokenizer, recipe), encoding="utf-8")
    log.info("GGUF written to %s (%.1f MB); Ollama: %s", out, out.stat().st_size / 1e6, f"{out.stem}.Modelfile")
    return out
