from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.constraints.spec import MAX_CONSTRAINT_CHARS
from disagg.engine.kv_blocks import DEFAULT_BLOCK_SIZE
from disagg.engine.requests import MAX_REQUEST_ID_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS
from disagg.rpc.discovery import parse_target
from disagg.rpc.security import TlsFiles

from .prefix_index import PREFIX_INDEX_TOKENS


@dataclass(frozen=True)
class Limits:
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 256
    # The engine's bounds, which the workers hold every caller to: lower is fine, higher is refused there.
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_request_id_chars: int = MAX_REQUEST_ID_CHARS
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_choices: int = 16  # n
    # A constraint's text (a JSON schema, a regex, a grammar, a choice list; tools' schemas together):
    # longer is refused before it is compiled. At most the engine's MAX_CONSTRAINT_CHARS.
    max_constraint_chars: int = 64 * 1024


@dataclass(frozen=True)
class RouterConfig:
    model: str  # used for the tokenizer and the model's EOS ids
    prefill_workers: tuple[str, ...]  # targets: HOST:PORT or dns:[//DNS_SERVER/]NAME:PORT
    decode_workers: tuple[str, ...]
    address: str = "127.0.0.1:50050"
    limits: Limits = Limits()
    max_queue: int = 256  # requests waiting for a decode slot before RESOURCE_EXHAUSTED
    # With no prefill (or no decode) worker up, a request waits this long for one before UNAVAILABLE:
    # a worker being restarted (disagg serve's supervisor, a Deployment) is back within seconds.
    worker_wait_seconds: float = 15.0
    load_poll_seconds: float = 1.0
    resolve_seconds: float = 5.0  # how often DNS targets are resolved again
    grace_seconds: float = 30.0
    metrics_port: int = 0
    port_file: str | None = None  # where to announce the bound ports
    tls: TlsFiles | None = None  # mutual TLS to the workers
    public_tls: TlsFiles | None = None  # TLS on the public port
    auth_token: str | None = None  # bearer token required on the public API (health stays open)
    http_port: int | None = None  # the OpenAI-compatible HTTP API (router/http/); None: off
    # The HTTP edge's bounds: a body over this is refused (413) before it is read in full, as
    # gRPC's PUBLIC_MESSAGE_BYTES bounds a message; a request still unanswered after
    # http_timeout_seconds ends with 504 (a stream with a timeout error event).
    http_max_body_bytes: int = 4 * 1024 * 1024
    http_timeout_seconds: float = 600.0
    # Cache-aware routing (router/prefix_index.py): the workers' KV block size, and whether to route by prefix at all.
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = True
    prefix_index_tokens: int = PREFIX_INDEX_TOKENS  # per worker
    constraint_compile_seconds: float = 10.0  # a constraint not compiled by then is refused (INVALID_ARGUMENT)
    test_long_tokenize_gate: str | None = None  # tests only ($DISAGG_TEST_LONG_TOKENIZE_GATE): see router/tokenizing.py

    def __post_init__(self):
        if not self.prefill_workers:
            raise ValueError("--prefill needs at least one prefill worker address")
        if not self.decode_workers:
            raise ValueError("--decode needs at least one decode worker address")
        for flag, targets in (("--prefill", self.prefill_workers), ("--decode", self.decode_workers)):
            for target in targets:
                parse_target(target, flag)
        if not self.resolve_seconds > 0:
            raise ValueError(f"--resolve-seconds must be positive, not {self.resolve_seconds}")
        if self.http_max_body_bytes < 1024:
            raise ValueError(f"--http-max-body-bytes must be at least 1024, not {self.http_max_body_bytes}")
        if not self.http_timeout_seconds > 0:
            raise ValueError(f"--http-timeout-seconds must be positive, not {self.http_timeout_seconds}")
        if not 1 <= self.limits.max_constraint_chars <= MAX_CONSTRAINT_CHARS:
            raise ValueError(f"--max-constraint-chars must be in [1, {MAX_CONSTRAINT_CHARS}], not {self.limits.max_constraint_chars}")
        if not self.constraint_compile_seconds > 0:
            raise ValueError(f"--constraint-compile-seconds must be positive, not {self.constraint_compile_seconds}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, not {self.block_size}")
