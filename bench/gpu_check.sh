#!/usr/bin/env bash
# The GPU check on an offline GPU machine, in one command, from the repository root with the kit beside it
# (`make gpu-kit` on a connected machine writes .gpu-kit/; copy the repository with it, at most 64 MiB):
#   bash bench/gpu_check.sh [--out FILE] [--only NAME ...]
# Installs the kit into this machine's Python with no index (what the image lacks: transformers at tunekit's
# pin, trl, bitsandbytes, deepspeed, ...), then runs bench/gpu_check.py on tunekit's source tree. Nothing is
# fetched. PYTHON picks the interpreter (default: the image's /opt/torch/.venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${GPU_KIT:-.gpu-kit}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /opt/torch/.venv/bin/python ]; then PY=/opt/torch/.venv/bin/python; else PY=$(command -v python3); fi
fi
if [ ! -f "$KIT/requirements.txt" ]; then
  echo "gpu-check: $KIT/requirements.txt not found; run 'make gpu-kit' on a connected machine and copy $KIT/ here" >&2
  exit 2
fi
echo "gpu-check: installing the kit ($(du -sh "$KIT" | cut -f1)) into $PY"
started=$(date +%s)
"$PY" -m pip install -q --no-index --find-links "$KIT" -r "$KIT/requirements.txt"
echo "gpu-check: kit installed in $(( $(date +%s) - started )) s"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TUNEKIT_CACHE="${TUNEKIT_CACHE:-/tmp/tunekit-cache}" TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"
exec "$PY" bench/gpu_check.py "$@"
