"""Stand-in for neuronx_distributed_inference/_version.py: the release this stand-in mirrors.

NxDI exposes its version twice: this module (`neuronx_distributed_inference.__version__`,
"0.9.0" at Neuron SDK 2.29) and its installed distribution's metadata
(`importlib.metadata.version("neuronx-distributed-inference")`); the stand-in's metadata
is the dist-info folder beside this package. A test that needs another release sets
`neuronx_distributed_inference.__version__` (see models/config.py's `release()`).
"""

__version__ = "0.9.0"
