"""The records of `make test-full` style runs (tests/*-last-run.json, written by --record-run in tests/conftest.py)
name commands that run as written today: every path the command names exists, a -k or -m expression is one
quoted word, and every test the record lists is a test function of the file it names. A test moved or renamed
since its record fails here until the record says where it is now."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDS = sorted((ROOT / "tests").glob("*-last-run.json"))
VALUED = {"-k", "-m", "-n", "-p", "-W", "-o", "--dist", "--maxfail", "--timeout"}  # their value is the next word


def test_there_are_run_records():
    assert (ROOT / "tests" / "test-full-last-run.json") in RECORDS


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.name)
def test_a_run_record_names_paths_and_tests_that_exist_today(record):
    data = json.loads(record.read_text(encoding="utf-8"))
    words = shlex.split(data["command"])
    assert words[0] == "pytest", data["command"]
    paths, value_next = [], False
    for word in words[1:]:
        if value_next:
            value_next = False
        elif word in VALUED:
            value_next = True
        elif not word.startswith("-"):
            paths.append(word)
    missing = [p for p in paths if not (ROOT / p.split("::")[0]).exists()]
    assert paths and not missing, f"{record.name}: {data['command']!r} names {missing}, which do not exist"
    for node in data["seconds_per_test"]:
        path, *names = node.split("::")
        source = ROOT / path
        function = names[-1].split("[")[0]
        assert source.is_file() and re.search(rf"\bdef {re.escape(function)}\(", source.read_text(encoding="utf-8")), (
            f"{record.name}: {node} is not a test in {path}")
