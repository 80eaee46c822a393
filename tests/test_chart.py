"""The Helm chart (deploy/helm/disagg) and the images (deploy/images), offline:
rendered by Helm's engine and validated object by object against a current
Kubernetes release's schemas; the wiring between the parts checked on the
rendered objects (probes, drain, Neuron resources, network policy, autoscaling
metrics that the processes really export)."""

from __future__ import annotations

import re

import pytest
import yaml
from helm_chart import (
    CHART,
    IMAGES,
    KUBERNETES,
    ROOT,
    container,
    entrypoint_in_images,
    find,
    local_path,
    render,
    validate,
)
from prometheus_client import CollectorRegistry

from disagg.rpc.metrics import DecodeMetrics, PrefillMetrics, RouterMetrics

NEURON_VALUES = CHART / "values-neuron.yaml"
EVERYTHING_ON = {
    "tls": {"enabled": True},
    "model": {
        "path": "/models/m",
        "volume": {"emptyDir": {}},
        "init": {"image": "amazon/aws-cli:2", "command": ["aws", "s3", "sync", "s3://bucket/m", "/models/m"]},
    },
    "router": {
        "http": {"enabled": True},
        "publicTls": {"enabled": True, "secretName": "public"},
        "authTokenSecret": {"name": "token", "key": "token"},
        "extraDecodeTargets": ["10.0.0.9:50061"],
    },
    "prefill": {"autoscaling": {"enabled": True}, "extraResources": {"vpc.amazonaws.com/efa": 1}},
    "decode": {"autoscaling": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusAdapterRules": {"enabled": True}},
    "networkPolicy": {"routerFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]},
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {"default": render(), "neuron": render(values_file=NEURON_VALUES), "everything": render(EVERYTHING_ON)}


@pytest.mark.parametrize("case", ["default", "neuron", "everything"])
def test_every_rendered_object_is_valid_for_kubernetes(rendered, case):
    objects = rendered[case]
    for obj in objects:
        validate(obj)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount"} <= kinds
    if case != "default":
        assert {"HorizontalPodAutoscaler", "ServiceMonitor", "ConfigMap"} <= kinds
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"] == ["demo-disagg-router", "demo-disagg-prefill", "demo-disagg-decode"]


def test_the_validator_refuses_what_kubernetes_refuses():
    """The check above can fail: a misspelled field, a wrong type, an unknown CRD field."""
    import jsonschema
    import kubernetes_validate

    deployment = find(render(), "Deployment", "-decode")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    service = find(render(), "Service", "-decode")
    service["spec"]["ports"][0]["port"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service)
    monitor = find(render(EVERYTHING_ON), "ServiceMonitor", "")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


def test_helm_lint_finds_nothing_to_fix():
    import helm_python as helm

    for values in ({}, yaml.safe_load(NEURON_VALUES.read_text())):
        findings = helm.lint(str(CHART), values=values, strict=True, kube_version=KUBERNETES)
        # Helm's severities: 1 info (an icon is recommended), 2 warning, 3 error.
        assert not findings["errors"] and not [m for m in findings["messages"] if m["severity"] >= 2], findings


def test_router_resolves_the_headless_worker_services(rendered):
    objects = rendered["default"]
    args = container(objects, "router")["args"]
    for role, port in (("prefill", 50051), ("decode", 50061)):
        service = find(objects, "Service", f"-{role}")
        assert service["spec"]["clusterIP"] == "None"  # headless: DNS answers with the ready pods' addresses
        assert {p["port"] for p in service["spec"]["ports"]} == {port, 9401 if role == "prefill" else 9402}
        assert args[args.index(f"--{role}") + 1] == f"dns:///demo-disagg-{role}.llm.svc.cluster.local:{port}"
    assert find(objects, "Service", "-router")["spec"].get("clusterIP") != "None"


@pytest.mark.parametrize("case", ["default", "everything"])
def test_prefill_pods_send_kv_only_to_the_decode_pool_the_router_uses(rendered, case):
    objects = rendered[case]
    router, prefill = container(objects, "router")["args"], container(objects, "prefill")["args"]
    pairs = lambda args: [args[i + 1] for i, a in enumerate(args) if a == "--decode"]  # noqa: E731
    assert pairs(prefill) == pairs(router) and pairs(router)[0].startswith("dns://")
    assert ("10.0.0.9:50061" in pairs(prefill)) == (case == "everything")  # router.extraDecodeTargets too
    assert "--decode" not in container(objects, "decode").get("args", [])


@pytest.mark.parametrize("case", ["default", "everything"])
def test_probes_ask_the_standard_health_service_and_drain_fits_the_grace_period(rendered, case):
    objects = rendered[case]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ("router", "prefill", "decode"):
        spec = container(objects, role)
        pod = find(objects, "Deployment", f"-{role}")["spec"]["template"]["spec"]
        tls = case == "everything"
        for probe, service in (("readinessProbe", ""), ("livenessProbe", "liveness"), ("startupProbe", "liveness")):
            if tls:  # the kubelet's gRPC probe has no TLS: the image's entrypoint asks instead
                assert spec[probe]["exec"]["command"] == [entrypoint_in_images()[0], "probe", *(["--service", service] if service else [])]
            else:
                assert spec[probe]["grpc"] == {"port": spec["ports"][0]["containerPort"], **({"service": service} if service else {})}
        sleep = int(spec["lifecycle"]["preStop"]["exec"]["command"][1])
        grace = float(next(e["value"] for e in spec["env"] if e["name"] == "DISAGG_GRACE_SECONDS"))
        # The kubelet waits for the preStop sleep plus the part's own drain.
        assert pod["terminationGracePeriodSeconds"] >= sleep + grace
        # The sleep outlasts a DNS answer's 5 s TTL plus the routers' re-resolution.
        assert sleep >= 5 + values["router"]["resolveSeconds"]


def test_neuron_values_ask_for_neuron_cores_on_neuron_instances(rendered):
    objects = rendered["neuron"]
    for role in ("prefill", "decode"):
        spec = container(objects, role)
        pod = find(objects, "Deployment", f"-{role}")["spec"]["template"]["spec"]
        args = spec["args"]
        assert args[args.index("--backend") + 1] == "neuron"
        tp = int(args[args.index("--tp-degree") + 1])
        assert spec["resources"]["limits"]["aws.amazon.com/neuroncore"] == tp == spec["resources"]["requests"]["aws.amazon.com/neuroncore"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        types = terms[0]["matchExpressions"][0]["values"]
        assert {"trn1.32xlarge", "inf2.48xlarge", "trn2.48xlarge"} <= set(types)
        assert any(t["key"] == "aws.amazon.com/neuron" for t in pod["tolerations"])
        assert args[args.index("--neuron-compiled-path") + 1] == spec["volumeMounts"][-1]["mountPath"]
    router = find(objects, "Deployment", "-router")["spec"]["template"]["spec"]
    assert "aws.amazon.com/neuroncore" not in str(router["containers"][0]["resources"])


def test_mutual_tls_comes_from_a_cert_manager_secret(rendered):
    objects = rendered["everything"]
    for role in ("router", "prefill", "decode"):
        spec = container(objects, role)
        pod = find(objects, "Deployment", f"-{role}")["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in spec["env"]}
        mount = next(m for m in spec["volumeMounts"] if m["name"] == "tls")
        assert env["DISAGG_TLS_DIR"] == mount["mountPath"] and mount["readOnly"]
        assert env["DISAGG_TLS_SERVER_NAME"] == "disagg-internal"
        assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "disagg-internal-tls"
    # The entrypoint reads exactly cert-manager's key names.
    script = local_path(entrypoint_in_images()[0]).read_text()
    assert all(f'"$DISAGG_TLS_DIR/{name}"' in script for name in ("tls.crt", "tls.key", "ca.crt"))


def test_only_the_router_and_the_peers_reach_the_workers(rendered):
    policy = find(rendered["default"], "NetworkPolicy", "-workers")["spec"]
    assert policy["podSelector"]["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]
    peers, metrics = policy["ingress"]
    (peer,) = peers["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"
    assert peer["podSelector"]["matchExpressions"][0]["values"] == ["router", "prefill", "decode"]
    assert "ports" not in peers  # the KV hand-off (gRPC, or NIXL's own ports) between the peers
    assert [p["port"] for p in metrics["ports"]] == [9401, 9402]  # the rest: metrics only


def _exported_metric_names() -> set[str]:
    names = set()
    for metrics_class in (RouterMetrics, PrefillMetrics, DecodeMetrics):
        registry = CollectorRegistry()
        metrics_class(registry)
        names |= {sample.name for family in registry.collect() for sample in family.samples}
    return names


def test_autoscalers_use_metrics_the_adapter_publishes_from_series_the_workers_export(rendered):
    objects = rendered["everything"]
    rules = yaml.safe_load(find(objects, "ConfigMap", "-adapter-rules")["data"]["config.yaml"])["rules"]
    published = {rule["name"]["as"]: rule for rule in rules}
    exported = _exported_metric_names()
    for rule in rules:
        series = set(re.findall(r"\bdisagg_[a-z_]+", rule["seriesQuery"] + rule["metricsQuery"]))
        assert series <= exported, series - exported
    for role, metric in (("prefill", "disagg_prefill_queued_prompt_tokens"), ("decode", "disagg_decode_slot_utilization")):
        hpa = find(objects, "HorizontalPodAutoscaler", f"-{role}")["spec"]
        assert hpa["scaleTargetRef"]["name"] == f"demo-disagg-{role}"
        (target,) = hpa["metrics"]
        assert target["pods"]["metric"]["name"] == metric and metric in published
        assert "replicas" not in find(objects, "Deployment", f"-{role}")["spec"]  # the HPA owns it
    monitor = find(objects, "ServiceMonitor", "")["spec"]
    assert monitor["endpoints"][0]["port"] == "metrics"
    for role in ("router", "prefill", "decode"):
        assert "metrics" in {p["name"] for p in find(objects, "Service", f"-{role}")["spec"]["ports"]}


def test_images_copy_what_exists_and_share_one_entrypoint():
    entrypoint = entrypoint_in_images()
    assert entrypoint == ("/opt/disagg/entrypoint.sh",)
    assert local_path(entrypoint[0]) == IMAGES / "entrypoint.sh"
    ignored = (ROOT / ".dockerignore").read_text().split()
    for containerfile in IMAGES.glob("Containerfile.*"):
        text = containerfile.read_text()
        assert re.search(r"^USER 10001", text, re.MULTILINE), f"{containerfile.name} runs as root"
        for source in re.findall(r"^COPY\s+(\S+)\s+\S+\s*$", text, re.MULTILINE):
            assert (ROOT / source).exists(), f"{containerfile.name}: COPY {source}: no such path"
            assert source not in ignored
    assert "torch==${TORCH_VERSION}" in (IMAGES / "Containerfile.cpu").read_text()
    assert "pip.repos.neuron.amazonaws.com" in (IMAGES / "Containerfile.neuron").read_text()


def test_the_tls_probe_runs_as_the_chart_runs_it_against_a_pod_dialled_by_ip(tmp_path):
    """The exec probe of a worker with mutual TLS, as rendered, against a server whose
    certificate names only tls.serverName (no IP): SERVING -> 0, NOT_SERVING -> 1,
    and the same certificate check fails without the name (what --tls-server-name fixes)."""
    import asyncio
    import os
    import shutil
    import subprocess
    import sys
    from concurrent import futures

    import grpc
    from certs import CertificateAuthority
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from disagg.rpc.security import TlsFiles, open_channel

    ca = CertificateAuthority(tmp_path, "ca")
    secret = tmp_path / "secret"  # what cert-manager writes into the Secret
    secret.mkdir()
    cert, key = ca.issue("pod", dns_names=("disagg-internal",), ips=())
    for name, path in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca.cert_path)):
        shutil.copy(path, secret / name)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    statuses = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(statuses, server)
    key_pair = ((secret / "tls.key").read_bytes(), (secret / "tls.crt").read_bytes())
    credentials = grpc.ssl_server_credentials([key_pair], (secret / "ca.crt").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        spec = container(render(EVERYTHING_ON), "decode")
        env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
        env.update({e["name"]: e["value"] for e in spec["env"]})
        env.update({"DISAGG_TLS_DIR": str(secret), "DISAGG_PORT": str(port)})  # the Secret's mount; the pod's port

        def probe(kind: str) -> int:
            command = [str(local_path(spec[kind]["exec"]["command"][0])), *spec[kind]["exec"]["command"][1:]]
            return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, timeout=60, check=False).returncode

        statuses.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        statuses.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        assert (probe("readinessProbe"), probe("livenessProbe")) == (1, 0)
        statuses.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe("readinessProbe") == 0
        env.pop("DISAGG_TLS_SERVER_NAME")  # the certificate does not name 127.0.0.1
        assert probe("readinessProbe") == 1

        # The router's and the prefill worker's channels (disagg.rpc.security.open_channel) check the same way.
        async def check(server_name):
            files = TlsFiles(str(secret / "tls.crt"), str(secret / "tls.key"), str(secret / "ca.crt"), server_name=server_name)
            async with open_channel(f"127.0.0.1:{port}", files) as channel:
                return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)).status

        assert asyncio.run(check("disagg-internal")) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(check(None))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
