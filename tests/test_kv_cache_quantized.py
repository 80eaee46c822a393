"""The 8-bit KV cache (--kv-cache-dtype int8|fp8, disagg/engine/quantization/kv_cache.py): its numbers,
the held-out likelihood against the unquantized cache, the blocks a budget holds, and the whole
service against a reference that attends over the same 8-bit values, written here position by
position from the format's definition (transformers' model code, a cache of its own)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math

import pytest
import torch
from conftest import DEFAULT_TRANSPORT, TEST_MODELS, assert_nothing_held, kv_bytes_received, start_cluster, tiny_model
from test_prefix_cache_e2e import decode_metric
from transformers.cache_utils import Cache, CacheLayerMixin

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.engine.backends.base import StepInputs
from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig
from disagg.engine.quantization.kv_cache import LARGEST_CODE, QuantizedBlocks, QuantizedKv, code_dtype
from disagg.kv_transport.chunk_codec import KvKind
from disagg.tools.tinymodel import paragraphs

BLOCK = 16
CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def coded(scaled: torch.Tensor, method: str) -> torch.Tensor:
    """The format's code of each value already divided by its scale, as a float."""
    limit = LARGEST_CODE[CODES[method]]
    clamped = scaled.clamp(-limit, limit)
    return clamped.round() if method == "int8" else clamped.to(torch.float8_e4m3fn).float()


class SpecKv:
    """One layer's keys or values under the format's definition, kept position by position: a prompt
    quantized whole (a scale per block of BLOCK positions and head: its largest magnitude over the
    largest code), then one position at a time (the block's scale grows to hold the new line, its
    earlier codes coded again under the grown scale)."""

    def __init__(self, method: str):
        self.method, self.limit = method, LARGEST_CODE[CODES[method]]
        self.codes: list[torch.Tensor] = []  # per position [heads, head_dim], float
        self.scales: dict[int, torch.Tensor] = {}  # per block [heads]

    def add_prompt(self, x: torch.Tensor) -> None:  # [heads, T, head_dim], from position 0
        for block in range(-(-x.shape[1] // BLOCK)):
            part = x[:, block * BLOCK : (block + 1) * BLOCK].float()
            scale = part.abs().amax(dim=(1, 2)) / self.limit
            self.scales[block] = scale
            for position in range(part.shape[1]):
                self.codes.append(coded(part[:, position] / self.safe(scale)[:, None], self.method))

    def add_line(self, line: torch.Tensor) -> None:  # [heads, head_dim]
        position = len(self.codes)
        block, needed = position // BLOCK, line.float().abs().amax(-1) / self.limit
        if position % BLOCK == 0:
            scale = needed
        else:
            old = self.scales[block]
            scale = torch.maximum(old, needed)
            for head in range(scale.shape[0]):
                if scale[head] > old[head] > 0:
                    for earlier in range(block * BLOCK, position):
                        self.codes[earlier][head] = coded(self.codes[earlier][head] * (old[head] / scale[head]), self.method)
        self.scales[block] = scale
        self.codes.append(coded(line.float() / self.safe(scale)[:, None], self.method))

    @staticmethod
    def safe(scale: torch.Tensor) -> torch.Tensor:
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def values(self) -> torch.Tensor:
        return torch.stack([code * self.scales[p // BLOCK][:, None] for p, code in enumerate(self.codes)], dim=1)


class SpecLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, method: str):
        super().__init__()
        self.keys_spec, self.values_spec = SpecKv(method), SpecKv(method)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        for spec, states in ((self.keys_spec, key_states[0]), (self.values_spec, value_states[0])):
            spec.add_prompt(states) if not spec.codes else spec.add_line(states[:, 0])
        return self.keys_spec.values()[None].to(key_states.dtype), self.values_spec.values()[None].to(value_states.dtype)

    def get_seq_length(self) -> int:
        return len(self.keys_spec.codes)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


@functools.cache
def spec_reference(architecture: str, method: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(architecture)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def spec_greedy(architecture: str, method: str, prompt: str | list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of the checkpoint attending over the 8-bit KV of the format's definition."""
    model, tokenizer = spec_reference(architecture, method)
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    cache = Cache(layers=[SpecLayer(method) for _ in range(model.config.num_hidden_layers)])
    out, inputs, position = [], torch.tensor([ids]), 0
    with torch.no_grad():
        while len(out) < max_new_tokens:
            positions = torch.arange(position, position + inputs.shape[1])[None]
            logits = model(inputs, position_ids=positions, past_key_values=cache, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            if token == tokenizer.eos_token_id:
                break
            position += inputs.shape[1]
            inputs = torch.tensor([[token]])
    return out


# -- the numbers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_prompt_is_coded_per_block_and_head_as_the_definition_says(method):
    x = torch.randn(2, 37, 8, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 30.0])[:, None, None]
    kv = QuantizedKv.quantize(x, BLOCK, code_dtype(method))
    spec = SpecKv(method)
    spec.add_prompt(x)
    assert kv.scales.shape == (2, 3) and torch.equal(kv.scales, torch.stack([spec.scales[b] for b in range(3)], dim=1))
    assert torch.equal(kv.dequantize(torch.float32), spec.values())
    assert int(kv.codes.float().abs().amax(dim=(1, 2)).min()) == LARGEST_CODE[code_dtype(method)]  # each head's largest takes the largest code
    # Cut at a block's start only (prefix hits and transfers are whole blocks).
    assert torch.equal(kv[:, 16:].dequantize(torch.float32), spec.values()[:, 16:])
    with pytest.raises(IndexError, match="splits a block"):
        kv[:, 5:]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_lines_appended_one_at_a_time_grow_the_block_scale_as_the_definition_says(method):
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randn(2, 21, 8, generator=generator)
    blocks = QuantizedBlocks(torch.zeros(6, 2, BLOCK, 8, dtype=code_dtype(method)), torch.zeros(6, 2))
    table = [3, 1, 4]
    blocks.write(table, 0, QuantizedKv.quantize(prompt, BLOCK, code_dtype(method)))
    spec = SpecKv(method)
    spec.add_prompt(prompt)
    grew = 0
    for step in range(20):  # through the prompt's partial block, and a fresh block from its first line
        line = torch.randn(2, 8, generator=generator) * (1 + step % 4)  # every fourth line larger than the block so far
        position = 21 + step
        before = blocks.scales[table[position // BLOCK]].clone()
        blocks.append_lines(torch.tensor([table[position // BLOCK]]), torch.tensor([position % BLOCK]), line[None])
        grew += int((blocks.scales[table[position // BLOCK]] > before).any() and position % BLOCK)
        spec.add_line(line)
        held = blocks.gather(torch.tensor([table]), 0, position + 1, torch.float32)[0]
        assert torch.equal(held, spec.values()), f"step {step}"
    assert grew >= 3  # scales did grow, and codes were coded again


# -- the likelihood ------------------------------------------------------------------------------------


def teacher_forced_nll(backend: TorchBackend, texts: list[list[int]], prompt_len: int = 24) -> float:
    """Mean NLL per token of each text: its first prompt_len tokens prefilled (their KV into the blocks),
    the rest fed one per decode step, all texts as rows of the same steps (scattered blocks)."""
    from disagg.engine.backends.slot_kv_cache import PrefillCache

    total, count, rows = 0.0, 0, len(texts)
    width = backend.row_tables.shape[1]
    for row, ids in enumerate(texts):
        table = [1 + row * width + i for i in range(width)]
        backend.set_block_table(row, table)
        layers = {}
        cache = PrefillCache(backend.plans, lambda layer, k, v: layers.setdefault(layer, (k, v)), None, backend.kv_quantization)
        with torch.inference_mode():
            logits = backend.model(torch.tensor([ids[:prompt_len]]), position_ids=torch.arange(prompt_len)[None], past_key_values=cache).logits[0]
        total += float(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:prompt_len]), reduction="sum"))
        count += prompt_len - 1
        for layer, (keys, values) in layers.items():
            backend.write_kv(table, layer, KvKind.KEY, 0, keys)
            backend.write_kv(table, layer, KvKind.VALUE, 0, values)
    longest = max(len(ids) for ids in texts)
    for position in range(prompt_len - 1, longest - 1):
        live = [row for row in range(rows) if position + 1 < len(texts[row])]
        step = StepInputs(
            slots=torch.tensor(live), positions=torch.full((len(live),), position), input_ids=torch.tensor([texts[r][position] for r in live]),
            params=torch.zeros(len(live), 7), seeds=torch.zeros(len(live), dtype=torch.long), steps=torch.zeros(len(live), dtype=torch.long),
            kv_len=position + 1, min_position=position, contiguous_from=None,
        )
        with torch.inference_mode():
            logits = backend.decode_logits(step).float()
        targets = torch.tensor([texts[r][position + 1] for r in live])
        total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(live)
    return total / count


def nll_by_text_set(kv_cache_dtype: str | None, quantization: str | None = None) -> dict[str, float]:
    """Mean NLL on the held-out paragraphs and on paragraphs the model was trained on. The tiny model
    is far from sure on the first (it saw 16 paragraphs) and sure on the second, where a coarse cache
    would cost the most."""
    from transformers import AutoTokenizer

    path = tiny_model("llama-held-out")
    tokenizer = AutoTokenizer.from_pretrained(path)
    every = TEST_MODELS["llama-held-out"].held_out_every
    sets = {
        "held-out": [text for index, text in enumerate(paragraphs()) if index % every == 0],
        "trained": [text for index, text in enumerate(paragraphs()) if index % every][:12],
    }
    backend = TorchBackend(TorchBackendConfig(model=path, dtype="float32", kv_cache_dtype=kv_cache_dtype, quantization=quantization, share_weights=False))
    width = -(-backend.info.max_seq_len // BLOCK)
    out = {}
    for name, texts in sets.items():
        ids = [row for row in (tokenizer(text)["input_ids"][:160] for text in texts) if len(row) > 30]
        backend.allocate_slots(len(ids), len(ids) * width + 1, BLOCK)
        out[name] = teacher_forced_nll(backend, ids)
    return out


@functools.cache
def unquantized_nll() -> dict[str, float]:
    plain = nll_by_text_set(None)
    assert plain["trained"] < 0.5 * math.log(512)  # the model learned its text: a broken cache would show
    return plain


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_nll_with_an_8_bit_kv_cache_within_2_percent(kv_cache_dtype):
    plain, nll = unquantized_nll(), nll_by_text_set(kv_cache_dtype)
    for name in plain:
        assert nll[name] <= plain[name] * 1.02, f"{kv_cache_dtype} KV, {name} text: {nll[name]:.4f} against {plain[name]:.4f}"
    assert nll != plain  # the cache did hold other numbers


@pytest.mark.parametrize("weights,kv_cache_dtype", [("int8", "int8"), ("fp8", "fp8"), ("w8a8_int8", "int8")])
def test_nll_with_8_bit_weights_and_kv_within_4_percent(weights, kv_cache_dtype):
    from disagg.engine.cpu_kernels import small_gemm

    if weights == "w8a8_int8" and small_gemm.quantized_kernel(torch.int8, torch.float32, "int8") is None:
        pytest.skip("no AVX2 CPU (or no C compiler): the W8A8 kernel does not run here")
    plain, nll = unquantized_nll(), nll_by_text_set(kv_cache_dtype, quantization=weights)
    for name in plain:
        assert nll[name] <= plain[name] * 1.04, f"{weights} weights, {kv_cache_dtype} KV, {name} text: {nll[name]:.4f} against {plain[name]:.4f}"


# -- the budget ----------------------------------------------------------------------------------------


def test_the_same_budget_holds_twice_the_blocks():
    from decode_worker.config import DecodeWorkerConfig
    from decode_worker.grpc_edge import size_slots

    backend = TorchBackend(TorchBackendConfig(model=tiny_model("llama"), dtype="float32", kv_cache_dtype="int8", share_weights=False))
    info = backend.info
    config = DecodeWorkerConfig(model="m", kv_cache_gib=0.004, block_size=BLOCK, max_batch_size=64)
    unquantized = dataclasses.replace(info, kv_cache_dtype="", kv_block_size=0)
    blocks = {name: size_slots(config, held, pages_kv=True).num_blocks - 1 for name, held in (("int8", info), ("plain", unquantized))}
    bf16_blocks = int(config.kv_cache_gib * 2**30) // info.kv_bytes_per_token(2) // BLOCK  # the same KV in bfloat16
    assert blocks["int8"] >= 1.9 * bf16_blocks and blocks["int8"] >= 3.8 * blocks["plain"], blocks  # plain: float32 here
    cache_bytes = backend.allocate_slots(4, blocks["int8"] + 1, BLOCK)
    assert cache_bytes <= config.kv_cache_gib * 2**30  # codes and scales within the budget


def test_the_kv_dtype_is_refused_where_it_cannot_be_served():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TorchBackendConfig(model="m", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="--no-compile"):
        TorchBackendConfig(model="m", kv_cache_dtype="int8", compile=True)
    from decode_worker.config import DecodeWorkerConfig
    from disagg.engine.backends.neuron.config import NeuronOptions

    # The neuron backend's KV dtype goes to NxDI (tests/test_neuron_kv_fp8.py), which quantizes KV to fp8 only.
    neuron = DecodeWorkerConfig(model="m", backend="neuron", kv_cache_dtype="int8")
    assert neuron.kv_cache_options(16) == {}
    with pytest.raises(ValueError, match="NxDI's KV cache quantization is fp8"):
        NeuronOptions(model="m", **neuron.neuron_kv_cache_options())


# -- the whole service ----------------------------------------------------------------------------------

CONTEXT = "Every spring the school holds a fair. There are games, music, and a long table of cakes that the parents bake the night before. "
QUESTIONS = ["Who bakes the cakes?", "What is there at the fair?", "When is the fair held?"]
# mistral-sw's decode worker also guesses (prompt lookup): a rejected guess's 8-bit line is undone, the tokens are the reference's.
CASES = [("llama", "int8", "grpc"), ("llama", "fp8", "nixl"), ("mistral-sw", "int8", DEFAULT_TRANSPORT), ("llama", "int8", "colocated")]
SPECULATING = {"mistral-sw": ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]}


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def kv8_cluster(request, cluster_logs):
    architecture, method, transport = request.param
    if transport == "nixl":
        from disagg.kv_transport.nixl_transport import available

        if not available():
            pytest.skip("NIXL is not installed")
    wire = {"colocated": True} if transport == "colocated" else {"transport": transport}  # colocated: the decode worker prefills itself
    flags = ["--kv-cache-dtype", method, "--block-size", str(BLOCK), *SPECULATING.get(architecture, [])]  # both pools: their settings must agree
    cluster = start_cluster(cluster_logs / f"kv8-{method}", architecture, batch_size=8, worker_args=flags, **wire)
    yield architecture, method, transport, cluster
    cluster.stop()


def test_greedy_tokens_equal_the_reference_over_the_same_8_bit_kv(kv8_cluster):
    """A mixed batch of different lengths, and prompts that share whole blocks (prefix hits on both workers)."""
    architecture, method, transport, cluster = kv8_cluster
    texts = paragraphs()
    cases = [(" ".join(texts[i].split()[: 3 + (i * 7) % 30]), 6 + (i * 5) % 20) for i in range(6)]
    before = kv_bytes_received(cluster, transport)
    with Client(cluster.router_address, timeout=60) as client:  # the context's blocks published first
        assert client.complete(CONTEXT + QUESTIONS[0], max_new_tokens=12).token_ids == spec_greedy(architecture, method, CONTEXT + QUESTIONS[0], 12)
    hits = decode_metric(cluster, "disagg_decode_prefix_hit_tokens_total")
    cases += [(CONTEXT + question, 12) for question in QUESTIONS[1:]]

    async def run():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n) for prompt, n in cases))

    for (prompt, n), result in zip(cases, asyncio.run(run())):
        assert result.token_ids == spec_greedy(architecture, method, prompt, n), prompt
    assert decode_metric(cluster, "disagg_decode_prefix_hit_tokens_total") - hits >= 2 * BLOCK * 2  # both later questions hit the context
    if architecture in SPECULATING:  # guesses kept, and others not: both paths ran
        accepted, proposed = (decode_metric(cluster, f"disagg_decode_spec_{kind}_tokens_total") for kind in ("accepted", "proposed"))
        assert 0 < accepted < proposed, (accepted, proposed)
    if transport != "colocated":
        assert kv_bytes_received(cluster, transport) > before, f"the KV did not move through {transport}"
    assert_nothing_held(cluster)


def test_the_hand_off_moves_the_codes_and_their_scales(kv8_cluster):
    """A fresh prompt's KV: exactly its codes and one float32 scale per block and head, about half of bf16's bytes."""
    architecture, method, transport, cluster = kv8_cluster
    if transport == "colocated":
        pytest.skip("a colocated worker hands no KV across the wire")
    _, tokenizer = spec_reference(architecture, method)
    prompt = "A prompt that no other test sends, long enough to fill a few blocks of the cache: " + paragraphs()[7]
    ids = tokenizer(prompt)["input_ids"]
    before = kv_bytes_received(cluster, transport)
    with Client(cluster.router_address, timeout=60) as client:
        assert len(client.complete(prompt, max_new_tokens=3, ignore_eos=True).token_ids) == 3  # past the first token: the KV moved
    moved = kv_bytes_received(cluster, transport) - before
    model, _ = spec_reference(architecture, method)
    config = model.config
    layers, heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    codes, scales = 2 * layers * heads * head_dim * len(ids), 2 * layers * heads * 4 * -(-len(ids) // BLOCK)
    assert moved == codes + scales
    assert moved <= 0.55 * 2 * codes  # the same KV in bfloat16
