"""Offline checks of the deployment files in ``infra/deploy/`` (no cluster, no Docker).

* Kubernetes manifests (``infra/deploy/k8s/``) are validated in strict mode (unknown
  fields are errors) with ``kubernetes-validate``, which bundles the JSON schemas of the
  built-in kinds for each Kubernetes minor version; KEDA's custom resources against the
  minimal schemas vendored in ``infra/deploy/schemas/`` (see the README there).
* Cross-references that no schema sees: names the pods mount exist, probed ports are the
  container port, KEDA watches the workers' consumer group and topic, the ConfigMap's YAML
  is a valid prm-pipeline config, the grace period outlasts the drain, the CLI accepts the
  arguments, ``compose.yaml`` and the Dockerfile point at files that exist.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from infra.config import PipelineConfig, apply_env_overrides, config_from_mapping

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "infra" / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = DEPLOY / "schemas"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"

# The oldest Kubernetes minor the manifests promise to work on, and the newest schema set
# kubernetes-validate ships (it validates against the newest it has at or below a version).
K8S_VERSIONS = ("1.29", kv.latest_version())
# Custom resources: kind -> vendored schema (kubernetes-validate knows built-in kinds only).
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject-v1alpha1.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda-triggerauthentication-v1alpha1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-v1.json",
}
IMAGE = "prm-pipeline"  # the image name the manifests use; kustomization.yaml maps it to a registry
CONFIG_PATH = "/etc/prm/config.yaml"
# KEDA's names for aiokafka's SASL mechanisms (infra/config.py KafkaConfig.sasl_mechanism).
KEDA_SASL = {
    "PLAIN": "plaintext",
    "SCRAM-SHA-256": "scram_sha256",
    "SCRAM-SHA-512": "scram_sha512",
    "OAUTHBEARER": "oauthbearer",
    "GSSAPI": "gssapi",
}


# --------------------------------------------------------------------------- loading
@cache
def _manifests() -> tuple[tuple[Path, dict[str, Any]], ...]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs, f"{path} holds no manifest"
        out.extend((path, d) for d in docs)
    return tuple(out)


# a Secret's value in a test: of the right form where the loader parses it (addresses)
PLACEHOLDERS = {"PRM_REDIS_URL": "redis://placeholder:6379/0", "PRM_KAFKA_BOOTSTRAP": "placeholder:9092"}


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    return copy.deepcopy(list(_manifests()))


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == kind}


def one(kind: str, name: str) -> dict[str, Any]:
    found = of_kind(kind)
    assert name in found, f"no {kind} named {name!r} in {K8S} (have {sorted(found)})"
    return found[name]


def pod_templates() -> dict[str, dict[str, Any]]:
    """``Kind/name`` -> pod template of every workload."""
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]
        for _, d in manifests()
        if d["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet")
    }


def worker() -> dict[str, Any]:
    return one("Deployment", "prm-scoring-worker")


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def configmap_raw() -> dict[str, Any]:
    return yaml.safe_load(one("ConfigMap", "prm-config")["data"]["config.yaml"])


def pipeline_config() -> PipelineConfig:
    return config_from_mapping(configmap_raw(), environ={})


def secret_keys() -> dict[str, set[str]]:
    """Secret name -> keys, from the Secret manifests (secret.example.yaml)."""
    return {name: set(s.get("stringData", {})) | set(s.get("data", {})) for name, s in of_kind("Secret").items()}


def arg_after(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def resolve_port(c: dict[str, Any], port: int | str) -> int:
    """A probe's port (number or name) -> the container port number it refers to."""
    by_name = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    if isinstance(port, str):
        assert port in by_name, f"probe port {port!r} is not a named port of container {c['name']}"
        return by_name[port]
    assert port in by_name.values(), f"probe port {port} is not a containerPort of {c['name']}"
    return port


def _id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


# --------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("item", _manifests(), ids=_id)
def test_manifest_validates_against_its_schema(item: tuple[Path, dict[str, Any]]) -> None:
    """Every manifest: built-in kinds with kubernetes-validate (strict) on the oldest and
    newest supported Kubernetes; KEDA kinds with the vendored schema. Nothing is skipped."""
    path, doc = item
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{path.name}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors)
        return
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(
                f"{path.name} ({doc['kind']}) against Kubernetes {e.version}: {'.'.join(map(str, e.path))}: {e.message}"
            )
        except kv.SchemaNotFoundError as e:
            pytest.fail(f"{path.name}: {e.message}; vendor a schema in {SCHEMAS} and list it in CRD_SCHEMAS")


def test_validators_reject_misspelt_fields() -> None:
    """The checks above are not vacuous: a typo anywhere is an error, not silently pruned."""
    bad = worker()
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[0], strict=True)
    so_schema = json.loads((SCHEMAS / CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")]).read_text())
    so = one("ScaledObject", "prm-scoring-worker")
    typo = copy.deepcopy(so)
    typo["spec"]["triggers"][0]["metadata"]["lagTreshold"] = "10"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, so_schema, cls=jsonschema.Draft202012Validator)
    typo = copy.deepcopy(so)
    typo["spec"]["maxReplicas"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, so_schema, cls=jsonschema.Draft202012Validator)
    typo = copy.deepcopy(so)
    typo["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 128  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, so_schema, cls=jsonschema.Draft202012Validator)


def test_kustomization_lists_every_manifest_but_the_secret() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "duplicate resources"
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists missing {name}"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk - {"secret.example.yaml"}, "a manifest is not in kustomization.yaml"
    assert "secret.example.yaml" not in listed, "placeholders would overwrite the real Secret on every apply"
    # Everything lands in the kustomization's namespace; manifests do not hard-code another.
    namespaces = {d["metadata"]["name"] for d in of_kind("Namespace").values()}
    assert kustomization["namespace"] in namespaces
    for path, doc in manifests():
        assert doc["metadata"].get("namespace") in (None, kustomization["namespace"]), path.name
    # Every image reference is the one name the kustomization rewrites.
    assert [i["name"] for i in kustomization["images"]] == [IMAGE]
    for key, template in pod_templates().items():
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            assert c["image"] == IMAGE, f"{key}/{c['name']}: image {c['image']!r} is not rewritten by kustomize"


# --------------------------------------------------------------------------- config
def test_configmap_yaml_is_a_valid_prm_config() -> None:
    cfg = pipeline_config()  # raises ConfigError on unknown keys and broken AReaL config rules
    assert cfg.prm.active, "the shipped config should score (replace the scorers, keep them active)"
    # No credentials in the ConfigMap: they come from the Secret as PRM_* variables.
    assert cfg.kafka.sasl_password is None and cfg.kafka.sasl_username is None
    assert "@" not in cfg.redis.url, "redis.url in the ConfigMap must not carry credentials"
    assert cfg.topics.replication_factor >= 3, "production topics need replicas"
    dlq = getattr(cfg.worker, "dead_letter_max_bytes", None)
    if dlq is not None:
        assert dlq < cfg.kafka.max_message_bytes, "a dead letter plus its headers must fit max_message_bytes"


@pytest.mark.parametrize("key", sorted(pod_templates()))
def test_pod_references_exist(key: str) -> None:
    """ConfigMaps, Secrets (and their keys), PVCs and the ServiceAccount a pod names exist;
    ``--config`` points into the mounted ConfigMap; every PRM_* variable is a config field."""
    spec = pod_templates()[key]["spec"]
    configmaps, secrets, pvcs = of_kind("ConfigMap"), secret_keys(), of_kind("PersistentVolumeClaim")
    assert spec["serviceAccountName"] in of_kind("ServiceAccount")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for v in volumes.values():
        if "configMap" in v:
            cm = configmaps.get(v["configMap"]["name"])
            assert cm is not None, f"{key}: ConfigMap {v['configMap']['name']!r} does not exist"
            for item in v["configMap"].get("items", []):
                assert item["key"] in cm["data"], f"{key}: ConfigMap key {item['key']!r} missing"
        if "secret" in v:
            assert v["secret"]["secretName"] in secrets, f"{key}: Secret {v['secret']['secretName']!r} missing"
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in pvcs, f"{key}: PVC missing"
    for c in spec["containers"]:
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        for m in mounts.values():
            assert m["name"] in volumes, f"{key}/{c['name']}: mount of undeclared volume {m['name']!r}"
        # --config FILE is a file of a mounted ConfigMap.
        config_file = arg_after(c["args"], "--config")
        assert config_file == CONFIG_PATH
        mount_dir, _, filename = config_file.rpartition("/")
        assert mount_dir in mounts, f"{key}/{c['name']}: nothing mounted at {mount_dir}"
        cm_volume = volumes[mounts[mount_dir]["name"]]
        assert filename in [i["path"] for i in cm_volume["configMap"]["items"]]
        # Secret references and PRM_* names.
        environ = {}
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["name"] in secrets, f"{key}: Secret {ref['name']!r} does not exist"
                assert ref["key"] in secrets[ref["name"]], f"{key}: Secret {ref['name']} has no key {ref['key']!r}"
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref is not None:
                assert ref["key"] in configmaps[ref["name"]]["data"]
            if env["name"].startswith("PRM_"):
                environ[env["name"]] = env.get("value", PLACEHOLDERS.get(env["name"], "placeholder"))
        apply_env_overrides({}, environ)  # raises ConfigError naming an unknown PRM_* field
        config_from_mapping(configmap_raw(), environ=environ)


def test_credentials_come_from_the_secret() -> None:
    for name in (
        "Deployment/prm-scoring-worker",
        "Deployment/prm-trainer",
        "Deployment/prm-gateway",
        "Job/prm-topics-create",
    ):
        (c,) = pod_templates()[name]["spec"]["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        for var in ("PRM_KAFKA_SASL_USERNAME", "PRM_KAFKA_SASL_PASSWORD"):
            assert "secretKeyRef" in env[var]["valueFrom"], f"{name}: {var} must come from a Secret"
    env = {e["name"]: e for e in container(worker()).get("env", [])}
    assert "secretKeyRef" in env["PRM_REDIS_URL"]["valueFrom"]


# --------------------------------------------------------------------------- worker
def test_worker_probes_metrics_port_and_scrape_annotations() -> None:
    cfg = pipeline_config()
    template = worker()["spec"]["template"]
    c = container(worker())
    port = int(arg_after(c["args"], "--metrics-port"))
    assert cfg.worker.metrics_port in (None, port), "worker.metrics_port and --metrics-port disagree"
    assert port in [p["containerPort"] for p in c["ports"]]
    probes = {kind: c[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for kind, probe in probes.items():
        assert resolve_port(c, probe["httpGet"]["port"]) == port, f"{kind} probes another port"
        assert probe["timeoutSeconds"] < probe["periodSeconds"]
    # Liveness must not fire before the scorers are built: startup allows much longer.
    startup, liveness = probes["startupProbe"], probes["livenessProbe"]
    assert (
        startup["periodSeconds"] * startup["failureThreshold"]
        > 2 * liveness["periodSeconds"] * liveness["failureThreshold"]
    )
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] == "/metrics"
    # KEDA owns the replica count; a replicas field would reset it on every apply.
    assert "replicas" not in worker()["spec"]


def test_termination_grace_outlasts_the_drain() -> None:
    """SIGTERM -> drain up to worker.drain_timeout_s -> commit -> leave the group -> exit:
    the kubelet must not SIGKILL in the middle (and compose must not either)."""
    drain = pipeline_config().worker.drain_timeout_s
    grace = worker()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain, f"terminationGracePeriodSeconds {grace} <= worker.drain_timeout_s {drain}"
    assert grace - drain >= 10, "leave >= 10 s after the drain for the commit, group leave and producer flush"
    compose = yaml.safe_load(COMPOSE.read_text())
    compose_drain = compose_config(compose, "worker-1").worker.drain_timeout_s
    for name in worker_services(compose):
        assert _seconds(compose["services"][name]["stop_grace_period"]) > compose_drain, name


def test_worker_rollout_and_disruption_budget() -> None:
    strategy = worker()["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    (pdb,) = of_kind("PodDisruptionBudget").values()
    selector = pdb["spec"]["selector"]["matchLabels"]
    labels = worker()["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), "the PDB does not select the worker pods"
    for key, template in pod_templates().items():
        if key != "Deployment/prm-scoring-worker":
            assert not selector.items() <= template["metadata"]["labels"].items(), f"the PDB also selects {key}"
    so = one("ScaledObject", "prm-scoring-worker")["spec"]
    assert pdb["spec"]["maxUnavailable"] < so["minReplicaCount"], "a drain could evict every worker at once"


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_selectors_match_pod_labels(kind: str) -> None:
    for name, d in of_kind(kind).items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        selector = d["spec"].get("selector", {}).get("matchLabels")
        if selector is not None:
            assert selector.items() <= labels.items(), f"{kind}/{name}: selector does not match its pods"


# --------------------------------------------------------------------------- gateway
GATEWAY_CLIENT_LABEL = {"prm.io/gateway-client": "true"}


def test_gateway_listens_with_tokens_from_the_secret_and_is_probed() -> None:
    """All interfaces only with bearer tokens (the Secret, as a file); probes on its port."""
    gateway = one("Deployment", "prm-gateway")
    c = container(gateway)
    args = c["args"]
    assert args[args.index("gateway") + 1 :].count("--allow-unauthenticated") == 0, "tokens are the default gate"
    port = int(arg_after(args, "--port"))
    host = arg_after(args, "--host")
    assert [p["containerPort"] for p in c["ports"]] == [port]
    env = {e["name"]: e for e in c["env"]}
    cfg = config_from_mapping(configmap_raw(), environ={k: e["value"] for k, e in env.items() if "value" in e})
    assert cfg.gateway.port == port, "gateway.port in the ConfigMap and --port disagree"
    # the token file is a key of prm-secrets mounted read-only
    token_file = cfg.gateway.auth_tokens_file
    assert host == "0.0.0.0" and token_file, (
        "beyond loopback the gateway runs with bearer tokens (PRM_GATEWAY_AUTH_TOKENS_FILE)"
    )
    mount_dir, _, filename = token_file.rpartition("/")
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == mount_dir)
    assert mount["readOnly"] is True
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    item = next(i for i in volume["secret"]["items"] if i["path"] == filename)
    assert item["key"] in secret_keys()[volume["secret"]["secretName"]]
    assert volume["secret"]["defaultMode"] & 0o007 == 0, "tokens must not be world-readable"
    tokens = one("Secret", "prm-secrets")["stringData"]["gateway-tokens"].split()
    assert tokens, "the example Secret's gateway-tokens holds no token (the gateway refuses to start without one)"
    probes = {kind: c[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["httpGet"]["path"] == probes["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for kind, probe in probes.items():
        assert resolve_port(c, probe["httpGet"]["port"]) == port, f"{kind} probes another port"
        assert probe["timeoutSeconds"] < probe["periodSeconds"]
    assert gateway["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert gateway["spec"]["replicas"] >= 2, "one gateway pod is a single point of failure for every trainer"


def test_gateway_service_targets_the_gateway_pods_only() -> None:
    gateway = one("Deployment", "prm-gateway")
    service = one("Service", "prm-gateway")["spec"]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert service["type"] == "ClusterIP", "no exposure outside the cluster in the base"
    assert service["selector"].items() <= labels.items()
    for key, template in pod_templates().items():
        if key != "Deployment/prm-gateway":
            assert not service["selector"].items() <= template["metadata"]["labels"].items(), f"it also selects {key}"
    (port,) = service["ports"]
    assert resolve_port(container(gateway), port["targetPort"]) == int(arg_after(container(gateway)["args"], "--port"))


def test_gateway_network_policy_admits_only_labelled_trainers_and_reaches_only_kafka() -> None:
    gateway = one("Deployment", "prm-gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    port = int(arg_after(container(gateway)["args"], "--port"))
    policies = of_kind("NetworkPolicy")
    selecting = [
        n for n, p in policies.items() if p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
    ]
    assert sorted(selecting) == ["prm-default-deny", "prm-gateway"], selecting
    policy = policies["prm-gateway"]["spec"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    (source,) = rule["from"]
    assert source["podSelector"] == {"matchLabels": GATEWAY_CLIENT_LABEL}, "only pods labelled as gateway clients"
    assert "ipBlock" not in source
    kafka_ports = {p["port"] for e in policies["prm-default-deny"]["spec"]["egress"] for p in e["ports"]} - {53}
    egress_ports = {p["port"] for e in policy["egress"] for p in e["ports"]}
    assert egress_ports <= kafka_ports, f"the gateway reaches more than Kafka: {sorted(egress_ports - kafka_ports)}"
    # the other pods' policies do not open the gateway's port to anyone else
    for name, p in policies.items():
        if name != "prm-gateway":
            for r in p["spec"].get("ingress", []):
                assert port not in {q["port"] for q in r.get("ports", [])}, f"{name} opens the gateway port"


# --------------------------------------------------------------------------- KEDA
def test_keda_scaledobject_matches_the_workers() -> None:
    cfg = pipeline_config()
    so = one("ScaledObject", "prm-scoring-worker")["spec"]
    target = so["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target["name"] in of_kind("Deployment") and target["name"] == worker()["metadata"]["name"]
    assert 1 <= so["minReplicaCount"] <= so["maxReplicaCount"], "the CRD's CEL rule"
    assert so["maxReplicaCount"] <= cfg.topics.partitions, "replicas beyond the partition count sit idle"
    fallback = so.get("fallback")
    if fallback:
        assert so["minReplicaCount"] <= fallback["replicas"] <= so["maxReplicaCount"]
    (trigger,) = so["triggers"]
    assert trigger["type"] == "kafka"
    md = trigger["metadata"]
    assert md["consumerGroup"] == cfg.worker.group_id
    assert md["topic"] == cfg.topics.trajectories
    assert md["bootstrapServers"] == cfg.kafka.bootstrap
    assert int(md["lagThreshold"]) > cfg.worker.concurrency, "in-flight records count as lag"
    assert md["offsetResetPolicy"] == "earliest", "infra.kafka.make_consumer starts new groups at the earliest offset"
    assert md.get("allowIdleConsumers", "false") == "false"
    # KEDA must speak to the brokers the way the workers do.
    tls = "enable" if cfg.kafka.security_protocol in ("SSL", "SASL_SSL") else "disable"
    assert md.get("tls", "disable") == tls
    if cfg.kafka.security_protocol.startswith("SASL"):
        assert md["sasl"] == KEDA_SASL[(cfg.kafka.sasl_mechanism or "PLAIN").upper()]
        auth = one("TriggerAuthentication", trigger["authenticationRef"]["name"])
        refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
        assert {"username", "password"} <= refs.keys()
        secrets = secret_keys()
        for r in refs.values():
            assert r["key"] in secrets.get(r["name"], set()), f"TriggerAuthentication: {r['name']}/{r['key']} missing"
        # ... with the same credentials as the workers.
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(worker())["env"] if "valueFrom" in e}
        for param, var in (("username", "PRM_KAFKA_SASL_USERNAME"), ("password", "PRM_KAFKA_SASL_PASSWORD")):
            assert (refs[param]["name"], refs[param]["key"]) == (env[var]["name"], env[var]["key"])
    else:
        assert md.get("sasl", "none") == "none"


# --------------------------------------------------------------------------- security
@pytest.mark.parametrize("key", sorted(pod_templates()))
def test_pods_run_non_root_read_only_with_resources(key: str) -> None:
    spec = pod_templates()[key]["spec"]
    uid, gid = dockerfile_user()
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == uid and sc.get("runAsGroup", gid) == gid, "runAsUser differs from the image's USER"
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec["containers"]:
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"]["drop"] == ["ALL"]
        assert not csc.get("privileged", False)
        for section in ("requests", "limits"):
            assert {"cpu", "memory"} <= c["resources"][section].keys(), f"{key}: resources.{section}"
        tmp = next((m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"), None)
        assert tmp is not None and "emptyDir" in volumes[tmp["name"]], (
            f"{key}: /tmp must be a writable emptyDir (HOME=/tmp)"
        )


# --------------------------------------------------------------------------- CLI
def check_cli_argv(argv: list[str]) -> str:
    """Parse ``argv`` with the real ``prm-pipeline`` parser (building it imports no torch);
    return the subcommand. Fails on an unknown or deprecated option."""
    from prm_pipeline.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 0, f"{argv}: {err.getvalue().strip()}"
            return "--help"  # printed the help and stopped, as argparse does
    assert "deprecated" not in err.getvalue(), f"{argv}: {err.getvalue().strip()}"  # manifests use today's flags
    return args.command


def test_cli_accepts_the_manifest_and_compose_commands() -> None:
    """The arguments the manifests and compose.yaml pass are ones prm-pipeline parses."""
    commands: dict[str, list[str]] = {}
    for key, template in pod_templates().items():
        for c in template["spec"]["containers"]:
            assert c["command"] == ["prm-pipeline"], key
            commands[key] = c["args"]
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        if "build" in service:
            entry = service.get("entrypoint", ["prm-pipeline"])
            assert entry[0] == "prm-pipeline", name
            commands[f"compose/{name}"] = entry[1:] + service["command"]
    subcommands = {key: check_cli_argv(argv) for key, argv in commands.items()}
    assert {"worker", "trainer", "topics"} <= set(subcommands.values())
    for key, argv in commands.items():
        assert arg_after(argv, "--config") == CONFIG_PATH, key


# --------------------------------------------------------------------------- compose
def worker_services(compose: dict[str, Any]) -> list[str]:
    return [n for n, s in compose["services"].items() if "worker" in s.get("command", [])]


def compose_config(compose: dict[str, Any], service: str) -> PipelineConfig:
    """The config a compose service runs with: its mounted file plus its PRM_* environment."""
    s = compose["services"][service]
    mounts = dict(reversed(v.split(":")[:2]) for v in s["volumes"])
    source = mounts[CONFIG_PATH]
    raw = yaml.safe_load((DEPLOY / source).read_text())
    env = {k: str(v) for k, v in (s.get("environment") or {}).items()}
    return config_from_mapping(raw, environ=env)


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|s|m|h)", duration))


def test_compose_file_parses_and_references_existing_files() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    schema = json.loads((SCHEMAS / "compose-minimal.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(compose, schema, cls=jsonschema.Draft202012Validator)
    services = compose["services"]
    declared_volumes = set(compose.get("volumes") or {})
    for name, s in services.items():
        if "build" in s:
            context = (DEPLOY / s["build"]["context"]).resolve()
            assert context == ROOT, f"{name}: build context must be the repository root"
            assert (context / s["build"]["dockerfile"]).resolve() == DOCKERFILE
        for volume in s.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: bind-mount source {source} does not exist"
            else:
                assert source in declared_volumes, f"{name}: named volume {source!r} is not declared"
        for dep in s.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep!r}"
    # The stack the issue asks for: KRaft Kafka, Redis with AOF, topic setup, 2 workers, a trainer.
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert set(kafka["environment"]["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "noeviction"
    assert services["topics"]["command"][-2:] == ["topics", "create"]
    assert len(worker_services(compose)) == 2
    assert "trainer" in services["trainer"]["command"]
    for name in worker_services(compose):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        port = arg_after(services[name]["command"], "--metrics-port")
        assert f"127.0.0.1:{port}/readyz" in " ".join(services[name]["healthcheck"]["test"])
        assert any(p.endswith(f":{port}") for p in services[name]["ports"])
    worker_ids = [arg_after(services[n]["command"], "--worker-id") for n in worker_services(compose)]
    assert len(set(worker_ids)) == len(worker_ids)


def test_compose_config_loads_and_matches_the_broker() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    kafka_env = compose["services"]["kafka"]["environment"]
    listeners = kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    for name, s in compose["services"].items():
        if "build" not in s:
            continue
        cfg = compose_config(compose, name)
        assert f"//{cfg.kafka.bootstrap}" in listeners, f"{name}: {cfg.kafka.bootstrap} is not an advertised listener"
        assert cfg.kafka.max_message_bytes <= int(kafka_env["KAFKA_MESSAGE_MAX_BYTES"])
        assert cfg.topics.replication_factor == 1, "one broker"
        assert cfg.topics.partitions >= len(worker_services(compose))
        if name in worker_services(compose):
            host = cfg.redis.url.split("//", 1)[1].split(":")[0].split("/")[0]
            assert host in compose["services"], f"{name}: Redis host {host!r} is not a service"


async def test_deployments_inherit_no_embedded_broker_workaround() -> None:
    """The rule: the product defaults are Apache Kafka's, the embedded broker's workarounds
    are the local stack's settings (infra.local.LOCAL_BROKER_CLIENT), so a deployment
    config never has to undo one — and none of them applies one."""
    from infra.config import KafkaConfig
    from infra.kafka import make_consumer
    from infra.local import LOCAL_BROKER_CLIENT

    defaults = KafkaConfig()
    for name, local in LOCAL_BROKER_CLIENT.items():
        assert getattr(defaults, name) != local, f"kafka.{name}: the embedded broker's {local!r} is the default"
    assert defaults.leave_group_on_stop and defaults.fetch_min_wait_ms is None and defaults.fetch_max_wait_ms == 500
    consumer = make_consumer(defaults, group_id=None)
    assert consumer.fetch_wait is None  # no adaptive wait: aiokafka's fetcher left as it is
    await consumer.stop()
    compose = yaml.safe_load(COMPOSE.read_text())
    configs = [("configmap", pipeline_config())] + [
        (name, compose_config(compose, name)) for name, s in compose["services"].items() if "build" in s
    ]
    for where, cfg in configs:
        for name, local in LOCAL_BROKER_CLIENT.items():
            if name in ("session_timeout_ms", "heartbeat_interval_ms"):
                continue  # timings, not workarounds: a deployment may pick any
            assert getattr(cfg.kafka, name) != local, f"{where}: kafka.{name} is the embedded broker's {local!r}"


# --------------------------------------------------------------------------- Dockerfile
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def dockerfile_user() -> tuple[int, int]:
    users = [rest for op, rest in dockerfile_instructions() if op == "USER"]
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), "USER must be numeric for runAsNonRoot to verify it"
    return int(uid), int(gid)


def test_dockerfile_installs_the_project_as_non_root() -> None:
    instructions = dockerfile_instructions()
    froms = [rest for op, rest in instructions if op == "FROM"]
    args = dict(rest.split("=", 1) for op, rest in instructions if op == "ARG" and "=" in rest)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    # COPY sources exist (relative to the context = repository root) and survive the ignore file.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    copied = []
    for op, rest in instructions:
        if op == "COPY" and not rest.startswith("--from"):
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert f"!{src}" in ignore or f"!{src}/" in ignore, f"COPY {src}: excluded by Dockerfile.dockerignore"
                copied.append(src.rstrip("/"))
    # Every package pyproject.toml installs is copied into the build.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"
    assert pyproject["project"]["readme"] in copied
    run = " ".join(rest for op, rest in instructions if op == "RUN")
    assert "pip install ." in run
    assert dockerfile_user()[0] != 0
    entrypoint = [rest for op, rest in instructions if op == "ENTRYPOINT"][-1]
    assert json.loads(entrypoint) == ["prm-pipeline"]
    # compose runs as the same user as the Kubernetes pods.
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, s in compose["services"].items():
        if "build" in s:
            assert s["user"] == "{}:{}".format(*dockerfile_user()), name
            assert s["read_only"] is True, name


# --------------------------------------------------------------------------- docs
def test_deploy_docs_cover_the_files_and_the_health_contract() -> None:
    docs = (ROOT / "docs" / "deploy.md").read_text()
    names = [p.name for p in K8S.glob("*.yaml")] + ["compose.yaml", "Dockerfile"]
    missing = [n for n in names if n not in docs]
    assert not missing, f"docs/deploy.md does not mention {missing}"
    for term in (
        "/healthz",
        "/readyz",
        "9108",
        "drain_timeout_s",
        "max.message.bytes",
        "message.max.bytes",
        "rediss://",
        "{group_id}",
        "lagThreshold",
    ):
        assert term in docs, f"docs/deploy.md does not explain {term}"
