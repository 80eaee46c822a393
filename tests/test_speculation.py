"""Speculative decoding (disagg/engine/speculation): prompt lookup on the decode worker, through
the whole service, token for token what generate() gives without it."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch
from conftest import EAGLE_HEADS, assert_nothing_held, eagle_head, start_cluster
from prometheus_client.parser import text_string_to_metric_families
from test_failures import hold_decode_steps, stream_across_a_killed_decode_worker

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.engine.speculation.acceptance import AdaptiveLength, kept_tokens
from disagg.engine.speculation.ngram import NgramIndex
from disagg.tools.tinymodel import paragraphs

# A paragraph of the tiny model's training text, then its first words again: the model goes on to recite it
# (loosely: it is tiny), and prompt lookup finds what comes next in the prompt, about two tokens a step.
REPEATING = paragraphs()[3] + " " + " ".join(paragraphs()[3].split()[:4])
PLAIN = ["The baker opens his shop", "A storm came over the hills and", "She wrote a letter to", "In the morning the village"]
GUESSES = 4


def test_prompt_lookup_proposes_what_followed_the_longest_latest_suffix():
    index = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3], min_n=1, max_n=3)
    assert index.propose(3) == [4, 9, 2]  # [2, 3] was last followed by 5, but the longest suffix found wins: [1, 2, 3] -> 4
    index.extend([8])
    assert index.propose(2) == []  # 8 never came before
    index.extend([1, 2])
    assert index.propose(4) == [3, 8, 1, 2]  # [8, 1, 2] latest ended before the 3 that followed it
    assert NgramIndex([5], 1, 4).propose(4) == []


def test_kept_tokens_stop_at_the_first_guess_the_target_did_not_pick():
    assert kept_tokens([7, 8, 9], [7, 8, 9, 10]) == [7, 8, 9, 10]
    assert kept_tokens([7, 8, 9], [7, 5, 9, 10]) == [7, 5]
    assert kept_tokens([7, 8, 9], [6, 8, 9, 10]) == [6]
    assert kept_tokens([], [3]) == [3]


def test_a_row_whose_guesses_keep_missing_rests_and_one_that_hits_grows():
    length = AdaptiveLength(4)
    assert length.wanted() == 4
    length.observe(4, 1)
    assert length.wanted() == 2
    length.observe(2, 2)
    assert length.wanted() == 3
    length.observe(3, 0)
    length.no_proposal()
    assert [length.wanted() for _ in range(8)] == [0] * 8
    assert length.wanted() == 1
    length.no_proposal()
    length.no_proposal()  # missed again after its rest: it rests twice as long
    assert [length.wanted() for _ in range(16)] == [0] * 16 and length.wanted() == 1
    length.observe(1, 1)  # a kept guess: rests are short again
    length.no_proposal()
    length.no_proposal()
    assert [length.wanted() for _ in range(8)] == [0] * 8 and length.wanted() == 2
    length.may_rest = False  # in a step of one or two sequences misses cost next to nothing: no rest
    for _ in range(5):
        length.no_proposal()
    assert length.wanted() == 2


def case_table(backend, cases: int, i: int) -> list[int]:
    """Case i's block table in decode_in_process: the cases' blocks interleaved."""
    return [1 + i + cases * b for b in range(backend.info.max_seq_len // BLOCK)]


def decode_in_process(backend, speculation, cases, max_batch: int = 8, method: str = "ngram", proposer=None):
    """Each case (prompt ids, Sampling, max_new_tokens) prefilled and decoded together by one
    DecodeLoop over a paged cache (tables interleaved); {case index: tokens}, the loop's stats."""
    import threading

    from decode_worker.decode_loop import DecodeLoop, Sequence
    from disagg.engine.requests import Stopping
    from disagg.engine.speculation import SpeculationConfig
    from disagg.engine.speculation.rows import row_speculation
    from disagg.kv_transport.chunk_codec import KvKind

    # rest_above=max_batch: every step guesses for its rows that are ready, whatever steps measured. Above rest_above
    # the loop guesses only where its timings say it pays, and on a loaded host they said so less often: the ngram
    # compiled step kept 16 guesses (beside a second pytest process on two cores), where these tests ask for 20.
    config = None if speculation is None else SpeculationConfig(method, speculation, max_batch=max_batch, rest_above=max_batch)
    out, retired, done = {}, [], threading.Event()

    def publish(events):
        for event in events:
            out[event.key] += event.token_ids

    def on_retired(keys):
        retired.extend(keys)
        if len(retired) == len(cases):
            done.set()

    loop = DecodeLoop(backend, publish, on_retired, async_mode=True, speculation=config, proposer=proposer)
    loop.start()
    for i, (ids, sampling, max_new) in enumerate(cases):
        table = case_table(backend, len(cases), i) if backend.paged else [i]  # a slot cache: slot i is block i
        result = backend.prefill(ids, sampling)
        for layer, (k, v) in enumerate(result.layers):
            backend.write_kv(table, layer, KvKind.KEY, 0, k)
            backend.write_kv(table, layer, KvKind.VALUE, 0, v)
        out[str(i)] = [result.first_token]
        rows = row_speculation(config, i, tuple(ids), result.first_token)
        loop.admit(Sequence(str(i), i, len(ids), result.first_token, sampling, Stopping(max_new), table=tuple(table) if backend.paged else (),
                            speculation=rows))
    assert done.wait(300), "the batch did not finish"
    loop.stop()
    return {int(key): tokens for key, tokens in out.items()}, loop.stats


BLOCK = 8


MODELS = [("llama", None, None), ("qwen2", None, None), ("mistral-sw", None, None), ("gemma2-sw", None, None), ("llama", "int8", None),
          ("qwen2", "fp8", None), ("llama", None, "int8"), ("mistral-sw", "int8", "fp8"), ("llama", "w8a8_int8", "int8")]


def model_id(architecture: str, quantization: str | None, kv_cache_dtype: str | None) -> str:
    return architecture + (f"-{quantization}" if quantization else "") + (f"-kv-{kv_cache_dtype}" if kv_cache_dtype else "")


def cache_blocks(backend, tables: list[list[int]], lines: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Per sequence, a copy of its whole blocks below its written lines: every layer's codes and scales of an
    8-bit cache (the blocks' bytes as the decode steps left them)."""
    cache, copies = backend.cache, []
    for table, written in zip(tables, lines):
        whole = torch.tensor(table[: written // BLOCK], dtype=torch.long)
        copies.append(tuple(t.index_select(0, whole).clone() for t in (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)))
    return copies


@pytest.mark.parametrize("architecture,quantization,kv_cache_dtype", MODELS, ids=[model_id(*m) for m in MODELS])
def test_speculation_changes_no_token_greedy_seeded_or_sampled_in_a_batch(architecture, quantization, kv_cache_dtype):
    """The same requests decoded with and without guesses: greedy and seeded sampled rows (temperature,
    top-k, top-p, min-p), penalized ones (their guesses counted as generated), each token the same; with
    8-bit weights too (the guesses' rows through the same 8-bit kernels), greedy against generate() on
    the dequantized checkpoint. Over an 8-bit KV cache, the blocks the decode steps filled hold the same
    codes and scales with guesses as without: a rejected guess's line, which may grow its block's scale
    and code the kept lines again, is undone."""
    from conftest import reference, tiny_model

    from disagg.engine.backends import load_backend
    from disagg.engine.cpu_kernels import small_gemm
    from disagg.engine.requests import Sampling

    if quantization and small_gemm.kernel(torch.int8) is None:
        pytest.skip("no AVX2 CPU or C compiler: the 8-bit kernels are not built here")
    if quantization == "w8a8_int8" and small_gemm.quantized_kernel(torch.int8, torch.float32, "int8") is None:
        pytest.skip("no AVX2 CPU (or no C compiler): the W8A8 kernel does not run here")
    if quantization:
        from test_quantization import dequantized_reference

        ref = dequantized_reference(architecture, quantization)
    else:
        ref = reference(architecture)
    options = {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "kv_block_size": BLOCK}
    backend = load_backend("torch", model=tiny_model(architecture), dtype="float32", torch=options)
    backend.allocate_slots(8, num_blocks=1 + 8 * (backend.info.max_seq_len // BLOCK), block_size=BLOCK)
    if kv_cache_dtype:
        assert backend.native is not None and backend.scores_guesses, "the native step serves guesses over an 8-bit cache"
    text = paragraphs()
    samplings = [
        Sampling(), Sampling(temperature=0.8, seed=11), Sampling(temperature=1.0, top_p=0.9, seed=12), Sampling(temperature=0.7, top_k=20, seed=13),
        Sampling(temperature=1.2, min_p=0.05, seed=14), Sampling(repetition_penalty=1.3), Sampling(logprobs=2),
        Sampling(temperature=0.9, seed=15, logprobs=1, presence_penalty=0.5, frequency_penalty=0.3),
    ]
    cases = []
    for i, sampling in enumerate(samplings):
        paragraph = text[(3 * i) % len(text)]
        cases.append((ref.ids(paragraph + " " + " ".join(paragraph.split()[:4])), sampling, 40 + 5 * i))
    plain, _ = decode_in_process(backend, None, cases)
    if kv_cache_dtype:
        tables = [case_table(backend, len(cases), i) for i in range(len(cases))]
        lines = [len(ids) + len(plain[i]) - 1 for i, (ids, _, _) in enumerate(cases)]  # the last token's line is never written
        plain_blocks = cache_blocks(backend, tables, lines)
    speculated, stats = decode_in_process(backend, GUESSES, cases)
    assert speculated == plain
    assert stats.accepted_tokens >= 20 and stats.accepted_tokens < stats.proposed_tokens  # guesses kept, and some not
    if kv_cache_dtype:
        for i, (before, after) in enumerate(zip(plain_blocks, cache_blocks(backend, tables, lines))):
            assert all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a, b.view(torch.uint8) if b.dtype != torch.float32 else b)
                       for a, b in zip(before, after)), f"sequence {i}: its 8-bit blocks differ with guesses"
        return  # generate() reads no 8-bit cache: the run without guesses is the reference
    for i, (ids, sampling, n) in enumerate(cases):
        if sampling == Sampling():
            assert plain[i] == ref.greedy(ids, n, ignore_eos=True), i


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_the_compiled_step_scores_guesses_and_changes_no_token(method):
    """--compile with speculation: the compiled step's verify graph (a sequence's guesses as rows of their own, each
    row reading its slot) over rows buckets, greedy, seeded sampled and penalized rows in a batch: the same tokens as
    the compiled step without guesses, greedy ones generate()'s, guesses kept; for EAGLE the graphs return each row's
    final hidden states too (checked against the eager step's at start-up), which the head reads."""
    from conftest import eagle_head, reference, tiny_model

    from disagg.engine.backends import load_backend
    from disagg.engine.requests import Sampling
    from disagg.engine.speculation.eagle import EagleProposer, load_eagle_head

    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=256, compile=True, batch_buckets=(4, 8),
                           token_buckets=(128, 256), verify_rows=8 * (1 + GUESSES), step_hidden=method == "eagle")
    backend.allocate_slots(8)
    proposer = EagleProposer(backend, load_eagle_head(eagle_head("llama")), 8) if method == "eagle" else None
    assert backend.compiled is not None and backend.scores_guesses and backend.compiled.verify_buckets == (2, 4, 8, 16, 32, 40)
    text = paragraphs()
    samplings = [Sampling(), Sampling(temperature=0.8, seed=31), Sampling(repetition_penalty=1.3), Sampling(), Sampling(temperature=1.0, top_p=0.9, seed=32)]
    cases = [(ref.ids(text[3 * i % len(text)] + " " + " ".join(text[3 * i % len(text)].split()[:4])), sampling, 40 + 5 * i)
             for i, sampling in enumerate(samplings)]
    plain, _ = decode_in_process(backend, None, cases)
    speculated, stats = decode_in_process(backend, GUESSES, cases, method=method, proposer=proposer)
    assert speculated == plain
    assert stats.accepted_tokens >= 20 and stats.accepted_tokens < stats.proposed_tokens
    for i, (ids, sampling, n) in enumerate(cases):
        if sampling == Sampling():
            assert plain[i] == ref.greedy(ids, n, ignore_eos=True), i


def test_a_draft_models_guesses_change_no_token_and_are_kept():
    """The draft proposer (a one-layer model of the llama model's tokenizer) beside greedy and sampled rows:
    the same tokens as without speculation, most steps keeping guesses."""
    from conftest import reference, tiny_model

    from disagg.engine.backends import load_backend
    from disagg.engine.requests import Sampling
    from disagg.engine.speculation.draft import CATCH_UP_ROWS, DraftProposer

    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(8, num_blocks=1 + 8 * (backend.info.max_seq_len // BLOCK), block_size=BLOCK)
    draft = load_backend("torch", model=tiny_model("llama-draft"), dtype="float32")
    draft.allocate_slots(8)
    text = paragraphs()
    samplings = [Sampling(), Sampling(temperature=0.8, seed=21), Sampling(), Sampling(temperature=1.0, top_p=0.9, seed=22), Sampling(logprobs=1)]
    cases = [(ref.ids(" ".join(text[5 * i % len(text)].split()[:6])), sampling, 30 + 7 * i) for i, sampling in enumerate(samplings)]
    long_context = ref.ids(" ".join(text[:4]))  # the draft takes its prompt in pieces of CATCH_UP_ROWS the first time
    assert len(long_context) > 2 * CATCH_UP_ROWS
    cases.append((long_context, Sampling(), 40))
    plain, _ = decode_in_process(backend, None, cases)
    speculated, stats = decode_in_process(backend, GUESSES, cases, method="draft", proposer=DraftProposer(draft))
    assert speculated == plain
    for i, (ids, sampling, n) in enumerate(cases):
        if sampling.temperature == 0:
            assert plain[i] == ref.greedy(ids, n, ignore_eos=True), i
    assert stats.accepted_tokens >= 0.3 * stats.proposed_tokens > 0


@pytest.mark.parametrize("architecture", EAGLE_HEADS)
def test_an_eagle_heads_guesses_change_no_token_and_are_kept(architecture):
    """The EAGLE proposer (a head over the model's own hidden states, from NxDI's checkpoint layout) beside
    greedy, sampled and penalized rows: the same tokens as without speculation, greedy ones generate()'s, and
    the head's guesses kept (it reads the model's features from the native step or transformers' modules alike)."""
    from conftest import reference, tiny_model

    from disagg.engine.backends import load_backend
    from disagg.engine.requests import Sampling
    from disagg.engine.speculation.eagle import EagleProposer, load_eagle_head

    ref = reference(architecture)
    backend = load_backend("torch", model=tiny_model(architecture), dtype="float32")
    backend.allocate_slots(8, num_blocks=1 + 8 * (backend.info.max_seq_len // BLOCK), block_size=BLOCK)
    text = paragraphs()
    samplings = [Sampling(), Sampling(temperature=0.8, seed=31), Sampling(), Sampling(temperature=1.0, top_p=0.9, seed=32),
                 Sampling(logprobs=1), Sampling(repetition_penalty=1.3)]
    cases = [(ref.ids(" ".join(text[5 * i % len(text)].split()[:6])), sampling, 30 + 7 * i) for i, sampling in enumerate(samplings)]
    plain, _ = decode_in_process(backend, None, cases)
    proposer = EagleProposer(backend, load_eagle_head(eagle_head(architecture)), 8)
    speculated, stats = decode_in_process(backend, GUESSES, cases, method="eagle", proposer=proposer)
    assert speculated == plain
    for i, (ids, sampling, n) in enumerate(cases):
        if sampling == Sampling() or sampling == Sampling(logprobs=1):
            assert plain[i] == ref.greedy(ids, n, ignore_eos=True), i
    assert stats.accepted_tokens >= 0.3 * stats.proposed_tokens > 0


def test_an_eagle_checkpoint_that_does_not_fit_is_refused_at_start_up_naming_what(tmp_path):
    """Before the model loads (check_draft): another width, a tensor missing or misshapen, an EAGLE-3 head."""
    import json
    import shutil

    from conftest import tiny_model
    from safetensors.torch import load_file, save_file

    from decode_worker.__main__ import parse_config
    from decode_worker.grpc_edge import check_draft

    model, head = tiny_model("llama"), eagle_head("llama")

    def variant(name: str, edit_config=None, edit_state=None) -> str:
        path = tmp_path / name
        shutil.copytree(head, path)
        if edit_config:
            config = json.loads((path / "config.json").read_text())
            edit_config(config)
            (path / "config.json").write_text(json.dumps(config))
        if edit_state:
            state = load_file(str(path / "model.safetensors"))
            edit_state(state)
            save_file(state, str(path / "model.safetensors"))
        return str(path)

    def refusal(path: str) -> str:
        with pytest.raises(SystemExit) as refused:
            check_draft(parse_config(["--model", model, "--speculative-method", "eagle", "--draft-model", path]))
        assert "\n" not in str(refused.value)
        return str(refused.value)

    wide = variant("wide", edit_config=lambda c: c.update(hidden_size=96))
    assert refusal(wide) == f"decode_worker: --draft-model {wide}: an EAGLE head 96 wide for a model 64 wide"
    missing = variant("missing", edit_state=lambda s: s.pop("fc.weight"))
    assert refusal(missing) == f"decode_worker: --draft-model {missing}: no tensor fc.weight"
    bent = variant("bent", edit_state=lambda s: s.update({"layers.0.mlp.up_proj.weight": s["layers.0.mlp.up_proj.weight"][:-1]}))
    assert refusal(bent) == f"decode_worker: --draft-model {bent}: layers.0.mlp.up_proj.weight is (191, 64), expected (192, 64)"
    eagle3 = variant("eagle3", edit_state=lambda s: s.update({"d2t": torch.zeros(4, dtype=torch.long)}))
    assert refusal(eagle3) == f"decode_worker: --draft-model {eagle3}: an EAGLE-3 checkpoint (midlayer, d2t): only EAGLE v1 heads are served"
    check_draft(parse_config(["--model", model, "--speculative-method", "eagle", "--draft-model", head]))  # its own head passes


def test_a_step_that_takes_one_row_a_sequence_is_refused_for_speculation():
    """The compiled step without a verify graph (chosen by default on CUDA, not by --compile alone, which builds one)
    is refused after it loads, in one line."""
    from conftest import tiny_model

    from decode_worker.grpc_edge import refuse_unless_scores_guesses
    from disagg.engine.backends import load_backend

    compiled = load_backend("torch", model=tiny_model("llama"), dtype="float32", torch={"compile": True})  # compiles only when slots are allocated
    with pytest.raises(SystemExit) as refused:
        refuse_unless_scores_guesses(compiled, "the model's")
    expected = ("decode_worker: --speculative-method: the model's TorchBackend step does not score guesses: its compiled step was built "
                "without a verify graph (verify_rows 0)")
    assert str(refused.value) == expected
    refuse_unless_scores_guesses(load_backend("torch", model=tiny_model("llama"), dtype="float32"), "the model's")  # eager: served
    # Over an 8-bit KV cache only the native step undoes a rejected guess's append: transformers' modules are refused.
    modules = load_backend("torch", model=tiny_model("llama"), dtype="float32", torch={"kv_cache_dtype": "int8", "native_step": False})
    with pytest.raises(SystemExit) as refused:
        refuse_unless_scores_guesses(modules, "the model's")
    assert str(refused.value).endswith("step does not score guesses: over its int8 KV cache only the native step (native_step.c) scores guesses, "
                                       "and it does not serve this model here")


def test_lmis_speculative_draft_model_and_length_are_a_draft_models_speculation(tmp_path):
    from decode_worker.__main__ import parse_config

    properties = tmp_path / "serving.properties"
    properties.write_text("option.model_id=/models/target\noption.speculative_draft_model=/models/draft\noption.speculative_length=5\n")
    config = parse_config(["--serving-properties", str(properties)])
    assert (config.model, config.speculative_method, config.draft_model, config.num_speculative_tokens) == ("/models/target", "draft", "/models/draft", 5)
    assert config.speculation().num_tokens == 5


@pytest.mark.parametrize("nxdi,method", [({"enable_fused_speculation": True}, "draft"),
                                          ({"enable_fused_speculation": True, "enable_eagle_speculation": True}, "eagle")])
def test_nxdis_speculation_settings_in_a_worker_config_are_ours(tmp_path, nxdi, method):
    """NxDI's names in a --worker-config JSON: speculation_length counts the input token's position too (one more than
    the guesses a row), draft_model_path is the draft, and enable_eagle_speculation makes it EAGLE's."""
    import json

    from decode_worker.__main__ import parse_config

    path = tmp_path / "worker.json"
    path.write_text(json.dumps({"model": "/models/target", "speculation_length": 5, "draft_model_path": "/models/d", **nxdi}))
    config = parse_config(["--backend", "neuron", "--worker-config", str(path)])
    assert (config.speculative_method, config.draft_model, config.num_speculative_tokens) == (method, "/models/d", 4)
    assert config.neuron_speculation_options()["speculation_length"] == 5
    for bad in (1, "5", 2.5):  # no guess, or not a whole number: refused naming the setting, never the default count
        path.write_text(json.dumps({"model": "/models/target", "speculation_length": bad, "draft_model_path": "/models/d", **nxdi}))
        with pytest.raises(ValueError) as refused:  # the worker's main prints it as one line (test_a_speculation_setting_out_of_range...)
            parse_config(["--backend", "neuron", "--worker-config", str(path)])
        assert str(refused.value).startswith(f"{path}: speculation_length {bad!r}: NxDI's fused step scores the input token and at least one guess")


def test_a_draft_of_another_tokenizer_is_refused_at_start_up_with_one_line():
    """Before either model loads (decode_worker/grpc_edge.py's check_draft, the first thing serve() does)."""
    from conftest import tiny_model

    from decode_worker.__main__ import parse_config
    from decode_worker.grpc_edge import check_draft

    model, draft = tiny_model("llama"), tiny_model("other-tokenizer")
    with pytest.raises(SystemExit) as refused:
        check_draft(parse_config(["--model", model, "--speculative-method", "draft", "--draft-model", draft]))
    assert str(refused.value) == f"decode_worker: --draft-model {draft}: its vocabulary has 600 tokens, the model's 512"
    check_draft(parse_config(["--model", model, "--speculative-method", "draft", "--draft-model", tiny_model("llama-draft")]))  # its own draft passes


def nucleus(logits, temperature: float, top_p: float):
    """The target's distribution, computed here: softmax at the temperature, then the smallest
    most-likely set whose mass reaches top_p (a token stays while the mass before it is below top_p)."""
    import torch

    probs = torch.softmax(logits.double() / temperature, -1)
    ordered, order = probs.sort(descending=True)
    kept = (ordered.cumsum(-1) - ordered) < top_p
    out = torch.zeros_like(probs)
    out[order[kept]] = ordered[kept]
    return out / out.sum()


def chi_square_holds(counts, expected_probs, draws: int) -> bool:
    """Pearson's test at p = 0.0005 (bins of expected count under 5 merged); the quantile by Wilson-Hilferty."""
    import math

    expected = expected_probs * draws
    big = expected >= 5
    observed_bins = [*counts[big].tolist(), counts[~big].sum().item()]
    expected_bins = [*expected[big].tolist(), expected[~big].sum().item()]
    pairs = [(o, e) for o, e in zip(observed_bins, expected_bins) if e > 0]
    if any(o > 0 for o, e in zip(observed_bins, expected_bins) if e == 0):
        return False  # a token the target never draws
    statistic = sum((o - e) ** 2 / e for o, e in pairs)
    df = len(pairs) - 1
    assert df >= 3, "too few tokens likely enough to test"
    quantile = df * (1 - 2 / (9 * df) + 3.29 * math.sqrt(2 / (9 * df))) ** 3
    return statistic < quantile


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.9), (1.3, 1.0)])
def test_sampled_tokens_kept_after_a_guess_follow_the_targets_distribution(llama_ref, temperature, top_p):
    """20,000 draws of a row and its guess's row through the decode step's sampler: the first token and,
    where the guess was right, the token after it are distributed as the target's at each position."""
    import torch

    from disagg.engine.requests import Sampling
    from disagg.engine.sampler import params_row, sample

    draws = 20_000
    ids = llama_ref.ids("and the")  # a context the tiny model is unsure of at both positions: dozens of tokens to test
    with torch.no_grad():
        first_logits = llama_ref.model(torch.tensor([ids])).logits[0, -1].float()
        guess = int(first_logits.argmax())
        second_logits = llama_ref.model(torch.tensor([ids + [guess]])).logits[0, -1].float()
    logits = torch.stack([first_logits, second_logits]).repeat(draws, 1)
    params = torch.tensor([params_row(Sampling(temperature=temperature, top_p=top_p))] * (2 * draws), dtype=torch.float32)
    seeds = torch.arange(1, draws + 1).repeat_interleave(2)
    steps = torch.tensor([7, 8]).repeat(draws)  # the row's counter and its guess's
    tokens = sample(logits, params, seeds, steps).token_ids.view(draws, 2).tolist()
    kept = [kept_tokens([guess], pair) for pair in tokens]
    vocab = first_logits.shape[0]
    firsts = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=vocab)
    seconds = torch.tensor([k[1] for k in kept if len(k) == 2])
    assert chi_square_holds(firsts, nucleus(first_logits, temperature, top_p), draws)
    assert len(seconds) > 1000  # the guess was the most likely token: kept often enough to test
    assert chi_square_holds(torch.bincount(seconds, minlength=vocab), nucleus(second_logits, temperature, top_p), len(seconds))


def decode_metrics(cluster) -> dict[str, float]:
    totals: dict[str, float] = {}
    for process in cluster.processes:
        if process.name.startswith("decode"):
            text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def accepted(cluster) -> float:
    return decode_metrics(cluster).get("disagg_decode_spec_accepted_tokens_total", 0.0)


@pytest.fixture(scope="module")
def speculating_cluster(cluster_logs):
    cluster = start_cluster(cluster_logs / "speculating", "llama", batch_size=16,
                            worker_args=["--speculative-method", "ngram", "--num-speculative-tokens", str(GUESSES)])
    yield cluster
    cluster.stop()


def test_greedy_output_at_batch_1_is_generates_and_guesses_are_kept(speculating_cluster, llama_ref):
    before = accepted(speculating_cluster)
    with Client(speculating_cluster.router_address, timeout=120) as client:
        for prompt, n in [(REPEATING, 100), (PLAIN[0], 60)]:
            result = client.complete(prompt, max_new_tokens=n, ignore_eos=True)
            assert result.token_ids == llama_ref.greedy(prompt, n, ignore_eos=True), prompt
            assert result.completion_tokens == n and result.finish_reason == "length"
    assert accepted(speculating_cluster) - before >= 30  # the steps did speculate: guesses were kept, many tokens a pass


def test_stops_and_lengths_hold_as_without_speculation(speculating_cluster, llama_ref):
    """No token past a stop reaches the client though a step keeps several at once."""
    expected = llama_ref.greedy(REPEATING, 40, ignore_eos=True)
    with Client(speculating_cluster.router_address, timeout=120) as client:
        for n in (1, 2, 3, 5, 9, 17):
            assert client.complete(REPEATING, max_new_tokens=n, ignore_eos=True).token_ids == expected[:n]
        stop_id = expected[11]
        by_token = client.complete(REPEATING, max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
        assert (by_token.finish_reason, by_token.token_ids) == ("stop", expected[: expected.index(stop_id) + 1])
        text = llama_ref.tokenizer.decode(expected, skip_special_tokens=True)
        stop_text = text.split()[9]
        by_text = client.complete(REPEATING, max_new_tokens=40, ignore_eos=True, stop=[stop_text])
        assert by_text.finish_reason == "stop_sequence" and by_text.text == text[: text.index(stop_text)]
    assert_nothing_held(speculating_cluster)


def test_logprobs_of_kept_guesses_are_the_targets(speculating_cluster, llama_ref):
    import torch

    n = 30
    expected = llama_ref.greedy(REPEATING, n, ignore_eos=True)
    with Client(speculating_cluster.router_address, timeout=120) as client:
        result = client.complete(REPEATING, max_new_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=2)
    assert result.token_ids == expected
    ids = llama_ref.ids(REPEATING) + expected
    with torch.no_grad():
        logits = llama_ref.model(torch.tensor([ids])).logits[0, len(ids) - n - 1 : -1].float()
    reference = torch.log_softmax(logits, -1)
    for i, entry in enumerate(result.logprobs):
        assert entry.token_id == expected[i]
        assert abs(entry.logprob - reference[i, expected[i]].item()) < 1e-3, i
        top = reference[i].topk(2)
        assert [alt[0] for alt in entry.top] == top.indices.tolist()


@pytest.mark.parametrize("kind", ["words", "json_schema", "regex"])
def test_constrained_rows_speculate_and_equal_generate_under_the_same_mask(speculating_cluster, llama_ref, kind):
    """A guess the grammar refuses is never consumed by the row's matcher, the kept ones stay consumed,
    the rest are taken back: the same tokens as transformers' generate() with the grammar as a logits processor."""
    import llguidance
    from test_structured_output import CASES, PROMPT, constrained_reference

    if kind == "words":  # a prompt whose words repeat, in the grammar's words: prompt lookup guesses, many kept
        words = r"((the|a|cat|dog|sat|on|mat) ){10,40}"
        constraint, grammar, prompt = dict(regex=words), llguidance.LLMatcher.grammar_from_regex(words), "the cat sat on the mat " * 4 + "the"
    else:
        constraint, make_grammar, _ = CASES[kind]
        grammar, prompt = make_grammar(), PROMPT
    expected, _ = constrained_reference(llama_ref, prompt, grammar, 80)
    before = accepted(speculating_cluster)
    with Client(speculating_cluster.router_address, timeout=120) as client:
        assert client.complete(prompt, max_new_tokens=80, **constraint).token_ids == expected
    if kind == "words":
        assert accepted(speculating_cluster) - before >= 10


@pytest.mark.parametrize("size", [6, 16])
def test_a_mixed_batch_gets_what_each_request_gets_alone(speculating_cluster, llama_ref, size):
    """Greedy and sampled rows speculate beside penalized ones (which decode one token a step); 16
    rows are over the batch that speculates (SpeculationConfig.max_batch) until they thin out."""
    cases = []
    before = accepted(speculating_cluster)
    for i in range(size):
        prompt = REPEATING if i % 2 == 0 else PLAIN[i % 4]
        params = dict(max_new_tokens=10 + (i * 7) % 30, ignore_eos=True)
        if i % 4 == 1:
            params.update(temperature=0.8, seed=100 + i)
        if i % 8 == 3:
            params.update(repetition_penalty=1.3)
        cases.append((prompt, params))
    assert_batch_gets_what_each_gets_alone(speculating_cluster, llama_ref, cases)
    assert accepted(speculating_cluster) > before
    assert_nothing_held(speculating_cluster)


def test_speculation_and_an_8_bit_kv_cache_run_eagerly_unless_compile_is_asked_for():
    """CUDA's default is the compiled step, in one slot a sequence: speculation and an 8-bit KV cache make the default
    eager (as vLLM falls back); --compile builds the verify graph for guesses (its rows: at most max_batch sequences,
    each its input and its guesses), and for eagle graphs that return the rows' hidden states too."""
    from decode_worker.config import DecodeWorkerConfig
    from decode_worker.grpc_edge import backend_options

    assert DecodeWorkerConfig(model="m").compile_choice() is None  # the backend's default: compiled on CUDA only
    assert DecodeWorkerConfig(model="m", compile=True).compile_choice() is True
    assert DecodeWorkerConfig(model="m", speculative_method="ngram").compile_choice() is False
    assert DecodeWorkerConfig(model="m", kv_cache_dtype="fp8").compile_choice() is False
    assert DecodeWorkerConfig(model="m", speculative_method="ngram").verify_rows() == 0
    compiled = DecodeWorkerConfig(model="m", speculative_method="ngram", num_speculative_tokens=6, compile=True)
    assert compiled.verify_rows() == 8 * 7 and backend_options(compiled)["torch"]["verify_rows"] == 8 * 7
    eagle = DecodeWorkerConfig(model="m", speculative_method="eagle", draft_model="e", compile=True)
    assert backend_options(eagle)["torch"]["step_hidden"] and not backend_options(compiled)["torch"]["step_hidden"]


def test_a_speculation_setting_out_of_range_or_not_served_is_refused_with_one_line():
    """The worker's own entry point: SystemExit with the line it prints, before anything loads."""
    from decode_worker.__main__ import main

    for flags, message in [
        (["--speculative-method", "ngram", "--num-speculative-tokens", "65"], "--num-speculative-tokens must be 1..64, got 65"),
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative-method"),
        (["--speculative-method", "draft"], "--speculative-method draft needs --draft-model"),
        (["--speculative-method", "ngram", "--draft-model", "d"], "--draft-model is for --speculative-method draft or eagle, not ngram"),
    ]:
        with pytest.raises(SystemExit) as refused:
            main(["--model", "unused", *flags])
        assert str(refused.value).startswith(f"decode_worker: {message}") and "\n" not in str(refused.value)


@pytest.mark.parametrize("architecture,transport", [("qwen2", "grpc"), ("mistral-sw", "nixl")])
def test_other_architectures_and_transports_with_prefix_hits_equal_generate(cluster_logs, architecture, transport):
    """Through the whole service: the prompt's second request reads the first one's cached blocks."""
    from conftest import reference

    if transport == "nixl":
        from disagg.kv_transport.nixl_transport import available

        if not available():
            pytest.skip("NIXL is not installed")
    ref = reference(architecture)
    cluster = start_cluster(cluster_logs / f"speculating-{architecture}", architecture, transport=transport, batch_size=4,
                            worker_args=["--speculative-method", "ngram", "--block-size", "8"])
    try:
        with Client(cluster.router_address, timeout=120) as client:
            expected = ref.greedy(REPEATING, 60, ignore_eos=True)
            assert client.complete(REPEATING, max_new_tokens=60, ignore_eos=True).token_ids == expected
            hits = decode_metrics(cluster).get("disagg_decode_prefix_hit_tokens_total", 0.0)
            assert client.complete(REPEATING, max_new_tokens=60, ignore_eos=True).token_ids == expected
            assert decode_metrics(cluster)["disagg_decode_prefix_hit_tokens_total"] > hits
        assert accepted(cluster) >= 10
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


@pytest.fixture
def held_speculating_cluster(cluster_logs, tmp_path, monkeypatch):
    """Two speculating decode workers, their steps held (test_failures.hold_decode_steps) until the
    returned path exists: the stream is certainly running when its worker is killed."""
    release = hold_decode_steps(monkeypatch, tmp_path)
    cluster = start_cluster(cluster_logs / "speculating-held", "llama", decode=2, batch_size=4,
                            worker_args=["--speculative-method", "ngram"], router_args=["--worker-wait-seconds", "1"])
    yield cluster, release
    release.touch()
    cluster.stop()


def test_a_speculating_decode_worker_killed_mid_stream_loses_and_repeats_no_token(held_speculating_cluster, llama_ref):
    cluster, release = held_speculating_cluster
    expected = llama_ref.greedy(REPEATING, 300, ignore_eos=True)
    with Client(cluster.router_address, timeout=120) as client:
        def kept_guesses(victim):  # held mid-stream, having kept guesses
            assert accepted(cluster) > 0

        tokens, last = stream_across_a_killed_decode_worker(cluster, release, client, REPEATING, 300, kept_guesses)
        assert tokens == expected
        assert last.finish_reason == "length" and last.completion_tokens == 300
        # A cancelled speculating stream frees its blocks.
        cancelled = client.generate(REPEATING, max_new_tokens=300, ignore_eos=True)
        next(cancelled)
        cancelled.close()
    assert_nothing_held(cluster, within=10.0)


def assert_batch_gets_what_each_gets_alone(cluster, llama_ref, cases: list[tuple[str, dict]]) -> None:
    """The cases sent together: greedy ones equal generate(), every one what it gets alone."""

    async def batch():
        async with AsyncClient(cluster.router_address, timeout=300) as client:
            return await asyncio.gather(*(client.complete(prompt, **params) for prompt, params in cases))

    together = asyncio.run(batch())
    with Client(cluster.router_address, timeout=120) as client:
        for (prompt, params), result in zip(cases, together):
            if "temperature" not in params and "repetition_penalty" not in params:
                assert result.token_ids == llama_ref.greedy(prompt, params["max_new_tokens"], ignore_eos=True)
            assert result.token_ids == client.complete(prompt, **params).token_ids


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_draft_model_or_eagle_head_through_the_service_with_a_mixed_batch(cluster_logs, llama_ref, method):
    """--speculative-method draft (a one-layer model) and eagle (a head over the model's hidden states) end to end:
    greedy rows equal generate(), sampled and penalized rows what they get alone, guesses kept, every block freed."""
    from conftest import tiny_model

    guesser = tiny_model("llama-draft") if method == "draft" else eagle_head("llama")
    cluster = start_cluster(cluster_logs / f"speculating-{method}", "llama", batch_size=8,
                            worker_args=["--speculative-method", method, "--draft-model", guesser])
    try:
        text = paragraphs()
        cases = [(" ".join(text[3 * i].split()[:6]), dict(max_new_tokens=20 + 9 * i, ignore_eos=True)) for i in range(6)]
        cases[1][1].update(temperature=0.8, seed=5)
        cases[4][1].update(repetition_penalty=1.2)
        assert_batch_gets_what_each_gets_alone(cluster, llama_ref, cases)
        assert accepted(cluster) >= 20
        assert_nothing_held(cluster)
    finally:
        cluster.stop()
