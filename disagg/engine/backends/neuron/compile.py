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
import shutil
import time

from disagg.rpc import startup

from . import artifacts
from .config import (
    MODEL_CLASSES,
    NeuronOptions,
    compiled_lines,
    compiled_path,
    draft_neuron_config,
    draft_quantized_path,
    full_attention_window,
    neuron_config_kwargs,
)
from .packages import INSTALL, NeuronPackagesMissing, UnsupportedNxdi, import_nxdi

log = logging.getLogger(__name__)

COMPILE_WORK_DIR_ENV = "BASE_COMPILE_WORK_DIR"  # read by NxDI's get_builder when compile() runs
# What NxDI's inference_demo sets for an f8e4m3 model before it compiles and loads (torch-xla's
# handling of the fp8 casts); NxDI's ModelWrapper adds the compiler's fp8 option itself.
FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}


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
    if options.speculation is not None:
        config.fused_spec_config = fused_spec_config(cls, config, options)
    return config


def fused_spec_config(cls, config, options: NeuronOptions):
    """NxDI's FusedSpecNeuronConfig, built as its inference_demo builds it: the draft's InferenceConfig of the target's
    config class over the draft checkpoint, and worker_cls the target's model (NeuronFusedSpecModel builds the draft
    from worker_cls when draft_model_cls is None, so the draft must be of the target's architecture)."""
    from transformers import AutoConfig

    from . import eagle_draft

    if options.speculation == "eagle":  # NxDI's draft reads its own embeddings and LM head: a directory with the target's
        head = eagle_draft.check_eagle_target(options)
        # NeuronConfig.enable_eagle_draft_input_norm: whether the head's layers norm their input
        checkpoint, input_norm = str(eagle_draft.ensure_draft_directory(options)), head.layers[0].input_layernorm is not None
    else:
        checkpoint, input_norm = options.draft_model, False
    target, draft = ((AutoConfig.from_pretrained(path).architectures or ["?"])[0] for path in (options.model, checkpoint))
    if draft != target:
        raise ValueError(f"--draft-model {options.draft_model} is a {draft}: NxDI's fused speculation builds the draft with the model's own "
                         f"class (FusedSpecNeuronConfig.worker_cls), so it must be a {target}")
    # Quantized, the draft's weights are its own quantized state dict (made before the compile, ensure_quantized_draft).
    weights = str(draft_quantized_path(options, checkpoint)) if options.quantization else checkpoint
    nxdi_config = import_nxdi("neuronx_distributed_inference.models.config")
    hf_adapter = import_nxdi("neuronx_distributed_inference.utils.hf_adapter")
    draft_config = cls.get_config_cls()(
        draft_neuron_config(config.neuron_config, options.speculation, input_norm, weights), load_config=hf_adapter.load_pretrained_config(checkpoint)
    )
    full_attention_window(draft_config, options.seq_len)
    return nxdi_config.FusedSpecNeuronConfig(cls._model_cls, draft_config=draft_config, draft_model_path=weights)


def describe(options: NeuronOptions) -> str:
    model = pathlib.Path(options.model.rstrip("/")).name
    weights = f", {options.quantization} {options.quantization_type} weights" if options.quantization else ""
    weights += ", fp8 KV cache" if options.kv_cache_dtype == "fp8" else ""
    draft = pathlib.Path(options.draft_model.rstrip("/")).name
    draft = f", {options.speculation} {draft} fused, {options.speculation_length} positions a step" if options.speculation else ""
    return f"{model} for Neuron (tp {options.tp_degree}, {compiled_lines(options)} KV lines, seq {options.seq_len}, {options.dtype}{weights}{draft})"


def set_quantization_env(options: NeuronOptions) -> None:
    """The environment an fp8 model (fp8 weights, or an fp8 KV cache) compiles and runs under, as NxDI's
    inference_demo sets it (values already in the environment are kept)."""
    if options.quantization == "fp8" or options.kv_cache_dtype == "fp8":
        for name, value in FP8_ENV.items():
            os.environ.setdefault(name, value)


def compile_or_load(options: NeuronOptions):
    """The loaded NxDI model: compiled once into its own directory, loaded from it after."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(options.model)
    cls = model_class((hf_config.architectures or ["?"])[0])
    config = build_config(cls, options)
    nxdi = artifacts.nxdi_version()
    path = compiled_path(options, nxdi)
    set_quantization_env(options)
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
        ensure_quantized(cls, options, config)  # read by the compile's weight sharding; a load reads the sharded weights only
        ensure_quantized_draft(cls, options, config)
        partial = artifacts.partial_path(path)
        started = time.monotonic()
        with startup.phase(startup.Phase.COMPILING, f"compiling {describe(options)} into {path}", after=f"compiled {describe(options)}"):
            with compile_work_dir(path):
                cls(options.model, config).compile(str(partial) + "/")
        seconds = time.monotonic() - started
        record = {"nxdi": nxdi, "options": dataclasses.asdict(options), "compile_seconds": round(seconds, 1)}
        artifacts.install_complete(partial, path, record)
        log.info("compiled %s in %.0f s into %s", describe(options), seconds, path)


def ensure_quantized(cls, options: NeuronOptions, config) -> None:
    """NxDI's quantized state dict at config.neuron_config.quantized_checkpoints_path, made once
    per checkpoint and settings (config.quantized_path) as NxDI's inference_demo makes it before
    compiling: the model class's save_quantized_state_dict(model_path, config), which loads the
    Hugging Face model (load_hf_model), quantizes its linears (generate_quantized_state_dict) and,
    the path being a directory, saves safetensors there. Made in a partial directory renamed
    into place when complete, under a lock, as a compile is (artifacts.py)."""
    if options.quantization:
        quantize_once(cls, options, options.model, config)


def ensure_quantized_draft(cls, options: NeuronOptions, config) -> None:
    """With speculation, the draft's own quantized state dict, made as the target's is: NxDI converts a fused model's
    draft to quantized linears with the target's settings and reads its weights from draft_model_path. For EAGLE, of
    the draft directory written from the head (loaded as a Llama model, which has no fc: fc is added in full
    precision, eagle_draft.add_fc)."""
    if not (options.quantization and options.speculation):
        return
    from . import eagle_draft

    if options.speculation == "eagle":
        quantize_once(cls, options, str(eagle_draft.draft_directory(options)), config.fused_spec_config.draft_config,
                      completes=lambda partial: eagle_draft.add_fc(options, partial))
    else:
        quantize_once(cls, options, options.draft_model, config.fused_spec_config.draft_config)


def quantize_once(cls, options: NeuronOptions, model_path: str, config, completes=None) -> None:
    """cls.save_quantized_state_dict(model_path, config) into config's quantized_checkpoints_path, once (see
    ensure_quantized); completes(partial directory), where given, runs on the result before it is installed."""
    neuron_config = config.neuron_config
    path = pathlib.Path(neuron_config.quantized_checkpoints_path)
    if artifacts.is_complete(path):
        return
    what = f"{options.quantization} {options.quantization_type} weights of {pathlib.Path(model_path.rstrip('/')).name}"
    waiting = f"waiting for another process quantizing the {what} into {path}"
    with artifacts.exclusive(path, on_wait=lambda: startup.report(startup.Phase.WAITING_FOR_COMPILE, waiting)):
        if artifacts.is_complete(path):
            return
        partial = artifacts.partial_path(path)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)  # a directory: save_quantized_state_dict saves safetensors into it (a file path: torch.save)
        started = time.monotonic()
        with startup.phase(startup.Phase.COMPILING, f"quantizing the {what} into {path}", after=f"quantized the {what}"):
            neuron_config.quantized_checkpoints_path = str(partial)
            try:
                cls.save_quantized_state_dict(model_path, config)
            finally:
                neuron_config.quantized_checkpoints_path = str(path)
            if completes is not None:
                completes(partial)
        seconds = time.monotonic() - started
        record = {"nxdi": artifacts.nxdi_version(), "quantizer": artifacts.quantizer(), "model": model_path,
                  "quantization": options.quantization, "quantization_type": options.quantization_type,
                  "quantization_skip": list(options.quantization_skip), "quantize_seconds": round(seconds, 1)}
        artifacts.install_complete(partial, path, record)
        log.info("quantized the %s in %.0f s into %s", what, seconds, path)
