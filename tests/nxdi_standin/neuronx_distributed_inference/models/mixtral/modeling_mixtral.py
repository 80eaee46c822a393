"""Stand-in (see the package docstring)."""

from ..config import InferenceConfig, MoENeuronConfig
from ..standin_model import StandInCausalLM


class MixtralInferenceConfig(InferenceConfig):
    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig  # NxDI models/mixtral/modeling_mixtral.py MixtralInferenceConfig.get_neuron_config_cls


class NeuronMixtralForCausalLM(StandInCausalLM):
    config_cls = MixtralInferenceConfig

    def _check_config(self):
        # NxDI's MoE modules (initialize_moe_module) read MoENeuronConfig's fields; a plain
        # NeuronConfig has none of them and fails while the model is built.
        nc = self.config.neuron_config
        for field in ("glu_mlp", "capacity_factor", "glu_type"):
            if not hasattr(nc, field):
                raise AttributeError(f"'{type(nc).__name__}' object has no attribute '{field}'")
