# djev on vLLM: the official vLLM OpenAI image of the release djev's plugin was tested on, plus djev
# and its vLLM plugin (patches/). Multi-arch like its base (linux/amd64, linux/arm64 for the GB10):
#   docker buildx build --platform linux/amd64,linux/arm64 -t djev:vllm-0.32.0 .
# The versions here and in constraints/vllm.txt change together (tests/patches checks they agree).
FROM vllm/vllm-openai:v0.32.0

WORKDIR /opt/djev

# Install with the constraints the CPU test venv uses: transformers 5.23.0 over vLLM's own pin, and
# vLLM itself held at 0.32.0 (the build fails rather than move it).
COPY constraints/vllm.txt constraints/vllm.txt
COPY pyproject.toml README.md ./
COPY app app
COPY patches patches
RUN python3 -m pip install --no-cache-dir -c constraints/vllm.txt . ./patches \
    && python3 -c "import vllm, app, djev_vllm_patch, importlib.metadata as md; \
assert vllm.__version__ in djev_vllm_patch.TESTED_VLLM_VERSIONS, vllm.__version__; \
assert 'djev_vllm_patch' in [e.name for e in md.entry_points(group='vllm.general_plugins')]; \
print('image ok: vllm', vllm.__version__)"

COPY docker/entrypoint.sh docker/preflight.py docker/

ENV ENGINE=vllm \
    MODELS_DIR=/models \
    TLS_PORT=8443 \
    CERT_DIR=/certs \
    VLLM_USE_V2_MODEL_RUNNER=1 \
    HF_HUB_OFFLINE=1

EXPOSE 8011 8443

# One decision end to end through the running server (vLLM may take many minutes to load and warm up).
HEALTHCHECK --interval=60s --timeout=120s --start-period=1800s --retries=3 \
    CMD ["/bin/sh", "-c", "djev selftest --url http://127.0.0.1:${STRUCTURED_PORT:-8011} --timeout 100"]

ENTRYPOINT ["/opt/djev/docker/entrypoint.sh"]
