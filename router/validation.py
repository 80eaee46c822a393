"""GenerateParams -> GenerationRequest: every check names the field it refuses.

Both public edges (gRPC, OpenAI HTTP) hand in GenerateParams and check them here.
The rules themselves are the engine's (disagg.engine.requests), the same ones the
workers check their own API with; what is here is what only the router knows (its
Limits, the prompt's three forms, the backend). A refusal is a RequestError whose
`field` is the gRPC API's dotted field name (see params.FIELD_NAMES).
"""

from __future__ import annotations

import contextlib
import random
import uuid
from dataclasses import dataclass

from disagg.engine.requests import InvalidField, Sampling, Stopping, check_logprobs, check_prompt_len, check_request_id, check_token_ids, stop_token_bound
from disagg.rpc.server import RequestError

from .config import Limits
from .params import FIELD_NAMES, GenerateParams


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
    prompt_hashes: tuple[bytes, ...] = ()  # the prompt's block hashes for cache-aware routing (prefix_index.py); none: by load alone

    @property
    def max_new_tokens(self) -> int:
        return self.stopping.max_new_tokens


def refuse(name: str, message: str) -> RequestError:
    """An INVALID_ARGUMENT naming the GenerateParams field `name` by its gRPC name."""
    field = FIELD_NAMES[name]
    return RequestError(f"{field} {message}", field=field)


@contextlib.contextmanager
def public_names():
    """The engine's rules, refusing by the public API's field names."""
    try:
        yield
    except InvalidField as exc:
        raise refuse(exc.field, exc.rule) from None


def check_params(params: GenerateParams, limits: Limits, facts: ModelFacts) -> None:
    """The checks that need no tokenizer."""
    with public_names():
        check_request_id(params.request_id, limits.max_request_id_chars)
    _check_prompt(params, facts)
    _check_sampling(params)
    _check_stopping(params, limits, facts)
    _check_output(params, limits)
    _check_constraint(params, limits)
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
        with public_names():
            check_token_ids("prompt_token_ids", params.prompt_token_ids, facts.vocab_size)
    if params.messages is not None:
        if not params.messages:
            raise refuse("messages", "is empty")
        for i, (role, content, *_) in enumerate(params.messages):
            if not isinstance(role, str) or not role:
                raise refuse("messages", f"[{i}] has no role")
            if not isinstance(content, str):
                raise refuse("messages", f"[{i}].content must be a string")


def _check_sampling(p: GenerateParams) -> None:
    """The sampling a request asks for, with the unset values as the engine reads them."""
    candidate = Sampling(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=1.0 if p.top_p is None else p.top_p,
        seed=0 if p.seed is None else p.seed,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
    )  # logprobs: checked with the output fields (_check_output)
    with public_names():
        candidate.check()


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
    with public_names():
        check_token_ids("stop_token_ids", p.stop_token_ids, facts.vocab_size, limits.max_stop_token_ids)


def _check_output(p: GenerateParams, limits: Limits) -> None:
    with public_names():
        check_logprobs(p.logprobs, p.top_logprobs, limits.max_top_logprobs)
    if not 1 <= p.n <= limits.max_choices:
        raise refuse("n", f"must be in [1, {limits.max_choices}], got {p.n}")


def _check_constraint(p: GenerateParams, limits: Limits) -> None:
    """Its size and form; whether it compiles is asked next (Router.prepare), off the event loop."""
    if p.constraint is not None:
        with public_names():
            p.constraint.check(limits.max_constraint_chars)


# What NxDI's on-device sampler cannot do (docs/neuron.md says why).
NEURON_REFUSES = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "constraint")


def _check_backend(p: GenerateParams, facts: ModelFacts) -> None:
    if facts.backend != "neuron":
        return
    used = {
        "min_p": p.min_p != 0,
        "presence_penalty": p.presence_penalty != 0,
        "frequency_penalty": p.frequency_penalty != 0,
        "repetition_penalty": p.repetition_penalty not in (None, 1.0),
        "logprobs": p.logprobs,
        "constraint": p.constraint is not None,
    }
    for name in NEURON_REFUSES:
        if used[name]:
            raise refuse(
                name,
                "is not supported on the neuron backend: NxDI's on-device sampler takes top_k, top_p and temperature only"
                " and returns token ids (see docs/neuron.md)",
            )


def build_request(
    params: GenerateParams, prompt_ids: list[int], limits: Limits, facts: ModelFacts, prompt_hashes: tuple[bytes, ...] = ()
) -> GenerationRequest:
    """The checks that need the prompt's length, then the engine-level request."""
    if not prompt_ids:
        raise RequestError("prompt tokenizes to no tokens", field="prompt")
    with public_names():
        if params.max_new_tokens:
            Stopping(params.max_new_tokens).check(len(prompt_ids), facts.vocab_size, facts.max_seq_len, limits.max_stop_token_ids)
        check_prompt_len("prompt", len(prompt_ids), facts.max_seq_len)
    room = facts.max_seq_len - len(prompt_ids)
    max_new = params.max_new_tokens or min(limits.default_max_new_tokens, room)
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
        constraint=params.constraint,
    )
    stopping = Stopping(max_new_tokens=max_new, stop_token_ids=frozenset(stop_ids))
    # What the workers will check it by: a request the router sends never comes back refused.
    with public_names():
        sampling.check(limits.max_top_logprobs, limits.max_constraint_chars)
        stopping.check(len(prompt_ids), facts.vocab_size, facts.max_seq_len, stop_token_bound(len(facts.eos_token_ids)))
    return GenerationRequest(
        request_id=params.request_id or uuid.uuid4().hex,
        prompt_ids=list(prompt_ids),
        sampling=sampling,
        stopping=stopping,
        stop_sequences=tuple(params.stop),
        n=params.n,
        prompt_hashes=prompt_hashes,
    )
