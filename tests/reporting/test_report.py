"""`tunekit report`: the page's tables and embedded curves come from what the runs wrote; the page renders
in a real headless browser (Chromium) with every plot drawn and no console error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import history, reverse_rows, run_cli, tiny_recipe, write_jsonl, write_recipe
from tunekit.config import recipefile
from tunekit.evaluation import evaluator
from tunekit.reporting import report
from tunekit.runs.layout import RunRecord
from tunekit.training import runner

BASELINE = {"bleu": 1.25, "chrf": 10.5, "rougeL": 3.0, "exact_match": 0.0, "examples": 6}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_model):
    """Two runs of the tiny model at different learning rates, each with an end-of-training eval, and a
    base-model eval's metrics.json as the baseline."""
    root = tmp_path_factory.mktemp("report")
    data = write_jsonl(root / "train.jsonl", reverse_rows(32))
    for name, lr in (("fast", 1e-2), ("slow", 2e-3)):
        raw = tiny_recipe(tiny_model, data, root / name, training={
            "max_steps": 8, "eval_steps": 4, "learning_rate": lr, "metric_for_best": "eval_loss"},
            eval={"limit": 4, "batch_size": 2, "max_new_tokens": 6})
        raw["data"]["eval"] = str(data)
        recipe = recipefile.load(write_recipe(root / f"{name}.yaml", raw))
        runner.run(recipe)
        evaluator.end_of_training(recipe, root / name)
    (root / "base").mkdir()
    (root / "base" / "metrics.json").write_text(json.dumps({"scores": BASELINE}))
    out = report.write([root / "fast", root / "slow"], root / "compare.html", root / "base")
    return root, out


def embedded(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_marked_diff_strikes_missing_words_and_marks_added_ones():
    ref, pred = report.marked_diff("the cat sat <here>", "the dog sat <here> down")
    assert ref == "the <del>cat</del> sat &lt;here&gt;"
    assert pred == "the <ins>dog</ins> sat &lt;here&gt; <ins>down</ins>"


@pytest.mark.slow
def test_page_holds_both_runs_curves_scores_and_the_before_after_table(two_runs):
    root, out = two_runs
    page = out.read_text()
    data = embedded(page)
    assert [r["name"] for r in data["runs"]] == ["fast", "slow"]
    for run in data["runs"]:
        rows = history(root / run["name"])
        assert run["series"]["loss"] == [[r["step"], r["loss"]] for r in rows if "loss" in r]
        assert [p[0] for p in run["series"]["eval_loss"]] == [4, 8]
        assert [p[0] for p in run["series"]["eval_chrf"]] == [4, 8]
        assert all(p[1] > 0 for p in run["series"]["examples_per_s"])
        best = RunRecord.load(root / run["name"]).best
        assert run["best"] == best["step"]
    keys = [k for k, _ in data["curves"]]
    assert keys[:5] == ["loss", "eval_loss", "learning_rate", "grad_norm", "examples_per_s"] and "eval_bleu" in keys
    # before/after: the change column is each run's end-of-training score minus the baseline's
    table = page.split('<table class="before-after">')[1].split("</table>")[0]
    chrf_row = next(r for r in table.split("<tr>") if r.startswith("<td>chrF"))
    fast = json.loads((root / "fast" / "eval" / "metrics.json").read_text())["scores"]["chrf"]
    assert f"{fast - BASELINE['chrf']:+.2f}" in chrf_row
    # predictions beside references, first rows of eval/predictions.jsonl, differences marked
    first = json.loads((root / "fast" / "eval" / "predictions.jsonl").read_text().splitlines()[0])
    assert report.marked_diff(first["reference"], first["prediction"])[0] in page
    assert "<del>" in page or "<ins>" in page
    # the data section: each run's split and contamination report as run.json has them (these runs hold out
    # their own training file, so every eval example is in the training data)
    found = RunRecord.load(root / "fast").data["contamination"]
    assert found["eval_exact"] == found["eval_examples"] == 32 and found["duplicates"] > 0
    table = page.split('<table class="data">')[1].split("</table>")[0]
    fast_row = next(r for r in table.split("<tr>") if r.startswith("<td>fast"))
    assert f"<td>{found['duplicates']}</td><td>32</td>" in fast_row and "(data.eval)" in fast_row
    # self-contained: nothing is fetched
    assert not re.search(r'\b(src|href)=', page)


@pytest.mark.slow
def test_bad_report_requests_are_one_line(tmp_path, two_runs):
    root, out = two_runs
    cases = [
        (["report", str(tmp_path)], "is not a run directory"),
        (["report", str(root / "fast"), str(root / "slow")], "several runs need --out FILE.html"),
        (["report", str(root / "fast"), "--out", str(out)], "exists; add --force"),
        (["report", str(root / "fast"), "--baseline", str(tmp_path)], "--baseline"),
    ]
    for args, expected in cases:
        res = run_cli(*args)
        assert res.returncode == 2 and expected in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1


def chromium() -> str:
    """Chromium from the distribution's packages, installed when missing and possible."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=600)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("Chromium is not installed and cannot be installed here (apt-get install chromium, as root)")
    return found


BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
                 "--v=0"]


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium_with_every_plot_drawn(two_runs):
    root, out = two_runs
    browser = chromium()
    done = subprocess.run([browser, *BROWSER_FLAGS, "--dump-dom", out.as_uri()], capture_output=True, text=True,
                          timeout=120)
    dom = done.stdout
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []  # no error, no message at all
    assert 'data-report="ready"' in dom and "data-errors" not in dom
    curves = embedded(out.read_text())["curves"]
    assert f'data-plots="{len(curves)}"' in dom
    for key, _ in curves:  # one drawn line per run in every plot
        plot = dom.split(f'data-key="{key}"')[1].split('class="plot"')[0]
        assert plot.count('class="series"') == 2, key
    shot = root / "report.png"
    subprocess.run([browser, *BROWSER_FLAGS, "--window-size=1280,1800", f"--screenshot={shot}", out.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


@pytest.mark.slow
def test_a_broken_page_is_caught(tmp_path, two_runs):
    """The browser check can fail: a script error on the page is reported by the page itself."""
    root, out = two_runs
    broken = tmp_path / "broken.html"
    broken.write_text(out.read_text().replace("const data = JSON.parse", "const data = JSON.parze"))
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("Chromium is not installed")
    done = subprocess.run([chromium(), *BROWSER_FLAGS, "--dump-dom", broken.as_uri()], capture_output=True,
                          text=True, timeout=120)
    assert 'data-report="ready"' not in done.stdout and "Uncaught TypeError" in done.stderr
