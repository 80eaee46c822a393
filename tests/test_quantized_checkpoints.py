"""Pre-quantized checkpoints (disagg/engine/quantization/checkpoints.py): compressed-tensors
checkpoints made here by the package's own compressors, and NxD Inference's quantized state
dict, read into the 8-bit values and scales they store and served as the model those dequantize
to; anything else refused, naming what."""

import json
import shutil

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from disagg.engine.quantization.checkpoints import load_prequantized_model, read_prequantized
from disagg.engine.quantization.schemes import quantize

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config  # noqa: E402

IDS = torch.tensor([[1, 17, 200, 33, 5, 90, 411, 2]])
Q_PROJ = "model.layers.0.self_attn.q_proj"


def base_model(dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=dtype).eval()


def weights_only(type_, strategy):
    return QuantizationScheme(targets=["Linear"], weights={"num_bits": 8, "type": type_, "strategy": strategy, "symmetric": True})


# name: (config groups, format to force (None: the package infers it, as llm-compressor does), method, granularity, saved dtype)
CT_CASES = {
    "int8-channel-w8a16-packed": ({"group_0": weights_only("int", "channel")}, None, "int8", "per_channel", torch.float32),
    "int8-channel-w8a8": ({"W8A8": ["Linear"]}, None, "int8", "per_channel", torch.float32),
    "int8-tensor": ({"group_0": weights_only("int", "tensor")}, "int-quantized", "int8", "per_tensor", torch.float32),
    "fp8-channel-dynamic-bf16": ({"FP8_DYNAMIC": ["Linear"]}, None, "fp8", "per_channel", torch.bfloat16),
    "fp8-tensor-naive": ({"group_0": weights_only("float", "tensor")}, None, "fp8", "per_tensor", torch.float32),
}


def compressed_checkpoint(directory, case: str) -> str:
    """The tiny model compressed as llm-compressor saves it, its scales NxDI's (schemes.quantize):
    apply the config, set the calibrated scales, compress, save, write the config."""
    groups, format, method, granularity, dtype = CT_CASES[case]
    model = base_model(dtype)
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]), show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                scale = quantize(module.weight, method, granularity).scale
                module.weight_scale.copy_(scale[: module.weight_scale.numel()].reshape(module.weight_scale.shape))
                module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=format)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequantized")
    return {case: compressed_checkpoint(root / case, case) for case in CT_CASES}


def stored_module(tensors: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized linear's values and [out] float32 scale, read straight from the file."""
    scale = tensors[f"{name}.weight_scale"]
    if f"{name}.weight_packed" in tensors:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        values = unpack_from_int32(tensors[f"{name}.weight_packed"], 8, torch.Size(tensors[f"{name}.weight_shape"].tolist()))
    else:
        values = tensors[f"{name}.weight"]
    return values, scale.float().reshape(-1).expand(values.shape[0])


def reference_logits(directory: str, quantized: list[str]) -> torch.Tensor:
    """The tiny model with the file's tensors, and each quantized linear's weight q * scale in float32."""
    tensors = load_file(f"{directory}/model.safetensors")
    model = base_model()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, param in params.items():
            if key.removesuffix(".weight") in quantized:
                values, scale = stored_module(tensors, key.removesuffix(".weight"))
                param.copy_(values.float() * scale[:, None])
            else:
                param.copy_(tensors[key].float())
        return model(IDS).logits


@pytest.mark.parametrize("case", CT_CASES)
def test_a_compressed_tensors_checkpoint_serves_the_numbers_it_stores(checkpoints, case):
    directory = checkpoints[case]
    checkpoint = read_prequantized(directory)
    _, _, method, _, _ = CT_CASES[case]
    assert checkpoint.method == method
    assert checkpoint.format.startswith("compressed-tensors ")
    assert ("served weight-only" in checkpoint.format) == ("w8a8" in case or "dynamic" in case)
    assert "lm_head" not in checkpoint.weights  # the ignore list
    assert len(checkpoint.weights) == 14  # 7 linears in each of 2 layers

    tensors = load_file(f"{directory}/model.safetensors")
    for name, weight in checkpoint.weights.items():
        values, scale = stored_module(tensors, name)
        assert weight.values.dtype == values.dtype and torch.equal(weight.values.view(torch.uint8), values.view(torch.uint8))
        assert weight.scale.dtype == torch.float32 and torch.equal(weight.scale, scale)
        if f"{name}.weight_packed" in tensors:  # the same words packed again: the bytes stored
            assert torch.equal(pack_to_int32(weight.values, 8), tensors[f"{name}.weight_packed"])

    model, _ = load_prequantized_model(directory, torch.float32, "cpu")
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference_logits(directory, list(checkpoint.weights)))


@pytest.mark.parametrize("case", ["int8-channel-w8a16-packed", "int8-channel-w8a8", "int8-tensor"])
def test_a_prequantized_checkpoint_serves_the_same_numbers_as_quantizing_at_load(checkpoints, case):
    """Compressed from scales NxDI computes, the checkpoint's values are those quantizing the
    original weights at load gives."""
    checkpoint = read_prequantized(checkpoints[case])
    _, _, method, granularity, _ = CT_CASES[case]
    linears = dict(base_model().named_modules())
    for name, weight in checkpoint.weights.items():
        at_load = quantize(linears[name].weight, method, granularity)
        assert torch.equal(weight.values, at_load.values) and torch.equal(weight.scale, at_load.scale), name


def test_a_plain_checkpoint_is_not_prequantized():
    assert read_prequantized(tiny_model("llama")) is None
    assert load_prequantized_model(tiny_model("llama"), torch.float32, "cpu") is None


# --- NxD Inference's quantized state dict ------------------------------------------------------


def nxdi_checkpoint(directory, method: str, granularity: str, file: str = "model.safetensors") -> str:
    """The layout save_quantized_state_dict writes: hf_model.model's state dict (no "model."),
    lm_head's beside it, each quantized linear's int8 / fp8 `weight` and float32 `scale`
    ([out, 1] per channel; per tensor [1] for int8, [] for fp8)."""
    shutil.copytree(tiny_model("llama"), directory, ignore=shutil.ignore_patterns("*.safetensors"))
    model = base_model()
    state = {}
    for key, tensor in model.state_dict().items():
        key = key.removeprefix("model.")
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and ("proj" in name or name == "lm_head"):
            weight = quantize(tensor, method, granularity)
            state[key] = weight.values
            state[f"{name}.scale"] = weight.scale[:, None] if granularity == "per_channel" else weight.scale[:1].reshape([1] if method == "int8" else [])
        else:
            state[key] = tensor.clone()
    if file.endswith(".safetensors"):
        save_file(state, f"{directory}/{file}")
    else:
        torch.save(state, f"{directory}/{file}")
    return str(directory)


@pytest.mark.parametrize("method,granularity,file", [
    ("int8", "per_channel", "model.safetensors"), ("int8", "per_tensor", "pytorch_model.bin"), ("fp8", "per_tensor", "model.safetensors"),
])
def test_nxdi_quantized_state_dict_serves_what_nxdi_quantized(tmp_path, method, granularity, file):
    directory = nxdi_checkpoint(tmp_path / "nxdi", method, granularity, file)
    checkpoint = read_prequantized(directory)
    assert checkpoint.method == method and checkpoint.format.startswith("NxD Inference")
    original = base_model()
    linears = dict(original.named_modules())
    assert set(checkpoint.weights) == {name for name, m in linears.items() if isinstance(m, torch.nn.Linear)}
    with torch.no_grad():
        for name, weight in checkpoint.weights.items():
            at_load = quantize(linears[name].weight, method, granularity)
            assert torch.equal(weight.values.view(torch.uint8), at_load.values.view(torch.uint8)) and torch.equal(weight.scale, at_load.scale), name
            linears[name].weight.copy_(at_load.dequantized())
        model, _ = load_prequantized_model(directory, torch.float32, "cpu")
        assert torch.equal(model(IDS).logits, original(IDS).logits)


# --- refused ----------------------------------------------------------------------------------


def edited(checkpoint: str, tmp_path, config=None, tensors=None) -> str:
    """A copy of the checkpoint with its quantization_config or tensors changed."""
    directory = tmp_path / "edited"
    shutil.copytree(checkpoint, directory)
    if config:
        data = json.loads((directory / "config.json").read_text())
        config(data["quantization_config"])
        (directory / "config.json").write_text(json.dumps(data))
    if tensors:
        state = load_file(directory / "model.safetensors")
        tensors(state)
        save_file(state, directory / "model.safetensors")
    return str(directory)


def group_weights(change):
    return lambda q: change(q["config_groups"]["group_0"]["weights"])


def set_scale_row(value):
    def edit(state):
        state[f"{Q_PROJ}.weight_scale"][3] = value
    return edit


def replace(key: str, change):
    """An edit of the tensors: `key` replaced by change(its tensor)."""
    return lambda state: state.update({key: change(state[key])})


def set_format(format: str):
    return lambda q: [q.update(format=format), q["config_groups"]["group_0"].update(format=format)]


W, SCALE, ZERO = f"{Q_PROJ}.weight", f"{Q_PROJ}.weight_scale", f"{Q_PROJ}.weight_zero_point"
CT_REFUSALS = {
    "other quant_method": (dict(config=lambda q: q.update(quant_method="gptq")), "'gptq'"),
    "other format": (dict(config=set_format("nvfp4-pack-quantized")), "nvfp4-pack-quantized"),
    "group strategy": (dict(config=group_weights(lambda w: w.update(strategy="group", group_size=32))), "strategy 'group'"),
    "int4": (dict(config=group_weights(lambda w: w.update(num_bits=4))), "num_bits=4"),
    "asymmetric": (dict(config=group_weights(lambda w: w.update(symmetric=False))), "symmetric=false"),
    "kv cache quantization": (dict(config=lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})), "kv_cache_scheme"),
    "transforms": (dict(config=lambda q: q.update(transform_config={"config_groups": {"u": {}}})), "transform_config"),
    "missing scale": (dict(tensors=lambda s: s.pop(SCALE)), f"{SCALE}: missing"),
    "scale per row without its axis": (dict(tensors=replace(SCALE, lambda t: t.reshape(-1))), f"{SCALE}: per-channel"),
    "integer scale": (dict(tensors=replace(SCALE, lambda t: t.to(torch.int32))), f"{SCALE}: a scale must be"),
    "values not int8": (dict(tensors=replace(W, lambda t: t.half())), f"{W}: values are torch.float16"),
    "values of another shape": (dict(tensors=replace(W, lambda t: t[:, :32].contiguous())), f"{W}: quantized shape"),
    "zero scale": (dict(tensors=set_scale_row(0.0)), f"{Q_PROJ}: scale holds"),
    "negative scale": (dict(tensors=set_scale_row(-0.5)), f"{Q_PROJ}: scale holds"),
    "nan scale": (dict(tensors=set_scale_row(float("nan"))), f"{Q_PROJ}: scale holds"),
    "nonzero zero point": (dict(tensors=lambda s: s.update({ZERO: torch.ones(64, 1, dtype=torch.int8)})), f"{ZERO}: nonzero"),
    "a tensor the model lacks": (dict(tensors=lambda s: s.update({"model.extra.weight": torch.zeros(2)})), "model.extra.weight"),
}


@pytest.mark.parametrize("refusal", CT_REFUSALS)
def test_a_compressed_tensors_checkpoint_we_cannot_serve_exactly_is_refused_naming_why(checkpoints, tmp_path, refusal):
    edits, message = CT_REFUSALS[refusal]
    directory = edited(checkpoints["int8-tensor" if refusal == "values not int8" else "int8-channel-w8a8"], tmp_path, **edits)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        read_prequantized(directory)


def test_the_checkpoint_w8a8_config_has_its_group_named_group_0(checkpoints):
    # The refusals above edit group_0's weights: W8A8's preset group is saved under that name.
    config = json.loads(open(f"{checkpoints['int8-channel-w8a8']}/config.json").read())["quantization_config"]
    assert list(config["config_groups"]) == ["group_0"] and config["format"] == "int-quantized"


@pytest.mark.parametrize("damage,message", [
    (lambda s: s.pop("layers.0.self_attn.q_proj.scale"), f"{Q_PROJ}.scale: missing"),
    (replace("layers.0.self_attn.q_proj.scale", lambda t: t.reshape(-1)), f"{Q_PROJ}.scale: shape"),
    (replace("layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.float8_e5m2)), f"{Q_PROJ}.weight: values are torch.float8_e5m2"),
    (replace("norm.weight", lambda t: t.to(torch.int8)), "model.norm.weight: values must be 2-D"),
], ids=["missing scale", "scale shape", "e5m2 values", "8-bit norm"])
def test_a_damaged_nxdi_state_dict_is_refused_naming_the_tensor(tmp_path, damage, message):
    directory = nxdi_checkpoint(tmp_path / "nxdi", "int8", "per_channel")
    state = load_file(f"{directory}/model.safetensors")
    damage(state)
    save_file(state, f"{directory}/model.safetensors")
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        read_prequantized(directory)
