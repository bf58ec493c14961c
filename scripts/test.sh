#!/usr/bin/env bash
# Install what is needed (once, chromium included) and run every test. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest "$@"
