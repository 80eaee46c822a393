"""The Neuron backend: NxD Inference on Trn1, Inf2 and Trn2.

Imported only when `--backend neuron` is chosen; the NxDI packages come from
the Neuron package repository (see packages.py and docs/neuron.md).
"""

from .backend import load_neuron_backend

__all__ = ["load_neuron_backend"]
