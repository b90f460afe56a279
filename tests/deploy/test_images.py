"""The container images (deploy/docker/): multi-stage, non-root, an
allow-list build context, pinned base images, and an orchestrator image
without torch whose dependency list is enough to import the orchestrator
and run its entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
ROLES = ("verifier", "drafter", "orchestrator")


@pytest.mark.parametrize("role", ROLES)
def test_dockerfile_runs_as_non_root(role):
    text = (DOCKER / f"{role}.Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the final stage must drop root"
    assert users[-1].split(":")[0] == "10001", "the same uid the pods' securityContext asks for"
    assert len(re.findall(r"^FROM\s", text, re.M)) >= 2, "multi-stage: build tools stay out of the image"
    assert "HEALTHCHECK" not in re.sub(r"#.*", "", text), "Kubernetes probes the gRPC health service"
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, re.M):
        assert ":" in image and not image.endswith(":latest"), image
    assert f'CMD ["{role}", "serve"]' in text
    ignore = (DOCKER / f"{role}.Dockerfile.dockerignore").read_text()
    assert ignore.splitlines()[1] == "**", "allow-list context: no .venv or model files slip in"


def test_orchestrator_image_has_no_torch():
    text = (DOCKER / "orchestrator.Dockerfile").read_text()
    assert "pip install --no-deps ." in text and "TORCH" not in text


def _orchestrator_image_modules() -> set[str]:
    """Top-level modules the orchestrator image holds: its requirements and theirs, and the project."""
    from importlib import metadata

    from packaging.requirements import Requirement

    names = [Requirement(line).name for line in (DOCKER / "orchestrator-requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    dists, seen = [], set()
    while names:
        name = names.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        dists.append(dist)
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                names.append(r.name)
    modules = {"specdec", "drafter", "verifier", "orchestrator"}
    for dist in dists:
        top = dist.read_text("top_level.txt")
        if top:
            modules.update(top.split())
        for f in dist.files or []:
            first = f.parts[0]
            if first.endswith(".py"):
                modules.add(first[:-3])
            elif not first.endswith((".dist-info", ".data")) and first != "..":
                modules.add(first)
    return modules


_BLOCKER = """
import importlib, json, sys
allowed = set(json.loads(sys.argv[1]))
class Block:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in allowed or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"{name} is not in the orchestrator image")  # what a missing one raises
sys.meta_path.insert(0, Block())
for module in sys.argv[2:]:
    importlib.import_module(module)
from specdec.cli.stack import main
try:
    main(["orchestrator", "serve", "--help"])
except SystemExit as exc:
    sys.exit(exc.code)
"""


def test_orchestrator_runs_on_its_image_dependencies():
    """The image's entry point and every module the orchestrator loads, with
    only what orchestrator-requirements.txt installs (no torch, no numpy)."""
    modules = [f"orchestrator.{p.stem}" for p in sorted((REPO / "orchestrator").glob("*.py"))
               if p.stem != "__init__"] + ["specdec.client", "specdec.model.loading", "specdec.serving.server"]
    allowed = sorted(_orchestrator_image_modules())
    proc = subprocess.run([sys.executable, "-c", _BLOCKER, json.dumps(allowed), *modules],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, (proc.stderr.strip().splitlines() or ["?"])[-1]
    assert "--tokenizer" in proc.stdout
    assert 'ENTRYPOINT ["python", "-m", "specdec.cli.stack"]' in (DOCKER / "orchestrator.Dockerfile").read_text()
