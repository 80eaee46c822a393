import torch

from disagg.engine.requests import Sampling
from disagg.engine.sampler import params_tensor, sample, uniform_draws


def logits(batch=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g)


def draw(lg, samplings, steps=None):
    steps = steps if steps is not None else torch.zeros(len(samplings), dtype=torch.long)
    return sample(lg, params_tensor(samplings), torch.tensor([s.seed for s in samplings]), steps).tolist()


def test_greedy_and_top_k_one_are_argmax():
    lg = logits()
    expected = lg.argmax(-1).tolist()
    assert draw(lg, [Sampling()] * 4) == expected
    assert draw(lg, [Sampling(temperature=1.5, top_k=1, seed=s) for s in range(4)]) == expected


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
