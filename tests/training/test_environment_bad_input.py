"""An environment (grpo.environment) that cannot be made or reset: one line naming the recipe key, the class and its
message, exit code 2, no traceback. A constructor that raises is found before weights load (the checks make one
environment); one that raises only once training has started ends the run as failed in run.json."""

from __future__ import annotations

import re

import pytest

from conftest import importable, refused_in_process, tiny_recipe, write_jsonl, write_recipe
from tunekit.config.methodsettings import GrpoSettings
from tunekit.core.errors import TunekitError
from tunekit.runs.layout import RunRecord
from tunekit.tooluse import episodes

ENVS = '''
class Base:
    def reset(self, **record):
        return None

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much
        """
        return by


class Broken(Base):
    def __init__(self):
        raise RuntimeError("no sandbox on this machine")


class NeedsSize(Base):
    def __init__(self, size):
        self.size = size


class Silent(Base):
    def __init__(self):
        raise KeyError


class FailsLater(Base):
    """Made once by the checks, then it fails: the run has started."""

    made = 0

    def __init__(self):
        FailsLater.made += 1
        if FailsLater.made > 1:
            raise RuntimeError("the sandbox went away")


class ResetRaises(Base):
    def reset(self, **record):
        return record["city"]


class ResetNumber(Base):
    def reset(self, **record):
        return 3
'''


@pytest.fixture
def envs(tmp_path, monkeypatch):
    yield from importable(tmp_path, monkeypatch, "myenvs", ENVS)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with a 1024-token context: room for a prompt that offers a tool."""
    from tunekit.models.tiny import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-1024")
    build_model(path, build_tokenizer(path), context=1024)
    return path


def env_recipe(model, tmp_path, environment: str, method: str = "grpo") -> dict:
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}.", "answer": str(i)} for i in range(8)])
    raw = tiny_recipe(model, data, tmp_path / "run", training={"method": method, "max_steps": 1,
                                                               "micro_batch_size": 4})
    raw["data"].update(format="prompt", max_length=600)
    raw[method] = {"completions": 2, "max_completion_length": 16, "environment": f"myenvs:{environment}",
                   "trust_local_code": True, "rewards": [{"reward": "length"}]}
    return raw


# name -> (environment class, method, expected line)
BEFORE_WEIGHTS = {
    "constructor raises": ("Broken", "grpo", "grpo.environment: Broken() raised RuntimeError: no sandbox on this "
                                             "machine; an environment is made with no arguments, once per episode: "
                                             "fix Broken.__init__"),
    "constructor raises under rloo": ("Broken", "rloo", "rloo.environment: Broken() raised RuntimeError: no sandbox"),
    "constructor takes an argument": ("NeedsSize", "grpo", "grpo.environment: NeedsSize() raised TypeError: "
                                                           "NeedsSize.__init__() missing 1 required positional "
                                                           "argument: 'size'"),
    "constructor raises without a message": ("Silent", "grpo", "grpo.environment: Silent() raised KeyError: KeyError;"),
}


@pytest.mark.parametrize("verb", ["validate", "train"])
@pytest.mark.parametrize("case", BEFORE_WEIGHTS)
def test_an_environment_that_cannot_be_made_is_refused_before_weights(case, verb, envs, tmp_path, long_model,
                                                                      capsys, monkeypatch):
    cls, method, expected = BEFORE_WEIGHTS[case]
    recipe = write_recipe(tmp_path / "r.yaml", env_recipe(long_model, tmp_path, cls, method))
    line = refused_in_process([verb, str(recipe)], tmp_path, capsys, monkeypatch)
    assert line == f"tunekit: error: {expected}" or expected in line, line


def settings(environment: str) -> GrpoSettings:
    return GrpoSettings(rewards=[{"reward": "length"}], trust_local_code=True, environment=f"myenvs:{environment}")


# name -> (environment class, section, expected message) for an episode started on a record read at "p.jsonl line 3"
AT_AN_EPISODE = {
    "constructor raises": ("Broken", "grpo", r"^grpo.environment: Broken\(\) raised RuntimeError: no sandbox on this "
                                             r"machine; .* fix Broken.__init__$"),
    "reset raises": ("ResetRaises", "rloo", r"^rloo.environment: ResetRaises.reset raised KeyError: 'city' on "
                                            r"p.jsonl line 3; it takes the record's fields as keyword arguments$"),
    "reset returns a number": ("ResetNumber", "grpo", r"^grpo.environment: ResetNumber.reset returned int on p.jsonl "
                                                      r"line 3; it returns None or a text added to the prompt$"),
}


@pytest.mark.parametrize("case", AT_AN_EPISODE)
def test_an_episode_whose_environment_fails_is_one_line(case, envs):
    cls, section, expected = AT_AN_EPISODE[case]
    kit = episodes.Toolkit(environment=getattr(__import__(envs), cls), section=section)
    with pytest.raises(TunekitError) as e:
        kit.start({"prompt": "q"}, "p.jsonl line 3")
    assert re.search(expected, str(e.value)), str(e.value)


def test_the_checks_make_one_environment_and_an_episode_another(envs):
    import myenvs

    kit = episodes.Toolkit.of(settings("FailsLater"))
    assert myenvs.FailsLater.made == 0  # loading the class makes none
    kit.probe()
    assert myenvs.FailsLater.made == 1
    with pytest.raises(TunekitError, match=r"grpo.environment: FailsLater\(\) raised RuntimeError: the sandbox went"):
        kit.start({})


@pytest.mark.slow  # builds the trainer (seconds)
def test_an_environment_failing_once_training_started_marks_the_run_failed(envs, tmp_path, long_model, capsys,
                                                                          monkeypatch):
    """The checks' environment is made; the first episode's constructor raises: one error line, exit code 2, and
    run.json says failed with that line, not running."""
    import logging

    from tunekit.cli.main import main

    recipe = write_recipe(tmp_path / "r.yaml", env_recipe(long_model, tmp_path, "FailsLater"))
    monkeypatch.setattr(logging.getLogger("tunekit"), "handlers", [])  # its log lines on this test's stderr
    capsys.readouterr()
    code = main(["train", str(recipe)])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("tunekit: error: ")]
    expected = "grpo.environment: FailsLater() raised RuntimeError: the sandbox went away"
    assert code == 2 and errors == err[-1:] and expected in errors[0], err[-20:]
    assert not any("Traceback" in line for line in err), err[-20:]
    run = RunRecord.load(tmp_path / "run")
    assert run.status == "failed" and expected in run.error, run
