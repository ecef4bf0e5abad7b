#!/usr/bin/env bash
# Creates (once) and prints the path of the Python interpreter of muster's PyTorch virtualenv.
#
# Real PyTorch is the peer every compatibility test is judged against, so it is never assumed to be
# on the machine: it is installed here, from PyPI, into a cache outside the checkout that repeated
# CI runs reuse. A venv that is missing or broken (no `import torch`) is rebuilt.
#
#   PY=$(scripts/torch-venv.sh)        # stdout: the interpreter path, and nothing else
set -euo pipefail

TORCH_VERSION="${MUSTER_TORCH_VERSION:-2.15.0}"
CACHE_ROOT="${MUSTER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/muster}"
VENV="$CACHE_ROOT/venv-torch-$TORCH_VERSION"
STAMP="$VENV/.muster-ready"
# What the tests and examples import besides torch; bump the stamp when this list changes.
# The frameworks of the zero-code integrations (docs/frameworks.md), pinned: their tests build
# tiny models from a config, nothing is downloaded at run time.
EXTRA_PACKAGES=(numpy pytest pytest-timeout tqdm prometheus_client
  transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6)
STAMP_CONTENT="torch==$TORCH_VERSION ${EXTRA_PACKAGES[*]}"

log() { echo "torch-venv: $*" >&2; }

ready() {
  [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] &&
    "$VENV/bin/python" -c 'import torch, torch.distributed, pytest' >/dev/null 2>&1
}

if ! ready; then
  mkdir -p "$CACHE_ROOT"
  # One installer at a time: parallel test scripts on a fresh machine must not race.
  exec 9>"$CACHE_ROOT/.venv-$TORCH_VERSION.lock"
  flock 9
  if ! ready; then
    base_python="${PYTHON:-$(command -v python3 || command -v python)}"
    [[ -n "$base_python" ]] || { log "no python3 on PATH"; exit 1; }
    if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'pass' 2>/dev/null; then
      log "creating $VENV with $base_python"
      rm -rf "$VENV"
      "$base_python" -m venv "$VENV"
    fi
    log "installing torch==$TORCH_VERSION ${EXTRA_PACKAGES[*]} (first run only; ~3 GB, 1-3 minutes)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q \
      "torch==$TORCH_VERSION" "${EXTRA_PACKAGES[@]}" >&2
    "$VENV/bin/python" -c 'import torch, torch.distributed, pytest' >&2
    echo "$STAMP_CONTENT" >"$STAMP"
    log "ready: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  fi
fi
echo "$VENV/bin/python"
