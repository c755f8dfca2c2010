"""The report's expert-load table (reporting.expertload) from a run's expert-load file."""

from __future__ import annotations

from tunekit.reporting import expertload


def test_the_table_shows_each_router_at_the_first_and_last_evaluation(tmp_path):
    evaluations = [{"step": 3, "top_k": 2, "layers": {"model.layers.0.mlp.gate": [4, 4, 4, 4]}},
                   {"step": 6, "top_k": 2, "layers": {"model.layers.0.mlp.gate": [8, 8, 0, 0]}}]
    assert expertload.rows(evaluations) == [["model.layers.0.mlp.gate", "4", "8", "1.00 / 0", "2.00 / 2"]]
    assert expertload.headers(evaluations)[-1].endswith("(step 6)")
    assert "4 / 2 (experts / top-k)" in expertload.note(evaluations)
    assert expertload.rows([]) == [] and expertload.read(tmp_path) == []
