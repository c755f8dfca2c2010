"""`tunekit chat` (tunekit.evaluation.conversation): answers as `tunekit eval` generates them, the conversation
kept across turns and rendered by the run's template, /reset and /exit, and bad input in one line."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

from conftest import reverse_rows, run_watching_imports, tiny_recipe, write_jsonl, write_recipe
from tunekit.cli import main
from tunekit.core import console
from tunekit.core.errors import TunekitError
from tunekit.data.formats import ALPACA_PROMPT
from tunekit.evaluation import conversation

SYSTEM = "Reverse the word you are given."


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model):
    """A tiny LoRA run trained in-process, with its end-of-training eval (predictions.jsonl) and a system prompt."""
    root = tmp_path_factory.mktemp("chat")
    data = write_jsonl(root / "train.jsonl", reverse_rows(40))
    raw = tiny_recipe(tiny_model, data, root / "run", data={"eval_fraction": 0.2, "system_prompt": SYSTEM},
                      training={"max_steps": 12, "learning_rate": 1e-2},
                      eval={"batch_size": 4, "max_new_tokens": 8, "metrics": ["exact_match"]})
    assert main.main(["train", str(write_recipe(root / "r.yaml", raw))]) == 0
    return root / "run"


@pytest.fixture(autouse=True)
def _log_to_this_tests_stderr():
    """cli.main's log handler is made once per process, on the stderr of the test that first called it
    (capsys's, closed once that test ends): each test here gets its own."""
    def drop():
        log = logging.getLogger("tunekit")
        for handler in [h for h in log.handlers if isinstance(h, console.LogHandler)]:
            log.removeHandler(handler)
    drop()
    yield
    drop()


# ---------------------------------------------------------------- bad input, before any model loads


def test_a_missing_run_is_one_line_exit_2_before_torch(tmp_path):
    code, out, err, loaded = run_watching_imports(("torch",), "chat", str(tmp_path / "nope" / "run"), "--once", "hi")
    assert code == 2 and out == "" and loaded == []
    assert err.strip().splitlines() == [
        f"tunekit: error: {tmp_path / 'nope' / 'run'}: no such directory; give a run directory (the output_dir "
        "`tunekit train` wrote, e.g. runs/NAME), a merged directory (`tunekit merge`) or a model (directory, GGUF "
        "file or hub id)"]
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("argv, expected", [
    (["--once", " "], "--once: the text is empty"),
    (["--recipe", "missing.yaml"], "--recipe missing.yaml: file not found"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
    (["--image", "a.png"], "--image goes with --once; in the conversation, attach one with /image PATH"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, expected, tmp_path, capsys):
    try:
        code = main.main(["chat", str(tmp_path), *argv])
    except SystemExit as e:  # argparse's refusals exit from the parser
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tunekit") and expected in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_system_without_a_chat_template_is_refused(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_model, data, tmp_path / "run",
                                                           data={"template": "raw"}))
    target = conversation.target_for(str(tiny_model), str(recipe))
    from transformers import AutoTokenizer

    with pytest.raises(TunekitError, match="--system: the run renders prompts without a chat template"):
        conversation.Prompter.of(target.recipe, AutoTokenizer.from_pretrained(tiny_model), "be brief")


# ---------------------------------------------------------------- rendering the conversation


def test_a_base_model_needs_no_recipe_and_uses_its_chat_template(tiny_model, tiny_tokenizer):
    target = conversation.target_for(str(tiny_model))
    assert target.kind == "base"
    prompter = conversation.Prompter.of(target.recipe, tiny_tokenizer, "Be brief.")
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "eno"}]
    expected = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "two"}],
        tokenize=False, add_generation_prompt=True)
    assert prompter.render(history, "two") == expected and not prompter.add_special_tokens


def test_without_a_chat_template_earlier_turns_go_before_as_they_trained():
    prompter = conversation.Prompter(SimpleNamespace(chat=None, template="alpaca"), None, "</s>")
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}]
    assert prompter.render(history, "b") == (ALPACA_PROMPT.format(instruction="a") + "A</s>"
                                             + ALPACA_PROMPT.format(instruction="b"))
    raw = conversation.Prompter(SimpleNamespace(chat=None, template="raw"), None, "</s>")
    assert raw.render(history, "b") == "aA</s>b" and raw.add_special_tokens


def test_the_oldest_turns_are_left_out_where_the_conversation_outgrows_the_context(tiny_model, tiny_tokenizer):
    prompter = conversation.Prompter.of(conversation.target_for(str(tiny_model)).recipe, tiny_tokenizer)
    history = [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "xof"},
               {"role": "user", "content": "jumps over"}, {"role": "assistant", "content": "spmuj"}]
    fits = len(tiny_tokenizer(prompter.render(history[2:], "dog"), add_special_tokens=False)["input_ids"]) + 8
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=fits))  # the last turn fits, not both
    chat = conversation.Conversation(model, tiny_tokenizer, prompter, max_new_tokens=8, history=list(history))
    prompt = chat.prompt("dog")
    assert "jumps over" in prompt and "quick" not in prompt and len(chat.history) == 2
    with pytest.raises(TunekitError, match="send a shorter one or lower --max-new-tokens"):
        chat.prompt("the lazy dog " * 20)


# ---------------------------------------------------------------- talking to a trained run


@pytest.mark.slow
def test_once_answers_what_eval_generated_for_the_same_prompt(lora_run, capsys):
    rows = [json.loads(line) for line in (lora_run / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert any(r["prediction"] for r in rows)
    target = conversation.target_for(str(lora_run))
    chat = conversation.load(target)
    for row in rows[:3]:
        text = _user_message(row["prompt"])
        assert chat.prompter.render([], text) == row["prompt"]  # the run's template and system prompt
        assert chat.reply(text) == row["prediction"]
        chat.reset()
    text = _user_message(rows[0]["prompt"])
    capsys.readouterr()
    assert main.main(["chat", str(lora_run), "--once", text]) == 0
    assert capsys.readouterr().out == rows[0]["prediction"] + "\n"


@pytest.mark.slow
def test_history_is_kept_and_reset_clears_it(lora_run, tiny_tokenizer):
    chat = conversation.load(conversation.target_for(str(lora_run)))
    first = chat.reply("Reverse the word.\n\ncatdog")
    second_prompt = chat.prompt("Reverse the word.\n\nfishbird")
    assert second_prompt == tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Reverse the word.\n\ncatdog"},
         {"role": "assistant", "content": first}, {"role": "user", "content": "Reverse the word.\n\nfishbird"}],
        tokenize=False, add_generation_prompt=True)
    chat.reply("Reverse the word.\n\nfishbird")
    assert [m["role"] for m in chat.history] == ["user", "assistant"] * 2

    lines = iter(["Reverse the word.\n\nwolfbear", "/reset", "Reverse the word.\n\nducklion", "/nope", "/exit",
                  "never read"])
    out = io.StringIO()
    conversation.talk(chat, read=lambda prompt: next(lines), out=out)
    assert chat.history[0]["content"] == "Reverse the word.\n\nducklion" and len(chat.history) == 2
    shown = out.getvalue()
    assert "(conversation cleared)" in shown and "unknown command /nope" in shown
    assert shown.count("model> ") == 2


@pytest.mark.slow
def test_interactive_on_stdin_until_end_of_input(lora_run, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Reverse the word.\n\n/reset\nhello\n"))
    assert main.main(["chat", str(lora_run), "--system", "Be brief.", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chat: /image PATH attach an image") and out.count("model> ") == 2
    assert "(conversation cleared)" in out and out.endswith("\n")


def test_an_image_for_a_text_only_model_is_one_line_and_the_conversation_goes_on(lora_run, tmp_path, monkeypatch,
                                                                                  capsys):
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 0, 0)).save(tmp_path / "red.png")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {tmp_path / 'red.png'}\n/image\nhello\n"))
    assert main.main(["chat", str(lora_run), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "tunekit: error: chat: /image " in out and "is a text-only language model" in out
    assert "tunekit: error: /image: give the image's path" in out and out.count("model> ") == 1


@pytest.mark.slow
def test_a_merged_directory_answers_as_its_run(lora_run, tmp_path, capsys):
    assert main.main(["merge", str(lora_run), "--out", str(tmp_path / "merged")]) == 0
    text = "Reverse the word.\n\ncatdog"
    capsys.readouterr()
    assert main.main(["chat", str(lora_run), "--once", text]) == 0
    from_run = capsys.readouterr().out
    assert main.main(["chat", str(tmp_path / "merged"), "--once", text]) == 0
    assert capsys.readouterr().out == from_run


def _user_message(prompt: str) -> str:
    """The user message of a ChatML prompt eval wrote (the tiny tokenizer's template)."""
    return prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


@pytest.mark.slow
def test_a_full_fine_tuning_run_and_a_base_model(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(20))
    raw = tiny_recipe(tiny_model, data, tmp_path / "full", adapter="none", lora=None, data={"eval_fraction": 0.2},
                      training={"max_steps": 4, "learning_rate": 1e-3},
                      eval={"max_new_tokens": 6, "metrics": ["exact_match"]})
    assert main.main(["train", str(write_recipe(tmp_path / "r.yaml", raw))]) == 0
    row = json.loads((tmp_path / "full" / "eval" / "predictions.jsonl").read_text().splitlines()[0])
    capsys.readouterr()
    assert main.main(["chat", str(tmp_path / "full"), "--once", _user_message(row["prompt"])]) == 0
    assert capsys.readouterr().out == row["prediction"] + "\n"
    assert main.main(["chat", str(tiny_model), "--once", "hello", "--max-new-tokens", "4"]) == 0  # no recipe needed
    assert capsys.readouterr().out.endswith("\n")
