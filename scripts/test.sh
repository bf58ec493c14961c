#!/usr/bin/env bash
# Install what is needed (once: chromium and the CPU vLLM venv .venv-vllm included) and run every test. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test --vllm
exec .venv/bin/python -m pytest "$@"
