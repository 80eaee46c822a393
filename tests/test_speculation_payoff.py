"""The measured gate on guessing (disagg/engine/speculation/payoff.py): per batch size, steps with guesses
against steps without, by tokens per second of the loop's time."""

from __future__ import annotations

import pytest

from disagg.engine.speculation.payoff import StepPayoff


def measured(plain: tuple[float, int], guessing: tuple[float, int], batch: int = 6, times: int = 3) -> StepPayoff:
    payoff = StepPayoff(min_samples=3, recheck_every=8)
    for _ in range(times):
        payoff.observe(batch, False, *plain)
    for _ in range(times):
        payoff.observe(batch, True, *guessing)
    return payoff


@pytest.mark.parametrize("promising", [True, False])
def test_until_both_kinds_are_measured_the_kept_guesses_rule_decides(promising):
    payoff = measured((0.010, 6), (0.030, 20), times=2)  # two of each: fewer than min_samples
    assert payoff.worth_guessing(6, 26.0, promising) is promising
    assert payoff.worth_guessing(7, 26.0, promising) is promising  # another batch size: nothing measured


def test_guessing_that_emits_fewer_tokens_a_second_is_turned_down_however_promising():
    # Without guesses: 6 tokens in 10 ms (600/s). With: 30 ms a step, so 17 tokens expected is 567/s.
    payoff = measured((0.010, 6), (0.030, 17))
    assert payoff.worth_guessing(6, 17.0, promising=True) is False
    assert payoff.worth_guessing(6, 19.0, promising=False) is True  # 633/s: pays, though the rule said no


def test_a_decision_that_held_for_recheck_every_steps_is_turned_once():
    payoff = measured((0.010, 6), (0.030, 30))  # guessing pays: 1,000/s against 600/s
    assert payoff.worth_guessing(6, 30.0, False) is True
    for _ in range(4):
        payoff.observe(6, True, 0.030, 30)
    assert payoff.worth_guessing(6, 30.0, False) is True  # seven guessing steps in a row (the 3 measured and 4)
    payoff.observe(6, True, 0.030, 30)
    # Eight guessing steps in a row at this batch size: one without guesses, to measure it again.
    assert payoff.worth_guessing(6, 30.0, False) is False
    payoff.observe(6, False, 0.010, 6)
    assert payoff.worth_guessing(6, 30.0, False) is True


def test_the_figures_follow_the_steps_measured_last():
    payoff = measured((0.010, 6), (0.030, 30))
    assert payoff.worth_guessing(6, 30.0, False) is True
    for _ in range(40):  # guessing steps got slower: 60 ms
        payoff.observe(6, True, 0.060, 30)
    payoff.observe(6, False, 0.010, 6)  # (ends the streak)
    assert payoff.worth_guessing(6, 30.0, True) is False
