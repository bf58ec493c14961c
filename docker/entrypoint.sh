#!/usr/bin/env bash
# The djev image's entrypoint: check the checkpoint and the memory, then `djev serve --engine vllm`
# with TLS. Every djev setting comes from the environment (see .env.example); djev's Settings define
# their defaults. `docker run IMAGE selftest` or any other djev command runs that command instead.
#
# Image-only variables (not djev settings; their defaults are defined here):
#   MODEL             checkpoint directory in the container     default /models/$MODEL_NAME (MODEL_NAME: djev's)
#   HEADROOM_GB       memory kept free beyond the estimate      default 12
#   TRANSIENT_COPIES  fp32 [MAX_SEQS x CANVAS, vocab] logits copies budgeted for start-up   default 2
#   MEMORY_CHECK      0 skips the memory check                  default 1
#   MEMINFO           where MemAvailable is read (tests)        default /proc/meminfo
#   PYTHON            the interpreter for the checks            default python3
# Image defaults for djev settings (override them like any setting):
#   ENGINE=vllm, TLS_PORT=8443, CERT_DIR=/certs, MODELS_DIR=/models
set -euo pipefail

if [ "$#" -gt 0 ]; then
  exec djev "$@"
fi

export MODEL_NAME=${MODEL_NAME:-dgemma}
export MODELS_DIR=${MODELS_DIR:-/models}
export MODEL=${MODEL:-$MODELS_DIR/$MODEL_NAME}
export HEADROOM_GB=${HEADROOM_GB:-12}
export TRANSIENT_COPIES=${TRANSIENT_COPIES:-2}
export ENGINE=${ENGINE:-vllm}
export TLS_PORT=${TLS_PORT:-8443}
export CERT_DIR=${CERT_DIR:-/certs}
# DiffusionGemma needs vLLM's model runner V2.
export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-1}

# Exit status 2 with a message when the checkpoint is missing, unsuitable, or memory is short.
"${PYTHON:-python3}" "$(dirname "$0")/preflight.py"

mkdir -p "$CERT_DIR"
echo "djev-image: starting djev serve --engine $ENGINE --model $MODEL (HTTP ${STRUCTURED_PORT:-8011}, HTTPS $TLS_PORT)"
exec djev serve --engine "$ENGINE" --model "$MODEL" --tls-port "$TLS_PORT" --cert-dir "$CERT_DIR"
