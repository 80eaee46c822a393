"""Compiling an NxDI model once per configuration, and loading it after.

Complete directories, the lock and the atomic rename are artifacts.py's; the
phases (compiling, waiting for another process's compile, loading) go to the
worker's start-up status (disagg/rpc/startup.py), so a launcher waits for a compile
and a log shows its progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import time

from disagg.rpc import startup

from . import artifacts
from .config import MODEL_CLASSES, NeuronOptions, compiled_lines, compiled_path, full_attention_window, neuron_config_kwargs
from .packages import INSTALL, NeuronPackagesMissing, UnsupportedNxdi, import_nxdi

log = logging.getLogger(__name__)

COMPILE_WORK_DIR_ENV = "BASE_COMPILE_WORK_DIR"  # read by NxDI's get_builder when compile() runs


def model_class(architecture: str):
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"the neuron backend has no NxDI model class for {architecture}; supported: {', '.join(sorted(MODEL_CLASSES))}")
    module, name = MODEL_CLASSES[architecture]
    try:
        return getattr(import_nxdi(module), name)
    except NeuronPackagesMissing:
        # NxDI itself imports (its release was checked): this release has no such model (Mistral came in 0.9).
        version = getattr(import_nxdi(), "__version__", "?")
        raise UnsupportedNxdi(f"NxDI {version} has no {name} ({module}) for {architecture}; upgrade NxDI: {INSTALL}") from None


@contextlib.contextmanager
def compile_work_dir(path: pathlib.Path):
    """NxDI traces in BASE_COMPILE_WORK_DIR (/tmp/nxd_model/ by default) and deletes it
    afterwards; each compiled path gets its own, so two workers compiling at once on
    one instance keep their files."""
    work = artifacts.work_path(path)
    previous = os.environ.get(COMPILE_WORK_DIR_ENV)
    os.environ[COMPILE_WORK_DIR_ENV] = str(work) + "/"
    try:
        yield
    finally:
        os.environ.pop(COMPILE_WORK_DIR_ENV) if previous is None else os.environ.__setitem__(COMPILE_WORK_DIR_ENV, previous)


def build_config(cls, options: NeuronOptions):
    nxdi_config = import_nxdi("neuronx_distributed_inference.models.config")
    hf_adapter = import_nxdi("neuronx_distributed_inference.utils.hf_adapter")
    sampling = nxdi_config.OnDeviceSamplingConfig(dynamic=True, do_sample=True, global_topk=options.global_topk)
    config_cls = cls.get_config_cls()
    # The model's own NeuronConfig class: Mixtral's is MoENeuronConfig, whose fields its MoE modules read.
    neuron_config = config_cls.get_neuron_config_cls()(**neuron_config_kwargs(options, sampling))
    config = config_cls(neuron_config, load_config=hf_adapter.load_pretrained_config(options.model))
    full_attention_window(config, options.seq_len)  # before the model is built from it
    return config


def describe(options: NeuronOptions) -> str:
    model = pathlib.Path(options.model.rstrip("/")).name
    return f"{model} for Neuron (tp {options.tp_degree}, {compiled_lines(options)} KV lines, seq {options.seq_len}, {options.dtype})"


def compile_or_load(options: NeuronOptions):
    """The loaded NxDI model: compiled once into its own directory, loaded from it after."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(options.model)
    cls = model_class((hf_config.architectures or ["?"])[0])
    config = build_config(cls, options)
    nxdi = artifacts.nxdi_version()
    path = compiled_path(options, nxdi)
    ensure_compiled(cls, options, config, path, nxdi)
    startup.report(startup.Phase.LOADING, f"loading {describe(options)} from {path}")
    model = cls(options.model, config)
    model.load(str(path) + "/")
    return model, hf_config


def ensure_compiled(cls, options: NeuronOptions, config, path: pathlib.Path, nxdi: str) -> None:
    """Compiles into path unless it is complete; a second process asking for the same path
    meanwhile waits for the first and loads its result."""
    if artifacts.is_complete(path):
        return
    waiting = f"waiting for another process compiling {describe(options)} into {path}"
    with artifacts.exclusive(path, on_wait=lambda: startup.report(startup.Phase.WAITING_FOR_COMPILE, waiting)):
        if artifacts.is_complete(path):  # the process we waited for finished it
            return
        artifacts.clear_leftovers(path)
        partial = artifacts.partial_path(path)
        started = time.monotonic()
        with startup.phase(startup.Phase.COMPILING, f"compiling {describe(options)} into {path}", after=f"compiled {describe(options)}"):
            with compile_work_dir(path):
                cls(options.model, config).compile(str(partial) + "/")
        seconds = time.monotonic() - started
        record = {"nxdi": nxdi, "options": dataclasses.asdict(options), "compile_seconds": round(seconds, 1)}
        artifacts.install_complete(partial, path, record)
        log.info("compiled %s in %.0f s into %s", describe(options), seconds, path)
