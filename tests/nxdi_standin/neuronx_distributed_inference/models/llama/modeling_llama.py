"""Stand-in for NxDI 0.9.0 models/llama/modeling_llama.py (see the package docstring).

NeuronLlamaForCausalLM passes config.sliding_window to its attention and KV cache manager (setup_attr_for_model)."""

from ..config import LLAMA_REQUIRED, InferenceConfig, NeuronConfig, release  # noqa: F401
from ..standin_model import StandInCausalLM


class LlamaInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return LLAMA_REQUIRED

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class NeuronLlamaForCausalLM(StandInCausalLM):
    config_cls = LlamaInferenceConfig
    uses_sliding_window = True
