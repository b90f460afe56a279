"""Kubernetes manifests and container images (deploy/).

Every overlay renders, passes kubernetes-validate --strict and checkov
(deploy/validate.py), and keeps the rules docs/deploy.md promises: separate
workloads per role, native gRPC probes, headless Services, PDBs, autoscaling
on queue depth, a grace period longer than the drain, non-root pods. The
manifests' flags are parsed by the real CLI. The images: test_images.py.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
ROLES = ("verifier", "drafter", "orchestrator")
GRPC_PORT = 50051
HTTP_PORT = 8000           # the orchestrator's OpenAI-compatible API
# Flags the manifests pass that the CLI is still gaining (none now). A flag
# listed here may be unknown to the parser; every other flag must parse.
PENDING_FLAGS: dict[str, set[str]] = {}


def _load_validate():
    spec = importlib.util.spec_from_file_location("deploy_validate", REPO / "deploy" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


validate = _load_validate()
OVERLAYS = validate.overlays()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    try:
        validate.kustomize_command()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("k8s")
    return {name: validate.render(name, out) for name in OVERLAYS}


def objects(r, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in r.docs if d["kind"] == kind}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def container(deployment: dict) -> dict:
    (c,) = pod_spec(deployment)["containers"]
    return c


def knobs(r, deployment: dict) -> dict[str, str]:
    """The environment a container gets from ConfigMaps (envFrom) and literal env entries."""
    maps = objects(r, "ConfigMap")
    env = {}
    c = container(deployment)
    for source in c.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e.get("value", "<from valueFrom>") for e in c.get("env", [])})
    return env


def expanded_args(r, deployment: dict) -> list[str]:
    env = knobs(r, deployment)
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container(deployment)["args"]]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# -- the validators ------------------------------------------------------------------------
def test_every_overlay_is_checked():
    assert set(OVERLAYS) == {"dev-cpu", "gpu", "gpu-keda"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_validate_strict(rendered, overlay):
    try:
        validate.kubernetes_validate_command()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert validate.schema_problems(rendered[overlay]) == []


def test_kubernetes_validate_rejects_a_bad_object(tmp_path):
    """The wrapper reports schema errors and unknown kinds rather than passing them."""
    try:
        validate.kubernetes_validate_command()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 'grpc'}]}\n---\n"
                   "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: y}\n")
    problems = validate.schema_problems(validate.Rendered("bad", bad, []))
    assert any("is not of type 'integer'" in p for p in problems)
    assert any("Widget" in p for p in problems)


def test_checkov_passes(rendered):
    checkov = validate.checkov_command()
    if checkov is None:
        # checkov cannot share the project's venv (it pins old packaging and
        # networkx): it gets one of its own, made once.
        try:
            checkov = validate.install_checkov()
        except (subprocess.CalledProcessError, OSError) as exc:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"checkov is not installed and could not be installed ({exc}): "
                        f"run `python deploy/validate.py --install-checkov`")
    assert validate.checkov_problems(list(rendered.values()), checkov) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_skips_carry_reasons(rendered, overlay):
    assert validate.skip_annotation_problems(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources(rendered, overlay):
    assert validate.custom_resource_problems(rendered[overlay]) == []


# -- workloads -----------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_deployment_per_role_with_its_own_replicas_and_resources(rendered, overlay):
    r = rendered[overlay]
    deployments = objects(r, "Deployment")
    assert set(deployments) == set(ROLES)
    images = set()
    for role, d in deployments.items():
        # Fixed counts on a laptop; elsewhere the role's own autoscaler owns it.
        assert ("replicas" in d["spec"]) == (overlay == "dev-cpu"), f"{overlay}/{role}"
        assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        res = container(d)["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[kind]), f"{overlay}/{role}: {kind}"
        image = container(d)["image"]
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"{overlay}/{role}: image {image} not pinned"
        assert role in name
        images.add(image)
    assert len(images) == 3
    if overlay == "dev-cpu":
        assert {d["spec"]["replicas"] for d in deployments.values()} == {1}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_only_where_the_overlay_says(rendered, overlay):
    deployments = objects(rendered[overlay], "Deployment")
    gpus = {role: container(d)["resources"]["limits"].get("nvidia.com/gpu") for role, d in deployments.items()}
    if overlay == "dev-cpu":
        assert gpus == {role: None for role in ROLES}
        return
    assert gpus == {"verifier": "4", "drafter": "1", "orchestrator": None}
    for role in ("verifier", "drafter"):
        d = deployments[role]
        assert container(d)["resources"]["requests"]["nvidia.com/gpu"] == gpus[role]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(d)["tolerations"])
        assert pod_spec(d)["nodeSelector"]
    verifier = deployments["verifier"]
    assert f"--tp={gpus['verifier']}" in container(verifier)["args"], "one tensor-parallel rank per GPU"
    shm = {m["mountPath"]: m["name"] for m in container(verifier)["volumeMounts"]}["/dev/shm"]
    assert {v["name"]: v for v in pod_spec(verifier)["volumes"]}[shm]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "dev-cpu"])
def test_models_come_read_only_from_the_claim(rendered, overlay):
    r = rendered[overlay]
    claims = objects(r, "PersistentVolumeClaim")
    for role, d in objects(r, "Deployment").items():
        volumes = {v["name"]: v for v in pod_spec(d)["volumes"]}
        (mount,) = [m for m in container(d)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True
        pvc = volumes[mount["name"]]["persistentVolumeClaim"]
        assert pvc["readOnly"] is True and pvc["claimName"] in claims, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compiled_forwards_knob_and_cache_volume(rendered, overlay, monkeypatch):
    """The verifier and drafter take --compile from SPECDEC_COMPILE (auto on
    CPU, where it is measured to pay; off on the untested CUDA path) and keep
    the compiled packages on a writable volume of their own, the root
    filesystem being read-only: a size-limited emptyDir per pod, or in the gpu
    overlays a claim every pod shares."""
    r = rendered[overlay]
    claims = objects(r, "PersistentVolumeClaim")
    for role in ("verifier", "drafter"):
        d = objects(r, "Deployment")[role]
        env = knobs(r, d)
        assert env["SPECDEC_COMPILE"] == ("auto" if overlay == "dev-cpu" else "off"), f"{overlay}/{role}"
        for name, value in env.items():
            if name.startswith("SPECDEC_"):
                monkeypatch.setenv(name, value)
        assert role_parser(role).parse_known_args(expanded_args(r, d))[0].compile == env["SPECDEC_COMPILE"]
        (mount,) = [m for m in container(d)["volumeMounts"] if m["mountPath"] == env["TORCHINDUCTOR_CACHE_DIR"]]
        assert not mount.get("readOnly"), f"{overlay}/{role}"
        volume = {v["name"]: v for v in pod_spec(d)["volumes"]}[mount["name"]]
        if overlay == "dev-cpu":
            assert set(volume) == {"name", "emptyDir"} and volume["emptyDir"]["sizeLimit"], f"{overlay}/{role}"
        else:
            assert set(volume) == {"name", "persistentVolumeClaim"}, f"{overlay}/{role}"
            claim = claims[volume["persistentVolumeClaim"]["claimName"]]
            assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "pods on many nodes share it"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc(rendered, overlay):
    """The GPU roles are probed over gRPC; the orchestrator over its HTTP API
    (/health mirrors the gRPC readiness), which checks both of its servers."""
    for role, d in objects(rendered[overlay], "Deployment").items():
        c = container(d)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == GRPC_PORT
        if role == "orchestrator":
            assert ports["http"] == HTTP_PORT
            assert f"--http-port={HTTP_PORT}" in c["args"]
            # Its readiness waits on the verifiers, so its startup probe asks
            # only whether the process is up.
            expected = {"startupProbe": "/health/live", "readinessProbe": "/health", "livenessProbe": "/health/live"}
            for probe, path in expected.items():
                assert c[probe]["httpGet"] == {"port": "http", "path": path}, f"{overlay}/{role}: {probe}"
            continue
        expected = {"startupProbe": "readiness", "readinessProbe": "readiness", "livenessProbe": "liveness"}
        for probe, service in expected.items():
            assert c[probe]["grpc"] == {"port": GRPC_PORT, "service": service}, f"{overlay}/{role}: {probe}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrator_service_and_policy_open_the_http_api(rendered, overlay):
    r = rendered[overlay]
    ports = {p["name"]: p for p in objects(r, "Service")["orchestrator"]["spec"]["ports"]}
    assert ports["http"]["port"] == HTTP_PORT and ports["http"]["targetPort"] == "http"
    policy = objects(r, "NetworkPolicy")["orchestrator-ingress"]["spec"]
    public = [rule for rule in policy["ingress"] if "from" not in rule]
    assert {p["port"] for rule in public for p in rule["ports"]} == {"grpc", "http"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_headless_services_for_pinned_roles(rendered, overlay):
    r = rendered[overlay]
    services = objects(r, "Service")
    deployments = objects(r, "Deployment")
    for role in ("verifier", "drafter"):
        svc = services[f"{role}-headless"]["spec"]
        assert svc["clusterIP"] == "None"
        assert svc["ports"][0]["port"] == GRPC_PORT
        assert selects({"matchLabels": svc["selector"]}, deployments[role]["spec"]["template"]["metadata"]["labels"])
        assert not svc.get("publishNotReadyAddresses"), "a draining pod must leave the DNS answer"
    assert services["orchestrator"]["spec"].get("clusterIP") != "None"
    # The orchestrator finds both roles through those Services' DNS names.
    args = container(deployments["orchestrator"])["args"]
    for role in ("verifier", "drafter"):
        assert f"--{role}-dns={role}-headless.$(POD_NAMESPACE).svc.cluster.local:{GRPC_PORT}" in args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_one_pdb(rendered, overlay):
    r = rendered[overlay]
    pdbs = objects(r, "PodDisruptionBudget").values()
    for role, d in objects(r, "Deployment").items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        matching = [p for p in pdbs if selects(p["spec"]["selector"], labels)]
        assert len(matching) == 1, f"{overlay}/{role}"
        assert matching[0]["spec"].get("maxUnavailable") == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling_on_queue_depth(rendered, overlay):
    r = rendered[overlay]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in objects(r, "HorizontalPodAutoscaler").values()}
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in objects(r, "ScaledObject").values()}
    if overlay == "dev-cpu":
        assert not hpas and not scaled, "the laptop overlay runs fixed single replicas"
        return
    if overlay == "gpu-keda":
        assert not hpas and set(scaled) == set(ROLES)
        for role, s in scaled.items():
            assert 2 <= s["spec"]["minReplicaCount"] <= s["spec"]["maxReplicaCount"]
            queries = [t["metadata"]["query"] for t in s["spec"]["triggers"] if t["type"] == "prometheus"]
            assert any(f'specdec_queue_depth{{namespace="specdec", role="{role}"}}' in q for q in queries)
        return
    assert set(hpas) == set(ROLES) and not scaled
    for role, h in hpas.items():
        assert h["apiVersion"] == "autoscaling/v2"
        pods = [m["pods"] for m in h["spec"]["metrics"] if m["type"] == "Pods"]
        assert [p["metric"]["name"] for p in pods] == ["specdec_queue_depth"], role
        assert 2 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"], "one pod draining leaves one serving"


def test_adapter_serves_the_hpa_metric():
    import yaml

    values = yaml.safe_load((REPO / "deploy" / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == "specdec_queue_depth"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}, "a Pods metric needs pod and namespace"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_outlasts_the_drain(rendered, overlay):
    r = rendered[overlay]
    for role, d in objects(r, "Deployment").items():
        drain = float(knobs(r, d)["SPECDEC_DRAIN_S"])
        grace = pod_spec(d)["terminationGracePeriodSeconds"]
        assert grace >= drain + 15, f"{overlay}/{role}: grace {grace}s for a {drain}s drain"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_locked_down(rendered, overlay):
    r = rendered[overlay]
    for role, d in objects(r, "Deployment").items():
        pod = pod_spec(d)
        where = f"{overlay}/{role}"
        assert pod["automountServiceAccountToken"] is False, where
        assert objects(r, "ServiceAccount")[pod["serviceAccountName"]]["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] >= 10000, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        sc = container(d)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"] == {"drop": ["ALL"]}, where
        tmp = {m["mountPath"]: m["name"] for m in container(d)["volumeMounts"]}["/tmp"]
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[tmp], where
    namespaces = objects(r, "Namespace")
    assert [n["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] for n in namespaces.values()] == ["restricted"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_policy_covers_a_workload(rendered, overlay):
    r = rendered[overlay]
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in objects(r, "Deployment").values()]
    covered = set()
    for name, policy in objects(r, "NetworkPolicy").items():
        hits = [labels["app.kubernetes.io/component"] for labels in pod_labels
                if selects(policy["spec"]["podSelector"], labels)]
        assert len(hits) == 1, name
        covered.update(hits)
    assert covered == set(ROLES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_token_is_a_secret_reference(rendered, overlay):
    r = rendered[overlay]
    orchestrator = container(objects(r, "Deployment")["orchestrator"])
    (token,) = [e for e in orchestrator["env"] if e["name"] == "SPECDEC_AUTH_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    secrets = objects(r, "Secret")
    if overlay == "dev-cpu":
        value = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
        assert "dev-only" in value and "insecure" in value, "the dev token must read as a dummy"
    else:
        assert not secrets, "real clusters create the token Secret themselves"
        assert ref["name"] == "specdec-api-token"


def test_base_holds_no_secret():
    for path in (REPO / "deploy" / "k8s" / "base").iterdir():
        text = path.read_text()
        assert "kind: Secret" not in text and "secretGenerator" not in text, path.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_args_reference_defined_variables(rendered, overlay):
    """A $(VAR) the kubelet cannot fill in reaches the program verbatim."""
    r = rendered[overlay]
    for role, d in objects(r, "Deployment").items():
        env = knobs(r, d)
        for arg in container(d)["args"]:
            for name in re.findall(r"\$\((\w+)\)", arg):
                assert name in env, f"{overlay}/{role}: {arg}"


def role_parser(role: str):
    """The parser each image's entry point runs: `specdec` for the GPU roles,
    `python -m specdec.cli.stack` (the orchestrator alone) for the orchestrator."""
    import argparse

    if role != "orchestrator":
        from specdec.cli.main import build_parser

        return build_parser()
    from specdec.cli.stack import add_orchestrator_parser

    parser = argparse.ArgumentParser(prog="specdec")
    add_orchestrator_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cli_accepts_the_manifest_args(rendered, overlay):
    for role, d in objects(rendered[overlay], "Deployment").items():
        argv = expanded_args(rendered[overlay], d)
        try:
            _, unknown = role_parser(role).parse_known_args(argv)
        except SystemExit:
            raise AssertionError(f"{overlay}/{role}: the CLI rejects {argv}") from None
        flags = {u.split("=")[0] for u in unknown}
        assert flags <= PENDING_FLAGS.get(role, set()), f"{overlay}/{role}: unknown flags {flags}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_torch_threads_follow_the_cpu_limit(rendered, overlay):
    """torch would size its pool from the node's cores; the verifier and
    drafter pods get OMP_NUM_THREADS from their own CPU limit instead."""
    deployments = objects(rendered[overlay], "Deployment")
    for role in ("verifier", "drafter"):
        c = container(deployments[role])
        (threads,) = [e for e in c["env"] if e["name"] == "OMP_NUM_THREADS"]
        ref = threads["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "limits.cpu" and str(ref["divisor"]) == "1", (overlay, role)
        assert "cpu" in c["resources"]["limits"], (overlay, role)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_verifier_takes_its_tree_sizing_from_the_knobs(rendered, overlay, monkeypatch):
    """SPECDEC_TREE_SIZING (specdec-knobs) is what `verifier serve --tree-sizing` defaults to."""
    r = rendered[overlay]
    d = objects(r, "Deployment")["verifier"]
    env = knobs(r, d)
    assert env["SPECDEC_TREE_SIZING"] == "fixed"
    monkeypatch.setenv("SPECDEC_TREE_SIZING", "cost")             # an operator's edit of the ConfigMap
    assert role_parser("verifier").parse_known_args(expanded_args(r, d))[0].tree_sizing == "cost"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_verifier_compiles_the_graphs_of_the_deployments_trees(rendered, overlay):
    """The verifier builds at start-up the compiled graphs of the tree size the drafters draft."""
    r = rendered[overlay]
    d = objects(r, "Deployment")["verifier"]
    args = role_parser("verifier").parse_known_args(expanded_args(r, d))[0]
    assert args.compile_tree_tokens == int(knobs(r, d)["TREE_TOTAL_TOKENS"])
