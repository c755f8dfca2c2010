"""Third-party messages that need no action are hidden (tunekit/quiet.py lists each, with its reason);
other messages from the same sources still show, and --verbose shows everything."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from conftest import run_cli
from tunekit.core import quiet

# a message each hidden entry must catch, as the library prints it
EXAMPLES = {
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community: No module named "
                                     "'kernels'. Please make sure you already `pip install kernels` and the kernels "
                                     ">= 0.11.1",
    "lm_eval.models.huggingface": "`pretrained` model kwarg is not of type `str`. Many other model arguments may be "
                                  "ignored.",
    "warnings:FutureWarning": "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                              "`is_activation_checkpointing` instead.",
}


class Catch(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_every_hidden_entry_has_an_example_and_a_reason():
    assert sorted(h.source for h in quiet.HIDDEN) == sorted(EXAMPLES)
    for h in quiet.HIDDEN:
        assert re.search(h.pattern, EXAMPLES[h.source]) and len(h.reason) > 40


@pytest.mark.parametrize("verbose", [False, True])
def test_listed_log_messages_are_dropped_and_others_kept(monkeypatch, verbose):
    for h in quiet.HIDDEN:
        if h.source.startswith("warnings:"):
            continue
        logger = logging.getLogger(h.source)
        monkeypatch.setattr(logger, "filters", [])
        quiet.install(verbose)
        catch = Catch()
        logger.addHandler(catch)
        try:
            logger.warning("%s", EXAMPLES[h.source])
            logger.warning("an unrelated warning from %s", h.source)
        finally:
            logger.removeHandler(catch)
        expected = ([EXAMPLES[h.source]] if verbose else []) + [f"an unrelated warning from {h.source}"]
        assert catch.messages == expected


@pytest.mark.parametrize("verbose", [False, True])
def test_the_listed_future_warning_of_transformers_is_dropped(tiny_model, verbose):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install(verbose)
        assert model.is_gradient_checkpointing is False  # transformers' own deprecated alias: warns
        warnings.warn("an unrelated FutureWarning", FutureWarning)
    texts = [str(w.message) for w in seen]
    assert "an unrelated FutureWarning" in texts
    assert any("is_gradient_checkpointing" in t for t in texts) == verbose


@pytest.mark.slow
def test_deepspeed_note_hidden_unless_verbose():
    """The flagship recipe names a ZeRO config: validating it for a world size runs DeepSpeed's own check of
    that config, which imports DeepSpeed, which prints its note."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": ""}
    quiet_run = run_cli("validate", "recipes/llama_qlora.yaml", "--world-size", "2", env=env, fresh=True)
    loud_run = run_cli("validate", "recipes/llama_qlora.yaml", "--world-size", "2", "--verbose", env=env,
                       fresh=True)
    assert quiet_run.returncode == loud_run.returncode == 0, quiet_run.stderr
    assert "Setting accelerator to CPU" not in quiet_run.stdout + quiet_run.stderr
    assert "Setting accelerator to CPU" in loud_run.stdout + loud_run.stderr
