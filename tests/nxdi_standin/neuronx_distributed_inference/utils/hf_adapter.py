"""Stand-in for neuronx_distributed_inference.utils.hf_adapter."""

from transformers import AutoConfig


def load_pretrained_config(model_path_or_name=None, hf_config=None):
    def load_config(self):
        config = hf_config or AutoConfig.from_pretrained(model_path_or_name)
        self.hf_config = config
        for key, value in config.to_dict().items():
            setattr(self, key, value)

    return load_config
