"""training.method: grpo: recipe checks, the rewards registry on known values, prompts sampled exactly as `tunekit
eval` renders them, seeded sampling, and GRPO runs on the tiny model (rewards logged per function, the base
untouched under LoRA, the KL to the adapter-off base, samples kept per evaluation, a failing reward stopped in one
line, resume and two processes equal to one)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    history,
    in_full,
    refused_in_process,
    run_cli,
    tiny_recipe,
    training_rows,
    write_jsonl,
    write_recipe,
)
from tunekit.config import recipefile
from tunekit.config.methodsettings import RewardSpec
from tunekit.core.errors import TunekitError
from tunekit.evaluation import evaluator, rewards
from tunekit.models import loader
from tunekit.runs.layout import RunRecord
from tunekit.training import runner, sampling
from tunekit.training.methods import rollouts

WORDS = ["catfish", "dogduck", "birddog", "fishbear", "lioncrab", "wolflion", "bearcat", "crabfish"]
REWARD_MODULE = '''
def vowels(completion, **_):
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(1, len(letters))

def broken(completion, record, **_):
    if record["answer"] == "lioncrab":
        raise KeyError("no score for lions")
    return 0.0

def wordy(completion, **_):
    return "a lot"
'''


def prompts(n_repeat=4):
    return [{"prompt": f"Say the word.\n\n{w}", "answer": w} for w in WORDS * n_repeat]


def grpo_raw(tiny_model, tmp_path, out, rewards_=None, grpo_=None, **training):
    data = write_jsonl(tmp_path / "p.jsonl", prompts())
    raw = tiny_recipe(tiny_model, data, out, training={"method": "grpo", "max_steps": 4, "micro_batch_size": 8,
                                                         "learning_rate": 5e-2, **training})
    raw["data"].update(format="prompt", eval_fraction=0.25)
    raw["grpo"] = {"completions": 4, "max_completion_length": 8,
                   "rewards": rewards_ or [{"reward": "chrf"}, {"reward": "length", "weight": 0.5}], **(grpo_ or {})}
    raw["eval"] = {"max_new_tokens": 8, "batch_size": 4}
    return raw


def load(tmp_path, raw):
    return recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


@pytest.mark.parametrize("change, message", [
    (lambda r: r["grpo"].update(rewards=[]), r"grpo.rewards: name at least one reward"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "blue"}]), r"grpo.rewards\[0\].reward: unknown reward 'blue'"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "regex"}]), r"grpo.rewards\[0\].pattern: reward regex needs it"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "regex", "pattern": "(a"}]), r"grpo.rewards\[0\].pattern: not a"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "function", "function": "m:f"}]),
     r"grpo.rewards\[0\]: a function reward runs your Python code \(m:f\); set grpo.trust_local_code: true"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "function", "function": "m.f"}], trust_local_code=True),
     r"grpo.rewards\[0\].function: 'm.f' is not module:function"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "chrf", "name": "x"}, {"reward": "bleu", "name": "x"}]),
     r"grpo.rewards\[1\].name: 'x' is logged twice"),
    (lambda r: r["training"].update(micro_batch_size=6), r"must be a multiple of grpo.completions \(4\)"),
    pytest.param(lambda r: r["grpo"].update(vllm=True), r"grpo.vllm: vLLM is not installed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")),
    (lambda r: r["data"].update(format="text"), r"training.method: grpo trains on prompts"),
    (lambda r: r["training"].update(method="sft") or r.pop("grpo"), r"data.format: prompt is training data for "
                                                                       r"training.method grpo"),
    (lambda r: r["training"].update(method="sft"), r"grpo: these settings belong to training.method grpo"),
    (lambda r: r["grpo"].update(beta=0.1) or r["lora"].update(init="pissa"), r"grpo.beta: the reference"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "json", "pattern": "x"}]),
     r"grpo.rewards\[0\].pattern: reward json does not read it; remove it"),
    (lambda r: r["grpo"].update(rewards=[{"reward": "chrf", "target": 3}]),
     r"grpo.rewards\[0\].target: reward chrf does not read it"),
])
def test_recipe_checks_name_the_setting(tmp_path, tiny_model, change, message):
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "run")
    change(raw)
    with pytest.raises(TunekitError, match=message):
        load(tmp_path, raw)


def sample(completion, reference="Omar | teapot | red", tokens=3, record=None):
    return rewards.Sample("prompt", completion, reference, tokens, record or {}, "data.jsonl line 7")


def score(spec: dict, s: rewards.Sample, max_len: int = 10) -> float:
    raw = {"reward": spec.pop("reward"), **spec}
    built = RewardSpec(**raw)
    return rewards.Reward(built, 0, [built], max_len).score(s)


def test_rewards_score_known_values():
    assert score({"reward": "exact_match"}, sample(" Omar |  teapot | red ")) == 1.0
    assert score({"reward": "exact_match"}, sample("Omar | teapot | blue")) == 0.0
    assert score({"reward": "chrf"}, sample("Omar | teapot | red")) == pytest.approx(1.0)
    assert 0.3 < score({"reward": "chrf"}, sample("Omar | kettle | red")) < 0.9
    assert score({"reward": "rougeL"}, sample("Omar teapot")) == pytest.approx(2 * (2 / 2) * (2 / 3) / (1 + 2 / 3))
    assert score({"reward": "bleu"}, sample("Omar | teapot | red")) == pytest.approx(1.0)
    layout = {"reward": "regex", "pattern": r"[^|]+( \| [^|]+){2}"}
    assert score(dict(layout), sample("  Omar | mug | blue\n")) == 1.0
    assert score(dict(layout), sample("Omar | mug")) == 0.0
    assert score({"reward": "json"}, sample('```json\n{"a": [1, 2]}\n```')) == 1.0
    assert score({"reward": "json"}, sample('{"a": 1} and more')) == 0.0
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert score({"reward": "tool_calls"}, sample(call, reference=call)) == 1.0
    wrong_args = call.replace("Oslo", "Rome")
    assert score({"reward": "tool_calls"}, sample(wrong_args, reference=call)) == pytest.approx(2 / 3)
    assert score({"reward": "tool_calls"}, sample("It is sunny.", reference=call)) == 0.0
    assert score({"reward": "tool_calls"}, sample(call, reference="Hello!")) == 0.0  # a call nobody asked for
    assert score({"reward": "tool_calls"}, sample("Hi!", reference="Hello!")) == 1.0
    assert score({"reward": "length", "target": 4}, sample("x", tokens=4)) == 0.0
    assert score({"reward": "length", "target": 4}, sample("x", tokens=7)) == pytest.approx(-0.5)
    assert score({"reward": "length"}, sample("x", tokens=30)) == -1.0


def test_reward_labels_and_weighted_means():
    specs = [RewardSpec(reward="chrf"), RewardSpec(reward="regex", pattern="a+", weight=0.5),
             RewardSpec(reward="regex", pattern="b+"), RewardSpec(reward="function", function="m:vowels")]
    assert [rewards.label(s, i, specs) for i, s in enumerate(specs)] == ["chrf", "regex_1", "regex_2", "vowels"]
    built = rewards.build(specs[:2], 10)
    means, rows = rewards.mean_scores(built, [1.0, 0.5], [sample("aaa", reference="aaa"), sample("b", reference="a")])
    assert rows[0] == {"chrf": pytest.approx(1.0), "regex": 1.0, "reward": pytest.approx(1.5)}
    assert rows[1]["regex"] == 0.0 and means["reward/regex"] == 0.5
    assert means["reward"] == pytest.approx((rows[0]["reward"] + rows[1]["reward"]) / 2)


def test_a_reward_that_fails_is_named_with_the_example(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    specs = [RewardSpec(reward="function", function="myrewards:broken"),
             RewardSpec(reward="function", function="myrewards:wordy")]
    broken, wordy = rewards.build(specs, 10)
    ok = {"completion_ids": [[1]], "reference": ["x"], "where": ["p.jsonl line 3"], "record": ['{"answer": "cat"}']}
    assert broken(["p"], ["c"], **ok) == [0.0]
    with pytest.raises(TunekitError, match=r"^grpo.rewards\[0\] \(broken\): raised KeyError: 'no score for lions' on "
                                           r"p.jsonl line 5$"):
        broken(["p"], ["c"], **{**ok, "where": ["p.jsonl line 5"], "record": ['{"answer": "lioncrab"}']})
    with pytest.raises(TunekitError, match=r"^grpo.rewards\[1\] \(wordy\): returned 'a lot' on p.jsonl line 3; a "
                                           r"reward returns a finite number$"):
        wordy(["p"], ["c"], **ok)
    chrf = rewards.build([RewardSpec(reward="chrf")], 10)[0]
    with pytest.raises(TunekitError, match=r"p.jsonl line 3 has no reference answer to score against"):
        chrf(["p"], ["c"], **{**ok, "reference": [""]})
    missing = RewardSpec(reward="function", function="nosuchmodule:f")
    with pytest.raises(TunekitError, match=r"cannot load 'nosuchmodule:f'"):
        rewards.build([missing], 10)


def test_prompts_are_what_eval_generates_from(tmp_path, tiny_model):
    """GRPO samples from each record's prompt exactly as `tunekit eval` renders and tokenizes it (the chat
    template's text, its special tokens not added twice), with the reference answer and the raw record."""
    recipe = load(tmp_path, grpo_raw(tiny_model, tmp_path, tmp_path / "run"))
    tok = loader.load_tokenizer(recipe.model)
    bundle = rollouts.build(recipe, tok)
    held = evaluator.held_out_records(recipe)
    rendered = evaluator.rendered_examples(recipe, tok, held, recipe.eval)
    assert bundle.eval["prompt"] == [r.prompt for r in rendered]
    assert bundle.eval["reference"] == [r.reference for r in rendered] and set(bundle.eval["reference"]) <= set(WORDS)
    assert [json.loads(r)["answer"] for r in bundle.eval["record"]] == bundle.eval["reference"]
    assert len(bundle.train) == 24 and not set(bundle.train["where"]) & set(bundle.eval["where"])
    assert bundle.add_special_tokens == rendered[0].add_special_tokens is False
    ids = tok(bundle.eval["prompt"][0], add_special_tokens=bundle.add_special_tokens)["input_ids"]
    assert tok.decode(ids) == bundle.eval["prompt"][0] and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_seeded_sampling_draws_from_the_softmax_and_depends_only_on_its_key():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    picks = [int((logits + sampling.gumbel(sampling._seed("k", i), 4)).argmax()) for i in range(20000)]
    freq = torch.bincount(torch.tensor(picks), minlength=4).float() / len(picks)
    torch.testing.assert_close(freq, torch.softmax(logits[0], 0), atol=0.015, rtol=0)
    a = sampling.SeededSampling(("s", 1), [0, 1, 2], 5, 0.7, 0.9, 0)
    b = sampling.SeededSampling(("s", 1), [2], 3, 0.7, 0.9, 0)
    ids, scores = torch.zeros(3, 7, dtype=torch.long), torch.randn(3, 50)
    # row 2 at position 2 is the same draw whether it is sampled among three rows or alone, after other padding
    torch.testing.assert_close(a(ids, scores.clone())[2], b(ids[2:, :5], scores[2:].clone())[0])
    assert not torch.equal(a(ids, scores.clone())[0], a(ids, scores.clone())[1])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("grpo")
    (tmp / "myrewards.py").write_text(REWARD_MODULE)
    raw = grpo_raw(tiny_model, tmp, tmp / "run", eval_steps=2,
                   rewards_=[{"reward": "chrf"}, {"reward": "function", "function": "myrewards:vowels", "weight": 0.5}],
                   grpo_={"beta": 0.1, "trust_local_code": True})
    res = run_cli("train", str(write_recipe(tmp / "r.yaml", raw)), cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "run", res


@pytest.mark.slow  # a training run
def test_a_run_logs_each_reward_the_kl_and_completion_length(lora_run):
    run_dir, res = lora_run
    rows = training_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"rewards/chrf/mean", "rewards/chrf/std", "rewards/vowels/mean", "rewards/vowels/std", "reward",
                "kl", "completions/mean_length"} <= r.keys()
        assert r["reward"] == pytest.approx(r["rewards/chrf/mean"] + 0.5 * r["rewards/vowels/mean"], abs=1e-5)
    assert any(r["kl"] > 0 for r in rows[1:])  # the policy moved away from the adapter-off base
    assert "reference: the base with the adapter switched off (no second copy)" in res.stderr
    assert "rewards: chrf x 1, vowels x 0.5" in res.stderr
    evals = history(run_dir, "eval_reward")
    assert [r["step"] for r in evals] == [2, 4] and all("eval_reward/vowels" in r for r in evals)


@pytest.mark.slow  # a training run
def test_lora_leaves_the_base_untouched_and_keeps_samples_with_their_rewards(lora_run, tiny_model):
    run_dir, _ = lora_run
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().sum()) > 0 for k, v in adapter.items() if "lora_B" in k)
    base = load_file(str(tiny_model / "model.safetensors"))
    model = loader.load_base(recipefile.load(run_dir / "recipe.yaml").model, torch.float32)
    assert all(torch.equal(base[k], v) for k, v in model.state_dict().items() if k in base)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] * 8 + [4] * 8
    for s in samples:
        assert {"prompt", "reference", "prediction", "chrf", "vowels", "reward"} <= s.keys()
        assert s["reward"] == pytest.approx(s["chrf"] + 0.5 * s["vowels"])
    scores = json.loads((run_dir / "eval" / "metrics.json").read_text())["scores"]
    predictions = [json.loads(line) for line in (run_dir / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert scores["reward"] == pytest.approx(sum(p["reward"] for p in predictions) / len(predictions))
    page = (run_dir / "report.html").read_text()
    assert "GRPO: mean reward (weighted sum)" in page and "reward vowels" in page


@pytest.mark.slow  # a training run
def test_a_failing_reward_stops_the_run_in_one_line(tmp_path, tiny_model):
    (tmp_path / "myrewards.py").write_text(REWARD_MODULE)
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "run", rewards_=[{"reward": "function",
                                                                     "function": "myrewards:broken"}],
                   grpo_={"trust_local_code": True})
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)), cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(
        "tunekit: error: grpo.rewards[0] (broken): raised KeyError: 'no score for lions' on ")
    assert RunRecord.load(tmp_path / "run").status == "failed"


@pytest.mark.slow  # a training run
def test_full_finetuning_with_a_kl_term_takes_a_frozen_copy_as_the_reference(tmp_path, tiny_model):
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "run", max_steps=2, grpo_={"beta": 0.1})
    raw["adapter"] = "none"
    raw.pop("lora")
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reference: a frozen copy of the base model (fp32)" in res.stderr
    assert any(r.get("kl", 0) > 0 for r in history(tmp_path / "run"))


@pytest.mark.slow
def test_resume_after_a_kill_ends_where_the_uninterrupted_run_ends(tmp_path, tiny_model):
    from conftest import assert_no_pickles, assert_resume_ends_as_uninterrupted

    full = tmp_path / "full"
    runner.run(load(tmp_path, grpo_raw(tiny_model, tmp_path, full, max_steps=6, save_steps=3)))
    assert_no_pickles(assert_resume_ends_as_uninterrupted(full, 3))


@pytest.mark.slow
# make test: DDP; ZeRO-2 (whose sampling is DDP's: the weights stay whole) and FSDP2 are `full`
@pytest.mark.parametrize("sharding", [pytest.param(None, id="ddp"),
                                      in_full({"deepspeed": "ds_configs/zero2.json"}, id="zero2"),
                                      in_full({"fsdp": {}}, id="fsdp2")])
def test_two_processes_train_as_one_does(tmp_path, tiny_model, sharding):
    """2 processes with micro-batch 4 against one with micro-batch 8: the same prompts per step and, by seeded
    sampling, the same completions, so the same rewards and losses; the adapters agree to 1% of the largest
    weight (Adam divides by the root of tiny second moments, so summation order shows at that scale)."""
    from conftest import launch

    single = tmp_path / "single"
    runner.run(load(tmp_path, grpo_raw(tiny_model, tmp_path, single)))
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "two", micro_batch_size=4, **(sharding or {}))
    res = launch(write_recipe(tmp_path / "two.yaml", raw), tmp_path / "two", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert RunRecord.load(tmp_path / "two").world_size == 2
    one, two = (training_rows(d) for d in (single, tmp_path / "two"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-5)
        assert a["completions/mean_length"] == b["completions/mean_length"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
    got, expected = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "two", single))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-2 * float(expected[k].abs().max()))


def test_plan_counts_the_sampling_and_the_reference_forward(tmp_path, tiny_model):
    from tunekit.plan import estimate

    base = grpo_raw(tiny_model, tmp_path, tmp_path / "run", gradient_accumulation_steps=2)
    recipe = load(tmp_path, base)
    with_kl = load(tmp_path, {**base, "grpo": {**base["grpo"], "beta": 0.1}})
    cfg, model = estimate.meta_model(recipe)
    s = estimate.settings_from(recipe, 1, "fp32")
    assert (s.seq_len, s.sampled, s.extra_forwards) == (64 + 8, 16, 0)
    assert estimate.settings_from(with_kl, 1, "fp32").extra_forwards == 1
    made = estimate.make(recipe, s, cfg, model)
    kv = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
          * 4 * 16 * 72)
    assert made.parts["sampling: KV cache"] == kv and ("sampling: KV cache",) in made.phases
    quiet = estimate.make(recipe, estimate.settings_from(recipe, 1, "fp32", sampled=0), cfg, model)
    assert made.flops_per_step == pytest.approx(quiet.flops_per_step + 2 * made.counts.total * 16 * 72 / 2)


@pytest.mark.slow
def test_grpo_continues_an_sft_run(tmp_path, tiny_model):
    """model.adapter_from: SFT on the answers, then GRPO from that adapter; run.json names the run it started from
    and, as for DPO, the reference (beta > 0) is the SFT model: the KL starts at 0 and grows."""
    sft = grpo_raw(tiny_model, tmp_path, tmp_path / "sft", method="sft", max_steps=4)
    sft["data"].update(format="prompt_completion")
    sft.pop("grpo")
    rows = [{"prompt": r["prompt"], "completion": r["answer"]} for r in prompts()]
    sft["data"]["train"] = str(write_jsonl(tmp_path / "pc.jsonl", rows))
    runner.run(load(tmp_path, sft))
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "grpo", max_steps=2, grpo_={"beta": 0.1})
    raw["model"]["adapter_from"] = str(tmp_path / "sft")
    runner.run(load(tmp_path, raw))
    start, end = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "sft",
                                                                                        tmp_path / "grpo"))
    assert start.keys() == end.keys() and any(not torch.equal(start[k], end[k]) for k in start)
    assert RunRecord.load(tmp_path / "grpo").adapter_from["training_method"] == "sft"
    kl = [r["kl"] for r in history(tmp_path / "grpo") if "kl" in r and "eval_loss" not in r]
    assert kl[0] == 0 < kl[1], kl


@pytest.mark.slow
def test_qlora_trains_the_adapter_over_a_4bit_base(tmp_path, tiny_model):
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "run", max_steps=2, grpo_={"beta": 0.1})
    raw["quantization"] = {"bits": 4}
    res = run_cli("train", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reference: the base with the adapter switched off (no second copy)" in res.stderr
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().sum()) > 0 for k, v in adapter.items() if "lora_B" in k)
    assert all(r["kl"] >= 0 for r in history(tmp_path / "run") if "kl" in r)


BEFORE_WEIGHTS = {  # what the recipe and its surroundings decide -> the one line's cause
    "a reward module that does not import": (
        lambda r: r["grpo"].update(rewards=[{"reward": "function", "function": "no_such_rewards:score"}],
                                   trust_local_code=True),
        "grpo.rewards[0] (score): cannot load 'no_such_rewards:score' (No module named 'no_such_rewards')"),
    "a reward with a reference on data without one": (
        lambda r: r["data"].update(train=str(write_jsonl(Path(r["data"]["train"]).with_name("q.jsonl"),
                                                         [{"prompt": p["prompt"]} for p in prompts()]))),
        "line 1: no reference answer, and grpo.rewards[0] (chrf) scores against one"),
    "completions past the context window": (
        lambda r: r["grpo"].update(max_completion_length=100_000),
        "grpo.max_completion_length=100000: with prompts of up to data.max_length="),
}


@pytest.mark.parametrize("case", BEFORE_WEIGHTS)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_grpo_faults_known_before_weights_are_refused_by_validate_as_by_train(case, command, tmp_path, tiny_model,
                                                                             capsys, monkeypatch):
    """In-process: exit 2, one line, nothing written (train had loaded the model and sampled before)."""
    raw = grpo_raw(tiny_model, tmp_path, tmp_path / "run")
    change, expected = BEFORE_WEIGHTS[case]
    change(raw)
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    line = refused_in_process([command, str(recipe)], tmp_path, capsys, monkeypatch)
    assert line.startswith("tunekit: error: ") and expected in line, line
