"""Stand-in for NxDI's modules/generation/sampling.py: the checks and the per-row
semantics of dynamic on-device sampling, written from reading that file."""

from __future__ import annotations

import torch

IGNORED_LOGITS_VALUE = -3000.0  # Sampler.IGNORED_LOGITS_VALUE


def validate_sampling_params(params: torch.Tensor, on_device_sampling_config) -> None:
    """validate_sampling_params: one bad row raises for the whole batch (model_base
    forward -> preprocess_inputs calls it before any row runs)."""
    if params.shape[1] != 3:
        raise ValueError(f"Expected tensor of shape (batch_size, 3), but got {params.shape}")
    params = params.to(torch.float32)
    top_k, top_p, temperature = params[:, 0], params[:, 1], params[:, 2]
    global_top_k = on_device_sampling_config.global_topk
    if not torch.all((top_k == -1) | ((top_k >= 0) & (top_k <= global_top_k))):
        raise ValueError(f"Invalid top-k values found. top-k must be -1 or greater than 0 but less than or equal to {global_top_k=}. Found {top_k=}.")
    if not torch.equal(top_k, top_k.floor()):
        raise ValueError(f"Invalid top-k values found. Found {top_k=}.")
    if not torch.all((top_p > 0.0) & (top_p <= 1.0)):
        raise ValueError(f"Invalid top-p values found. top-p must be in the range (0.0, 1.0]. Found {top_p=}.")
    if not torch.all(temperature >= 0.0):
        raise ValueError(f"Invalid temperature values found. Found {temperature=}.")
    if torch.any((temperature == 0.0) & ((top_k == -1) | (top_k == 0))):
        raise ValueError("Invalid sampling parameters found. Temperature = 0 enables greedy sampling. Please set top_k to 1")


def infer_sampling_params(params: torch.Tensor) -> torch.Tensor:
    """infer_sampling_params: temperature 0 rows get top_k 1 and top_p 1 (temperature stays 0)."""
    params = params.clone()
    greedy = params[:, 2] == 0
    params[greedy, 0] = 1
    params[greedy, 1] = 1
    return params


class Sampler:
    """Sampler._multinomial_sample with dynamic=True: top global_topk candidates,
    ranks >= top_k set to IGNORED_LOGITS_VALUE (so top_k 0 leaves every candidate
    at the same value: a uniform pick), division by temperature, top-p on the
    cumulative sum keeping the first, then a uniform draw against the CDF."""

    def __init__(self, config: "OnDeviceSamplingConfig", generator: torch.Generator):  # noqa: F821
        self.global_topk = config.global_topk
        self.dynamic = config.dynamic
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        # logits: [n, vocab]; params: [n, 3]
        indices, probs = self.probabilities(logits, params)
        return indices.gather(-1, self.draw(probs)).flatten()

    def probabilities(self, logits: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """_multinomial_sample up to `return_values`: each row's top global_topk token ids and their
        probabilities after top-k, temperature and top-p, both [n, global_topk] (what a fused EAGLE step's
        target sampler returns for its rejection sampling)."""
        top_k, top_p, temperature = (params[:, i : i + 1].float() for i in range(3))
        values, indices = torch.topk(logits.float(), k=min(self.global_topk, logits.shape[-1]), dim=-1)
        rank = torch.arange(values.shape[-1]).broadcast_to(values.shape)
        values = values.masked_fill(rank >= top_k, IGNORED_LOGITS_VALUE)
        if self.dynamic and bool((temperature == 0).any()):
            # torch.divide(top_k_logits_values, temperature) with temperature 0: inf and
            # NaN on the device, whatever token that yields. Refused here so it is seen.
            raise FloatingPointError("dynamic on-device sampling divides the logits by temperature 0")
        values = values / temperature
        probs = torch.softmax(values, dim=-1)
        cumsum = probs.cumsum(dim=-1)
        top_p = torch.max(cumsum.min(), top_p)
        drop = cumsum > top_p
        drop[:, 0] = False  # "need to keep at least one token"
        return indices, torch.softmax(values.masked_fill(drop, IGNORED_LOGITS_VALUE), dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """_multinomial: per row, the index ([n, 1]) a uniform draw picks from the probabilities' CDF."""
        cdf = probs.cumsum(dim=-1)
        cdf = cdf / cdf[:, -1:]
        draw = torch.rand(cdf.shape[0], 1, generator=self.generator)
        return (draw > cdf).sum(dim=-1, keepdim=True).clamp(max=cdf.shape[-1] - 1)

    def uniform(self, shape) -> torch.Tensor:
        """rand_like: the draws a fused EAGLE step's acceptance compares its ratios with."""
        return torch.rand(shape, generator=self.generator)
