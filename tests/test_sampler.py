import pytest
import torch
from conftest import PresenceFrequencyPenalty
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from disagg.engine.requests import Sampling
from disagg.engine.sampler import (
    SlotTokenCounts,
    params_tensor,
    sample,
    token_rows,
    uniform_draws,
)


def logits(batch=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g)


def draw(lg, samplings, steps=None):
    steps = steps if steps is not None else torch.zeros(len(samplings), dtype=torch.long)
    return sample(lg, params_tensor(samplings), torch.tensor([s.seed for s in samplings]), steps).token_ids.tolist()


def test_greedy_and_top_k_one_are_argmax():
    lg = logits()
    expected = lg.argmax(-1).tolist()
    assert draw(lg, [Sampling()] * 4) == expected
    assert draw(lg, [Sampling(temperature=1.5, top_k=1, seed=s) for s in range(4)]) == expected


def test_greedy_c_gives_torch_argmax_on_ties_signed_zeros_nans_and_strided_rows():
    from disagg.engine.cpu_kernels import greedy

    if greedy._library() is None:
        pytest.skip("greedy.c cannot be built here (no AVX2 or no compiler)")
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(n, generator=g) for n in (1, 7, 8, 9, 31, 49152, 49157)]
    tied = torch.randn(49152, generator=g)
    tied[[9, 4000, 49150]] = 50.0  # the first of three equal maxima, none at a vector's start
    quantized = torch.randint(0, 4, (1000,), generator=g).float()  # many ties
    zeros = torch.tensor([-1.0, -0.0, -3.0, 0.0, -0.0] + [-2.0] * 11)  # -0.0 == +0.0: the first
    nans = torch.randn(100, generator=g)
    nans[[37, 90]] = float("nan")  # the first NaN wins, as in torch
    tail_nan = torch.randn(21, generator=g)
    tail_nan[20] = float("nan")  # past the last whole vector
    minus_inf = torch.full((40,), float("-inf"))
    for row in [*rows, tied, quantized, zeros, nans, tail_nan, minus_inf]:
        assert greedy.greedy_ids(row[None]).tolist() == row[None].argmax(dim=-1).tolist(), row
    batch = torch.randn(6, 3000, generator=g)
    batch[2, 100:200] = 9.0
    view = batch[:, 5:2005]  # rows 3,000 apart, 2,000 read: the row stride honoured
    assert greedy.greedy_ids(view).tolist() == view.argmax(dim=-1).tolist()
    assert greedy.greedy_ids(batch).tolist() == batch.argmax(dim=-1).tolist()
    assert greedy.greedy_ids(batch.to(torch.bfloat16)).tolist() == batch.to(torch.bfloat16).argmax(dim=-1).tolist()  # torch's own


def test_seeded_row_is_independent_of_its_batch():
    lg = logits(batch=9)
    target = Sampling(temperature=1.0, seed=1234)
    alone = draw(lg[3:4], [target])
    others = [Sampling(temperature=0.7, top_p=0.9, seed=s) for s in range(9)]
    others[3] = target
    assert draw(lg, others)[3] == alone[0]


def test_draws_depend_on_seed_and_step():
    seeds = torch.tensor([1, 1, 2])
    steps = torch.tensor([0, 1, 0])
    u = uniform_draws(seeds, steps)
    assert len(set(u.tolist())) == 3
    assert torch.equal(u, uniform_draws(seeds, steps))
    many = uniform_draws(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert 0.0 <= float(many.min()) and float(many.max()) < 1.0
    assert abs(float(many.mean()) - 0.5) < 0.01


def test_top_p_tiny_keeps_only_the_most_likely_token():
    lg = logits()
    assert draw(lg, [Sampling(temperature=1.0, top_p=1e-6, seed=s) for s in range(4)]) == lg.argmax(-1).tolist()


def test_top_k_restricts_candidates():
    lg = logits(batch=1, vocab=100)
    top3 = set(lg[0].topk(3).indices.tolist())
    picks = {draw(lg, [Sampling(temperature=5.0, top_k=3, seed=s)])[0] for s in range(200)}
    assert picks <= top3 and len(picks) == 3


def test_sampling_follows_the_distribution():
    lg = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for s in range(3000):
        counts[draw(lg, [Sampling(temperature=1.0, seed=s)])[0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


# -- penalties, min-p and logprobs, against transformers' processors -----------------


def penalized_reference(scores, prompt, generated, repetition=1.0, presence=0.0, frequency=0.0):
    ids = torch.tensor([prompt + generated])
    if repetition != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(repetition)(ids, scores)
    return PresenceFrequencyPenalty(len(prompt), presence, frequency)(ids, scores)


PENALTIES = [dict(repetition=1.3), dict(repetition=0.8), dict(presence=0.7), dict(frequency=0.4), dict(repetition=1.2, presence=-0.5, frequency=0.9)]


@pytest.mark.parametrize("penalty", PENALTIES, ids=[str(p) for p in PENALTIES])
def test_penalties_equal_transformers_processors_in_a_mixed_batch(penalty):
    vocab = 40
    lg = logits(batch=3, vocab=vocab, seed=3)
    histories = [([1, 5, 5, 9], [5, 7, 7, 7]), ([2, 3], []), ([30, 31, 32], [4, 4, 30])]
    sampling = Sampling(
        repetition_penalty=penalty.get("repetition", 1.0), presence_penalty=penalty.get("presence", 0.0),
        frequency_penalty=penalty.get("frequency", 0.0), logprobs=5,
    )
    rows = [token_rows(p, g, vocab, "cpu") for p, g in histories]
    counts, in_prompt = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    plain = Sampling(logprobs=5)  # row 1 has no penalty: its logits are untouched
    samplings = [sampling, plain, sampling]
    out = sample(lg, params_tensor(samplings), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), 0, counts, in_prompt, 5)
    for i, (prompt, generated) in enumerate(histories):
        reference = penalized_reference(lg[i : i + 1], prompt, generated, **penalty) if i != 1 else lg[1:2]
        expected = reference.log_softmax(-1)[0]
        assert out.token_ids[i] == reference.argmax(-1)[0]
        torch.testing.assert_close(out.logprobs[i], expected[out.token_ids[i]], rtol=0, atol=1e-6)
        values, ids = expected.topk(5)
        assert out.top_ids[i].tolist() == ids.tolist()
        torch.testing.assert_close(out.top_logprobs[i], values, rtol=0, atol=1e-6)
        assert out.top_ids[i, 0] == out.token_ids[i]  # greedy: the chosen token is the top-1


def test_logprobs_of_a_sampled_token_are_after_temperature_before_truncation():
    lg = logits(batch=1, vocab=30)
    s = Sampling(temperature=0.5, top_k=3, seed=11, logprobs=2)
    out = sample(lg, params_tensor([s]), torch.tensor([11]), torch.zeros(1, dtype=torch.long), top_logprobs=2)
    expected = (lg / 0.5).log_softmax(-1)[0]
    torch.testing.assert_close(out.logprobs[0], expected[out.token_ids[0]], rtol=0, atol=1e-6)
    assert out.token_ids[0].item() in lg[0].topk(3).indices.tolist()


def test_min_p_keeps_what_transformers_min_p_keeps():
    lg = logits(batch=1, vocab=60, seed=5) * 3
    kept = MinPLogitsWarper(0.2)(None, lg.clone()).isfinite()[0]
    picks = {draw(lg, [Sampling(temperature=1.0, min_p=0.2, seed=s)])[0] for s in range(400)}
    assert picks == set(kept.nonzero()[:, 0].tolist())


def test_seeded_penalized_row_is_independent_of_its_batch():
    vocab = 50
    lg = logits(batch=6, vocab=vocab, seed=8)
    target = Sampling(temperature=0.9, top_p=0.95, min_p=0.05, seed=77, repetition_penalty=1.4, frequency_penalty=0.5)
    history = token_rows([1, 2, 3], [4, 4], vocab, "cpu")
    alone = sample(lg[2:3], params_tensor([target]), torch.tensor([77]), torch.tensor([5]), 0, *history)
    batch = [Sampling(temperature=0.7, seed=s, presence_penalty=0.3) for s in range(6)]
    batch[2] = target
    counts = torch.cat([token_rows([s], [s, s + 1], vocab, "cpu")[0] for s in range(6)])
    in_prompt = torch.cat([token_rows([s], [], vocab, "cpu")[1] for s in range(6)])
    counts[2], in_prompt[2] = history[0][0], history[1][0]
    steps = torch.tensor([0, 1, 5, 3, 4, 9])
    together = sample(lg, params_tensor(batch), torch.tensor([s.seed for s in batch]), steps, 0, counts, in_prompt)
    assert together.token_ids[2] == alone.token_ids[0]


def test_slot_counts_follow_start_and_add():
    counts = SlotTokenCounts(num_slots=3, vocab_size=10, device="cpu")
    counts.start(1, prompt_ids=[2, 3], generated_ids=[4, 4])
    counts.add(torch.tensor([0, 1]), torch.tensor([7, 4]))
    rows, in_prompt = counts.rows(torch.tensor([1]))
    assert rows[0].tolist() == [0, 0, 0, 0, 3, 0, 0, 0, 0, 0]
    assert in_prompt[0].nonzero()[:, 0].tolist() == [2, 3]
    counts.start(1, prompt_ids=[9], generated_ids=[1])  # a new owner: nothing of the old one stays
    rows, in_prompt = counts.rows(torch.tensor([1]))
    assert rows[0].nonzero()[:, 0].tolist() == [1] and in_prompt[0].nonzero()[:, 0].tolist() == [9]
