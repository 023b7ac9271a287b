#!/usr/bin/env bash
# One prepared GPU check; see the docstring of scripts/gpu_check.py for the sections, budgets and
# outputs. Runs from any directory, needs no `pip install -e .` and no network:
#
#   scripts/gpu_check.sh                        # results in $OUT (a folder or a .json), else .
#   scripts/gpu_check.sh --device cpu --quick   # the same script on CPU, small shapes
set -u
if [ -n "${OUT:-}" ]; then
    case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
    export OUT
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PYTHON" scripts/gpu_check.py "$@"
