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


def test_the_wheel_carries_every_c_kernel_and_the_verdicts(tmp_path):
    """A wheel without a kernel's source falls back silently, or fails where there is no compiler."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("disagg-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "disagg").rglob("*.c")}
    assert len(sources) >= 3 and sources <= shipped, sources - shipped
    assert "disagg/engine/backends/model_support.json" in shipped


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


@pytest.mark.parametrize("version, served", [("0.7.15603", True), ("0.8.16251", True), ("0.9.17334", True), ("0.6.10598", False), ("0.3.0", False), ("0.10.0", False)])
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
