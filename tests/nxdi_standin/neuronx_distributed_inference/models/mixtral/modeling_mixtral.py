"""Stand-in for NxDI 0.9.0 models/mixtral/modeling_mixtral.py (see the package docstring).

NeuronMixtralForCausalLM passes no sliding_window: NxDI computes full attention and a
full-length cache for it."""

from ..config import InferenceConfig, MoENeuronConfig
from ..standin_model import StandInCausalLM


class MixtralInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "vocab_size",
                "max_position_embeddings", "rope_theta", "num_local_experts", "num_experts_per_tok", "rms_norm_eps"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig  # MixtralInferenceConfig.get_neuron_config_cls


class NeuronMixtralForCausalLM(StandInCausalLM):
    config_cls = MixtralInferenceConfig
    uses_sliding_window = False

    def _check_config(self):
        # NxDI's MoE modules (initialize_moe_module) read MoENeuronConfig's fields; a plain
        # NeuronConfig has none of them and fails while the model is built.
        nc = self.config.neuron_config
        for field in ("glu_mlp", "capacity_factor", "glu_type"):
            if not hasattr(nc, field):
                raise AttributeError(f"'{type(nc).__name__}' object has no attribute '{field}'")
