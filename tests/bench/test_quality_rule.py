"""bench/quality.py's rule for keeping or changing a default, and bench/confirmdata.py's readers of the confirming
tasks' Debian sources (troff man pages, dictd dictionaries, changelog entries)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import confirmdata  # noqa: E402
import quality  # noqa: E402


def rows(scores: dict[str, dict[str, list[float]]]) -> dict:
    """Results by (task, arm) with the given headline scores, one row a seed."""
    return {(task, arm): [{"scores": {quality.TASKS[task][2]: v}} for v in values]
            for task, arms in scores.items() for arm, values in arms.items()}


def every_task(default, other, script=(10.0, 11.0, 12.0)) -> dict:
    return {t: {"defaults": list(default), "no-rslora": list(other), "script": list(script)}
            for t in quality.DECIDING + quality.CONFIRMING}


def test_a_default_higher_on_most_tasks_and_within_noise_everywhere_stays():
    scores = every_task((12.0, 12.5, 13.0), (11.0, 11.5, 12.0))
    scores["closes"]["defaults"] = [11.0, 11.2, 11.4]  # lower, by less than the script's seed sd (1.0)
    holds, lines = quality.verdict(rows(scores), "defaults", "no-rslora")
    assert holds is True
    assert lines[-1].endswith("stays") and "higher on 6 of 7 tasks" in lines[-1]


def test_worse_beyond_noise_on_one_confirming_task_is_enough_to_lose():
    scores = every_task((12.0, 12.5, 13.0), (11.0, 11.5, 12.0))
    scores["manpage"]["defaults"] = [9.0, 9.5, 10.0]  # 2 below, the noise 1
    holds, lines = quality.verdict(rows(scores), "defaults", "no-rslora")
    assert holds is False
    assert any(line.startswith("manpage (confirming)") and "worse beyond noise" in line for line in lines)


def test_higher_on_too_few_tasks_does_not_hold():
    scores = every_task((11.0, 11.5, 12.0), (11.0, 11.5, 12.0))  # equal: higher on none
    assert quality.verdict(rows(scores), "defaults", "no-rslora")[0] is False


def test_the_rule_waits_for_three_seeds_of_each_arm():
    scores = every_task((12.0, 12.5, 13.0), (11.0, 11.5, 12.0))
    scores["translate-fr"]["script"] = [10.0, 11.0]
    holds, lines = quality.verdict(rows(scores), "defaults", "no-rslora")
    assert holds is None and lines == ["translate-fr: seeds 3 / 3 / 2 (defaults / no-rslora / script); the rule needs "
                                       "3 of each"]


@pytest.mark.parametrize("library_holds", [False, True])
def test_a_candidate_that_does_not_hold_leaves_the_librarys_value(library_holds):
    scores = every_task((12.0, 12.5, 13.0), (11.0, 11.5, 12.0))
    scores["manpage"]["defaults"] = [9.0, 9.5, 10.0]  # the candidate: higher on 6 of 7, worse beyond noise on one
    if library_holds:
        for task in quality.DECIDING + quality.CONFIRMING:
            scores[task]["no-rslora"] = [13.0, 13.5, 14.0]
    chosen, lines = quality.decision(rows(scores), "defaults", "no-rslora")
    assert chosen == "no-rslora"
    assert lines[-1] == "default: no-rslora (" + ("the library's holds" if library_holds else "neither holds") + ")"
    scores["manpage"]["defaults"] = [12.0, 12.5, 13.0]
    if not library_holds:
        assert quality.decision(rows(scores), "defaults", "no-rslora")[0] == "defaults"


def test_the_side_by_side_table_puts_deciding_columns_before_confirming_ones():
    scores = every_task((12.0, 13.0, 14.0), (11.0, 11.5, 12.0))
    del scores["closes"]["no-rslora"]
    lines = quality.side_by_side(rows(scores), ["defaults", "no-rslora"]).splitlines()
    assert lines[0].startswith("| arm | deciding: translate (chrf) |") and lines[0].endswith("confirming: closes "
                                                                                        "(exact_match) |")
    assert lines[2] == "| defaults |" + " 13.00 ± 1.00 (3) |" * 7
    assert lines[3].endswith("| 11.50 ± 0.50 (3) | - |")


PRINTF = r""".\" Copyright notice
.TH printf 3 2023-02-05 "Linux man-pages 6.03"
.SH NAME
printf, fprintf \- formatted output conversion
.SH SYNOPSIS
.nf
.B #include <stdio.h>
.fi
.SH DESCRIPTION
The functions in the
.BR printf ()
family produce output according to a
.I format
as described below.
.PP
The function
.BR dprintf ()
is the same as
.BR fprintf ().
"""


def test_a_man_page_reads_as_sections_of_plain_paragraphs():
    page = confirmdata.man_sections(PRINTF)
    assert page["NAME"] == ["printf, fprintf - formatted output conversion"]
    assert page["DESCRIPTION"] == ["The functions in the printf() family produce output according to a format as "
                                   "described below.", "The function dprintf() is the same as fprintf()."]


def test_dictd_numbers_are_base_64_most_significant_first():
    assert [confirmdata._dictd_number(x) for x in ("A", "B", "/", "BA", "Bz")] == [0, 1, 63, 64, 115]


def test_the_bugs_an_upload_closes_follow_debians_rule():
    entry = ("bash (5.2-3) unstable; urgency=medium\n\n  * Repack. Closes: #1024598.\n  * d/copyright: convert.\n"
             "    closes: #1024602, #1021082\n  * Again closes: #1024598\n\n -- M K <m@k.org>  Mon, 02 Jan 2023")
    assert confirmdata.closed_bugs(entry) == ["1024598", "1024602", "1021082"]
    assert confirmdata.closed_bugs("  * New upstream release (bug #99 is not closed here).") == []


@pytest.mark.slow
@pytest.mark.skipif(bool(confirmdata.missing()), reason="the confirming tasks' packages are not installed "
                    f"(apt-get install {confirmdata.PACKAGES})")
def test_each_confirming_task_builds_hundreds_of_examples_with_answers():
    for name, build in confirmdata.SETS.items():
        built = build()
        assert len(built) >= 500, name
        answers = [r["messages"][1]["content"] if "messages" in r else r["output"] for r in built]
        assert all(a.strip() for a in answers), name
    closes = [r["output"] for r in confirmdata.closes_rows()]
    assert 0.2 < closes.count("none") / len(closes) < 0.8  # both kinds of answer
