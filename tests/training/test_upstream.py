"""The upstream internals tunekit relies on still exist, as tunekit uses them (issue 27).

tunekit overrides some private methods of transformers' Trainer, TRL's trainers and DeepSpeed's engine,
and reads or writes private attributes of transformers' tracker callbacks, of model configs, of torch and
bitsandbytes. None of them is a promised API: an upgrade may rename one, and then an override is skipped
silently (pickles written again, TRL re-tokenizing tunekit's data, ORPO normalized per micro-batch), or an
attribute read fails only at the end of a run. Each table below lists every such name for one library,
with why tunekit needs it; the tests make an upgrade that breaks one fail here instead.
"""

from __future__ import annotations

import inspect
import re
import sys
import types

import pytest

# tunekit's classes that subclass upstream ones: one import line per module, so a module move is one edit
from tunekit.training.loraplus import LoraPlusOptimizer
from tunekit.training.trainer import GenerationEval, SafeStateTrainer, TrainerAdditions
from tunekit.training.trainers.dpo import DpoTrainer
from tunekit.training.trainers.grpo import GrpoTrainer
from tunekit.training.trainers.kto import KtoTrainer
from tunekit.training.trainers.orpo import OrpoTrainer

# ---------------------------------------------------------------- transformers' Trainer
# (name, why tunekit overrides it) -- all in TrainerAdditions' pieces, inherited unchanged by every tunekit trainer
TRAINER_HOOKS = [
    ("_save", "weights without torch.save(self.args) (training_args.bin is a pickle); only the trained adapter"),
    ("_save_optimizer_and_scheduler", "optimizer and scheduler state as safetensors, not optimizer.pt / scheduler.pt"),
    ("_load_optimizer_and_scheduler", "reads that state back on --resume"),
    ("_save_scaler", "the gradient scaler as safetensors, not scaler.pt"),
    ("_load_scaler", "reads it back on --resume"),
    ("_save_rng_state", "RNG state per process as safetensors, not rng_state.pth"),
    ("_load_rng_state", "reads it back on --resume, so a resumed run draws as the uninterrupted one"),
    ("_load_from_checkpoint", "under FSDP, the checkpoint's gathered safetensors weights into each rank's shard "
                              "(the stock path reads only accelerate's pickled FSDP files)"),
    ("create_accelerator_and_postprocess", "installs the FSDP plugin on CPU processes, where accelerate falls "
                                           "back to DDP"),
    ("_prepare_for_training", "installs it again just before the model is wrapped (TRL's GRPO trainer resets "
                              "the state in between)"),
]
# (public name, why) overridden by a tunekit trainer but not a documented extension point
TRAINER_OVERRIDES = [
    ("evaluation_loop", "GenerationEval adds the generation metrics to the stock loss pass; RouterBalance counts a "
                        "mixture of experts' tokens per expert over it"),
    ("log", "RouterBalance adds a mixture of experts' aux_loss beside the loss"),
    ("compute_loss", "SafeStateTrainer's chunked loss over trained positions; OrpoTrainer keeps the step's count"),
    ("create_optimizer", "LoRA+ through peft's optimizer builder"),
    ("train", "SafeStateTrainer resumes mid-epoch past DeepSpeed's Ulysses loader (training.parallelism.sp), which "
              "accelerate's skip_first_batches cannot skip"),
]
# (pattern in Trainer's source, why)
TRAINER_INTERNALS = [
    (r"self\.deepspeed\s*=\s*self\.model_wrapped", "the Trainer hands its DeepSpeed engine to self.deepspeed, where "
                                                    "SafeState's property switches it to safetensors checkpoints"),
    (r"self\.loss_is_scaled_for_ga", "the Trainer reads OrpoTrainer's loss_is_scaled_for_ga (False: it divides "
                                     "by the accumulation steps, which the step's token count undoes)"),
    (r"skip_first_batches\(train_dataloader", "the Trainer skips a resumed epoch's first batches through the "
                                               "module's skip_first_batches, which SafeStateTrainer.train swaps"),
    (r"Resuming is not supported for models sharded at load time", "SafeStateTrainer passes this refusal of a "
                                                                    "tensor-parallel model's optimizer checkpoints"),
]

# ---------------------------------------------------------------- TRL
# (tunekit class, upstream class name, method, why) -- methods of TRL's trainers (or the Trainer under them)
TRL_HOOKS = [
    (DpoTrainer, "DPOTrainer", "_prepare_dataset", "the pairs come tokenized by tunekit's renderer: TRL's own "
                                                          "tokenization is skipped"),
    (KtoTrainer, "KTOTrainer", "_prepare_dataset", "tokenized by tunekit too; only TRL's KL pairing is rebuilt"),
    (OrpoTrainer, "ORPOTrainer", "_get_num_items_in_batch", "the step's answer tokens, across processes, for "
                                                                 "ORPO's SFT term"),
    (OrpoTrainer, "ORPOTrainer", "tokenize_row", "TRL's chosen/rejected columns from tunekit's ids"),
    (OrpoTrainer, "ORPOTrainer", "concatenated_forward", "the SFT term over answer tokens: reads the chosen "
                                                              "logits (output 2) and replaces the nll (output 4)"),
    (OrpoTrainer, "ORPOTrainer", "get_batch_loss_metrics", "rescales the SFT term to the step's token mean"),
    (GrpoTrainer, "GRPOTrainer", "_tokenize_prompts", "prompts come rendered by tunekit's renderer: tokenized with "
                                                       "the special tokens `tunekit eval` uses, not TRL's defaults"),
    (GrpoTrainer, "GRPOTrainer", "_generate_single_turn", "seeded sampling (training/sampling.py) on the "
                                                           "transformers path; vLLM and TRL's other paths as "
                                                           "TRL has them"),
    (GrpoTrainer, "GRPOTrainer", "_generate_and_score_completions", "counts the sampled tokens for the throughput"),
    (GrpoTrainer, "GRPOTrainer", "prediction_step", "evaluations score greedy answers' rewards instead of sampling "
                                                     "every held-out prompt's group again"),
]
# (upstream class name, attribute, why) -- attributes of TRL's trainers that tunekit reads or sets
TRL_ATTRIBUTES = [
    ("KTOTrainer", "calculate_KL", "KtoTrainer._prepare_dataset builds the KL pairs only when TRL computes KL"),
    ("ORPOTrainer", "loss_is_scaled_for_ga", "OrpoTrainer sets it False, as ORPOTrainer does, and relies on it"),
    ("GRPOTrainer", "temperature", "sampling.generate warps the logits with the trainer's sampling settings"),
    ("GRPOTrainer", "top_p", "the same"),
    ("GRPOTrainer", "top_k", "the same"),
    ("GRPOTrainer", "max_completion_length", "the same"),
    ("GRPOTrainer", "eos_token_ids", "sampling.generate ends a completion at them, as TRL does"),
    ("GRPOTrainer", "use_vllm", "GrpoTrainer leaves vLLM sampling to TRL"),
    ("GRPOTrainer", "use_transformers_continuous_batching", "the same for continuous batching"),
]

# ---------------------------------------------------------------- transformers' tracker callbacks (trackers.py)
# (callback class name, module it needs, attribute, why) -- read or written by SendRecipe / trackers.callbacks
TRACKER_ATTRIBUTES = [
    ("WandbCallback", "wandb", "_wandb", "SendRecipe updates the run's config through it and finishes the run"),
    ("TrackioCallback", "trackio", "_trackio", "the same for trackio"),
    ("TrackioCallback", "trackio", "_initialized", "a trackio run is finished only if the callback started one"),
    ("MLflowCallback", "mlflow", "_ml_flow", "SendRecipe logs the recipe's params and recipe.json to the active run"),
    ("MLflowCallback", "mlflow", "_MAX_PARAMS_TAGS_PER_BATCH", "params go in batches of MLflow's own limit"),
    ("TensorBoardCallback", "tensorboard", "tb_writer", "SendRecipe writes the recipe as text through it"),
    ("TensorBoardCallback", "tensorboard", "logging_dir", "set to the run directory's tensorboard/ (a rename would "
                                                          "write the events elsewhere, silently)"),
]

# ---------------------------------------------------------------- model configs
# (attribute, why)
CONFIG_ATTRIBUTES = [
    ("_attn_implementation", "train.py logs and records (run.json data.attention) the attention kernel in use"),
]

# ---------------------------------------------------------------- DeepSpeed (checkpointdeepspeed.py)
# (name, why) -- methods of DeepSpeedEngine that tunekit replaces on each built engine
ENGINE_HOOKS = [
    ("_get_ckpt_name", "shard file names end in .safetensors (the writer and the loader's glob both use it)"),
    ("_get_rank_zero_ckpt_name", "the same for rank 0's model-states file"),
    ("_copy_recovery_script", "not copied: zero_to_fp32.py reads torch.save files only"),
]

# ---------------------------------------------------------------- torch, bitsandbytes, transformers' GGUF reader
# (owner, name, why)
OTHER_INTERNALS = [
    ("torch.cpu", "_is_avx512_bf16_supported", "hardware.py picks bf16 on CPU only where it is native (no public API)"),
    ("torch.cpu", "_is_amx_tile_supported", "the same, for AMX"),
    ("bitsandbytes.nn.Linear4bit", "support_avx512bf16_for_cpu", "models.py turns off the inference-only CPU path "
                                                                 "that stops 4-bit training"),
    ("transformers.modeling_gguf_pytorch_utils", "load_gguf_checkpoint", "modelinfo.py reads a GGUF header "
                                                                         "(return_tensors=False) for plan/validate"),
    ("transformers.utils.logging", "set_tqdm_hook", "core/quiet.py hides the bars in quiet.HIDDEN_BARS through it "
                                                    "(their titles are checked in test_console.py)"),
    ("transformers.utils.logging", "EmptyTqdm", "the stand-in that hook returns for a hidden bar"),
    ("trl.trainer.grpo_trainer", "create_model_from_path", "GrpoTrainer hands TRL tunekit's reference copy for full "
                                                           "fine-tuning with a KL term through it"),
]


# ---------------------------------------------------------------- helpers (each shown to fail below)
def upstream_base(cls: type) -> type:
    """The first class in `cls`'s MRO that is not tunekit's."""
    return next(c for c in cls.__mro__ if not c.__module__.startswith("tunekit"))


def override_problems(ours: type, upstream: type, name: str) -> list[str]:
    """Why `ours.name` no longer overrides `upstream.name` as written: gone upstream, not overridden, or a
    different parameter list."""
    theirs = getattr(upstream, name, None)
    if not callable(theirs):
        return [f"{upstream.__name__}.{name} is gone upstream"]
    owner = next((c for c in ours.__mro__ if name in c.__dict__), None)
    if owner is None or not owner.__module__.startswith("tunekit"):
        return [f"{ours.__name__} no longer overrides {name}"]
    mine, upstream_params = (list(inspect.signature(f).parameters) for f in (owner.__dict__[name], theirs))
    if mine != upstream_params:
        return [f"{upstream.__name__}.{name} takes {upstream_params}, {owner.__name__}'s override {mine}"]
    return []


def missing_attributes(obj: object, names: list[str]) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def tracker_callback(class_name: str, module: str, monkeypatch):
    """A freshly built transformers tracker callback; where its library is not installed, built over an empty
    stand-in module (its __init__ only imports and stores it)."""
    from importlib.util import find_spec

    from transformers.integrations import integration_utils

    if find_spec(module) is None:
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
        monkeypatch.setattr(integration_utils, f"is_{module}_available", lambda: True)
    return getattr(integration_utils, class_name)()


def test_the_helpers_report_what_is_missing():
    class Upstream:
        def _hook(self, a, b): ...

        def _other(self, a): ...

    class Ours(Upstream):
        def _hook(self, a): ...

    Ours.__module__ = "tunekit.fake"
    assert override_problems(Ours, Upstream, "_hook") == ["Upstream._hook takes ['self', 'a', 'b'], "
                                                          "Ours's override ['self', 'a']"]
    assert override_problems(Ours, Upstream, "_other") == ["Ours no longer overrides _other"]
    assert override_problems(Ours, Upstream, "_gone") == ["Upstream._gone is gone upstream"]
    assert missing_attributes(types.SimpleNamespace(_a=1), ["_a", "_b"]) == ["_b"]
    assert upstream_base(Ours) is Upstream


# ---------------------------------------------------------------- the checks
TUNEKIT_TRAINERS = (SafeStateTrainer, DpoTrainer, KtoTrainer, OrpoTrainer, GrpoTrainer)


def test_the_private_trainer_methods_tunekit_overrides_still_exist_upstream():
    from transformers import Trainer

    problems = [p for name, _ in TRAINER_HOOKS for p in override_problems(TrainerAdditions, Trainer, name)]
    for name, _ in TRAINER_HOOKS:
        for trainer in TUNEKIT_TRAINERS:  # no class between them and TrainerAdditions overrides it
            if getattr(trainer, name) is not getattr(TrainerAdditions, name):
                problems.append(f"{trainer.__name__}.{name} bypasses TrainerAdditions")
    for name, _ in TRAINER_OVERRIDES:
        owners = [c for c in (SafeStateTrainer, GenerationEval, LoraPlusOptimizer, OrpoTrainer) if name in c.__dict__]
        problems += [p for c in owners for p in override_problems(c, Trainer, name)]
    assert not problems, "update trainer.py / methods/: " + "; ".join(problems)


def test_the_trainer_internals_tunekit_relies_on_are_still_there():
    from transformers import Trainer

    source = inspect.getsource(Trainer)
    gone = [why for pattern, why in TRAINER_INTERNALS if not re.search(pattern, source)]
    assert not gone, gone


def test_the_trl_methods_tunekit_overrides_still_exist_upstream():
    problems = []
    for ours, upstream_name, name, _ in TRL_HOOKS:
        upstream = upstream_base(ours)
        assert upstream.__name__ == upstream_name, f"{ours.__name__} now subclasses {upstream.__name__}"
        problems += override_problems(ours, upstream, name)
    assert not problems, "update methods/: " + "; ".join(problems)


def test_the_trl_attributes_tunekit_reads_are_still_set():
    by_name = {upstream_base(c).__name__: upstream_base(c) for c in (KtoTrainer, OrpoTrainer, GrpoTrainer)}
    for upstream_name, attribute, why in TRL_ATTRIBUTES:
        cls = by_name[upstream_name]
        # set in __init__ (a trainer needs a model to build) or on the class
        assert hasattr(cls, attribute) or re.search(rf"self\.{attribute}\s*=", inspect.getsource(cls.__init__)), \
            f"{upstream_name}.{attribute} is gone: {why}"


def test_no_tunekit_trainer_shadows_an_upstream_name_unlisted():
    """Every name a tunekit trainer class (or its mixins) defines that its TRL or transformers base also has
    is in a table above: a new override, or an upstream method landing on one of tunekit's helper names
    (SafeState._is_peft), fails here until it is reviewed."""
    listed = ({n for n, _ in TRAINER_HOOKS} | {n for n, _ in TRAINER_OVERRIDES} | {h[2] for h in TRL_HOOKS}
              | {a[1] for a in TRL_ATTRIBUTES} | {"deepspeed"})
    shadowing = []
    for trainer in TUNEKIT_TRAINERS:
        upstream = upstream_base(trainer)
        for cls in trainer.__mro__[:trainer.__mro__.index(upstream)]:
            shadowing += [f"{cls.__name__}.{n}" for n in cls.__dict__
                          if not (n.startswith("__") and n.endswith("__")) and n not in listed and hasattr(upstream, n)]
    assert not shadowing, f"tunekit defines names its upstream base also has, unlisted: {sorted(set(shadowing))}"


def test_the_tracker_callbacks_private_attributes_still_exist(monkeypatch):
    problems = []
    for class_name in dict.fromkeys(row[0] for row in TRACKER_ATTRIBUTES):
        rows = [row for row in TRACKER_ATTRIBUTES if row[0] == class_name]
        callback = tracker_callback(class_name, rows[0][1], monkeypatch)
        problems += [f"{class_name}.{n}" for n in missing_attributes(callback, [r[2] for r in rows])]
    assert not problems, "update trackers.py: gone from transformers' callbacks: " + ", ".join(problems)


def test_the_config_attributes_tunekit_reads_still_exist():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)  # the attention kernel is resolved when a model is built
    assert not missing_attributes(model.config, [n for n, _ in CONFIG_ATTRIBUTES])
    assert isinstance(model.config._attn_implementation, str)


def test_the_private_deepspeed_engine_methods_tunekit_replaces_still_exist_upstream():
    from deepspeed.runtime.engine import DeepSpeedEngine

    gone = [name for name, _ in ENGINE_HOOKS if not callable(getattr(DeepSpeedEngine, name, None))]
    assert not gone, f"DeepSpeedEngine lost {gone}: update checkpointdeepspeed.py"


def test_the_other_library_internals_tunekit_relies_on_still_exist():
    """A rename must fail here, not silently change which precision or path a run takes."""
    import importlib

    import bitsandbytes as bnb
    import torch

    owners = {"torch.cpu": torch.cpu, "bitsandbytes.nn.Linear4bit": bnb.nn.Linear4bit(64, 64, quant_type="nf4")}
    for owner, name, why in OTHER_INTERNALS:
        target = owners.get(owner) or importlib.import_module(owner)
        assert hasattr(target, name), f"{owner}.{name} is gone: {why}"
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    assert "return_tensors" in inspect.signature(load_gguf_checkpoint).parameters


@pytest.mark.parametrize("table", ["TRAINER_HOOKS", "TRL_HOOKS", "TRACKER_ATTRIBUTES", "ENGINE_HOOKS",
                                   "OTHER_INTERNALS"])
def test_every_entry_says_why(table):
    assert all(isinstance(row[-1], str) and len(row[-1]) > 10 for row in globals()[table])
