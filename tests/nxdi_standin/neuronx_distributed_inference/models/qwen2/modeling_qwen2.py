"""Stand-in for NxDI 0.9.0 models/qwen2/modeling_qwen2.py (see the package docstring).

NeuronQwen2ForCausalLM passes no sliding_window: NxDI computes full attention and a full-length cache for it."""

from ..config import LLAMA_REQUIRED, InferenceConfig, NeuronConfig, release  # noqa: F401
from ..standin_model import StandInCausalLM


class Qwen2InferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return LLAMA_REQUIRED

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class NeuronQwen2ForCausalLM(StandInCausalLM):
    config_cls = Qwen2InferenceConfig
    uses_sliding_window = False
