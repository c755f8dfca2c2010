"""Contamination report (tunekit.data.contamination): duplicates in training data, and eval examples that
occur in it exactly or share a long n-gram with it, on known small inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tunekit.core.errors import TunekitError
from tunekit.data import contamination
from tunekit.data.contamination import check, normalize, words

# 30 distinct words; spans of it are planted in eval prompts below
STORY = ("the old lighthouse keeper walked along the narrow stone path every evening before sunset while "
         "gulls circled above grey waves breaking slowly against black rocks near harbour walls beyond town")
SPAN = STORY.split()


def test_normalize_and_words():
    assert normalize("  Hello\t\n  WORLD  ") == "hello world"
    assert normalize("ｆｕｌｌ　ｗｉｄｔｈ") == "full width"  # NFKC
    assert words(normalize("Café Straße, naïve!")) == ["café", "strasse", "naïve"]
    assert normalize("cafe\u0301") == normalize("CAFÉ")  # decomposed accent composes
    assert words(normalize("東京タワー is tall")) == ["東", "京", "タ", "ワ", "ー", "is", "tall"]


def test_digest_is_stable_across_processes():
    """blake2b, not Python's per-process salted str hash: the same value in every run."""
    assert contamination.digest("a b c") == 0x7469278d4609cc30


def test_duplicates_after_normalisation_keep_the_first():
    train = [("Hello  World", "Hi"), ("x", "y"), ("hello world", " HI "), ("HELLO\tWORLD", "hi"),
             ("hello world", "hi there"), ("a b", "c"), ("a", "b c")]
    found = check(train, [])
    assert found.duplicates == [2, 3]
    assert found.duplicate_pairs == [(2, 0), (3, 0)]
    assert found.train_size == 7 and found.eval_size == 0
    assert found.eval_exact == found.eval_ngram == found.overlapping == []


def test_eval_answer_equal_to_a_training_answer_in_other_case_is_exact():
    train = [("What is the capital of France?", "Paris is the capital."), ("Unrelated", "Text here.")]
    held_out = [("Name France's capital city.", "PARIS IS THE   capital.")]
    found = check(train, held_out)
    assert found.eval_exact == [0]
    assert found.eval_ngram == []  # four words: shorter than n, so only an exact match counts
    assert found.overlapping == [0]
    assert found.overlap_pairs == [(0, 0, "answer")]


def test_exact_matching_keeps_prompts_and_answers_apart():
    found = check([("Paris", "Tell me a city")], [("Tell me a city", "Paris")])
    assert found.eval_exact == [] and found.overlapping == []


def test_thirteen_word_span_matches_by_ngram_but_twelve_does_not():
    train = [("Tell a story.", STORY), ("Another prompt", "another answer")]
    thirteen = "Please continue: " + " ".join(SPAN[5:18]) + " and then what happened"
    twelve = "Please continue: " + " ".join(SPAN[5:17]) + " and then what happened"
    found = check(train, [(twelve, "x"), (thirteen, "y")])
    assert found.eval_ngram == [1]
    assert found.eval_exact == []
    assert found.overlapping == [0]
    assert found.overlap_pairs == [(1, 0, "13-gram")]
    assert check(train, [(twelve, "x")], n=12).eval_ngram == [0]


def test_ngram_match_ignores_case_and_spacing_and_counts_long_exact_matches_too():
    train = [("", STORY)]
    found = check(train, [("Q", STORY.upper().replace(" ", "   "))])
    assert found.eval_exact == [0] and found.eval_ngram == [0]
    assert found.eval_contaminated == [0]


def test_cjk_text_matches_by_characters():
    answer = "東京は日本の首都であり世界最大の都市圏の一つです"
    span = answer[3:16]  # 13 characters: 13 words
    assert len(words(span)) == 13
    train = [("日本について教えて", answer)]
    found = check(train, [(f"次の文を説明して：{span}。", "はい"), (f"次の文を説明して：{span[:12]}。", "はい")])
    assert found.eval_ngram == [0]
    assert found.overlapping == [0]


def test_accented_text_is_not_lost():
    """An ASCII-only tokenizer (rouge-style) turns 'café' into 'caf' and drops words such as 'été'."""
    french = ("été café crème brûlée à côté du théâtre où élèves étudiaient l'œuvre de molière ensemble "
              "chaque soir")
    plain = ("ete cafe creme brulee a cote du theatre ou eleves etudiaient l'oeuvre de moliere ensemble "
             "chaque soir")
    train = [("Décris la scène.", french)]
    assert check(train, [("Traduis : " + french.upper(), "ok")]).eval_ngram == [0]
    assert check(train, [("Traduis : " + plain, "ok")]).eval_ngram == []  # accents make different words


def test_empty_prompts_never_match():
    train = [("", "answer one"), ("   ", "answer two")]
    found = check(train, [("", "something else"), ("\n", "different")])
    assert found.eval_exact == [] and found.overlapping == []
    assert check([("", "x")], [("", "x")]).eval_exact == [0]  # the answer still matches


def test_decontaminate_drops_the_overlapping_training_examples():
    train = [("one", "alpha"), ("two", "beta"), ("three", "gamma"), ("Two", "BETA"), ("five", STORY),
             ("six", "delta")]
    held_out = [("two", "other"), ("seven", "zeta"), ("Go on: " + " ".join(SPAN[10:25]), "x")]
    found = check(train, held_out, decontaminate=True)
    assert found.overlapping == [1, 3, 4]
    assert found.duplicates == [3]
    assert found.eval_exact == [0] and found.eval_ngram == [2]
    assert found.dropped == [1, 3, 4]
    assert check(train, held_out, dedup=True).dropped == [3]
    assert check(train, held_out).dropped == []
    assert check(iter(train), iter(held_out)).overlapping == [1, 3, 4]  # both sides may be streams


def test_line_and_to_json_report_the_counts():
    train = [("q", "a"), ("Q", "A"), ("q2", "a2"), ("", STORY)] + [(f"p{i}", f"r{i}") for i in range(6)]
    held_out = [("q2", "new"), ("Go on: " + " ".join(SPAN[:14]), "x"), ("fresh", "unseen")]
    found = check(train, held_out, dedup=True)
    assert found.line() == ("contamination: 1 duplicate training examples (10.0%); 1 of 3 eval examples share a "
                            "prompt or answer with training, 1 share a 13-gram (2 training examples overlap "
                            "them); dedup on, decontaminate off; 1 training examples dropped")
    assert check(train, []).line() == ("contamination: 1 duplicate training examples (10.0%); no held-out data; "
                                       "dedup off, decontaminate off")
    assert found.to_json() == {
        "n": 13, "train_examples": 10, "eval_examples": 3, "duplicates": 1, "eval_exact": 1, "eval_ngram": 1,
        "eval_contaminated": 2, "overlapping_train": 2, "dedup": True, "decontaminate": False, "dropped": 1,
        "duplicate_examples": [{"train": 1, "copy_of": 0}],
        "overlap_examples": [{"eval": 0, "train": 2, "match": "prompt"},
                             {"eval": 1, "train": 3, "match": "13-gram"}],
    }


def test_to_json_lists_at_most_five_locations():
    train = [("same", "text")] * 20
    found = check(train, [("same", "other")] * 3)
    data = found.to_json()
    assert data["duplicates"] == 19 and len(data["duplicate_examples"]) == 5
    assert data["overlapping_train"] == 20 and len(data["overlap_examples"]) == 5
    assert data["eval_exact"] == 3


def test_n_must_be_positive():
    with pytest.raises(ValueError, match="n must be at least 1"):
        check([], [], n=0)


def test_module_imports_no_ml_stack():
    code = ("import sys, tunekit.data.contamination; "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------- wired into data preparation


def _planted(tmp_path):
    """20 distinct training rows, two of them repeated in other case and spacing, and an eval file holding one
    training answer word for word plus two unseen rows."""
    from conftest import write_jsonl

    rows = [{"instruction": f"Spell number {i} backwards.", "output": f"answer {i:03d}"[::-1]} for i in range(20)]
    rows += [{"instruction": "SPELL number 3  backwards.", "output": rows[3]["output"].upper()},
             {"instruction": "spell NUMBER 7 backwards. ", "output": rows[7]["output"]}]
    held = [{"instruction": "Something else entirely.", "output": rows[5]["output"]},
            {"instruction": "Unseen one.", "output": "fresh"}, {"instruction": "Unseen two.", "output": "new"}]
    return write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", held)


@pytest.mark.slow  # prepares Arrow data sets: seconds
@pytest.mark.parametrize("dedup, decontaminate, kept", [(False, False, 22), (True, False, 20), (True, True, 19)])
def test_prepared_sets_report_contamination_and_drop_what_the_recipe_asks(tmp_path, tiny_tokenizer, dedup,
                                                                          decontaminate, kept):
    from tunekit.config.schema import DataConfig
    from tunekit.data import arrow

    train, held = _planted(tmp_path)
    cfg = DataConfig(train=str(train), eval=str(held), dedup=dedup, decontaminate=decontaminate)
    bundle = arrow.build(cfg, tiny_tokenizer, seed=0)
    report = bundle.contamination
    assert len(bundle.train) == bundle.train_stats.examples == kept
    assert (report["duplicates"], report["eval_exact"], report["overlapping_train"]) == (2, 1, 1)
    assert report["dropped"] == 22 - kept
    assert report["duplicate_examples"] == [{"train": f"{train} line 21", "copy_of": f"{train} line 4"},
                                            {"train": f"{train} line 22", "copy_of": f"{train} line 8"}]
    assert report["overlap_examples"] == [{"eval": f"{held} line 1", "train": f"{train} line 6", "match": "answer"}]
    assert report["line"].startswith("contamination: 2 duplicate training examples (9.1%); 1 of 3 eval examples")
    assert arrow.build(cfg, tiny_tokenizer, seed=0).contamination == report  # read back from the cache


@pytest.mark.slow  # seconds
def test_preference_pairs_report_contamination_too(tmp_path, tiny_model, tiny_tokenizer):
    from conftest import tiny_recipe, write_jsonl, write_recipe
    from tunekit.config import recipefile
    from tunekit.training import methods

    pairs = [{"prompt": f"Reverse w{i:03d}", "chosen": f"{i:03d}w", "rejected": f"w{i:03d}"} for i in range(12)]
    data = write_jsonl(tmp_path / "p.jsonl", pairs + [pairs[2]])
    raw = tiny_recipe(tiny_model, data, tmp_path / "run", training={"method": "dpo"},
                      data={"format": "preference", "eval": str(write_jsonl(tmp_path / "e.jsonl", pairs[:1])),
                            "dedup": True, "decontaminate": True})
    recipe = recipefile.load(write_recipe(tmp_path / "r.yaml", raw))
    bundle = methods.of(recipe).build_data(recipe, tiny_tokenizer)
    assert (bundle.contamination["duplicates"], bundle.contamination["overlapping_train"]) == (1, 1)
    assert bundle.contamination["dropped"] == 2 and bundle.train_stats.examples == 11


def _found(fmt, rows, held=(), **settings):
    from tunekit.config.schema import DataConfig
    from tunekit.data.contamination import of_records
    from tunekit.data.formats import Record

    cfg = DataConfig(train="unused.jsonl", format=fmt, template="chat", **settings)
    return of_records([Record(r, f"t line {i}") for i, r in enumerate(rows, 1)],
                      [Record(r, f"e line {i}") for i, r in enumerate(held, 1)], cfg)


def test_pairs_with_another_rejected_answer_or_label_are_not_duplicates():
    pairs = [{"prompt": "Q", "chosen": "good", "rejected": "bad one"},
             {"prompt": "Q", "chosen": "good", "rejected": "bad two"},
             {"prompt": "q", "chosen": "GOOD", "rejected": "bad one"}]
    assert _found("preference", pairs, dedup=True).dropped == [2]
    unpaired = [{"prompt": "Q", "completion": "A", "label": True}, {"prompt": "Q", "completion": "A", "label": False}]
    assert _found("unpaired_preference", unpaired, dedup=True).duplicates == []


def test_a_system_prompt_shared_by_every_example_is_no_overlap():
    system = {"role": "system", "content": " ".join(SPAN[:20])}
    rows = [{"messages": [system, {"role": "user", "content": f"task {i}"},
                          {"role": "assistant", "content": f"done {i}"}]}
            for i in range(6)]
    found = _found("chat", rows[:4], rows[4:], decontaminate=True)
    assert found.eval_ngram == [] and found.overlapping == [] and found.dropped == []


def test_dropping_every_training_example_is_one_line_naming_the_settings():
    from tunekit.data.contamination import report

    rows = [{"instruction": "Same.", "output": "same"}] * 2
    found = _found("alpaca", rows[:1], rows[1:], decontaminate=True)
    with pytest.raises(TunekitError, match="data.dedup/data.decontaminate drop all 1 training examples"):
        report(found, ["t line 1"], ["e line 1"])
