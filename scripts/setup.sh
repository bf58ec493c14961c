#!/usr/bin/env bash
# Install what djev needs into .venv, idempotently (a second run is a no-op).
#   scripts/setup.sh          the server
#   scripts/setup.sh --test   the server, the test tools, and Debian's chromium for the browser tests
# torch: TORCH_SPEC (default torch==2.13.0, the CPU build this workplace keeps on disk). On a GPU
# machine, install your CUDA build of torch into .venv first, or set TORCH_SPEC; an importable torch
# is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TEST=0
[ "${1:-}" = "--test" ] && TEST=1

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

hash=$(sha256sum pyproject.toml | cut -c1-16)
stamp="$VENV/.setup-$hash-$TEST"
if [ ! -f "$stamp" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
    "${PIP[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
  fi
  extras=""
  [ "$TEST" = 1 ] && extras="[test]"
  echo "setup: installing djev$extras and its dependencies"
  "${PIP[@]}" install -e ".$extras"
  touch "$stamp"
fi

if [ "$TEST" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  echo "setup: installing Debian's chromium for the browser tests"
  SUDO=""
  [ "$(id -u)" != 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
