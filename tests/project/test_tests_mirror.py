"""Tests mirror the packages: the tests of src/tunekit/<package>/<module>.py are under tests/<package>/ (whole
commands under tests/e2e/, the repository's own rules under tests/project/, the benchmarks' under tests/bench/).
Every module is imported by some test file, or is named in THROUGH with the test that covers it through a
command or another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE, TESTS = ROOT / "src" / "tunekit", ROOT / "tests"
FOLDERS = {"e2e", "project", "bench"}  # beside one folder per package
# module -> the test that covers it without importing it (through the CLI, the API package or another module)
THROUGH = {
    "tunekit.__main__": "tests/cli/test_bad_input.py::test_bad_argument",
    "tunekit.api.artifacts": "tests/api/test_python_api.py::test_train_evaluate_and_merge_in_process",
    "tunekit.api.pipeline": "tests/api/test_python_api.py::test_train_evaluate_and_merge_in_process",
    "tunekit.api.previews": "tests/api/test_python_api.py::test_plan_returns_the_plan",
    "tunekit.api.recipeargs": "tests/api/test_python_api.py::test_a_recipe_is_a_path_a_dict_or_a_recipe_with_list_or_"
                              "dict_overrides",
    "tunekit.cli.argtypes": "tests/cli/test_bad_input.py::test_bad_argument",
    "tunekit.cli.demo": "tests/e2e/test_e2e_smollm2.py::test_demo_pipeline_shows_a_clear_gain",
    "tunekit.config.modelsource": "tests/models/test_hub.py::test_every_command_names_an_uncached_model_in_one_line_"
                                  "when_offline",
    "tunekit.config.section": "tests/config/test_recipe.py::test_overrides_set_any_field_and_are_validated",
    "tunekit.tooluse.records": "tests/data/test_agent_data.py::test_contradicting_agent_records_are_refused_before_any_"
                          "weight_loads",
    "tunekit.evaluation.preference": "tests/training/test_preference.py::test_a_base_model_that_prefers_the_rejected_"
                                     "answers_scores_low",
    "tunekit.export.license": "tests/export/test_export.py::test_a_run_is_merged_on_the_fly_and_its_facts_are_recorded",
    "tunekit.export.llamacpp": "tests/export/test_export.py::test_k_quants_are_written_by_llama_cpp_and_pass_their_"
                               "tolerance",
    "tunekit.export.modelfile": "tests/export/test_push.py::test_a_gguf_file_arrives_with_its_modelfile",
    "tunekit.models.ggufread": "tests/e2e/test_e2e_smollm2.py::test_demo_pipeline_shows_a_clear_gain",
    "tunekit.models.hubclient": "tests/export/test_push.py::test_an_adapter_arrives_whole_in_one_commit_with_its_card_"
                                "and_curves",
    "tunekit.plan.sharding": "tests/plan/test_plan.py::test_fsdp2_terms_match_torchs_memory_tracker",
    "tunekit.reporting.listing": "tests/reporting/test_runlist.py::test_lists_every_run_with_status_steps_scores_wall_"
                                 "time_and_output",
    "tunekit.training.checkpointmark": "tests/e2e/test_faults.py::test_resume_ignores_a_half_written_checkpoint",
    "tunekit.training.cpuprocesses": "tests/e2e/test_multiprocess.py::test_fsdp2_equals_one_process_and_writes_no_"
                                     "pickles",
    "tunekit.training.checkpointdeepspeed": "tests/e2e/test_multiprocess.py::test_deepspeed_checkpoints_are_"
                                            "safetensors_and_resume_exactly",
    "tunekit.training.checkpointfsdp": "tests/e2e/test_multiprocess.py::test_fsdp2_resumes_on_one_process_after_a_kill",
    "tunekit.training.losshistory": "tests/training/test_train.py::test_run_directory_contents_and_no_overwrite_"
                                    "without_force",
    "tunekit.training.methods.base": "tests/training/test_methods.py::test_a_registered_method_is_a_training_method_"
                                     "with_its_section",
    "tunekit.training.methods.dpo": "tests/training/test_preference.py::test_dpo_learns_the_preference_against_the_"
                                    "adapter_off_base",
    "tunekit.training.methods.grpo": "tests/training/test_grpo.py::test_a_run_logs_each_reward_the_kl_and_"
                                     "completion_length",
    "tunekit.training.methods.kto": "tests/training/test_preference.py::test_kto_learns_desirable_completions_from_"
                                    "unpaired_labels",
    "tunekit.training.methods.orpo": "tests/training/test_preference.py::test_orpo_learns_the_preference_without_a_"
                                     "reference",
    "tunekit.training.methods.reward": "tests/training/test_reward_model.py::test_training_lowers_the_loss_and_"
                                       "raises_held_out_pair_accuracy",
    "tunekit.training.methods.sft": "tests/training/test_train.py::test_lora_lowers_loss_and_leaves_base_weights_"
                                    "unchanged",
    "tunekit.training.runrecord": "tests/training/test_train.py::test_run_directory_contents_and_no_overwrite_"
                                  "without_force",
    "tunekit.training.sequencepieces": "tests/e2e/test_parallel_runs.py::test_sequence_parallel_resumes_to_the_"
                                       "uninterrupted_run",
    "tunekit.training.trackers": "tests/training/test_trackers.py::test_tensorboard_event_files_hold_the_metrics_and_"
                                "the_recipe",
    "tunekit.training.trainers.reference": "tests/training/test_preference.py::test_dpo_learns_the_preference_"
                                           "against_the_adapter_off_base",
}


def modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found.add(".".join(("tunekit", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return found


def imported_by(path: Path, known: set[str]) -> set[str]:
    """tunekit modules a file imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunekit"):
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & known


def test_every_test_file_sits_in_its_packages_folder():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    wrong = [str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py")
             if len(p.relative_to(TESTS).parts) != 2 or p.parent.name not in packages | FOLDERS]
    assert not wrong, f"test files outside tests/<package>/: {wrong}"


def test_every_module_is_imported_by_a_test_or_named_with_the_test_that_covers_it():
    known = modules()
    tested = set().union(*(imported_by(p, known) for p in TESTS.rglob("*.py")))
    missing = sorted(known - tested - set(THROUGH) - {"tunekit"})
    assert not missing, f"modules no test imports and THROUGH does not name: {missing}"
    stale = sorted(m for m in THROUGH if m not in known or m in tested)
    assert not stale, f"THROUGH names modules that are gone or that a test imports now: {stale}"


def test_each_covering_test_exists():
    for module, where in THROUGH.items():
        file, _, name = where.partition("::")
        path = ROOT / file
        assert path.is_file(), (module, where)
        if name:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body), (module, where)
