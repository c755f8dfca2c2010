"""training.method: distill: the divergences on GKD's known values, recipe checks, the teacher's vocabulary and
state checked before weights load, the plan's teacher, and distillation runs on the tiny model from a tiny SFT
teacher (the divergence to the teacher falls on held-out answers, off- and on-policy; the base untouched; resume
and two processes equal one)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    NEEDS_SMOLLM2,
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
from tunekit.core.errors import TunekitError
from tunekit.runs.layout import RunRecord
from tunekit.training import distilldivergences, methods, runner
from tunekit.training.trainers import distill as distiller

MIN_DISTILLED = 80  # held-out exact match % the distilled student must reach (hand run: 0 -> 100; the teacher 100)
WORDS = ["catfish", "dogduck", "birddog", "fishbear", "lioncrab", "wolflion", "bearcat", "crabfish"]


def rows(n_repeat=4):
    return [{"instruction": "Say the word.", "input": w, "output": w} for w in WORDS * n_repeat]


@pytest.fixture(scope="module")
def teacher(tiny_model, tmp_path_factory):
    """A tiny SFT run taught to repeat the word: the teacher every run here distills."""
    tmp = tmp_path_factory.mktemp("teacher")
    raw = tiny_recipe(tiny_model, write_jsonl(tmp / "a.jsonl", rows()), tmp / "run",
                      training={"max_steps": 30, "learning_rate": 2e-2})
    runner.run(recipefile.load(write_recipe(tmp / "t.yaml", raw)))
    return tmp / "run"


def distill_raw(tiny_model, tmp_path, out, teacher_dir, distill_=None, **training):
    data = write_jsonl(tmp_path / "a.jsonl", rows())
    raw = tiny_recipe(tiny_model, data, out, training={"method": "distill", "max_steps": 8, "micro_batch_size": 4,
                                                         "learning_rate": 2e-2, "eval_on_start": True,
                                                         "eval_steps": 1000, **training})
    raw["data"]["eval_fraction"] = 0.25
    raw["distill"] = {"teacher": str(teacher_dir), "max_completion_length": 8, **(distill_ or {})}
    return raw


def load(tmp_path, raw):
    return recipefile.load(write_recipe(tmp_path / "r.yaml", raw))


def test_divergences_are_gkds_per_token():
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 50, generator=g) * 3, torch.randn(6, 50, generator=g) * 3
    for kind, beta in (("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.3), ("jsd", 0.5)):
        ours = distilldivergences.per_token(student, teacher, kind, beta, temperature=2.0)
        theirs = GKDTrainer.generalized_jsd_loss(student[None], teacher[None], beta=beta, temperature=2.0,
                                                 reduction="sum")
        assert ours.shape == (6,) and float(ours.sum()) == pytest.approx(float(theirs), rel=1e-5)
    # top_k: both renormalised over the teacher's k most likely tokens; k = the vocabulary is the whole of it
    whole = distilldivergences.per_token(student, teacher, "forward_kl")
    assert torch.allclose(distilldivergences.per_token(student, teacher, "forward_kl", top_k=50), whole)
    keep = teacher.topk(3, -1).indices
    p = torch.softmax(teacher.gather(-1, keep), -1)
    expected = (p * (p.log() - torch.log_softmax(student.gather(-1, keep), -1))).sum(-1)
    assert torch.allclose(distilldivergences.per_token(student, teacher, "forward_kl", top_k=3), expected, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (lambda r: r["distill"].pop("teacher"), r"distill.teacher: name the teacher"),
    (lambda r: r["data"].update(format="prompt"), r"distill.mode: off_policy trains on the data's answers, and "
                                                  r"data.format: prompt has none"),
    (lambda r: r["data"].update(format="prompt") or r["distill"].update(mode="on_policy", sft_weight=0.5),
     r"distill.sft_weight: the SFT loss trains on the data's answers"),
    (lambda r: r["distill"].update(teacher_4bit=True) or r["training"].update(deepspeed="ds_configs/zero3.json"),
     r"distill.teacher_4bit: a 4-bit teacher is not sharded"),
    (lambda r: r["distill"].update(jsd_beta=1.0), r"distill.jsd_beta"),
    (lambda r: r["distill"].update(divergence="kl"), r"distill.divergence"),
    (lambda r: r["training"].update(method="sft"), r"distill: these settings belong to training.method distill"),
])
def test_recipe_checks_name_the_setting(tmp_path, tiny_model, change, message):
    raw = distill_raw(tiny_model, tmp_path, tmp_path / "run", tmp_path / "teacher")
    change(raw)
    with pytest.raises(TunekitError, match=message) as e:
        load(tmp_path, raw)
    assert "\n" not in str(e.value).strip()


def test_a_teacher_of_another_vocabulary_is_refused_before_weights_load(tmp_path, tiny_model, capsys, monkeypatch):
    """Same sizes, one token more in the teacher's tokenizer: named in one line by `tunekit validate` and
    `tunekit train`, both tokenizers and the first id that differs."""
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    tok = AutoTokenizer.from_pretrained(other)
    size = len(tok)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    recipe = write_recipe(tmp_path / "r.yaml", distill_raw(tiny_model, tmp_path, tmp_path / "run", other))
    for verb in ("validate", "train"):
        line = refused_in_process([verb, str(recipe)], tmp_path, capsys, monkeypatch)
        assert "distill.teacher: the teacher's tokenizer" in line and str(other) in line and str(tiny_model) in line
        assert f"id {size} is only in the teacher's" in line


def test_a_teacher_run_not_trained_yet_is_named_by_plan_and_train(tmp_path, tiny_model, capsys, monkeypatch):
    """runs/teacher reads as a hub id when no such directory is here: the refusal names distill.teacher."""
    raw = distill_raw(tiny_model, tmp_path, tmp_path / "run", "runs/teacher")
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    for verb in ("plan", "train"):
        line = refused_in_process([verb, str(recipe)], tmp_path, capsys, monkeypatch)
        assert "distill.teacher: runs/teacher is no run or model directory here" in line, line


def test_an_unfinished_run_or_a_reward_model_is_no_teacher(tmp_path, tiny_model, teacher):
    from tunekit.runs import distillteacher as teachers

    for status, method, message in (("failed", "sft", "did not complete"), ("completed", "reward", "reward model")):
        run = tmp_path / status
        import shutil

        shutil.copytree(teacher, run)
        record = json.loads((run / "run.json").read_text())
        record.update(status=status, training_method=method)
        (run / "run.json").write_text(json.dumps(record))
        assert RunRecord.load(run).status == status
        with pytest.raises(TunekitError, match=message):
            teachers.resolve(load(tmp_path, distill_raw(tiny_model, tmp_path, tmp_path / "out", run)))


def test_a_teacher_loads_frozen_in_inference_mode_and_in_4_bits_when_asked(tmp_path, tiny_model, teacher):
    from tunekit.runs import distillteacher as teachers

    recipe = load(tmp_path, distill_raw(tiny_model, tmp_path, tmp_path / "run", teacher))
    found = teachers.resolve(recipe)
    assert found.target.kind == "run" and "tunekit run, lora on" in found.describe()
    for quantize in (False, True):
        model = teachers.load(found, torch.float32, quantize)
        assert not model.training and not any(p.requires_grad for p in model.parameters())
        linear4 = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
        assert bool(linear4) == quantize


def test_the_plan_counts_the_teacher_and_shows_where_it_is(tmp_path, tiny_model, teacher):
    from tunekit.plan import distillteacher as planned
    from tunekit.plan import estimate

    recipe = load(tmp_path, distill_raw(tiny_model, tmp_path, tmp_path / "run", teacher,
                                        deepspeed="ds_configs/zero3.json"))
    assert planned.of(recipe).name == str(teacher)
    cfg, model = estimate.meta_model(recipe)
    one = estimate.make(recipe, estimate.settings_from(recipe, 1, "fp32"), cfg, model, versus=False)
    two = estimate.make(recipe, estimate.settings_from(recipe, 2, "fp32"), cfg, model, versus=False)
    assert one.settings.teacher.params == one.counts.total - one.counts.trainable  # the student's base, as trained
    assert one.parts["teacher: weights (frozen, fp32, one copy)"] == one.settings.teacher.params * 4
    assert two.parts["teacher: weights (frozen, fp32, sharded over 2 devices)"] == one.settings.teacher.params * 2
    replicated = recipe.model_copy(update={"distill": recipe.distill.model_copy(update={"teacher_placement":
                                                                                         "replicated"})})
    whole = estimate.make(replicated, estimate.settings_from(replicated, 2, "fp32"), cfg, model, versus=False)
    assert whole.parts["teacher: weights (frozen, fp32, a whole copy per device)"] == one.settings.teacher.params * 4
    quiet = estimate.make(recipe, estimate.settings_from(recipe, 1, "fp32", teacher=None), cfg, model, versus=False)
    tokens = 4 * 64
    assert one.flops_per_step - quiet.flops_per_step == pytest.approx(2 * one.settings.teacher.params * tokens)


def test_prompts_are_cut_before_the_last_answer():
    assert methods.get("distill").trainer_class() is distiller.DistillTrainer
    assert distiller.prompt_of([1, 2, 3, 4, 5, 6, 7], [-100, -100, 3, -100, -100, 6, 7]) == [1, 2, 3, 4, 5]
    assert distiller.prompt_of([1, 2, 3], [-100, 2, 3]) == [1]


@pytest.mark.slow  # training runs
@pytest.mark.parametrize("mode", ["off_policy", "on_policy"])
def test_the_student_moves_toward_the_teacher_and_the_base_stays(tmp_path, tiny_model, teacher, mode):
    """The held-out divergence to the teacher (teacher-forced on held-out answers) falls to a fraction of the
    untrained student's; the logged loss parts are there; the base weights are untouched under LoRA."""
    from conftest import assert_no_pickles

    out = tmp_path / "run"
    runner.run(load(tmp_path, distill_raw(tiny_model, tmp_path, out, teacher, {"mode": mode}, max_steps=12)))
    rows_ = history(out)
    evals = [r["eval_loss"] for r in rows_ if "eval_loss" in r]
    assert evals[-1] < 0.5 * evals[0], evals
    trained = [r for r in rows_ if "loss" in r and "eval_loss" not in r]
    # one micro-batch a step, no SFT term: the logged divergence is the step's loss (evaluations add nothing to it)
    assert all(r["distill/divergence"] == pytest.approx(r["loss"], rel=1e-3) for r in trained)
    assert all(r.get("distill/on_policy") == (1.0 if mode == "on_policy" else None) for r in trained)
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)
    assert_no_pickles(out)


@pytest.mark.slow
def test_on_policy_training_never_reads_the_answers(tmp_path, tiny_model, teacher):
    """The same on-policy run with every training answer replaced by another text ends at the same adapter."""
    runs = []
    for name, answer in (("real", None), ("other", "zzz qqq")):
        out = tmp_path / name / "run"
        (tmp_path / name).mkdir()
        raw = distill_raw(tiny_model, tmp_path / name, out, teacher, {"mode": "on_policy"}, max_steps=3,
                          eval_on_start=False)
        data = [dict(r, output=answer or r["output"]) for r in rows()]
        raw["data"].update(train=str(write_jsonl(tmp_path / name / "a.jsonl", data)), eval_fraction=0.0)
        runner.run(load(tmp_path / name, raw))
        runs.append(load_file(str(out / "adapter" / "adapter_model.safetensors")))
    for k in runs[0]:
        torch.testing.assert_close(runs[0][k], runs[1][k], rtol=0, atol=0)


@pytest.mark.slow
def test_mixed_mode_draws_each_example_adds_the_sft_loss_keeps_the_best_and_merges(tmp_path, tiny_model, teacher):
    out = tmp_path / "run"
    runner.run(load(tmp_path, distill_raw(tiny_model, tmp_path, out, teacher,
                                          {"mode": "mixed", "sft_weight": 0.5, "divergence": "reverse_kl",
                                           "top_k": 8}, max_steps=6, metric_for_best="eval_loss", eval_steps=3,
                                          save_steps=3)))
    best = RunRecord.load(out).best  # the best checkpoint by held-out divergence
    assert best["metric"] == "eval_loss" and best["step"] in (3, 6)
    trained = training_rows(out)
    shares = [r["distill/on_policy"] for r in trained]
    assert 0 < sum(shares) / len(shares) < 1 and all("distill/sft_loss" in r for r in trained)
    res = run_cli("merge", str(out))  # the student merges as any run: logits checked equal to the adapter's
    assert res.returncode == 0 and "parity: max |logit diff|" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_resume_after_a_kill_ends_where_the_uninterrupted_run_ends(tmp_path, tiny_model, teacher):
    from conftest import assert_resume_ends_as_uninterrupted

    full = tmp_path / "full"
    runner.run(load(tmp_path, distill_raw(tiny_model, tmp_path, full, teacher, {"mode": "mixed"}, max_steps=6,
                                          save_steps=3)))
    assert_resume_ends_as_uninterrupted(full, 3)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [pytest.param({}, id="ddp"),
                                      pytest.param({"deepspeed": "ds_configs/zero3.json"}, id="zero3-sharded"),
                                      pytest.param({"deepspeed": "ds_configs/zero3.json", "placement": "replicated"},
                                                   id="zero3-replicated"),
                                      in_full({"fsdp": {}}, id="fsdp2-sharded")])
def test_two_processes_train_as_one_does(tmp_path, tiny_model, teacher, sharding):
    """2 processes with micro-batch 4 against one with micro-batch 4 and 2 accumulation steps: the same
    examples per step and, by seeded sampling, the same on-policy answers, so the same losses and adapters; the
    teacher sharded or whole as the recipe says."""
    from conftest import launch

    sharding = dict(sharding)
    placement = sharding.pop("placement", "sharded")
    single = tmp_path / "single"
    runner.run(load(tmp_path, distill_raw(tiny_model, tmp_path, single, teacher, {"mode": "mixed"}, max_steps=4,
                                          gradient_accumulation_steps=2)))
    raw = distill_raw(tiny_model, tmp_path, tmp_path / "two", teacher,
                      {"mode": "mixed", "teacher_placement": placement}, max_steps=4, **sharding)
    res = launch(write_recipe(tmp_path / "two.yaml", raw), tmp_path / "two", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    where = "a whole copy on each process" if not sharding or placement == "replicated" else \
        f"sharded across the processes ({'FSDP' if 'fsdp' in sharding else 'ZeRO-3'})"
    assert where in res.stderr
    one, two = (training_rows(d) for d in (single, tmp_path / "two"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert a["distill/on_policy"] == b["distill/on_policy"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
    got, expected = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "two", single))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-2 * float(expected[k].abs().max()))


@pytest.mark.slow
@pytest.mark.full
@NEEDS_SMOLLM2
def test_real_model_student_learns_the_teachers_task_from_prompts_alone(tmp_path):
    """recipes/smollm2_lora.yaml as shipped (the teacher), then recipes/smollm2_distill.yaml from it: the student,
    the base with a new LoRA, sees the training prompts only, and its held-out exact match rises from its zero-shot
    figure (the run's step-0 evaluation) to within reach of the teacher's; the SFT recipe on the first 20 labelled
    examples (what a user with few labels would train) is measured beside it. Hand run figures: docs/methods.md."""
    teacher, student, few = tmp_path / "teacher", tmp_path / "student", tmp_path / "few"
    runs = (("smollm2_lora", teacher, []), ("smollm2_distill", student, [f"distill.teacher={teacher}"]),
            ("smollm2_lora", few, ["data.max_examples=20"]))
    for recipe, out, sets in runs:
        res = run_cli("train", f"recipes/{recipe}.yaml", "--set", f"output_dir={out}",
                      *[a for s in sets for a in ("--set", s)], timeout=3600)
        assert res.returncode == 0, res.stderr[-3000:]
    start = history(student, "eval_exact_match")[0]
    assert start["step"] == 0
    end, taught, sft = (json.loads((d / "eval" / "metrics.json").read_text())["scores"]
                        for d in (student, teacher, few))
    assert end["examples"] == 40 and start["eval_exact_match"] <= 10, start
    assert end["exact_match"] >= MIN_DISTILLED and taught["exact_match"] >= 90, (end, taught, sft)
