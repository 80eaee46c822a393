"""Stand-in for NxDI 0.9.0 models/mistral/modeling_mistral.py (see the package docstring).

NeuronMistralForCausalLM passes config.sliding_window to its attention and KV cache manager (setup_attr_for_model)."""

from ..config import LLAMA_REQUIRED, InferenceConfig, NeuronConfig, release  # noqa: F401
from ..standin_model import StandInCausalLM

# models/mistral/modeling_mistral.py first ships in 0.9.0's release-2.29-v2 sync: 0.7 and 0.8
# have no Mistral model class at all.
if release() < (0, 9):
    raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)


class MistralInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return [name for name in LLAMA_REQUIRED if name != "pad_token_id"] + ["tie_word_embeddings"]

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class NeuronMistralForCausalLM(StandInCausalLM):
    config_cls = MistralInferenceConfig
    uses_sliding_window = True
