"""Compiling an NxDI model once per configuration, and loading it after."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib

from .config import MODEL_CLASSES, NeuronOptions, compiled_path, neuron_config_kwargs
from .packages import import_nxdi

log = logging.getLogger(__name__)

TRACED_MODEL_FILE = "model.pt"  # application_base.COMPILED_MODEL_FILE_NAME, written last by compile()
COMPILE_WORK_DIR_ENV = "BASE_COMPILE_WORK_DIR"  # read by NxDI's get_builder when compile() runs


def model_class(architecture: str):
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"the neuron backend has no NxDI model class for {architecture}; supported: {', '.join(sorted(MODEL_CLASSES))}")
    module, name = MODEL_CLASSES[architecture]
    return getattr(import_nxdi(module), name)


def is_compiled(path: pathlib.Path) -> bool:
    # NxDI's compile() saves neuron_config.json before tracing: only the traced model,
    # written after the trace, says a compile finished.
    return (path / TRACED_MODEL_FILE).exists()


@contextlib.contextmanager
def compile_work_dir(path: pathlib.Path):
    """NxDI traces in BASE_COMPILE_WORK_DIR (/tmp/nxd_model/ by default) and deletes it
    afterwards; each compiled path gets its own, so two workers compiling at once on
    one instance keep their files."""
    work = path.with_name(path.name + ".work")
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
    return config_cls(neuron_config, load_config=hf_adapter.load_pretrained_config(options.model))


def compile_or_load(options: NeuronOptions):
    """The loaded NxDI model: compiled once into its own directory, loaded from it after."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(options.model)
    cls = model_class((hf_config.architectures or ["?"])[0])
    config = build_config(cls, options)
    path = compiled_path(options)
    if not is_compiled(path):
        log.info("compiling %s for Neuron into %s (once per configuration)", options.model, path)
        with compile_work_dir(path):
            cls(options.model, config).compile(str(path) + "/")
    model = cls(options.model, config)
    model.load(str(path) + "/")
    return model, hf_config
