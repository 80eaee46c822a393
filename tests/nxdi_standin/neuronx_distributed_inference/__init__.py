"""STAND-IN for neuronx-distributed-inference, for tests on machines without Neuron.

It implements only the slice of NxDI's API that disagg's neuron backend calls
(NeuronConfig, OnDeviceSamplingConfig, load_pretrained_config, a model class
with get_config_cls/compile/load/forward, and the per-rank KV device state at
context_encoding_model.model.nxd_model.state), on the CPU with a transformers
model. It is not NxDI and runs no Neuron code.
"""

STANDIN = True
