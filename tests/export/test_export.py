"""tunekit export --format gguf: the file llama.cpp reads (metadata, vocabulary, q/k rows in llama.cpp's
order), read back by transformers with the source model's logits and token ids, refused above its
quantization's tolerance, written atomically, with an Ollama Modelfile beside it. The packaged SmolLM2
(its llama.cpp pre-tokenizer, token ids) is exported in the demo test (test_e2e_smollm2.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.export import exporting, readback
from tunekit.export import gguf as gguf_writer


def fields(path):
    import gguf

    reader = gguf.GGUFReader(path)
    return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_base_model_exports_and_reads_back_with_its_logits_and_token_ids(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = exporting.export(str(tiny_model), "f16", tmp_path / "tiny.gguf")
    reader, meta = fields(out)
    source = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert "general.license" not in meta  # the tiny model states none
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.chat_template"] == tok.chat_template
    assert meta["tokenizer.ggml.tokens"][:4] == ["<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 3] and meta["tokenizer.ggml.eos_token_id"] == 3
    assert len(meta["tokenizer.ggml.merges"]) > 100
    # q rows in llama.cpp's interleaved rotary order: what transformers' reader undoes
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    stored = torch.tensor(q.data.astype("float32")).reshape(64, 64)
    expected = gguf_writer.permute_for_llama_cpp(source.model.layers[0].self_attn.q_proj.weight.detach(), 4)
    torch.testing.assert_close(stored, expected, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(stored, source.model.layers[0].self_attn.q_proj.weight.detach(), atol=1e-3)

    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = tok(["Reverse the word.\n\ncatdog", "café straße 東京"], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(back(**ids).logits, source(**ids).logits, atol=2e-3, rtol=0)
    back_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in readback.TOKENIZER_PROBES:
        assert back_tok(text)["input_ids"] == tok(text)["input_ids"]
    modelfile = (tmp_path / "tiny.Modelfile").read_text()
    assert modelfile.startswith("FROM ./tiny.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "<|im_start|>{{ .Role }}" in modelfile
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.Modelfile", "tiny.gguf"]


def test_a_sentencepiece_vocabulary_exports_as_llama_cpp_reads_llama_2(tmp_path):
    """Llama 2 / Mistral 7B style: SentencePiece BPE with byte fallback. llama.cpp merges by token score,
    which tokenizer.json does not keep; the scores written must reproduce transformers' merge order."""
    pytest.importorskip("sentencepiece", reason="needs `pip install sentencepiece` (make test installs it)")
    from transformers import AutoTokenizer

    from tunekit.models.tiny import CORPUS, build_model, build_sentencepiece_tokenizer

    model_dir = tmp_path / "spm-llama"
    tok = build_sentencepiece_tokenizer(model_dir)
    tok.pad_token = tok.unk_token  # the model's config wants a pad id; the tokenizer, as Llama 2's, has none
    build_model(model_dir, tok)
    build_sentencepiece_tokenizer(model_dir)
    out = exporting.export(str(model_dir), "f32", tmp_path / "spm.gguf")
    _, meta = fields(out)
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in meta
    adds_bos = tok("a")["input_ids"][0] == tok.bos_token_id
    assert meta["tokenizer.ggml.add_space_prefix"] is True and meta["tokenizer.ggml.add_bos_token"] is adds_bos
    types, tokens = meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.tokens"]
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [2, 3, 3]  # UNKNOWN, CONTROL
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)] and set(types[3:259]) == {6}  # BYTE
    assert len(set(meta["tokenizer.ggml.scores"])) == len(tokens)  # a strict order, no ties
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    texts = CORPUS + readback.TOKENIZER_PROBES
    assert [back(t)["input_ids"] for t in texts] == [tok(t)["input_ids"] for t in texts]

    # without the scores' order (as llama.cpp's LlamaHfVocab writes: -1000 for all) the check refuses the file
    from tunekit.core.errors import TunekitError

    real = gguf_writer._sentencepiece_vocab

    def flat_scores(writer, *args):
        add = writer.add_token_scores
        writer.add_token_scores = lambda scores: add([-1000.0] * len(scores))
        real(writer, *args)

    gguf_writer._sentencepiece_vocab = flat_scores
    try:
        with pytest.raises(TunekitError, match="tokenizer ids differ"):
            exporting.export(str(model_dir), "f32", tmp_path / "flat.gguf")
    finally:
        gguf_writer._sentencepiece_vocab = real
    assert not (tmp_path / "flat.gguf").exists()


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_exports_are_smaller_and_pass_their_tolerance(tmp_path, tiny_model, quant):
    out = exporting.export(str(tiny_model), quant, tmp_path / f"{quant}.gguf")
    reader, meta = fields(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == quant.upper() and types["blk.0.attn_norm.weight"] == "F32"
    assert out.stat().st_size < 0.6 * (tiny_model / "model.safetensors").stat().st_size


def test_the_read_back_check_and_the_conversion_parse_the_file_once(tmp_path, tiny_model, monkeypatch):
    """transformers' loader opens a GGUFReader for each of the config, model and tokenizer loads; tunekit shares one."""
    import gguf

    opened = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            opened.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    out = exporting.export(str(tiny_model), "f32", tmp_path / "tiny.gguf")
    assert len(opened) == 1, opened  # the file checked before it takes its name
    assert gguf.GGUFReader is Counted  # restored after the check

    # a GGUF model to train from is converted to a cached directory once, reading the file once
    from transformers import AutoModelForCausalLM

    from tunekit.models.loader import convert_gguf

    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "cache"))
    opened.clear()
    converted = convert_gguf(out)
    assert opened == [str(out)] and convert_gguf(out) == converted and len(opened) == 1
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(converted)(ids).logits,
                                   AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits, atol=1e-4, rtol=0)


def test_an_export_below_its_tolerance_is_refused_and_nothing_is_left(tmp_path, tiny_model, monkeypatch):
    from tunekit.core.errors import TunekitError

    monkeypatch.setitem(gguf_writer.QUANTS, "q4_0", gguf_writer.Quant("Q4_0", "MOSTLY_Q4_0", 1.0, 1e-6))
    with pytest.raises(TunekitError, match=r"export refused: GGUF check: max \|logit diff\| .* q4_0 needs top-1"):
        exporting.export(str(tiny_model), "q4_0", tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_run_is_merged_on_the_fly_and_its_facts_are_recorded(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 2},
                      eval={"batch_size": 4, "max_new_tokens": 8}, data={"eval_fraction": 0.25})
    assert run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw))).returncode == 0
    res = run_cli("export", str(tmp_path / "run"), "--quant", "q8_0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "parity: max |logit diff|" in res.stderr and "GGUF check: max |logit diff|" in res.stderr
    out = tmp_path / "run" / "run-q8_0.gguf"
    _, meta = fields(out)
    facts = json.loads(meta["tunekit.finetune"])
    assert facts["training_method"] == "sft" and facts["adapter"] == "lora" and facts["steps"] == 2
    assert meta["general.base_model.0.name"] == str(tiny_model)
    assert "PARAMETER num_predict 8" in (tmp_path / "run" / "run-q8_0.Modelfile").read_text()
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".export") or "partial" in p.name]
    again = run_cli("export", str(tmp_path / "run"), "--quant", "q8_0")
    assert again.returncode != 0 and "Traceback" not in again.stderr
    assert "run-q8_0.gguf" in again.stderr and "--force" in again.stderr


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_other_architectures_are_refused_with_one_line(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(
        tmp_path / "gpt2")
    res = run_cli("export", str(tmp_path / "gpt2"), "--out", str(tmp_path / "g.gguf"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "supports Llama 2/3, SmolLM2 (llama); Mistral (mistral); Qwen2/Qwen2.5 (qwen2)" in res.stderr
    assert ("Gemma 3 (text) (gemma3_text); Phi-3/Phi-3.5 (phi3); Qwen3-MoE (qwen3_moe); OLMoE (olmoe); "
            "this one is GPT2LMHeadModel" in res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "g.gguf").exists()


# ---------------------------------------------------------------- --format safetensors, and the format registry


def _logits(model_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(**batch).logits


def test_a_base_model_exports_as_a_safetensors_directory_that_loads_with_its_logits(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    out = exporting.export(str(tiny_model), out=tmp_path / "st", format="safetensors")
    assert out == tmp_path / "st" and list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))
    tok = AutoTokenizer.from_pretrained(out)
    batch = tok(["Crème brûlée", "東京"], return_tensors="pt", padding=True)
    torch.testing.assert_close(_logits(out, batch), _logits(tiny_model, batch), atol=0, rtol=0)
    assert f"Base model: `{tiny_model}`" in (out / "README.md").read_text()

    half = exporting.export(str(tiny_model), out=tmp_path / "bf16", format="safetensors", dtype="bf16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("fmt, option, flag", [("safetensors", {"quant": "q4_0"}, "--quant"),
                                              ("gguf", {"dtype": "bf16"}, "--dtype")])
def test_an_option_the_format_does_not_take_is_refused_before_any_weight_loads(tmp_path, tiny_model, monkeypatch,
                                                                               fmt, option, flag):
    from tunekit.core.errors import TunekitError
    from tunekit.export import source as export_source

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was resolved before the options were checked")

    monkeypatch.setattr(export_source, "resolve", no_loading)
    with pytest.raises(TunekitError, match=f"export --format {fmt} does not take {flag}") as e:
        exporting.export(str(tiny_model), out=tmp_path / "x", format=fmt, **option)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_the_cli_refuses_a_wrong_format_option_in_one_line(tmp_path, tiny_model):
    res = run_cli("export", str(tiny_model), "--format", "safetensors", "--quant", "q8_0", "--out", str(tmp_path / "o"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "does not take --quant (it takes --dtype)" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("export", str(tiny_model), "--format", "onnx")
    assert res.returncode == 2 and "invalid choice: 'onnx'" in res.stderr


@pytest.mark.slow
def test_a_run_exports_as_a_safetensors_directory_equal_to_its_merged_model(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from tunekit.config import recipefile
    from tunekit.export import merge
    from tunekit.training import runner

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"max_steps": 2, "learning_rate": 1e-2},
                      eval=None)
    runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", raw)))
    res = run_cli("export", str(tmp_path / "run"), "--format", "safetensors")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "parity: max |logit diff|" in res.stderr
    out = tmp_path / "run" / "run-safetensors"
    merged = merge.merge(tmp_path / "run", tmp_path / "merged")
    tok = AutoTokenizer.from_pretrained(out)
    batch = tok(["Reverse the words: red green blue", "東京"], return_tensors="pt", padding=True)
    torch.testing.assert_close(_logits(out, batch), _logits(merged, batch), atol=0, rtol=0)
    assert "# Merged model" in (out / "README.md").read_text() and list(out.glob("*.safetensors"))


# ---------------------------------------------------------------- k-quants (llama.cpp's quantizer)


def test_a_k_quant_without_llama_cpp_is_refused_before_any_weight_loads(tmp_path, tiny_model, monkeypatch):
    import importlib.util

    from tunekit.core.errors import TunekitError
    from tunekit.export import writers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    monkeypatch.setattr(writers.Gguf, "write", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(TunekitError, match=r"--quant q4_k_m: this k-quant is written by llama.cpp's quantizer, "
                                           r"which is not installed; pip install 'llama-cpp-python==0.3.36'"):
        exporting.export(str(tiny_model), "q4_k_m", tmp_path / "k.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("quant,ktype", [("q6_k", "Q6_K"), ("q5_k_m", "Q5_K"), ("q4_k_m", "Q4_K")])
def test_k_quants_are_written_by_llama_cpp_and_pass_their_tolerance(tmp_path, quant, ktype):
    """A 256-wide tiny Llama, so that its rows are whole k-quant blocks (QK_K = 256) and llama.cpp uses the
    k-quant types rather than its 32-block fallbacks. Needs llama-cpp-python (make export-check builds it)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make export-check builds it)")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunekit.models.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path / "wide")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(tmp_path / "wide")
    out = exporting.export(str(tmp_path / "wide"), quant, tmp_path / f"{quant}.gguf")
    reader, meta = fields(out)
    types = {t.tensor_type.name for t in reader.tensors}
    assert ktype in types and "F32" in types  # norms stay f32
    assert meta["general.architecture"] == "llama"
    assert out.stat().st_size < 0.5 * (tmp_path / "wide" / "model.safetensors").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{quant}.Modelfile", f"{quant}.gguf", "wide"]


def test_llama3_rope_travels_as_the_frequency_divisors_transformers_applies():
    """llama.cpp takes Llama 3.1+'s RoPE scaling as a `rope_freqs` tensor of per-dimension divisors
    (conversion/llama.py): default inverse frequencies / these = transformers' llama3 inverse frequencies."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tunekit.export.architectures import rope_tensors

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=rope)
    (name, divisors), = rope_tensors(cfg)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    default = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert name == "rope_freqs.weight" and divisors.shape == (32,)
    torch.testing.assert_close(default / torch.tensor(divisors, dtype=torch.float64), scaled.double(),
                               rtol=1e-5, atol=0)
    assert divisors[0] == 1.0 and divisors[-1] == 32.0  # high frequencies kept, the lowest divided by the factor
    assert list(rope_tensors(LlamaConfig(hidden_size=64, num_attention_heads=4))) == []


def test_parity_logits_run_on_the_models_device():
    """A 4-bit base sits on the GPU while the parity batch is built on the CPU: the batch follows the model
    (here a model on the meta device records where its inputs arrived) and the logits come back on the CPU."""
    from tunekit.export import merge

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1, device="meta"))
            self.seen = []

        def forward(self, input_ids, attention_mask):
            self.seen += [input_ids.device.type, attention_mask.device.type]
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 3, dtype=torch.bfloat16)})

    model = Recorder()
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    out = merge.logits(model, batch)
    assert model.seen == ["meta", "meta"]
    assert out.device.type == "cpu" and out.dtype == torch.float32
