"""Stand-in for NxDI 0.9.0 models/qwen3/modeling_qwen3.py (see the package docstring).

NeuronQwen3ForCausalLM passes no sliding_window: NxDI computes full attention and a full-length cache for it."""

from ..config import LLAMA_REQUIRED, InferenceConfig, NeuronConfig, release  # noqa: F401
from ..standin_model import StandInCausalLM


class Qwen3InferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return LLAMA_REQUIRED[:4] + ["head_dim"] + LLAMA_REQUIRED[4:]

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class NeuronQwen3ForCausalLM(StandInCausalLM):
    config_cls = Qwen3InferenceConfig
    uses_sliding_window = False
