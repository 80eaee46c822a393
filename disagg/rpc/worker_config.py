"""What both workers are configured with; each role's config adds its own fields.

`flags.worker_fields()` fills exactly these from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.rpc.security import TlsFiles


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    address: str = "127.0.0.1:0"
    backend: str = "torch"
    dtype: str = "auto"  # dtype_choice: bf16 on a native-bf16 CPU, float32 on others
    device: str = "cpu"
    max_seq_len: int = 0  # 0: the model's limit (at most 4096)
    global_topk: int = 0
    threads: int = 0  # torch threads; 0 keeps torch's default
    device_cpus: frozenset[int] | None = None  # CPUs for the model's thread (None: any of the process's)
    grace_seconds: float = 30.0  # SIGTERM: how long work in flight may take to finish
    metrics_port: int = 0
    port_file: str | None = None  # where to announce the bound ports
    status_file: str | None = None  # where to publish the start-up phase (disagg/rpc/startup.py)
    neuron: dict = field(default_factory=dict)  # neuron backend options (tp_degree, buckets, ...)
    tls: TlsFiles | None = None  # mutual TLS between the router and the workers
    kv_transport: str = "grpc"  # how KV moves between the workers: grpc (push stream) or nixl (pull into the slot)
    kv_transport_fallback: bool = False  # --kv-transport auto: a NIXL that does not load falls back to grpc
    nixl_backend: str = "UCX"  # NIXL's transfer backend: UCX, or LIBFABRIC (EFA)
    compile: bool | None = None  # torch backend: the decode step compiled over buckets; None: on CUDA only
    batch_buckets: tuple[int, ...] = ()  # () : powers of two up to the slot count
    token_buckets: tuple[int, ...] = ()  # KV-length buckets; (): powers of two from 128 up to max_seq_len
    prepack: bool | None = None  # torch backend: linear weights laid out for few-row products; None: on CPU
    native_step: bool | None = None  # torch backend: decode steps and short prefills in one C call (native_step); None: where it serves the model
    share_weights: bool = True  # torch backend, prepacked: the box's workers map one packed weights file (disagg/engine/shared_weights.py)
    quantization: str | None = None  # 8-bit weights quantized at load: int8, fp8 or w8a8_int8 (engine/quantization); None: as the checkpoint holds them
    quantization_type: str = "per_channel"  # per_channel or per_tensor symmetric, as NxDI's quantization_type
    quantization_skip: tuple[str, ...] = ("lm_head",)  # linears whose name contains one of these stay in full precision (NxDI's modules_to_not_convert)
    kv_cache_dtype: str | None = None  # the KV cache in 8 bits: int8 or fp8, a scale per block and head (quantization/kv_cache.py); None: in dtype
    speculative_method: str | None = None  # speculative decoding on the decode worker (disagg/engine/speculation): ngram; None: off
    num_speculative_tokens: int = 0  # the most guesses a row gets in one step (0: the method's default)
    draft_model: str | None = None  # --speculative-method draft: the smaller checkpoint that guesses; eagle: the EAGLE head's checkpoint

    def __post_init__(self):
        self.speculation()  # a combination not served yet is refused before anything loads

    def compile_choice(self) -> bool | None:
        """--compile as the torch backend takes it: given, or None (its default: compiled on CUDA), except that
        speculation and an 8-bit KV cache run eagerly unless --compile is given: the compiled step keeps one slot of
        every position per sequence (an 8-bit cache is then refused), and its verify graph for guesses is built only
        where asked for (measured on CPU only, where eager is the default anyway)."""
        if self.compile is None and (self.speculative_method is not None or self.kv_cache_dtype is not None):
            return False
        return self.compile

    def quantization_options(self) -> dict:
        """The quantization settings as the backends take them."""
        return dict(quantization=self.quantization, quantization_type=self.quantization_type, quantization_skip=tuple(self.quantization_skip))

    def speculation(self):
        """The speculation settings (disagg/engine/speculation), or None: each step one token a row."""
        if self.speculative_method is None:
            if self.num_speculative_tokens or self.draft_model:
                raise ValueError(f"{'--num-speculative-tokens' if self.num_speculative_tokens else '--draft-model'} needs --speculative-method")
            return None
        if (self.speculative_method in ("draft", "eagle")) != bool(self.draft_model):
            raise ValueError(f"--speculative-method {self.speculative_method} needs --draft-model" if self.draft_model is None else
                             f"--draft-model is for --speculative-method draft or eagle, not {self.speculative_method}")
        from disagg.engine.speculation import DEFAULT_SPECULATIVE_TOKENS, SpeculationConfig

        if self.backend == "neuron":  # NxDI's fused speculation: neuron_speculation_options, backends/neuron/config.speculation_options
            if self.speculative_method == "ngram":
                raise ValueError("--speculative-method ngram on the neuron backend: NxDI has no prompt lookup (docs/neuron.md#speculation)")
            return SpeculationConfig(self.speculative_method, self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)
        if self.backend != "torch":
            raise ValueError(f"--speculative-method {self.speculative_method} is served by the torch backend only, not {self.backend} (yet)")
        return SpeculationConfig(self.speculative_method, self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)

    def verify_rows(self) -> int:
        """With --compile and speculation, the most rows a step with guesses has (at most max_batch sequences guess, each
        its input and its guesses): the compiled verify graph's last rows bucket; 0 otherwise."""
        spec = self.speculation()
        if spec is None or not self.compile or self.backend != "torch":
            return 0
        return spec.max_batch * (1 + spec.num_tokens)

    def neuron_speculation_options(self) -> dict:
        """The neuron backend's speculation fields (NeuronOptions: NxDI's fused speculation), the same on both workers:
        the prefill worker's context encoding is the fused model's too."""
        spec = self.speculation() if self.backend == "neuron" else None
        if spec is None:
            return {}
        from disagg.engine.backends.neuron.config import speculation_options

        return speculation_options(spec.method, spec.num_tokens, self.draft_model)

    def kv_cache_options(self, block_size: int) -> dict:
        """The torch backend's KV cache settings: an 8-bit cache's scales cover the worker's KV blocks
        (the neuron backend's are neuron_kv_cache_options)."""
        if self.kv_cache_dtype is None or self.backend == "neuron":
            return {}
        if self.backend != "torch":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is served by the torch and neuron backends, not {self.backend}")
        return dict(kv_cache_dtype=self.kv_cache_dtype, kv_block_size=block_size)

    def neuron_kv_cache_options(self) -> dict:
        """The neuron backend's KV cache dtype (NeuronOptions.kv_cache_dtype: NxDI's fp8 KV cache), the same on both workers."""
        return {"kv_cache_dtype": self.kv_cache_dtype} if self.backend == "neuron" and self.kv_cache_dtype is not None else {}
