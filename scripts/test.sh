#!/usr/bin/env bash
# Install what is needed (once: chromium, haproxy and the CPU vLLM venv .venv-vllm included), lint
# (ruff), check types (pyright, basic mode, app/) and run every test. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test --vllm
echo "test: ruff check"
.venv/bin/ruff check .
echo "test: pyright app/"
.venv/bin/pyright
exec .venv/bin/python -m pytest "$@"
