"""training.method: rloo: recipe checks (grpo's reward rules under rloo's name, settings RLOO does not read
refused), the plan counted as GRPO's, and a short RLOO run on the tiny model (each reward logged, the LoRA base
untouched, run.json completed)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import history, run_cli, tiny_recipe, training_rows, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError
from tunekit.models import loader
from tunekit.runs.layout import RunRecord

WORDS = ["catfish", "dogduck", "birddog", "fishbear", "lioncrab", "wolflion", "bearcat", "crabfish"]
REWARD_MODULE = '''
def vowels(completion, **_):
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(1, len(letters))
'''


def rloo_raw(tiny_model, tmp_path, out, rloo_=None, **training):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Say the word.\n\n{w}", "answer": w} for w in WORDS * 4])
    raw = tiny_recipe(tiny_model, data, out, training={"method": "rloo", "max_steps": 2, "micro_batch_size": 8,
                                                         "learning_rate": 5e-2, **training})
    raw["data"].update(format="prompt", eval_fraction=0.25)
    raw["rloo"] = {"completions": 4, "max_completion_length": 8,
                   "rewards": [{"reward": "chrf"}, {"reward": "length", "weight": 0.5}], **(rloo_ or {})}
    raw["eval"] = {"max_new_tokens": 8, "batch_size": 4}
    return raw


def load(tmp_path, raw):
    return recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


@pytest.mark.parametrize("change, message", [
    (lambda r: r["rloo"].update(rewards=[]), r"rloo.rewards: name at least one reward"),
    (lambda r: r["rloo"].update(rewards=[{"reward": "blue"}]), r"rloo.rewards\[0\].reward: unknown reward 'blue'"),
    (lambda r: r["rloo"].update(rewards=[{"reward": "function", "function": "m:f"}]),
     r"rloo.rewards\[0\]: a function reward runs your Python code \(m:f\); set rloo.trust_local_code: true"),
    (lambda r: r["rloo"].update(completions=1), r"rloo.completions"),
    (lambda r: r["rloo"].update(loss_type="dapo"), r"rloo.loss_type"),  # GRPO's, not read by RLOOTrainer
    (lambda r: r["rloo"].update(scale_rewards="group"), r"rloo.scale_rewards"),
    (lambda r: r["training"].update(micro_batch_size=6), r"must be a multiple of rloo.completions \(4\)"),
    (lambda r: r["data"].update(format="text"), r"training.method: rloo trains on prompts"),
    (lambda r: r["training"].update(method="grpo"), r"rloo: these settings belong to training.method rloo"),
    (lambda r: r["lora"].update(init="pissa"), r"rloo.beta: the reference"),
])
def test_recipe_checks_name_the_setting(tmp_path, tiny_model, change, message):
    raw = rloo_raw(tiny_model, tmp_path, tmp_path / "run")
    change(raw)
    with pytest.raises(TunekitError, match=message) as e:
        load(tmp_path, raw)
    assert "\n" not in str(e.value).strip()


def test_prompt_data_and_defaults(tmp_path, tiny_model):
    recipe = load(tmp_path, rloo_raw(tiny_model, tmp_path, tmp_path / "run"))
    assert recipe.rloo.beta == 0.05 and recipe.rloo.normalize_advantages is False and recipe.grpo is None


def test_plan_counts_it_as_grpo(tmp_path, tiny_model):
    from tunekit.plan import estimate

    raw = rloo_raw(tiny_model, tmp_path, tmp_path / "run", gradient_accumulation_steps=2)
    s = estimate.settings_from(load(tmp_path, raw), 1, "fp32")
    assert (s.seq_len, s.sampled, s.extra_forwards) == (64 + 8, 16, 1)
    raw["rloo"]["beta"] = 0
    assert estimate.settings_from(load(tmp_path, raw), 1, "fp32").extra_forwards == 0


def test_grpo_and_rloo_share_prompts_rewards_and_sampling():
    from tunekit.training import methods
    from tunekit.training.methods import rollouts
    from tunekit.training.trainers.grpo import GrpoTrainer
    from tunekit.training.trainers.rloo import RlooTrainer
    from tunekit.training.trainers.rollouts import Rollouts

    grpo, rloo = methods.get("grpo"), methods.get("rloo")
    assert isinstance(grpo, rollouts.SampledMethod) and isinstance(rloo, rollouts.SampledMethod)
    assert type(grpo).make_trainer is type(rloo).make_trainer is rollouts.SampledMethod.make_trainer
    assert grpo.trainer_class() is GrpoTrainer and rloo.trainer_class() is RlooTrainer
    assert issubclass(GrpoTrainer, Rollouts) and issubclass(RlooTrainer, Rollouts)


def test_trainer_config_reads_the_section(tmp_path, tiny_model):
    from transformers import TrainingArguments

    from tunekit.training.methods import rloo

    raw = rloo_raw(tiny_model, tmp_path, tmp_path / "run", rloo_={"normalize_advantages": True, "top_p": 0.9})
    recipe = load(tmp_path, raw)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=8, use_cpu=True)
    cfg = rloo.Rloo().trainer_config(args, recipe)
    assert (cfg.num_generations, cfg.max_completion_length, cfg.top_p, cfg.beta, cfg.normalize_advantages,
            cfg.reward_weights) == (4, 8, 0.9, 0.05, True, [1.0, 0.5])


@pytest.mark.slow  # a training run
def test_a_run_logs_each_reward_and_leaves_the_base_untouched(tmp_path, tiny_model):
    (tmp_path / "myrewards.py").write_text(REWARD_MODULE)
    raw = rloo_raw(tiny_model, tmp_path, tmp_path / "run", eval_steps=2,
                   rloo_={"trust_local_code": True, "rewards": [
                       {"reward": "chrf"}, {"reward": "function", "function": "myrewards:vowels", "weight": 0.5}]})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert RunRecord.load(run_dir).status == "completed"
    assert "rewards: chrf x 1, vowels x 0.5" in res.stderr
    assert "reference: the base with the adapter switched off (no second copy)" in res.stderr
    rows, train = history(run_dir), training_rows(run_dir)
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert {"rewards/chrf/mean", "rewards/vowels/mean", "reward", "kl"} <= r.keys()
        assert r["reward"] == pytest.approx(r["rewards/chrf/mean"] + 0.5 * r["rewards/vowels/mean"], abs=1e-5)
    assert any("eval_reward/vowels" in r for r in rows)  # the held-out reward during training
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().sum()) > 0 for k, v in adapter.items() if "lora_B" in k)
    base = load_file(str(tiny_model / "model.safetensors"))
    model = loader.load_base(recipefile.load(run_dir / "recipe.yaml").model, torch.float32)
    assert all(torch.equal(base[k], v) for k, v in model.state_dict().items() if k in base)


def test_reward_errors_name_the_rloo_section():
    from tunekit.config.methodsettings import RewardSpec
    from tunekit.evaluation import rewards

    missing = RewardSpec(reward="function", function="no_such_rloo_rewards:f")
    with pytest.raises(TunekitError, match=r"^rloo.rewards\[0\] \(f\): cannot load 'no_such_rloo_rewards:f'"):
        rewards.build([missing], 10, "rloo")
