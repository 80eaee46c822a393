"""Importing NxDI, with the install command in the error when it is missing.

The PyPI entries of neuronx-distributed-inference and torch-neuronx are
placeholders that raise ImportError on import; the real packages are only in
the Neuron package repository.
"""

from __future__ import annotations

import importlib
import re

INSTALL = "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com 'disagg[neuron]'"


class NeuronPackagesMissing(RuntimeError):
    pass


def import_nxdi(module: str = "neuronx_distributed_inference"):
    """Imports an NxDI module, or raises NeuronPackagesMissing naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NeuronPackagesMissing(
            f"--backend neuron needs neuronx-distributed-inference and torch-neuronx from the Neuron package "
            f"repository (the PyPI packages of those names are placeholders). Install them on a Neuron instance with:\n"
            f"  {INSTALL}\n(import of {module} failed: {exc})"
        ) from exc


# The releases this backend was read against (NxDI 0.7-0.9, Neuron SDK 2.27-2.29): each
# builds the KV cache with apply_seq_ids_mask's 128-position pad and has continuous
# batching with dynamic on-device sampling. Before 0.4 NeuronConfig dropped
# apply_seq_ids_mask with a log line, and padded rows then wrote KV into a slot that was
# receiving KV; 0.4-0.6 were not read.
SUPPORTED_RELEASES = ((0, 7), (0, 10))  # [from, to)


class UnsupportedNxdi(RuntimeError):
    pass


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of an NxDI version string: "0.9.0", "0.7.14366", "0.9.0+1a2b3c4d.dev"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise UnsupportedNxdi(f"cannot read the NxDI version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_nxdi_release() -> str:
    """The installed NxDI's version, refused outside SUPPORTED_RELEASES with the install command."""
    version = getattr(import_nxdi(), "__version__", "unknown")
    low, high = SUPPORTED_RELEASES
    if not low <= release_of(version) < high:
        raise UnsupportedNxdi(
            f"neuronx-distributed-inference {version} is installed; the neuron backend serves NxDI "
            f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))} (Neuron SDK 2.27-2.29): {INSTALL}"
        )
    return version


def check_seq_ids_mask(neuron_config) -> None:
    """The loaded config must keep apply_seq_ids_mask: without it a decode step's padded rows
    write KV into lines that are receiving a hand-off (KVCacheManager.update_cache)."""
    if getattr(neuron_config, "apply_seq_ids_mask", False) is not True:
        raise UnsupportedNxdi(
            "NxDI's NeuronConfig did not keep apply_seq_ids_mask=True (releases before 0.4 drop it): padded decode rows would "
            f"overwrite KV being handed off; install NxDI >=0.7,<0.10: {INSTALL}"
        )


def check_transformers_for_nxdi() -> None:
    """NxDI 0.7-0.9 pin transformers 4.56/4.57; under 5 their configs miss what NxDI's
    validate_config requires (rope_theta moved into rope_parameters), so refuse with the reason."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        raise UnsupportedNxdi(
            f"the neuron backend runs under NxDI's own transformers release (4.56 for NxDI 0.7, 4.57 for 0.8 and 0.9); this "
            f"environment has transformers {transformers.__version__}: {INSTALL}"
        )
