"""GenerateParams -> GenerationRequest: every check names the field it refuses.

Both public edges (gRPC, OpenAI HTTP) hand in GenerateParams, so each rule is
written once here. A refusal is a RequestError whose `field` is the gRPC API's
dotted field name (see params.FIELD_NAMES).
"""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass

from disagg.engine.requests import Sampling, Stopping
from disagg.rpc import RequestError

from .config import Limits
from .params import FIELD_NAMES, GenerateParams

INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    vocab_size: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]
    backend: str
    dtype: str


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    stopping: Stopping  # EOS merged into stop_token_ids unless ignore_eos
    stop_sequences: tuple[str, ...]
    n: int = 1  # choices, each sampled with its own seed (choices.py)

    @property
    def max_new_tokens(self) -> int:
        return self.stopping.max_new_tokens


def refuse(name: str, message: str) -> RequestError:
    """An INVALID_ARGUMENT naming the GenerateParams field `name` by its gRPC name."""
    field = FIELD_NAMES[name]
    return RequestError(f"{field} {message}", field=field)


def check_params(params: GenerateParams, limits: Limits, facts: ModelFacts) -> None:
    """The checks that need no tokenizer."""
    if len(params.request_id) > limits.max_request_id_chars:
        raise refuse("request_id", f"has {len(params.request_id)} characters; at most {limits.max_request_id_chars} are allowed")
    _check_prompt(params, facts)
    _check_sampling(params)
    _check_stopping(params, limits, facts)
    _check_output(params, limits)
    _check_backend(params, facts)


def _check_prompt(params: GenerateParams, facts: ModelFacts) -> None:
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(params, name) is not None]
    if len(given) != 1:
        detail = f" ({' and '.join(given)} are)" if given else " (none is)"
        raise RequestError("exactly one of prompt, prompt_token_ids or messages must be set" + detail, field="prompt")
    if params.prompt is not None and not params.prompt:
        raise refuse("prompt", "is empty")
    if params.prompt_token_ids is not None:
        if not params.prompt_token_ids:
            raise refuse("prompt_token_ids", "is empty")
        bad = next((t for t in params.prompt_token_ids if not 0 <= t < facts.vocab_size), None)
        if bad is not None:
            raise refuse("prompt_token_ids", f"contains {bad}, outside the vocabulary [0, {facts.vocab_size})")
    if params.messages is not None:
        if not params.messages:
            raise refuse("messages", "is empty")
        for i, (role, content) in enumerate(params.messages):
            if not isinstance(role, str) or not role:
                raise refuse("messages", f"[{i}] has no role")
            if not isinstance(content, str):
                raise refuse("messages", f"[{i}].content must be a string")


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check_sampling(p: GenerateParams) -> None:
    if not _finite(p.temperature) or p.temperature < 0:
        raise refuse("temperature", f"must be a finite number >= 0, got {p.temperature}")
    if p.top_p is not None and not (_finite(p.top_p) and 0 < p.top_p <= 1):
        raise refuse("top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise refuse("top_k", f"must be >= 0 (0 turns it off), got {p.top_k}")
    if not (_finite(p.min_p) and 0 <= p.min_p <= 1):
        raise refuse("min_p", f"must be in [0, 1] (0 turns it off), got {p.min_p}")
    if p.seed is not None and not INT64[0] <= p.seed <= INT64[1]:
        raise refuse("seed", f"must fit in a signed 64-bit integer, got {p.seed}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (_finite(value) and -2 <= value <= 2):
            raise refuse(name, f"must be in [-2, 2] (0 turns it off), got {value}")
    if p.repetition_penalty is not None and not (_finite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise refuse("repetition_penalty", f"must be a finite number > 0 (1 turns it off), got {p.repetition_penalty}")


def _check_stopping(p: GenerateParams, limits: Limits, facts: ModelFacts) -> None:
    if p.max_new_tokens is not None and not 1 <= p.max_new_tokens <= limits.max_new_tokens_cap:
        raise refuse("max_new_tokens", f"must be in [1, {limits.max_new_tokens_cap}] (unset or 0 means the default), got {p.max_new_tokens}")
    if len(p.stop) > limits.max_stop_sequences:
        raise refuse("stop", f"has {len(p.stop)} strings; at most {limits.max_stop_sequences} are allowed")
    long_stop = next((x for x in p.stop if len(x) > limits.max_stop_sequence_chars), None)
    if long_stop is not None:
        raise refuse("stop", f"has a string of {len(long_stop)} characters; at most {limits.max_stop_sequence_chars} are allowed")
    if any(not x for x in p.stop):
        raise refuse("stop", "contains an empty string")
    if len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise refuse("stop_token_ids", f"has {len(p.stop_token_ids)} ids; at most {limits.max_stop_token_ids} are allowed")
    bad = next((x for x in p.stop_token_ids if not 0 <= x < facts.vocab_size), None)
    if bad is not None:
        raise refuse("stop_token_ids", f"contains {bad}, outside the vocabulary [0, {facts.vocab_size})")


def _check_output(p: GenerateParams, limits: Limits) -> None:
    if not 0 <= p.top_logprobs <= limits.max_top_logprobs:
        raise refuse("top_logprobs", f"must be in [0, {limits.max_top_logprobs}], got {p.top_logprobs}")
    if p.top_logprobs and not p.logprobs:
        raise refuse("top_logprobs", "needs logprobs set to true")
    if not 1 <= p.n <= limits.max_choices:
        raise refuse("n", f"must be in [1, {limits.max_choices}], got {p.n}")


# What NxDI's on-device sampler cannot do (docs/neuron.md says why).
NEURON_REFUSES = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")


def _check_backend(p: GenerateParams, facts: ModelFacts) -> None:
    if facts.backend != "neuron":
        return
    used = {
        "min_p": p.min_p != 0,
        "presence_penalty": p.presence_penalty != 0,
        "frequency_penalty": p.frequency_penalty != 0,
        "repetition_penalty": p.repetition_penalty not in (None, 1.0),
        "logprobs": p.logprobs,
    }
    for name in NEURON_REFUSES:
        if used[name]:
            raise refuse(name, "is not supported on the neuron backend: NxDI's on-device sampler takes top_k, top_p and temperature only and returns token ids (see docs/neuron.md)")


def build_request(params: GenerateParams, prompt_ids: list[int], limits: Limits, facts: ModelFacts) -> GenerationRequest:
    """The checks that need the prompt's length, then the engine-level request."""
    if not prompt_ids:
        raise RequestError("prompt tokenizes to no tokens", field="prompt")
    room = facts.max_seq_len - len(prompt_ids)
    max_new = params.max_new_tokens
    if max_new and len(prompt_ids) + max_new > facts.max_seq_len:
        raise refuse("max_new_tokens", f"is {max_new} and the prompt has {len(prompt_ids)} tokens: together {len(prompt_ids) + max_new}, over the maximum sequence length {facts.max_seq_len}")
    if room < 1:
        raise RequestError(f"prompt has {len(prompt_ids)} tokens; the maximum sequence length {facts.max_seq_len} leaves no room to generate", field="prompt")
    max_new = max_new or min(limits.default_max_new_tokens, room)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(facts.eos_token_ids))
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    sampling = Sampling(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=1.0 if params.top_p is None else params.top_p,
        seed=seed,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=1.0 if params.repetition_penalty is None else params.repetition_penalty,
        logprobs=params.top_logprobs if params.logprobs else -1,
    )
    return GenerationRequest(
        request_id=params.request_id or uuid.uuid4().hex,
        prompt_ids=list(prompt_ids),
        sampling=sampling,
        stopping=Stopping(max_new_tokens=max_new, stop_token_ids=frozenset(stop_ids)),
        stop_sequences=tuple(params.stop),
        n=params.n,
    )
