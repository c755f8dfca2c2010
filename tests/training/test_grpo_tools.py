"""GRPO with tools (grpo.tools, grpo.environment): recipe checks, and a run on the tiny model whose sampling is
scripted (half the episodes call the tool and answer from its result, half answer at once), so the loop, the masks,
the rewards and the logs are checked against known episodes; `tunekit eval` plays held-out episodes and writes
their transcripts."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import (
    NEEDS_SMOLLM2,
    ROOT,
    refused_in_process,
    run_cli,
    tiny_recipe,
    training_rows,
    write_jsonl,
    write_recipe,
)
from tunekit.config import recipefile
from tunekit.evaluation import evaluator
from tunekit.runs import history
from tunekit.runs.layout import RunRecord
from tunekit.training import runner, sampling
from tunekit.training.methods import rollouts
from tunekit.training.trainers import tooluse
from tunekit.training.trainers.rollouts import Rollouts

TOOLS = '''
TABLE = {"oslo": 7, "lima": 19, "rome": 24, "kyiv": 3}


def lookup(city: str) -> int:
    """The temperature in a city today.

    Args:
        city: the city, lower case
    """
    return TABLE[city]
'''
CITIES = ["oslo", "lima", "rome", "kyiv"]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with a 1024-token context: its near-character-level tokenizer spends ~450 tokens on a prompt
    offering one tool."""
    from tunekit.models.tiny import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-1024")
    build_model(path, build_tokenizer(path), context=1024)
    return path
CALL = '<tool_call>\n{{"name": "lookup", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def raw_recipe(tiny_model, tmp_path, out, **grpo):
    (tmp_path / "weather.py").write_text(TOOLS)
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"How warm is it in {c}?", "answer": str(t), "city": c}
                                              for c, t in zip(CITIES * 4, [7, 19, 24, 3] * 4)])
    raw = tiny_recipe(tiny_model, data, out, training={"method": "grpo", "max_steps": 2, "micro_batch_size": 8,
                                                       "learning_rate": 5e-2})
    raw["data"].update(format="prompt", eval_fraction=0.25, max_length=600)
    raw["grpo"] = {"completions": 4, "max_completion_length": 160, "tools": ["weather:lookup"], "max_turns": 3,
                   "trust_local_code": True,
                   "rewards": [{"reward": "task_success"}, {"reward": "tool_success", "weight": 0.5}], **grpo}
    raw["eval"] = {"max_new_tokens": 8, "batch_size": 4, "limit": 4}
    return raw


@pytest.mark.parametrize("change, message", [
    (lambda g: g.update(trust_local_code=False), r"grpo.tools: tools run your Python code; set "
                                                 r"grpo.trust_local_code: true"),
    (lambda g: g.update(tools=["weather:lookup:x"]), r"grpo.tools\[0\]: 'weather:lookup:x' is not module:function"),
    (lambda g: g.update(tools=["weather:nothere"]), r"grpo.tools\[0\]: weather has no function 'nothere'"),
    (lambda g: g.update(max_turns=0), r"grpo.max_turns"),
    (lambda g: g.update(environment="weather.Table"), r"grpo.environment: 'weather.Table' is not module:Class"),
    (lambda g: g.update(rewards=[{"reward": "environment"}]), r"grpo.rewards\[0\] \(environment\) is the "
                                                              r"environment's get_reward\(\); set grpo.environment"),
    (lambda g: g.update(tools=[]), r"grpo.rewards\[0\] \(task_success\) scores an episode with tools; set "
                                   r"grpo.tools or grpo.environment"),
])
def test_tool_recipes_are_refused_before_weights(tmp_path, long_model, monkeypatch, capsys, change, message):
    raw = raw_recipe(long_model, tmp_path, tmp_path / "run")
    change(raw["grpo"])
    line = refused_in_process(["validate", str(write_recipe(tmp_path / "r.yaml", raw))], tmp_path, capsys,
                              monkeypatch)
    assert re.search(message, line), line


@pytest.mark.slow  # a training run
@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_a_run_plays_episodes_masks_the_results_and_logs_the_tools(tmp_path, long_model, monkeypatch, method):
    """Rows of even place call the tool for their city and answer from the result; odd rows answer '0' at once.
    RLOO (one mask for its attention and its loss) gets the tool results' log probabilities zeroed instead."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = raw_recipe(long_model, tmp_path, tmp_path / "run")
    if method == "rloo":
        raw["training"]["method"], raw["rloo"] = "rloo", raw.pop("grpo")
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    masks, tok, zeroed = [], None, []
    real_logps = tooluse.MaskedLogps._get_per_token_logps_and_entropies

    def keep_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = real_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        zeroed.append(int((out[0] == 0).sum()))
        return out

    monkeypatch.setattr(tooluse.MaskedLogps, "_get_per_token_logps_and_entropies", keep_logps)

    def scripted(trainer, prompt_ids, rows=None, turn=0, max_new_tokens=None):
        nonlocal tok
        tok = trainer.processing_class
        out = []
        for ids, row in zip(prompt_ids, rows):
            text = tok.decode(ids)
            city = next(c for c in CITIES if f"in {c}?" in text)
            if turn == 0:
                say = CALL.format(city=city) if row % 2 == 0 else "It is 0 degrees."
            else:
                say = f"It is {json.loads(text.rsplit('<|im_start|>tool', 1)[1].split('<|im_end|>')[0])} degrees."
            out.append(tok(say, add_special_tokens=False)["input_ids"][:max_new_tokens] + [tok.eos_token_id])
        return out

    monkeypatch.setattr(sampling, "generate", scripted)
    real_mask = Rollouts.tool_mask

    def keep_mask(self, completion_ids):
        mask = real_mask(self, completion_ids)
        masks.append((completion_ids.clone(), mask.clone(), [list(e.mask) for e in self.episodes]))
        return mask

    monkeypatch.setattr(Rollouts, "tool_mask", keep_mask)
    runner.run(recipe)
    run_dir = tmp_path / "run"
    steps = training_rows(run_dir)
    assert len(steps) == 2
    for r in steps:
        assert r["tools/calls"] == 0.5 and r["tools/failures"] == 0 and r["tools/turns"] == 1.5
        assert r["rewards/task_success/mean"] == 0.5  # the calling half answers right, the rest say 0
        assert r["rewards/tool_success/mean"] == 0.5
    if method == "rloo":  # the results' tokens of the scored batch and of each micro-batch's loss
        assert len(zeroed) >= 4 and all(z > 0 for z in zeroed), zeroed
    for ids, mask, episode_masks in masks:
        for row in range(ids.shape[0]):
            zeros = [tok.decode([t]) for t, m in zip(ids[row].tolist(), mask[row].tolist()) if m == 0]
            if row % 2 == 0:  # the tool's turn, as the template writes it, carries no loss
                assert "".join(zeros).startswith("\n<|im_start|>tool\n") and "assistant" in "".join(zeros)
            else:
                assert zeros == []
            assert mask[row].tolist()[:len(episode_masks[row])] == episode_masks[row]
    evaluator.end_of_training(recipe, run_dir)  # `tunekit eval RUN`: held-out episodes played greedily
    predictions = [json.loads(line) for line in (run_dir / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 4
    for p in predictions:
        assert {"turns", "answer", "calls", "tool_failures"} <= p["episode"].keys()
        assert p["prediction"] == p["episode"]["answer"] and "task_success" in p
    scores = json.loads((run_dir / "eval" / "metrics.json").read_text())["scores"]
    assert {"reward/task_success", "tool_calls_per_episode", "turns_per_episode"} <= scores.keys()


@pytest.fixture(scope="module")
def calling_model(long_model, tmp_path_factory):
    """The tiny model taught, in this process, to play the episode: call the tool for the city asked, then answer
    from the result (150 Adam steps on a training prompt a city, as GRPO renders them). Sampled at temperature 1 its
    episodes call the tool, mostly well, sometimes not: runs with tools to compare across processes and a resume."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunekit.tooluse.episodes import Continuation

    where = tmp_path_factory.mktemp("calling")
    sys.path.insert(0, str(where))  # the recipe's tools module, written beside it
    try:
        recipe = recipefile.load(write_recipe(where / "r.yaml", raw_recipe(long_model, where, where / "run")))
        tok = AutoTokenizer.from_pretrained(long_model)
        bundle = rollouts.build(recipe, tok)
        after = Continuation(bundle.renderer.base.chat, tok)
        seqs, taught = [], set()
        for row in bundle.train:
            values = json.loads(row["record"])
            if values["city"] in taught:  # one example a city: the same sequence again only costs time
                continue
            taught.add(values["city"])
            call = bundle.toolkit.start(values).call("lookup", {"city": values["city"]})
            prompt = tok(row["prompt"], add_special_tokens=bundle.add_special_tokens)["input_ids"]
            parts = [(prompt, False), (tok(CALL.format(city=values["city"]) + tok.eos_token)["input_ids"], True),
                     (after.ids([call]), False), (tok(f"It is {values['answer']} degrees." + tok.eos_token)
                                                  ["input_ids"], True)]
            ids = [t for p, _ in parts for t in p]
            labels = [t if learn else -100 for p, learn in parts for t in p]
            seqs.append((ids, labels))
    finally:
        sys.path.remove(str(where))
    model = AutoModelForCausalLM.from_pretrained(long_model, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in seqs])
    labels = torch.tensor([la + [-100] * (width - len(la)) for _, la in seqs])
    mask = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in seqs])[:, None]).long()
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # ~0.1 s a step; two threads fighting another test worker for two cores: ~2 s
    try:
        for _ in range(150):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < 0.05, losses[::10]
    path = where / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def acting_raw(model, tmp_path, out, **training):
    raw = raw_recipe(model, tmp_path, out)
    raw["training"].update(learning_rate=5e-3, **training)
    raw.pop("eval")
    return raw


@pytest.mark.slow
@pytest.mark.full  # 50-60 s; make test resumes GRPO in test_grpo.py, its draws seeded by key (test_seeded_sampling...)
def test_resume_with_tools_ends_where_the_uninterrupted_run_ends(tmp_path, calling_model, monkeypatch):
    """Episodes are seeded per row, turn and position: a run killed after its step-1 checkpoint and resumed plays
    the same episodes for step 2 (the same calls, rewards, loss) and ends with the same adapter."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from conftest import assert_no_pickles, cut_after_checkpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    full = tmp_path / "full"
    runner.run(recipefile.load(write_recipe(tmp_path / "r.yaml", acting_raw(calling_model, tmp_path, full,
                                                                         max_steps=2, save_steps=1))))
    expected, expected_steps = load_file(str(full / "adapter" / "adapter_model.safetensors")), training_rows(full)
    assert all(r["tools/calls"] > 0 for r in expected_steps), expected_steps  # the episodes do call the tool
    cut = cut_after_checkpoint(full, tmp_path / "cut", 1)
    shutil.rmtree(full)
    res = run_cli("train", str(cut / "recipe.yaml"), "--resume", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from checkpoint-1" in res.stderr
    assert len(expected_steps) == 2
    for a, b in zip(expected_steps[1:], training_rows(cut)[1:], strict=True):
        for key in ("tools/calls", "tools/failures", "tools/turns", "rewards/task_success/mean", "loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    got = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
    assert_no_pickles(cut)


@pytest.mark.slow
def test_two_processes_play_and_train_as_one_does(tmp_path, calling_model, monkeypatch):
    """2 processes with micro-batch 4 against one with micro-batch 8: each episode is keyed by its place in the
    step's batch, so the same calls, results, rewards and losses; the adapters agree to 1% of the largest weight."""
    import torch
    from safetensors.torch import load_file

    from conftest import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the launched processes import the tools module too
    single, two = tmp_path / "single", tmp_path / "two"
    runner.run(recipefile.load(write_recipe(tmp_path / "one.yaml", acting_raw(calling_model, tmp_path, single))))
    res = launch(write_recipe(tmp_path / "two.yaml", acting_raw(calling_model, tmp_path, two, micro_batch_size=4)),
                 two, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert RunRecord.load(two).world_size == 2
    one_steps, two_steps = training_rows(single), training_rows(two)
    assert [r["step"] for r in one_steps] == [r["step"] for r in two_steps] == [1, 2]
    assert all(r["tools/calls"] > 0 for r in one_steps), one_steps
    for a, b in zip(one_steps, two_steps):
        for key in ("tools/calls", "tools/failures", "tools/turns", "completions/mean_length", "reward"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
    got, expected = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (two, single))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-2 * float(expected[k].abs().max()))




def test_shipped_tool_prompts_are_what_the_generator_writes_and_held_out_stays_put(tmp_path, monkeypatch):
    """recipes/assistant_tools.py: the shipped files are its output and held-out shares no prompt with training;
    held-out is drawn first, so a change in how training is drawn (here its size) leaves it as it was."""
    monkeypatch.syspath_prepend(str(ROOT))
    from recipes import assistant_tools as tools

    train_path, held_path = tools.write(tmp_path)
    for path in (train_path, held_path):
        assert path.read_bytes() == (ROOT / "recipes" / "data" / path.name).read_bytes(), path.name
    prompts = [{json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines()}
               for path in (train_path, held_path)]
    assert len(prompts[0]) == 200 and len(prompts[1]) == 120 and not prompts[0] & prompts[1]
    (tmp_path / "other").mkdir()
    other_train, other_held = tools.write(tmp_path / "other", n_train=150)
    assert other_held.read_bytes() == held_path.read_bytes()
    assert other_train.read_bytes() != train_path.read_bytes()


@pytest.mark.parametrize("unit, degrees", [("fahrenheit", 37), ("°F", 37), (" Degrees F", 37), ("C", 3),
                                           ("celsius", 3), ("°c", 3)])
def test_the_weather_tool_takes_a_units_spellings(monkeypatch, unit, degrees):
    monkeypatch.syspath_prepend(str(ROOT))
    from recipes import assistant_tools as tools

    assert tools.get_weather("Paris", unit)["temperature"] == degrees
    with pytest.raises(ValueError, match="celsius or fahrenheit"):
        tools.get_weather("Paris", "weather")


@pytest.mark.slow
@pytest.mark.full
@NEEDS_SMOLLM2
def test_real_model_answers_more_held_out_requests_after_grpo_with_tools(tmp_path):
    """recipes/smollm2_tools.yaml (the tool-use SFT run), then recipes/smollm2_grpo_tools.yaml from it, both as
    shipped (their end-of-run eval aside for the SFT run): held-out task success rises by 0.025 (3 of 120 answers)
    or more from the GRPO run's step-0 evaluation (the SFT model alone) to its last one (after 20 steps), the same
    120 prompts, tools, greedy episodes and precision; the end-of-run `tunekit eval` plays all 120 too (docs/methods.md
    has the figures)."""
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    res = run_cli("train", "recipes/smollm2_tools.yaml", "--set", f"output_dir={sft}", "--set", "eval=null",
                  cwd=ROOT, timeout=3600)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_cli("train", "recipes/smollm2_grpo_tools.yaml", "--set", f"output_dir={grpo}", "--set",
                  f"model.adapter_from={sft}", cwd=ROOT, timeout=5400)  # 20 steps, 2 evals of 120: ~30 min, 2 cores
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [row for row in history.rows(grpo) if "eval_reward/task_success" in row]
    assert [e["step"] for e in evals] == [0, 20]
    before, after = (e["eval_reward/task_success"] for e in evals)
    end = json.loads((grpo / "eval" / "metrics.json").read_text())["scores"]
    assert end["examples"] == 120 and round(after - before, 6) >= 0.025, (before, after, end["reward/task_success"])


def test_plan_counts_a_generate_pass_per_turn(tmp_path, long_model, monkeypatch):
    from tunekit.plan import estimate

    monkeypatch.chdir(tmp_path)
    raw = raw_recipe(long_model, tmp_path, tmp_path / "run")
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    grpo = {k: v for k, v in raw["grpo"].items() if k != "max_turns"}  # without tools nothing reads it
    plain = recipefile.load(write_recipe(tmp_path / "p.yaml", {**raw, "grpo": {**grpo, "tools": [],
                                                                            "rewards": [{"reward": "chrf"}]}}))
    cfg, model = estimate.meta_model(recipe)
    s, p = (estimate.settings_from(r, 1, "fp32") for r in (recipe, plain))
    assert (s.sample_turns, p.sample_turns, s.seq_len) == (3, 1, 600 + 160)
    with_tools, without = (estimate.make(r, x, cfg, model) for r, x in ((recipe, s), (plain, p)))
    quiet = estimate.make(plain, estimate.settings_from(plain, 1, "fp32", sampled=0), cfg, model)
    one_pass = without.flops_per_step - quiet.flops_per_step
    assert one_pass > 0 and with_tools.flops_per_step - quiet.flops_per_step == pytest.approx(3 * one_pass)


def test_the_report_draws_the_tool_curves_with_their_titles():

    titles = dict(history.titled({"tools/calls", "tools/failures", "tools/turns", "rewards/task_success/mean"}))
    assert titles["tools/calls"] == "tools: calls per episode"
    assert titles["tools/failures"] == "tools: failed calls per episode"
    assert titles["tools/turns"] == "tools: turns per episode"
