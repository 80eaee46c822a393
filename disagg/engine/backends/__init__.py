"""Backend registry: the worker names a backend; only the chosen one is imported."""

from __future__ import annotations

from .base import Backend, ModelInfo, PrefillResult, StepInputs

BACKENDS = ("torch", "neuron")


def load_backend(name: str, **options) -> Backend:
    if name == "torch":
        from .torch_backend import TorchBackend, TorchBackendConfig

        return TorchBackend(TorchBackendConfig(**options))
    if name == "neuron":
        from .neuron_backend import load_neuron_backend

        return load_neuron_backend(**options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "BACKENDS", "ModelInfo", "PrefillResult", "StepInputs", "load_backend"]
