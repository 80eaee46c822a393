"""Backend registry: the worker names a backend; only the chosen one is imported."""

from __future__ import annotations

import logging

from ..dtype_choice import choose_dtype
from .base import Backend, ModelInfo, PrefillResult, StepInputs

BACKENDS = ("torch", "neuron")

log = logging.getLogger(__name__)


def load_backend(name: str, batch_size: int = 1, neuron: dict | None = None, torch: dict | None = None, **options) -> Backend:
    """options: model, dtype, device, max_seq_len, global_topk; batch_size and the
    neuron options only matter to the neuron backend, which compiles for them;
    the torch options (compile, buckets) only to the torch backend. dtype "auto":
    chosen for the device here (`dtype_choice`), and logged with the reason."""
    if options.get("dtype") == "auto":
        options["dtype"], why = choose_dtype(name, options.get("device") or "cpu", options.get("model"))
        log.info("dtype auto: %s (%s)", options["dtype"], why)
    if name == "torch":
        from .architectures import check_transformers_release

        check_transformers_release()  # before the import: its modules need that release's transformers
        from .torch_backend import TorchBackend, TorchBackendConfig

        return TorchBackend(TorchBackendConfig(**options, **(torch or {})))
    if name == "neuron":
        from .neuron import load_neuron_backend

        return load_neuron_backend(batch_size=batch_size, **options, **(neuron or {}))
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "BACKENDS", "ModelInfo", "PrefillResult", "StepInputs", "load_backend"]
