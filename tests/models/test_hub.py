"""Every way the Hub can fail is one line naming the model and the fix, without network and at once
(no retries): a local stand-in for the Hub answers as huggingface.co does (status and X-Error-Code)."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from conftest import reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.core.errors import TunekitError
from tunekit.models import hub

# what huggingface.co answers to HEAD /{repo}/resolve/{revision}/config.json, by repo name
ANSWERS = {
    "org/open-model": (200, {}),
    "org/gated-model": (401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}),
    "org/no-such-model": (401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}),
    "org/dataset-like": (404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}),
    "org/broken-hub": (503, {}),
}


class FakeHub(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        parts = self.path.strip("/").split("/")
        repo, revision = "/".join(parts[:2]), parts[3]
        status, headers = ANSWERS.get(repo, (404, {"X-Error-Code": "RepoNotFound"}))
        if status == 200 and revision != "main":
            status, headers = 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
        self.send_response(status)
        for k, v in {"ETag": '"abc"', "X-Repo-Commit": "0" * 40, "Content-Length": "2", **headers}.items():
            self.send_header(k, v)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def closed_port() -> str:
    with socket.socket() as s:  # bound and closed: nothing listens there, connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def hub_at(monkeypatch, tmp_path):
    """Point huggingface_hub at `endpoint`, with an empty cache and online mode, for one test."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)

    def _set(endpoint: str):
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
        monkeypatch.setattr(hub, "_checked", {})
        return tmp_path / "cache"
    return _set


def cache_config(cache, repo: str, revision: str = "main") -> None:
    """A Hugging Face cache entry for repo's config.json, laid out as hf_hub_download leaves it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / revision).write_text("1" * 40)
    (folder / "snapshots" / ("1" * 40)).mkdir(parents=True)
    (folder / "snapshots" / ("1" * 40) / "config.json").write_text("{}")


@pytest.mark.parametrize("repo, revision, key, expected", [
    ("org/gated-model", None, "model.name_or_path", "'org/gated-model' is a gated model"),
    ("org/no-such-model", None, "model.name_or_path", "no model 'org/no-such-model' on the Hub"),
    ("org/open-model", "v9", "model.revision", "'org/open-model' has no revision 'v9'"),
    ("org/dataset-like", None, "model.tokenizer", "'org/dataset-like' has no config.json"),
    ("org/broken-hub", None, "model.name_or_path", "cannot reach the Hugging Face Hub"),
])
def test_each_hub_failure_is_one_line_with_its_fix(fake_hub, hub_at, repo, revision, key, expected):
    hub_at(fake_hub)
    with pytest.raises(TunekitError) as e:
        hub.require(repo, revision, "model.tokenizer" if key == "model.tokenizer" else "model.name_or_path")
    message = str(e.value)
    assert message.startswith(key) and expected in message and "\n" not in message
    fixes = {"gated": "hf auth login", "no model": "check the name", "revision": "remove model.revision",
             "config.json": "point model.tokenizer", "reach": "set model.name_or_path to a local model directory"}
    assert any(word in message and fix in message for word, fix in fixes.items()), message
    hub.require("org/open-model", None)  # a reachable model passes


def test_offline_mode_fails_at_once_and_reads_the_cache(hub_at, monkeypatch):
    from huggingface_hub import constants

    cache = hub_at(closed_port())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.Unavailable, match=r"'org/m' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 "
                                              r"forbids downloading it; download it .*hf download org/m"):
        hub.require("org/m")
    cache_config(cache, "org/cached")
    hub.require("org/cached")  # offline, but cached: fine, and no request was made (the port is closed)


def test_unreachable_hub_fails_without_retries_or_goes_offline_for_a_cached_model(hub_at):
    from huggingface_hub import constants

    cache = hub_at(closed_port())
    started = time.monotonic()
    with pytest.raises(hub.Unavailable, match=r"cannot reach the Hugging Face Hub \(http://127\.0\.0\.1:\d+: "
                                              r".*\) to download 'org/m'"):
        hub.require("org/m")
    assert time.monotonic() - started < 5  # huggingface_hub's own retries wait 1+2+4+8+8 s
    cache_config(cache, "org/cached")
    hub.require("org/cached")
    assert constants.HF_HUB_OFFLINE is True  # later loads read the cache at once instead of retrying


def test_a_failure_is_asked_once_per_process(fake_hub, hub_at, monkeypatch):
    hub_at(fake_hub)
    calls = []
    real = hub._probe
    monkeypatch.setattr(hub, "_probe", lambda *a: (calls.append(a), real(*a)))
    for _ in range(3):
        with pytest.raises(TunekitError, match="gated"):
            hub.require("org/gated-model")
    assert len(calls) == 1


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": ""}


@pytest.mark.slow
def test_every_command_names_an_uncached_model_in_one_line_when_offline(tmp_path, tiny_model):
    """train, validate, plan, eval, merge and export on a hub model that is neither cached nor reachable."""
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows())
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe("org/not-here", data, tmp_path / "run"))
    env = {**OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf")}
    # a run trained on a local copy, whose recipe then names the hub model: merge must fetch that base
    trained = write_recipe(tmp_path / "t.yaml", tiny_recipe(tiny_model, data, tmp_path / "trained",
                                                            training={"max_steps": 1}))
    assert run_cli("train", str(trained), env=env).returncode == 0
    saved = tmp_path / "trained" / "recipe.yaml"
    saved.write_text(saved.read_text().replace(str(tiny_model), "org/not-here"))
    fix = "download it where the Hub is reachable (`hf download org/not-here`)"
    for args, key in [(["train", str(recipe)], "model.name_or_path"),
                      (["plan", str(recipe)], "model.name_or_path"),
                      (["eval", "org/not-here", "--data", str(data)], "model.name_or_path"),
                      (["export", "org/not-here", "--out", str(tmp_path / "m.gguf")], "export target"),
                      (["merge", str(tmp_path / "trained")], "model.name_or_path")]:
        res = run_cli(*args, env=env)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and lines[-1].startswith(f"tunekit: error: {key}: 'org/not-here'"), res.stderr
        assert fix in lines[-1] and "Traceback" not in res.stderr and "Retry" not in res.stderr, args
    assert not (tmp_path / "run").exists() and not (tmp_path / "m.gguf").exists()
    assert not (tmp_path / "trained" / "merged").exists()
    res = run_cli("validate", str(recipe), env=env)  # a recipe is valid offline; what was not checked is said
    assert res.returncode == 0 and "data.max_length not checked" in res.stderr and fix in res.stderr


@pytest.mark.slow
def test_flagship_plan_runs_offline_from_the_shipped_config():
    res = run_cli("plan", "recipes/llama_qlora.yaml", "--world-size", "4", "--gpu-memory", "24GiB", env=OFFLINE_ENV)
    assert res.returncode == 0, res.stderr
    assert "using tunekit's shipped copy of its config" in res.stderr
    assert "parameters: 8,072,204,288 total" in res.stdout and "verdict: fits in 24.0 GiB" in res.stdout


@pytest.mark.slow
def test_the_vision_recipe_plans_offline_from_the_shipped_config():
    """recipes/qwen_vl_qlora.yaml: Qwen2.5-VL-3B-Instruct's config as shipped (its config.json on the Hub), built
    with AutoModelForImageTextToText on the meta device; the tower counted apart from the language model's 4 bits."""
    res = run_cli("plan", "recipes/qwen_vl_qlora.yaml", "--gpu-memory", "24GiB", env=OFFLINE_ENV)
    assert res.returncode == 0, res.stderr
    assert "using tunekit's shipped copy of its config" in res.stderr
    assert "parameters: 3,784,556,544 total" in res.stdout and "vision: tower 668,684,288 parameters (frozen)" in \
        res.stdout
    assert "1,024 patches" in res.stdout and "verdict: fits in 24.0 GiB" in res.stdout


def test_unreachable_hub_data_set_fails_at_once_in_one_line(hub_at):
    from huggingface_hub import constants

    from tunekit.data.reading import iter_records

    hub_at(closed_port())
    started = time.monotonic()
    with pytest.raises(TunekitError, match=r"^data\.train: data set 'org/some-data' is not in the local datasets cache "
                                           r"and the Hub cannot be used here .*set data\.train to a local"):
        list(iter_records("org/some-data", "train", "data.train"))
    assert constants.HF_HUB_OFFLINE is True and time.monotonic() - started < 5
