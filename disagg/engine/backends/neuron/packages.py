"""Importing NxDI, with the install command in the error when it is missing.

The PyPI entries of neuronx-distributed-inference and torch-neuronx are
placeholders that raise ImportError on import; the real packages are only in
the Neuron package repository.
"""

from __future__ import annotations

import importlib

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
