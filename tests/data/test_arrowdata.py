"""Prepared data: Arrow tables cached by fingerprint, built once across processes, bad rows named."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from conftest import reverse_rows, write_jsonl
from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data import arrow


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "cache"))


def test_second_build_reads_the_cache_and_gives_the_same_data(tmp_path, tiny_tokenizer, caplog):
    cfg = DataConfig(train=str(write_jsonl(tmp_path / "d.jsonl", reverse_rows(40))), eval_fraction=0.25)
    with caplog.at_level(logging.INFO, logger="tunekit"):
        first = arrow.build(cfg, tiny_tokenizer, seed=1)
        assert "prepared and cached" in caplog.text and "read from the cache" not in caplog.text
        caplog.clear()
        second = arrow.build(cfg, tiny_tokenizer, seed=1)
        assert "read from the cache" in caplog.text
    assert first.train.to_dict() == second.train.to_dict() and first.eval.to_dict() == second.eval.to_dict()
    assert vars(first.train_stats) == vars(second.train_stats) and len(first.eval) == 10
    assert [r.reference for r in first.eval_rendered] == [r.reference for r in second.eval_rendered]
    assert sorted(first.train.column_names) == ["input_ids", "labels"]


def test_the_fingerprint_follows_data_tokenizer_settings_and_seed(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    cfg = DataConfig(train=str(path))
    key = arrow.fingerprint(cfg, tiny_tokenizer, 0)
    assert key == arrow.fingerprint(DataConfig(train=str(path)), tiny_tokenizer, 0)
    assert key != arrow.fingerprint(cfg.model_copy(update={"max_length": 32}), tiny_tokenizer, 0)
    assert key != arrow.fingerprint(cfg, tiny_tokenizer, 1)
    other = type(tiny_tokenizer).from_pretrained(tiny_tokenizer.name_or_path)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert key != arrow.fingerprint(cfg, other, 0)
    write_jsonl(path, reverse_rows(9))  # same path, new content
    assert key != arrow.fingerprint(cfg, tiny_tokenizer, 0)
    assert arrow.fingerprint(DataConfig(train="someone/hub-dataset"), tiny_tokenizer, 0) is None


@pytest.mark.parametrize("num_proc", [None, 2])
def test_a_bad_row_is_named_by_file_and_line_in_worker_processes_too(tmp_path, tiny_tokenizer, num_proc):
    rows = reverse_rows(60)
    rows[56] = {"instruction": "x", "answer": "no output field"}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(TunekitError, match=rf"{path} line 57: missing field 'output'"):
        arrow.build(DataConfig(train=str(path)), tiny_tokenizer, 0, num_proc=num_proc)
    assert not list((tmp_path / "cache" / "data").glob("*.partial")) and \
        not [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.endswith(".lock")]


def test_parallel_tokenization_equals_serial(tmp_path, tiny_tokenizer, monkeypatch):
    cfg = DataConfig(train=str(write_jsonl(tmp_path / "d.jsonl", reverse_rows(50))))
    serial = arrow.build(cfg, tiny_tokenizer, 0, num_proc=None)
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "other-cache"))
    parallel = arrow.build(cfg, tiny_tokenizer, 0, num_proc=2)
    assert serial.train.to_dict() == parallel.train.to_dict()


BUILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from transformers import AutoTokenizer
from tunekit.data import arrow
from tunekit.config.schema import DataConfig
bundle = arrow.build(DataConfig(train=sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[2]), 0)
print(len(bundle.train))
"""


@pytest.mark.slow  # seconds: make test-fast leaves it out
def test_concurrent_processes_prepare_once_and_share(tmp_path, tiny_model):
    """As the ranks of a multi-process run do: one prepares, the other waits and reads the cache."""
    path = write_jsonl(tmp_path / "d.jsonl", reverse_rows(3000))
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(path), str(tiny_model)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    logs = "".join(err for _, err in outs)
    assert logs.count("prepared and cached") == 1 and logs.count("read from the cache") == 1
    assert [out.strip() for out, _ in outs] == ["3000", "3000"]
