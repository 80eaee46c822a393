"""Public GenerateRequest -> GenerationRequest: every check names the field it refuses."""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass

from disagg.engine.requests import Sampling, Stopping
from disagg.rpc import RequestError
from disagg.v1 import generation_pb2 as pb

from .config import Limits


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

    @property
    def max_new_tokens(self) -> int:
        return self.stopping.max_new_tokens


def check_request_fields(request: pb.GenerateRequest, limits: Limits, facts: ModelFacts) -> None:
    """The checks that need no tokenizer."""
    if len(request.request_id) > limits.max_request_id_chars:
        raise RequestError(f"request_id has {len(request.request_id)} characters; at most {limits.max_request_id_chars} are allowed")
    has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
    if has_text == has_ids:
        raise RequestError("exactly one of prompt or prompt_token_ids must be set" + (" (both are)" if has_text else " (neither is)"))
    bad = next((t for t in request.prompt_token_ids if not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {facts.vocab_size})")
    s = request.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise RequestError(f"sampling.temperature must be a finite number >= 0, got {s.temperature}")
    if s.HasField("top_p") and not (0 < s.top_p <= 1):
        raise RequestError(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise RequestError(f"sampling.top_k must be >= 0 (0 turns it off), got {s.top_k}")
    t = request.stopping
    if not 0 <= t.max_new_tokens <= limits.max_new_tokens_cap:
        raise RequestError(f"stopping.max_new_tokens must be in [0, {limits.max_new_tokens_cap}] (0 means the default), got {t.max_new_tokens}")
    if len(t.stop) > limits.max_stop_sequences:
        raise RequestError(f"stopping.stop has {len(t.stop)} strings; at most {limits.max_stop_sequences} are allowed")
    long_stop = next((x for x in t.stop if len(x) > limits.max_stop_sequence_chars), None)
    if long_stop is not None:
        raise RequestError(f"stopping.stop has a string of {len(long_stop)} characters; at most {limits.max_stop_sequence_chars} are allowed")
    if any(not x for x in t.stop):
        raise RequestError("stopping.stop contains an empty string")
    if len(t.stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError(f"stopping.stop_token_ids has {len(t.stop_token_ids)} ids; at most {limits.max_stop_token_ids} are allowed")
    bad = next((x for x in t.stop_token_ids if not 0 <= x < facts.vocab_size), None)
    if bad is not None:
        raise RequestError(f"stopping.stop_token_ids contains {bad}, outside the vocabulary [0, {facts.vocab_size})")


def build_request(request: pb.GenerateRequest, prompt_ids: list[int], limits: Limits, facts: ModelFacts) -> GenerationRequest:
    """The checks that need the prompt's length, then the engine-level request."""
    if not prompt_ids:
        raise RequestError("prompt tokenizes to no tokens")
    room = facts.max_seq_len - len(prompt_ids)
    t = request.stopping
    if t.max_new_tokens and len(prompt_ids) + t.max_new_tokens > facts.max_seq_len:
        raise RequestError(f"prompt has {len(prompt_ids)} tokens and stopping.max_new_tokens is {t.max_new_tokens}: together {len(prompt_ids) + t.max_new_tokens}, over the maximum sequence length {facts.max_seq_len}")
    if room < 1:
        raise RequestError(f"prompt has {len(prompt_ids)} tokens; the maximum sequence length {facts.max_seq_len} leaves no room to generate")
    max_new = t.max_new_tokens or min(limits.default_max_new_tokens, room)
    stop_ids = set(t.stop_token_ids) | (set() if t.ignore_eos else set(facts.eos_token_ids))
    s = request.sampling
    seed = s.seed if s.HasField("seed") else random.getrandbits(63)
    sampling = Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.HasField("top_p") else 1.0, seed=seed)
    return GenerationRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=list(prompt_ids),
        sampling=sampling,
        stopping=Stopping(max_new_tokens=max_new, stop_token_ids=frozenset(stop_ids)),
        stop_sequences=tuple(t.stop),
    )
