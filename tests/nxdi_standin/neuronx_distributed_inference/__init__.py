"""STAND-IN for neuronx-distributed-inference, for tests on machines without Neuron.

It implements only the slice of NxDI's API that disagg's neuron backend calls
(NeuronConfig, InferenceConfig with each model's required attributes,
OnDeviceSamplingConfig, load_pretrained_config, the model classes with
get_config_cls/compile/load/forward, and the per-rank KV device state at
context_encoding_model.model.nxd_model.state), on the CPU with a transformers
model. It is not NxDI and runs no Neuron code. Every rule it enforces names the
NxDI function it stands for, read at NxDI 0.9.0 (Neuron SDK 2.29, the release-2.29-v2
sync); where 0.7 (2.27) or 0.8 (2.28) differ, the rule says so.
"""

from ._version import __version__  # noqa: F401  (as NxDI's __init__ does)

STANDIN = True
