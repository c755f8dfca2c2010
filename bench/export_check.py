"""`make export-check`: llama.cpp itself runs the GGUF that `tunekit export` wrote for the demo's fine-tuned
SmolLM2, and must give the greedy answers `tunekit eval` gave with transformers.

Builds llama.cpp's Python binding (llama-cpp-python, a source archive on the package index) into the venv
when it is missing and times the build; needs `make demo` to have run (runs/demo: the q8_0 GGUF and the
merged model's eval predictions). For each held-out prompt, exactly as `tunekit eval` rendered it, llama.cpp
tokenizes it (ids compared with the transformers tokenizer's) and generates greedily; the answers are
compared with `tunekit eval`'s. Prints the agreement and writes bench/export_check.json.

It also exports a tiny Llama with a Llama 2-style SentencePiece vocabulary (tunekit.models.tiny; needs the
`sentencepiece` package) and compares llama.cpp's tokenization of the tiny corpus and the export's probe
texts with transformers': the token scores tunekit writes are what llama.cpp merges by.

    python bench/export_check.py [--demo runs/demo] [--out bench/export_check.json] [--sentencepiece-only]
                                 [--families-only]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from tunekit.export.llamacpp import PACKAGE as BINDING  # the pin the `llama-cpp` extra and --quant's refusal name

ROOT = Path(__file__).resolve().parents[1]


def ensure_binding() -> float | None:
    """Seconds the build took, or None when the binding was already installed."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return None
    print(f"export-check: building {BINDING} (llama.cpp from source; minutes on 2 cores)", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", BINDING], check=True)
    return time.perf_counter() - started


def sentencepiece_check() -> dict:
    import tempfile

    from llama_cpp import Llama

    from tunekit.export import exporting, readback
    from tunekit.models.tiny import CORPUS, build_model, build_sentencepiece_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "spm-llama"
        tok = build_sentencepiece_tokenizer(model_dir)
        tok.pad_token = tok.unk_token
        build_model(model_dir, tok)
        tok = build_sentencepiece_tokenizer(model_dir)
        gguf_file = exporting.export(str(model_dir), "f32", Path(tmp) / "spm.gguf")
        llm = Llama(model_path=str(gguf_file), vocab_only=True, verbose=False)
        texts = CORPUS + readback.TOKENIZER_PROBES + [" text that begins with a space"]
        differ = [t for t in texts if llm.tokenize(t.encode(), add_bos=False, special=False)
                  != tok(t, add_special_tokens=False)["input_ids"]]
    print(f"export-check: SentencePiece vocabulary: llama.cpp tokenizes {len(texts) - len(differ)}/{len(texts)} texts "
          f"as transformers does; differ: {differ}")
    return {"texts": len(texts), "identical": len(texts) - len(differ), "differ": differ}


FAMILY_PROMPT = "Name three rivers of Europe, and say which is longest."


def _greedy_hf(model, ids: list[int], steps: int) -> list[int]:
    import torch

    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


def _greedy_llama_cpp(llm, ids: list[int], steps: int) -> list[int]:
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def family_check(family: str, tmp: Path, steps: int = 16) -> dict:
    """A tiny model of `family` with its real tokenizer, exported in f32 as `tunekit export` writes it: llama.cpp
    tokenizes the probe texts and the chat-rendered prompt as transformers does, and its greedy ids from that
    prompt equal the source model's."""
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    from tunekit.export import gguf, readback
    from tunekit.export.source import Facts
    from tunekit.models.families import build_family_model

    tok = build_family_model(tmp / family, family)
    model = AutoModelForCausalLM.from_pretrained(str(tmp / family), dtype=torch.float32).eval()
    gguf_file = tmp / f"{family}.gguf"
    gguf.write_gguf(model, tok, gguf_file, gguf.QUANTS["f32"], Facts(f"tiny-{family}", family))
    llm = Llama(model_path=str(gguf_file), n_ctx=512, n_threads=2, logits_all=True, verbose=False, seed=0)
    prompt = tok.apply_chat_template([{"role": "user", "content": FAMILY_PROMPT}], add_generation_prompt=True,
                                     tokenize=False) if tok.chat_template else FAMILY_PROMPT  # OLMoE ships none
    texts = readback.TOKENIZER_PROBES + [prompt]
    differ = [t for t in texts if llm.tokenize(t.encode(), add_bos=False, special=True)
              != tok(t, add_special_tokens=False)["input_ids"]]
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ours, theirs = _greedy_hf(model, ids, steps), _greedy_llama_cpp(llm, ids, steps)
    result = {"texts": len(texts), "tokenization_identical": len(texts) - len(differ), "differ": differ,
              "greedy_ids_equal": ours == theirs, "transformers": ours, "llama_cpp": theirs}
    print(f"export-check: {family}: llama.cpp tokenizes {result['tokenization_identical']}/{len(texts)} texts as "
          f"transformers does; greedy ids {'equal' if ours == theirs else 'DIFFER'} over {steps} steps", flush=True)
    return result


def families_check() -> dict:
    """Each dense family, and each mixture-of-experts family `tunekit export` writes (Qwen3-MoE, OLMoE)."""
    import tempfile

    from tunekit.export.architectures import ARCHITECTURES
    from tunekit.models.families import FAMILIES, MOE_FAMILIES

    moe = [family for family, (_, model_type, _) in MOE_FAMILIES.items() if model_type in ARCHITECTURES]
    with tempfile.TemporaryDirectory() as tmp:
        return {family: family_check(family, Path(tmp)) for family in [*FAMILIES, *moe]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", default=str(ROOT / "runs" / "demo"), help="the demo directory (make demo)")
    p.add_argument("--out", default=str(ROOT / "bench" / "export_check.json"))
    p.add_argument("--sentencepiece-only", action="store_true",
                   help="run only the SentencePiece check and update its entry in --out")
    p.add_argument("--families-only", action="store_true",
                   help="run only the model-family checks (Qwen2, Qwen3, Gemma 2/3, Mistral, Phi-3, Qwen3-MoE, "
                        "OLMoE) and update --out")
    a = p.parse_args()
    if a.sentencepiece_only or a.families_only:
        ensure_binding()
        out = Path(a.out)
        result = json.loads(out.read_text()) if out.is_file() else {}
        if a.sentencepiece_only:
            result["sentencepiece_vocabulary"] = sentencepiece_check()
        if a.families_only:
            result["families"] = families_check()
        out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return 0
    demo = Path(a.demo)
    gguf_file = demo / "smollm2-demo-q8_0.gguf"
    predictions = demo / "merged_eval" / "predictions.jsonl"
    if not gguf_file.is_file() or not predictions.is_file():
        print(f"export-check: {gguf_file} or {predictions} missing; run `make demo` first", file=sys.stderr)
        return 2
    build_s = ensure_binding()

    from llama_cpp import Llama
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo / "run" / "merged")
    settings = json.loads((demo / "merged_eval" / "metrics.json").read_text()).get("settings", {})
    max_new = int(settings.get("max_new_tokens", 32))
    llm = Llama(model_path=str(gguf_file), n_ctx=1024, n_threads=2, verbose=False, seed=0)
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    same_ids = same_text = 0
    started = time.perf_counter()
    examples = []
    for row in rows:
        ids = llm.tokenize(row["prompt"].encode(), add_bos=False, special=True)
        same_ids += ids == tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        out = llm.create_completion(ids, max_tokens=max_new, temperature=0.0, top_k=1)
        text = out["choices"][0]["text"].strip()
        same_text += text == row["prediction"]
        examples.append({"llama_cpp": text, "tunekit_eval": row["prediction"]})
    result = {
        "gguf": str(gguf_file), "bytes": gguf_file.stat().st_size, "examples": len(rows),
        "prompt_ids_identical": same_ids / len(rows), "greedy_answer_agreement": same_text / len(rows),
        "llama_cpp_seconds": round(time.perf_counter() - started, 1),
        "binding": BINDING, "build_seconds": round(build_s, 1) if build_s is not None else "already installed",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "first_examples": examples[:5],
        "sentencepiece_vocabulary": sentencepiece_check(), "families": families_check(),
    }
    Path(a.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"export-check: {len(rows)} held-out prompts; llama.cpp tokenization identical on "
          f"{100 * result['prompt_ids_identical']:.1f}%, greedy answers equal to tunekit eval's on "
          f"{100 * result['greedy_answer_agreement']:.1f}%; binding build: "
          f"{result['build_seconds']}{' s' if build_s is not None else ''}; written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
