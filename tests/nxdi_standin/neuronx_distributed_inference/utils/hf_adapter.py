"""Stand-in for neuronx_distributed_inference.utils.hf_adapter (NxDI 0.9.0)."""

from types import SimpleNamespace

from transformers import AutoConfig, PretrainedConfig

from ..models.config import to_torch_dtype


def load_pretrained_config(model_path_or_name=None, hf_config=None):
    """load_pretrained_config: the checkpoint config's to_dict() becomes the InferenceConfig's
    attributes as they are (no renaming: transformers 5's rope_parameters stays
    rope_parameters); its dtype sets torch_dtype only where the NeuronConfig did not."""

    def load_config(self):
        if (model_path_or_name is None) == (hf_config is None):
            raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
        config = AutoConfig.from_pretrained(model_path_or_name) if model_path_or_name is not None else hf_config
        values = config.to_dict()
        if config.transformers_version is not None:
            values["transformers_version"] = config.transformers_version
        hf_dtype = values.get("dtype", values.get("torch_dtype", None))
        if hf_dtype is not None:
            if self.neuron_config is not None and not self.neuron_config.overrides_torch_dtype:
                self.neuron_config.torch_dtype = to_torch_dtype(hf_dtype)
            values.pop("dtype", None)
            values.pop("torch_dtype", None)
        for key, value in values.items():
            if isinstance(getattr(config, key, None), PretrainedConfig):
                values[key] = SimpleNamespace(**value)
        self.__dict__.update(values)
        if hasattr(config, "attribute_map"):
            self.attribute_map = config.attribute_map

    return load_config
