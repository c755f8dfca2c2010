"""Command line: parse argv, call one library function per verb, turn known errors into one line.

Heavy libraries are imported inside the verbs so that `tunekit --help` stays instant."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import signal
import sys

from tunekit.cli import argtypes
from tunekit.core.errors import TunekitError
from tunekit.core.version import VERSION as __version__


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (usage is one `--help` away) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=argtypes.override,
                   help="override a recipe field by dotted key, e.g. --set training.learning_rate=1e-4 (repeatable)")


def say_defaults(recipe) -> None:
    """The measured defaults the recipe takes, and how an automatic learning rate will be found."""
    from tunekit.config import defaults

    log = logging.getLogger("tunekit")
    for line in defaults.applied(recipe):
        log.info("%s", line)
    if recipe.training.learning_rate == "auto" and "learning_rate" in recipe.training.model_fields_set:
        log.info("training.learning_rate: auto (a range test of %d steps on the training data picks it before "
                 "training)", recipe.training.lr_range_test_steps)


def cmd_validate(a) -> int:
    from tunekit import api

    # torch-free unless the recipe names a DeepSpeed config: a model or data set that cannot be had here is named
    # in a warning, not refused
    result = api.validate(a.recipe, a.overrides, a.world_size)
    print(result.yaml, end="")
    say_defaults(result.recipe)
    if result.deepspeed is not None:
        import json

        print(f"# DeepSpeed config for world size {result.world_size}, precision {result.precision}")
        print(json.dumps(result.deepspeed, indent=2))
    return 0


def cmd_train(a) -> int:
    from tunekit import api

    return api.train(a.recipe, a.overrides, force=a.force, resume=a.resume, argv=sys.argv[1:]).exit_code


def cmd_merge(a) -> int:
    from tunekit import api

    api.merge(a.run_dir, a.out, a.dtype, a.force, a.tolerance)
    return 0


def cmd_export(a) -> int:
    from tunekit import api

    api.export(a.target, a.format, a.quant, a.dtype, a.out, a.force)
    return 0


def cmd_eval(a) -> int:
    from tunekit import api

    if a.benchmarks is not None:
        for flag, value in (("--recipe", a.recipe), ("--data", a.data), ("--max-new-tokens", a.max_new_tokens)):
            if value is not None:
                raise TunekitError(f"{flag} does not apply to --benchmarks (each task brings its own data and "
                                   "prompts); leave it out")
        bench = api.benchmark(a.target, a.benchmarks, a.compare, a.out, a.num_fewshot, a.limit,
                              a.seed or 0, a.batch_size, a.dtype, a.force)
        print(bench.text())
        return 0
    for flag, value in (("--num-fewshot", a.num_fewshot), ("--seed", a.seed)):
        if value is not None:
            raise TunekitError(f"{flag} applies to --benchmarks only; add --benchmarks TASKS or leave it out")
    result = api.evaluate(a.target, a.recipe, a.data, a.compare, a.out, a.limit, a.batch_size, a.max_new_tokens,
                          a.dtype, a.force)
    print(result.table())
    return 0


def cmd_plan(a) -> int:
    from tunekit import api

    result = api.plan(a.recipe, a.overrides, a.world_size, a.gpu_memory, a.peak_tflops, a.utilization,
                      a.memory_bandwidth, a.model_config)
    print(result.to_json() if a.json else result.report())
    return 0


def cmd_data(a) -> int:
    from tunekit import api
    from tunekit.reporting import dataview

    result = api.data(a.recipe, a.overrides, a.show)
    print(result.json_lines() if a.json else result.text(dataview.colour_wanted()), end="")
    return 0


def cmd_runs(a) -> int:
    from pathlib import Path

    from tunekit.reporting import listing

    rows = listing.collect(Path(a.dir))
    if not rows:
        print(f"no runs under {a.dir} (a run is a directory holding run.json)")
        return 0
    print(listing.table(listing.sort(rows, a.sort) if a.sort else rows))
    return 0


def cmd_report(a) -> int:
    from pathlib import Path

    from tunekit.reporting import report

    out = report.write([Path(d) for d in a.runs], Path(a.out) if a.out else None,
                       Path(a.baseline) if a.baseline else None, a.force)
    print(f"report written to {out}")
    return 0


def cmd_push(a) -> int:
    from tunekit import api  # imports no torch: a LoRA run is merged (--what merged) only once all is checked

    pushed = api.push(a.target, a.repo, a.what, a.private, a.revision, a.force, a.baseline, a.base_model)
    print(f"pushed to {pushed.url}")
    return 0


def _validate_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--world-size", type=argtypes.positive_int, metavar="N",
                   help="also print the DeepSpeed config resolved for N processes, and refuse training.parallelism "
                        "sizes that do not divide N")


def _train_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in output_dir from its newest complete checkpoint")


def _plan_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--world-size", type=argtypes.positive_int, metavar="N",
                   help="number of devices (default 1; under training.parallelism, the fewest its sizes run on); "
                        "training.parallelism's tp x sp x cp must divide it, as at launch")
    p.add_argument("--gpu-memory", type=argtypes.size, metavar="SIZE",
                   help="memory per device, e.g. 24GiB: prints a verdict and fixes")
    p.add_argument("--peak-tflops", type=argtypes.positive_float, default=989.0,
                   help="peak TFLOP/s per device (default: H100 bf16)")
    p.add_argument("--utilization", type=argtypes.fraction, default=0.4,
                   help="fraction of peak the matmuls reach (default 0.4, an assumption for steps bound by their "
                        "matmuls; see docs/plan.md, Step time)")
    p.add_argument("--memory-bandwidth", type=argtypes.positive_float, metavar="GB_PER_S",
                   help="GB/s the elementwise work (activations, casts, dropout, the optimizer) reaches, for a CPU: "
                        "the step is then the matmuls plus that work (default: a GPU's step, the longer of the "
                        "matmuls and the host's work fitted to measured GPU runs; see docs/plan.md)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--model-config", metavar="FILE",
                   help="the model's config.json, for a model not downloaded here (without it: the model's own "
                        "config, else tunekit's copy for well-known models: Llama 3.x, Qwen2.5, Qwen3, Mistral 7B, "
                        "Gemma 2/3)")


def _data_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--show", type=argtypes.non_negative_int, default=3, metavar="N",
                   help="examples shown with their trained tokens marked (default 3; 0: counts only)")
    p.add_argument("--json", action="store_true",
                   help="JSON lines: a summary, then one line per shown example with its trained and untrained "
                        "segments")


def _merge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory written by `tunekit train`")
    p.add_argument("--out", help="output directory (default: RUN_DIR/merged)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="saved dtype (default: the base model's)")
    p.add_argument("--tolerance", type=argtypes.positive_float, default=1e-3,
                   help="largest max |logit difference| between adapter and merged model accepted (default 1e-3)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")


def _export_args(p: argparse.ArgumentParser) -> None:
    """--format and each format's own options, from the registry (export.writers.FORMATS)."""
    from tunekit.export.writers import FORMATS, all_options

    p.add_argument("target", help="run directory (merged on the fly), merged directory, or base model")
    p.add_argument("--format", choices=list(FORMATS), default="gguf",
                   help="; ".join(f"{f.name}: {f.help}" for f in FORMATS.values()) + " (default gguf)")
    for option in all_options().values():
        formats = [f.name for f in FORMATS.values() if option in f.options]
        p.add_argument(option.flag, choices=list(option.choices), help=f"{'/'.join(formats)}: {option.help}")
    p.add_argument("--out", help="file (gguf) or directory (safetensors) to write (default: NAME-QUANT.gguf or "
                                 "NAME-safetensors in the run or merged directory, or the current directory for a "
                                 "base model)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")


def _push_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="run directory, merged directory (tunekit merge) or .gguf file (tunekit export)")
    p.add_argument("--repo", required=True, metavar="OWNER/NAME", help="the Hugging Face Hub model repo to push to")
    from tunekit.export.writers import whats

    p.add_argument("--what", choices=whats(),
                   help="adapter: a LoRA/QLoRA run's adapter; merged: the merged weights (a LoRA run is merged first, "
                        "as tunekit merge does); gguf (or another pushable export format): the file tunekit "
                        "export wrote and its Modelfile (default: adapter for a LoRA/QLoRA run, merged for a full "
                        "fine-tuning run or merged directory, a file's own format for a file)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", metavar="BRANCH", help="commit to this branch (created from main when missing)")
    p.add_argument("--force", action="store_true",
                   help="push to a repo that exists: its files are replaced by this upload, in one commit")
    p.add_argument("--baseline", metavar="EVAL_DIR",
                   help="a `tunekit eval` of the base model (its --out directory): the card's before/after table")
    p.add_argument("--base-model", metavar="OWNER/NAME",
                   help="the base model's hub id, where the run names it by a local path or GGUF file: written in the "
                        "card and the adapter's adapter_config.json")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="run directory, merged directory, or base model (hub id, directory, GGUF)")
    p.add_argument("--recipe", help="recipe whose data and prompt settings a base-model target uses")
    p.add_argument("--data", help="eval file (default: the recipe's eval data)")
    p.add_argument("--limit", type=argtypes.positive_int, help="score only the first N examples")
    p.add_argument("--batch-size", type=argtypes.positive_int, help="prompts per generate() call")
    p.add_argument("--max-new-tokens", type=argtypes.positive_int, help="generation length cap")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="model dtype for eval (auto: bf16/fp16 on GPU, fp32 on CPU)")
    p.add_argument("--compare", metavar="OTHER_TARGET", help="evaluate a second target and print both side by side "
                   "(with --benchmarks: `base` is the run's own base model)")
    p.add_argument("--out", help="output directory for metrics.json and predictions.jsonl (benchmarks.json)")
    p.add_argument("--benchmarks", metavar="TASK[,TASK...]",
                   help="standard benchmarks through lm-evaluation-harness in place of the held-out eval: lm-eval task "
                        "names or paths to local task YAML (pip install 'tunekit[benchmarks]')")
    p.add_argument("--num-fewshot", type=argtypes.non_negative_int,
                   help="with --benchmarks: examples shown before each question (default: each task's own)")
    p.add_argument("--seed", type=argtypes.non_negative_int, help="with --benchmarks: lm-eval's seeds (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")


def cmd_chat(a) -> int:
    from tunekit.evaluation import conversation  # imports no torch: a missing run is one line before loading

    conversation.chat(a.target, a.recipe, a.once, a.system, a.max_new_tokens, a.dtype, images=a.image)
    return 0


def _chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="run directory, merged directory, or base model (hub id, directory, GGUF)")
    p.add_argument("--once", metavar="TEXT", help="send one message, print the answer and exit (for scripts)")
    p.add_argument("--image", metavar="PATH", action="append",
                   help="an image sent with --once (repeat for more; vision-language models)")
    p.add_argument("--system", metavar="TEXT", help="system message (default: the recipe's data.system_prompt)")
    p.add_argument("--max-new-tokens", type=argtypes.positive_int,
                   help="answer length cap (default: the recipe's eval.max_new_tokens, else 64)")
    p.add_argument("--recipe", help="recipe whose prompt settings a base-model target uses (default: its chat "
                                    "template, else the bare text)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="model dtype, as for eval (auto: bf16/fp16 on GPU, fp32 on CPU)")


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("torchrun_options_and_command", nargs="*", metavar="...",
                   help="torchrun's options (--nnodes, --nproc-per-node, --node-rank, --rdzv-endpoint HOST:PORT, "
                        "--rdzv-conf join_timeout=S, ...), then a tunekit command: train RECIPE [--set ...]")


def cmd_launch(a) -> int:
    from tunekit.cli import launch

    def check_command(argv: list[str], world: int | None) -> None:
        """The launched command's arguments, and a training recipe's checks (training.parallelism's sizes against
        the launch's processes, where their number is fixed), before any process starts."""
        command = build_parser().parse_args(argv)  # a wrong verb or option: one line, exit 2
        if command.func is cmd_train:
            from tunekit import api
            from tunekit.api import checks

            validated = api.validate(command.recipe, command.overrides)
            if world is not None:
                checks.world(validated.recipe, world, "--nnodes x --nproc-per-node")

    return launch.main(a.torchrun_options_and_command, check_command)


def cmd_init(a) -> int:
    from tunekit import api
    from tunekit.plan import fitrecipe

    out, fitted, target = fitrecipe.write(a.model, a.data, a.target, a.out, a.tokens_per_step, a.force)
    print(f"wrote {out}: {fitted.choice.label}, micro-batch {fitted.micro}, accumulation "
          f"{fitted.raw['training']['gradient_accumulation_steps']}; the plan:")
    print(api.plan(out, world_size=target.world, gpu_memory=fitted.budget).report())
    return 0


def _init_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="hub id, model directory or GGUF file")
    p.add_argument("--data", required=True, help="training data file (.jsonl, .json, .csv, .parquet)")
    p.add_argument("--target", required=True, help="cpu, the memory of one GPU (24GiB), GPUs x memory (8x80GiB) or "
                   "nodes x GPUs x memory (2x8x80GiB)")
    p.add_argument("--tokens-per-step", type=argtypes.positive_int, default=65536,
                   help="tokens per optimizer step the accumulation aims at (default %(default)s)")
    p.add_argument("--out", help="recipe file to write (default: MODEL-TARGET.yaml here, e.g. "
                   "Llama-3.1-8B-Instruct-24GiB.yaml)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")


def cmd_recipes(a) -> int:
    from pathlib import Path

    from tunekit.config import shipped

    if a.names:
        for path in shipped.copy_out(a.names, Path(a.out), a.force):
            print(f"copied {path}")
        return 0
    width = max(len(p.name) for p in shipped.recipes())
    print(f"shipped recipes ({shipped.HOME / 'recipes'}):")
    print("\n".join(f"  {p.name:<{width}}  {shipped.summary(p)}" for p in shipped.recipes()))
    print(f"configs ({shipped.HOME / 'ds_configs'}): " + ", ".join(map(shipped.name_of, shipped.configs())))
    print("copy one out: tunekit recipes NAME [--out DIR]; a copy runs from any directory: its recipes/... and "
          "ds_configs/... paths resolve to the shipped files")
    return 0


def _recipes_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME", help="shipped recipes or configs to copy out "
                   "(smollm2_lora.yaml, zero3.json, accelerate/fsdp2.yaml); none: list them")
    p.add_argument("--out", default=".", help="directory to copy into (default: the current one)")
    p.add_argument("--force", action="store_true", help="replace files of the same name there")


def _runs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", nargs="?", default="runs", help="directory holding run directories (default runs/)")
    p.add_argument("--sort", metavar="METRIC",
                   help="best first by a metric: bleu, chrf, rougeL, exact_match, eval_loss, steps, wall_s, ...")


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--out", help="HTML file to write (default RUN/report.html; required for several runs)")
    p.add_argument("--baseline", metavar="EVAL_DIR",
                   help="a `tunekit eval` of the base model (its --out directory): adds a before/after table")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")


# verb -> (help, its arguments, its function), in the order `tunekit --help` lists them
VERBS = {
    "init": ("write a recipe that fits a target (GPU memory, GPUs, nodes, or cpu) from a model and a data file, each "
             "choice explained, then print its plan", _init_args, cmd_init),
    "validate": ("check a recipe and print it with every default filled", _validate_args, cmd_validate),
    "train": ("train a recipe into its run directory", _train_args, cmd_train),
    "launch": ("run a tunekit command in several processes on one or several nodes: torchrun's options and "
               "rendezvous, launch failures in one line", _launch_args, cmd_launch),
    "plan": ("memory per device and time per step, before loading any weights", _plan_args, cmd_plan),
    "data": ("what training will see of the data: counts, tokens per role, lengths, examples with the trained "
             "tokens marked; loads the tokenizer only", _data_args, cmd_data),
    "merge": ("merge a run's adapter into its base and save deployable weights", _merge_args, cmd_merge),
    "export": ("write a GGUF file (llama.cpp, Ollama, LM Studio) checked against its source, and an Ollama "
               "Modelfile beside it; or a safetensors directory (--format safetensors)", _export_args, cmd_export),
    "push": ("upload a run's adapter, merged weights or GGUF file to the Hugging Face Hub as one commit, with a "
             "model card (recipe, data, eval before/after, contamination, training curves)", _push_args, cmd_push),
    "eval": ("generate on held-out data and score BLEU, chrF, ROUGE, exact match, loss", _eval_args, cmd_eval),
    "chat": ("talk to a run, merged directory or base model in the terminal, prompts and answers as eval makes "
             "them; history kept, /reset, /exit; --once TEXT for one answer", _chat_args, cmd_chat),
    "recipes": ("list the recipes and DeepSpeed/accelerate configs tunekit ships, or copy some out",
                _recipes_args, cmd_recipes),
    "runs": ("list the runs under a directory: status, steps, scores, wall time, output", _runs_args, cmd_runs),
    "report": ("one self-contained HTML page: curves, scores, best step, predictions; several runs overlaid",
               _report_args, cmd_report),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tunekit", description="Fine-tune causal language models from one YAML recipe.")
    parser.add_argument("--version", action="version", version=f"tunekit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb, (help_text, add_arguments, func) in VERBS.items():
        p = sub.add_parser(verb, help=help_text)
        add_arguments(p)
        p.set_defaults(func=func)
        p.add_argument("--verbose", action="store_true",
                       help="show every library's messages and progress bars (a listed few that need no action are "
                            "hidden otherwise: tunekit/core/quiet.py)")
    return parser


def _setup_logging(verbose: bool) -> None:
    from tunekit.core import console, quiet

    quiet.install(verbose)
    console.attach(sys.stderr)  # tunekit's log lines, above any progress bar; INFO on the main process only


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"] and not {"-h", "--help"} & set(argv[1:2]):
        # torchrun's options pass through unparsed (argparse would claim them for `launch`)
        args = argparse.Namespace(func=cmd_launch, verbose=False, torchrun_options_and_command=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints every thread's stack: a stuck rank shows where it waits
        with contextlib.suppress(ValueError, OSError):  # stderr without a file descriptor (captured, in-process)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return args.func(args)
    except TunekitError as e:
        print(f"tunekit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tunekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
