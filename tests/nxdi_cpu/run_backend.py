"""Runs our NeuronBackend on NxDI's real model code in its CPU mode, one backend per process.

NxDI's to_cpu() starts a gloo process group on MASTER_PORT and leaves it (and
NXD_CPU_MODE=1) behind, so each backend instance runs in its own process:

    python -m nxdi_cpu.run_backend JOB.json   (with tests/ on sys.path)

JOB.json: {"nxdi_src": ..., "model": ..., "seq_len": ..., "batch_size": ..., "actions": [...]}
Actions, run in order; the results go to JOB.json's "out" file (torch.save):
  {"do": "shapes"}                                   -> every KV tensor's (shape, dtype)
  {"do": "prefill", "name": N, "prompt": [ids]}      -> first token and the KV lines, saved under N
  {"do": "write", "slot": s, "kv": "file", "name": N} -> a prefill's KV (from another process) into slot s
  {"do": "decode", "rows": [{"slot", "first", "position", "steps"}]} -> greedy tokens per row, all rows
        stepping together (a row whose steps run out leaves the batch)
  {"do": "line", "slot": s, "length": n}             -> a slot's KV lines as the backend reads them

A job with "speculation": {"method", "num_tokens", "draft_model"} builds no backend: it builds NxDI's config through
ours (compile.build_config) with fused speculation, NxDI's application over it and NxDI's fused model in CPU mode, and
records what NxDI made of them (speculation_summary), or the refusal.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nxdi_paths(nxdi_src: str) -> list[str]:
    """$NXDI_SRC/neuronx-distributed-inference/src and $NXDI_SRC/neuronx-distributed/src."""
    return [os.path.join(nxdi_src, "neuronx-distributed-inference", "src"), os.path.join(nxdi_src, "neuronx-distributed", "src")]


def load_backend(job: dict):
    sys.path[:0] = nxdi_paths(job["nxdi_src"])
    from nxdi_cpu import shims

    shims.install()
    os.environ["MASTER_PORT"] = str(free_port())  # to_cpu's gloo group; 29500 collides between processes
    from disagg.engine.backends.neuron.backend import NeuronBackend
    from disagg.engine.backends.neuron.config import NeuronOptions

    seq_len = job["seq_len"]
    options = NeuronOptions(
        model=job["model"], dtype="float32", seq_len=seq_len, max_context_length=seq_len,  # CPU mode: max_context_length == seq_len
        batch_size=job["batch_size"], global_topk=job.get("global_topk", 64), extra={"on_cpu": True}, kv_cache_dtype=job.get("kv_cache_dtype"),
    )
    return NeuronBackend(options)


def speculation_summary(job: dict) -> dict:
    """Our flags -> NeuronOptions -> NxDI's NeuronConfig, FusedSpecNeuronConfig and draft InferenceConfig (NxDI's own
    classes), then NxDI's application built over them, its to_cpu(), and NeuronFusedSpecModel itself built in CPU mode."""
    import torch

    sys.path[:0] = nxdi_paths(job["nxdi_src"])
    from nxdi_cpu import shims

    shims.install()
    os.environ["MASTER_PORT"] = str(free_port())
    from transformers import AutoConfig

    from disagg.engine.backends.neuron.compile import build_config, model_class
    from disagg.engine.backends.neuron.config import NeuronOptions, speculation_options

    spec = job["speculation"]
    try:
        options = NeuronOptions(
            model=job["model"], dtype="float32", seq_len=job["seq_len"], batch_size=job["batch_size"], global_topk=64,
            **speculation_options(spec["method"], spec["num_tokens"], spec["draft_model"]), extra=job.get("extra", {}),
            compiled_root=job.get("compiled_root", ""), **job.get("quantization", {}),
        )
        cls = model_class(AutoConfig.from_pretrained(options.model).architectures[0])
        config = build_config(cls, options)
    except ValueError as exc:
        return {"load_error": f"{type(exc).__name__}: {exc}"}
    if options.quantization:  # the quantized state dicts a compile reads, made by NxDI's own quantizer (as ensure_compiled makes them)
        from disagg.engine.backends.neuron.compile import ensure_quantized, ensure_quantized_draft

        ensure_quantized(cls, options, config)
        ensure_quantized_draft(cls, options, config)
    neuron, fused = config.neuron_config, config.fused_spec_config
    draft = fused.draft_config
    fields = ("speculation_length", "enable_fused_speculation", "enable_eagle_speculation", "is_eagle_draft", "kv_cache_tiling", "seq_len",
              "max_length", "batch_size", "tkg_batch_size", "apply_seq_ids_mask", "is_continuous_batching")
    summary = {
        "target": {name: getattr(neuron, name) for name in fields},
        "draft": {name: getattr(draft.neuron_config, name) for name in fields},
        "draft_layers": draft.num_hidden_layers, "target_layers": config.num_hidden_layers, "draft_hidden": draft.hidden_size,
        "fused_spec_config": type(fused).__module__ + "." + type(fused).__name__,
        "worker_cls": fused.worker_cls.__name__, "draft_model_cls": fused.draft_model_cls, "draft_model_path": fused.draft_model_path,
    }
    model = cls(options.model, config)
    summary["graphs"] = sorted(m.model_cls.__name__ for m in model.models)
    summary["tags"] = sorted(m.tag for m in model.models)
    try:
        model.to_cpu()
    except NotImplementedError as exc:
        summary["to_cpu"] = f"{type(exc).__name__}: {exc}"
    # NxDI's fused model itself, built in CPU mode as to_cpu builds a model (gloo group, model parallel state): the names
    # of its KV parameters, which are the device state's keys once compiled.
    from neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel
    from neuronx_distributed_inference.models.application_base import init_custom_process_group_fn

    os.environ["NXD_CPU_MODE"] = "1"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.distributed.init_process_group(backend="gloo", world_size=1, rank=0)
    initialize_model_parallel(tensor_model_parallel_size=1, skip_collective_init=True)
    init_custom_process_group_fn(config)  # the draft's group, as NxDI's builder sets it up before tracing
    fused_model = model.fused_spec_model.model_cls(model.fused_spec_model.config)
    summary["kv_parameters"] = sorted(name for name, _ in fused_model.named_parameters() if "past_key_values" in name)
    summary["kv_shapes"] = {name: tuple(p.shape) for name, p in fused_model.named_parameters() if name.endswith("past_key_values.0")}
    # The draft's weights as NxDI reads them from draft_model_path (get_state_dict, as checkpoint_loader_fn does for the
    # draft, then the modules' preshard hooks, as sharding runs them), against the parameters of the draft model NxDI
    # built: what loading would find missing or misshapen.
    from neuronx_distributed.trace.trace import invoke_preshard_hook
    from neuronx_distributed_inference.models.model_wrapper import DecoderModelInstance

    # The fused model as NxDI's tracing loads it (DecoderModelInstance.load_module: quantized, both models' linears
    # converted by NxD with the settings of each model's own NeuronConfig).
    instance = DecoderModelInstance(model.fused_spec_model.model_cls, model.fused_spec_model.config)
    instance.load_module()
    draft_model = instance.module.draft_model
    state = cls.get_state_dict(fused.draft_model_path, draft)
    invoke_preshard_hook(draft_model, state, "")  # as sharding does: the attention's weights renamed into its modules
    wanted = {name: (tuple(p.shape), str(p.dtype)) for name, p in draft_model.named_parameters() if "past_key_values" not in name}
    summary["draft_weights_missing"] = sorted(set(wanted) - set(state))
    summary["draft_weights_misshapen"] = sorted(n for n in wanted if n in state and tuple(state[n].shape) != wanted[n][0])
    summary["draft_weight_dtypes"] = {name: (dtype, str(state[name].dtype)) for name, (_, dtype) in wanted.items() if name in state}
    # what loading would cast: an 8-bit parameter given another dtype, or a float one given 8 bits
    eight_bit = ("torch.int8", "torch.float8_e4m3fn", "torch.float8_e5m2")
    summary["draft_weights_of_another_dtype"] = sorted(n for n, (model_dtype, state_dtype) in summary["draft_weight_dtypes"].items()
                                                       if (model_dtype in eight_bit) != (state_dtype in eight_bit))
    summary["draft_has_fc"] = hasattr(draft_model, "fc")
    summary["draft_input_norm"] = draft_model.layers[0].input_layernorm is not None
    return summary


def decode(backend, rows: list[dict]) -> dict[int, list[int]]:
    import torch

    from disagg.engine.backends.base import StepInputs
    from disagg.engine.requests import Sampling
    from disagg.engine.sampler import params_tensor

    live = {row["slot"]: dict(row, tokens=[row["first"]]) for row in rows}
    while any(len(row["tokens"]) <= row["steps"] for row in live.values()):
        active = sorted(slot for slot, row in live.items() if len(row["tokens"]) <= row["steps"])
        positions = torch.tensor([live[s]["position"] + len(live[s]["tokens"]) - 1 for s in active])
        inputs = StepInputs(
            slots=torch.tensor(active), positions=positions, input_ids=torch.tensor([live[s]["tokens"][-1] for s in active]),
            params=params_tensor([Sampling() for _ in active]), seeds=torch.zeros(len(active), dtype=torch.long),
            steps=torch.zeros(len(active), dtype=torch.long), kv_len=int(positions.max()) + 1, contiguous_from=None,
        )
        out = backend.decode_step(inputs)
        for slot, token in zip(active, out.token_ids.tolist()):
            live[slot]["tokens"].append(int(token))
    return {slot: row["tokens"] for slot, row in live.items()}


def run(job: dict) -> dict:
    import torch

    from disagg.engine.requests import Sampling
    from disagg.kv_transport.chunk_codec import KvKind

    if "speculation" in job:
        return speculation_summary(job)
    results: dict = {}
    try:
        backend = load_backend(job)
    except ValueError as exc:  # the refusal a test expects is the result, with its one line
        return {"load_error": f"{type(exc).__name__}: {exc}"}
    for action in job["actions"]:
        if action["do"] == "shapes":
            results["shapes"] = [
                (tuple(c.shape), str(c.dtype)) for layer in range(backend.info.num_layers) for kind in KvKind for c in backend._caches(layer, kind)
            ]
        elif action["do"] == "prefill":
            result = backend.prefill(action["prompt"], Sampling())
            results[action["name"]] = {"first": result.first_token, "layers": result.layers}
        elif action["do"] == "write":
            layers = torch.load(action["kv"])[action["name"]]["layers"]
            for layer, (keys, values) in enumerate(layers):
                backend.write_kv([action["slot"]], layer, KvKind.KEY, 0, keys)
                backend.write_kv([action["slot"]], layer, KvKind.VALUE, 0, values)
        elif action["do"] == "decode":
            results.setdefault("decoded", []).append(decode(backend, action["rows"]))
        elif action["do"] == "line":
            results.setdefault("lines", []).append(
                [(backend.read_line(layer, KvKind.KEY, action["slot"], action["length"]),
                  backend.read_line(layer, KvKind.VALUE, action["slot"], action["length"])) for layer in range(backend.info.num_layers)]
            )
    return results


def main(path: str) -> None:
    import torch

    with open(path) as f:
        job = json.load(f)
    torch.save(run(job), job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
