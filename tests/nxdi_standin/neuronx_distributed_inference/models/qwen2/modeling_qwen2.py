"""Stand-in (see the package docstring)."""

from ..standin_model import StandInCausalLM


class NeuronQwen2ForCausalLM(StandInCausalLM):
    pass
