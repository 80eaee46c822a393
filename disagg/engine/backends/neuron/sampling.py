"""Our sampling rows -> the [batch, 3] rows NxDI's dynamic on-device sampler accepts.

NxDI's validate_sampling_params (modules/generation/sampling.py) raises for the
whole batched step on one row with temperature 0 unless top_k is 1, or top_k
above global_topk (releases before 2.26 also refuse top_k 0); its sampler reads
top_k 0 as "every global-top-k candidate equally likely", and with dynamic=True
divides the logits by the temperature, 0 included. Our rows mean: temperature 0
is greedy, top_k 0 is no top-k limit. The mapping below is the one vLLM's Neuron
plugin applies before calling NxDI (vllm-neuron, get_nxd_sampling_params).
"""

from __future__ import annotations

import torch

# The smallest top_p NxDI accepts is anything above 0; keep a row's first token only.
MIN_TOP_P = 1e-6


def nxdi_sampling_params(params: torch.Tensor, global_topk: int) -> torch.Tensor:
    """params: [n, 7] ours, whose first three columns are (top_k, top_p, temperature) -> [n, 3] float32 as NxDI reads them.

    The other columns (min_p, penalties) never reach here set: the backend refuses them (NeuronBackend.unsupported)."""
    top_k, top_p, temperature = (params[:, i].float() for i in range(3))
    greedy = (temperature <= 0) | (top_k == 1)
    unlimited = (top_k <= 0) | (top_k > global_topk)
    top_k = torch.where(unlimited, torch.full_like(top_k, global_topk), top_k.floor())
    top_p = top_p.clamp(min=MIN_TOP_P, max=1.0)
    # Greedy: top_k 1 keeps the argmax alone; temperature 1 never divides by 0.
    ones = torch.ones_like(top_k)
    return torch.stack([torch.where(greedy, ones, top_k), torch.where(greedy, ones, top_p), torch.where(greedy, ones, temperature)], dim=1)
