"""Settings nothing would read are refused in one line, as dpo.label_smoothing is where the loss does not read it:
grpo's (and rloo's) episode bounds without tools or an environment, eval metrics a method cannot compute (a
reward model generates nothing), and distill.jsd_beta beside a divergence other than jsd. The defaults, which every
run's recipe.yaml writes, still load."""

from __future__ import annotations

import pytest

from conftest import refused_in_process, tiny_recipe, write_jsonl, write_recipe
from tunekit import api
from tunekit.config import recipefile
from tunekit.core.errors import TunekitError

EPISODES = "applies to episodes with tools, and this recipe sets no {k}.tools or {k}.environment; set one or remove"
NOTHING_GENERATED = ("cannot be computed for training.method: reward, which generates nothing (its evaluations score "
                     "the held-out pairs: eval_loss, eval_accuracy, eval_margin); remove ")


def _recipe(tmp_path, model, method: str, section: dict | None = None, **sections) -> dict:
    if method == "reward":
        rows, fmt = [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4, "preference"
    else:
        rows, fmt = [{"prompt": "p", "answer": "a"}] * 4, "prompt"
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    raw = tiny_recipe(model, data, tmp_path / "run", training={"method": method}, data={"format": fmt}, **sections)
    if method in ("grpo", "rloo"):
        raw[method] = {"rewards": [{"reward": "length"}], **(section or {})}
    if method == "distill":  # prompt records: on-policy (the teacher is resolved by train, not by loading)
        raw[method] = {"teacher": str(model), "mode": "on_policy", **(section or {})}
    return raw


# name -> (method, its section's settings, other sections, expected part of the line)
REFUSED = {
    "grpo max_turns without tools": ("grpo", {"max_turns": 3}, {}, "grpo.max_turns " + EPISODES.format(k="grpo")),
    "rloo max_turns without tools": ("rloo", {"max_turns": 2}, {}, "rloo.max_turns " + EPISODES.format(k="rloo")),
    "grpo tool_timeout without tools": ("grpo", {"tool_timeout": 3}, {}, "grpo.tool_timeout " +
                                        EPISODES.format(k="grpo") + " tool_timeout"),
    "grpo tool_output_chars without tools": ("grpo", {"tool_output_chars": 100}, {}, "grpo.tool_output_chars"),
    "BLEU on a reward model": ("reward", None, {"eval": {"metrics": ["bleu"]}},
                               "eval.metrics: bleu " + NOTHING_GENERATED + "eval.metrics"),
    "loss on a reward model": ("reward", None, {"eval": {"metrics": ["loss", "chrf"]}},
                               "eval.metrics: loss, chrf " + NOTHING_GENERATED + "eval.metrics"),
    "tool calls on a reward model": ("reward", None, {"eval": {"metrics": ["tool_calls"]}}, "eval.metrics: tool_calls"),
    "an evaluate metric on a reward model": ("reward", None, {"eval": {"extra_metrics": ["sacrebleu"]}},
                                             "eval.extra_metrics: sacrebleu " + NOTHING_GENERATED +
                                             "eval.extra_metrics"),
    "jsd_beta with forward_kl": ("distill", {"divergence": "forward_kl", "jsd_beta": 0.9}, {},
                                 "distill.jsd_beta applies to distill.divergence: jsd; forward_kl does not read it: "
                                 "set distill.divergence: jsd or remove jsd_beta"),
    "jsd_beta with reverse_kl": ("distill", {"divergence": "reverse_kl", "jsd_beta": 0.1}, {},
                                 "distill.jsd_beta applies to distill.divergence: jsd; reverse_kl does not read it"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_setting_nothing_reads_is_refused(case, tmp_path, tiny_model):
    method, section, sections, expected = REFUSED[case]
    with pytest.raises(TunekitError) as e:
        api.load_recipe(_recipe(tmp_path, tiny_model, method, section, **sections))
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("case", ["grpo max_turns without tools", "BLEU on a reward model", "jsd_beta with forward_kl"])
def test_the_command_line_refuses_it_in_one_line(case, tmp_path, tiny_model, capsys, monkeypatch):
    method, section, sections, expected = REFUSED[case]
    recipe = write_recipe(tmp_path / "r.yaml", _recipe(tmp_path, tiny_model, method, section, **sections))
    for verb in ("validate", "train", "plan"):
        assert expected in refused_in_process([verb, str(recipe)], tmp_path, capsys, monkeypatch)


# name -> (method, its section's settings, other sections)
TAKEN = {
    "grpo without tools at the defaults": ("grpo", {}, {}),
    "grpo with tools and their bounds": ("grpo", {"tools": ["mytools:lookup"], "trust_local_code": True,
                                                  "max_turns": 3, "tool_timeout": 2, "tool_output_chars": 100}, {}),
    "rloo with an environment and a turn bound": ("rloo", {"environment": "mytools:Env", "trust_local_code": True,
                                                           "max_turns": 2}, {}),
    "a reward model's eval section at its defaults": ("reward", None, {"eval": {"batch_size": 4}}),
    "a reward model's eval section with no metrics": ("reward", None, {"eval": {"metrics": []}}),
    "distill forward_kl at the default jsd_beta": ("distill", {"divergence": "forward_kl"}, {}),
    "distill jsd with its beta": ("distill", {"divergence": "jsd", "jsd_beta": 0.9}, {}),
}


@pytest.mark.parametrize("case", TAKEN)
def test_the_defaults_and_read_settings_load_and_reload_from_a_run(case, tmp_path, tiny_model):
    """Loaded, then written as a run writes recipe.yaml (every default spelled out) and loaded again."""
    method, section, sections = TAKEN[case]
    loaded = api.load_recipe(_recipe(tmp_path, tiny_model, method, section, **sections))
    saved = tmp_path / "recipe.yaml"
    saved.write_text(recipefile.to_yaml(loaded))
    assert recipefile.load(saved).model_dump() == loaded.model_dump()
