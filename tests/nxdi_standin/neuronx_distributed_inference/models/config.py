"""Stand-in for neuronx_distributed_inference.models.config (see the package docstring)."""


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs):
        self.do_sample = kwargs.pop("do_sample", False)
        self.dynamic = kwargs.pop("dynamic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.deterministic = kwargs.pop("deterministic", False)


class NeuronConfig:
    def __init__(self, **kwargs):
        self.kwargs = dict(kwargs)  # what the caller asked for, for the tests to read
        for key, value in kwargs.items():
            setattr(self, key, value)


class InferenceConfig:
    def __init__(self, neuron_config, load_config=None, **kwargs):
        self.neuron_config = neuron_config
        if load_config is not None:
            load_config(self)
        for key, value in kwargs.items():
            setattr(self, key, value)
