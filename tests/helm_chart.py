"""The Helm chart rendered by Helm's own engine, and the image's entrypoint as the
images run it: shared by tests/test_chart.py and tests/test_discovery.py.

Rendering uses helm-python-sdk (Helm v4's Go SDK as a shared library, no
cluster, no helm binary); validation uses kubernetes-validate's bundled schemas
of a current Kubernetes release, and for the ServiceMonitor the Prometheus
Operator's own CRD schema (tests/k8s_schemas/README.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "disagg"
IMAGES = ROOT / "deploy" / "images"
SCHEMAS = pathlib.Path(__file__).resolve().parent / "k8s_schemas"
KUBERNETES = "1.37"  # the newest release kubernetes-validate bundles schemas for


def render(values: dict | None = None, values_file: pathlib.Path | None = None, name: str = "demo", namespace: str = "llm") -> list[dict]:
    """Every object the chart renders, in order; values_file first, then values on top."""
    import helm_python as helm

    merged = yaml.safe_load(values_file.read_text()) if values_file else {}
    _deep_update(merged, values or {})
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(merged, name=name, namespace=namespace, is_install=True)
    objects = []
    for path in sorted(manifests):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(manifests[path]) if doc]
    return objects


def _deep_update(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def find(objects: list[dict], kind: str, name_suffix: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"{kind} *{name_suffix}: {len(matches)} found"
    return matches[0]


def _strict(schema):
    """A CRD schema with unknown fields refused, as the API server's strict field
    validation does for structural schemas (kubectl apply --validate=strict)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        closed = schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
        if closed and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def validate(obj: dict) -> None:
    """Raises if obj is not valid for KUBERNETES (unknown fields included)."""
    import jsonschema
    import kubernetes_validate

    group, _, version = obj["apiVersion"].rpartition("/")
    crd = SCHEMAS / f"{obj['kind'].lower()}-{group.split('.')[0]}-{version}.json"
    if group and crd.exists():
        jsonschema.validate(obj, _strict(json.loads(crd.read_text())))
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, KUBERNETES, strict=True)  # its ObjectMeta
    else:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def entrypoint_in_images() -> str:
    """The ENTRYPOINT of both Containerfiles (they must agree)."""
    found = set()
    for containerfile in sorted(IMAGES.glob("Containerfile.*")):
        match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", containerfile.read_text(), re.MULTILINE)
        assert match, f"{containerfile.name} has no exec-form ENTRYPOINT"
        found.add(tuple(json.loads(match[1])))
    assert len(found) == 1, f"the images' entrypoints differ: {found}"
    (entrypoint,) = found
    return entrypoint


def local_path(image_path: str) -> pathlib.Path:
    """Where a file the images COPY into image_path lives in the repository."""
    for containerfile in IMAGES.glob("Containerfile.*"):
        for source, target in re.findall(r"^COPY\s+(\S+)\s+(\S+)\s*$", containerfile.read_text(), re.MULTILINE):
            if target == image_path:
                return ROOT / source
    raise AssertionError(f"no Containerfile copies anything to {image_path}")


def container(objects: list[dict], role: str) -> dict:
    deployment = find(objects, "Deployment", f"-{role}")
    (spec,) = deployment["spec"]["template"]["spec"]["containers"]
    return spec


def run_container(spec: dict, extra_env: dict[str, str], log_path: pathlib.Path) -> subprocess.Popen:
    """Starts a container's process as the image does: the image's ENTRYPOINT (the
    repository's copy of it) with the container's args and env. The image's own
    ENV (PATH=/opt/venv/bin:$PATH) is this test's Python environment; extra_env
    stands for what a pod has that a process here has not (its IP, DISAGG_HOST)."""
    entrypoint = [str(local_path(a)) if a.startswith("/opt/") else a for a in entrypoint_in_images()]
    command = entrypoint + [str(a) for a in spec.get("command", []) + spec.get("args", [])]
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for variable in spec.get("env", []):
        assert "value" in variable, f"{variable['name']} comes from the cluster ({variable}); give it in extra_env"
        env[variable["name"]] = variable["value"]
    env.update(extra_env)
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
