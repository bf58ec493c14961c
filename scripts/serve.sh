#!/usr/bin/env bash
# Install what is needed (once) and start the server. Flags go to `djev serve`; see `djev serve --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/djev serve "$@"
