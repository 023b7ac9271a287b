#!/usr/bin/env bash
# Runs aserve's XLA parity tests (tests/xla) on torch_xla's CPU PJRT device, in a venv of its own.
#
#   scripts/xla_check.sh                 create or reuse the venv, then run tests/xla
#   scripts/xla_check.sh --install-only  create or refresh the venv and stop
#   scripts/xla_check.sh -- -k parity -s extra pytest arguments after "--"
#
# torch_xla pins torch exactly (torch-xla 2.9.0 needs torch 2.9.0), so it cannot share the main
# environment's torch; the venv lives at ${ASERVE_XLA_VENV:-$HOME/.cache/aserve-xla/venv}.
# PyPI's Linux torch 2.9.0 wheel pulls CUDA libraries (a few GB); they load fine without a GPU.
# aserve itself is not installed there: it runs from this checkout through PYTHONPATH.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASERVE_XLA_VENV:-$HOME/.cache/aserve-xla/venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${ASERVE_XLA_TORCH_VERSION:-2.9.0}"

install_only=0
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --install-only) install_only=1 ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "usage: $0 [--install-only] [-- pytest args]" >&2; exit 2 ;;
    esac
    shift
done

# torch and torch-xla at one version, aserve's runtime deps less torch, and the test tools.
runtime_deps() {
    "$PYTHON" - "$REPO/pyproject.toml" <<'PY'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] != "torch"))
PY
}
mapfile -t deps < <(runtime_deps)
requirements=("torch==$TORCH_VERSION" "torch-xla==$TORCH_VERSION" "${deps[@]}" transformers pytest)
stamp="$VENV/.aserve-xla-requirements"

if [ ! -x "$VENV/bin/python" ]; then
    echo "xla_check: creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "${requirements[*]}" ]; then
    echo "xla_check: installing ${requirements[*]}"
    start=$SECONDS
    "$VENV/bin/python" -m pip install --upgrade --quiet pip
    "$VENV/bin/python" -m pip install --quiet "${requirements[@]}"
    echo "${requirements[*]}" > "$stamp"
    echo "xla_check: installed in $((SECONDS - start)) s, venv $(du -sh "$VENV" | cut -f1)"
fi
"$VENV/bin/python" -c 'import torch, torch_xla; print("xla_check: torch", torch.__version__,
                                                      "torch_xla", torch_xla.__version__)'
[ "$install_only" = 1 ] && exit 0

cd "$REPO"
export PJRT_DEVICE=CPU PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m pytest tests/xla -q -raP -p no:cacheprovider "${pytest_args[@]}"
