import pytest

from disagg.engine.slot_manager import SlotError, SlotManager, SlotState


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_reserve_activate_release_cycle():
    slots = SlotManager(2)
    a = slots.reserve("a", prompt_len=5, lease_seconds=10)
    b = slots.reserve("b", prompt_len=7, lease_seconds=10)
    assert (a.slot, b.slot) == (0, 1)
    assert not slots.can_reserve()
    with pytest.raises(SlotError):
        slots.reserve("c", 3, 10)
    slots.activate(a.reservation_id)
    assert slots.count(SlotState.ACTIVE) == 1 and slots.count(SlotState.RESERVED) == 1
    assert slots.release(a.reservation_id)
    assert not slots.release(a.reservation_id)  # idempotent
    assert slots.reserve("c", 3, 10).slot == 0  # lowest free slot is reused
    slots.check_integrity()


def test_activate_refuses_unknown_or_active():
    slots = SlotManager(1)
    r = slots.reserve("a", 4, 10)
    slots.activate(r.reservation_id)
    with pytest.raises(SlotError):
        slots.activate(r.reservation_id)
    with pytest.raises(SlotError):
        slots.activate("nope")


def test_expired_lists_only_waiting_reservations_past_their_lease():
    clock = Clock()
    slots = SlotManager(3, clock=clock)
    waiting = slots.reserve("w", 4, lease_seconds=1)
    active = slots.reserve("a", 4, lease_seconds=1)
    slots.activate(active.reservation_id)
    assert slots.expired() == []
    clock.now = 1.5
    assert [r.reservation_id for r in slots.expired()] == [waiting.reservation_id]


def test_integrity_check_catches_corruption():
    slots = SlotManager(2)
    r = slots.reserve("a", 4, 10)
    slots._owner[1] = r.reservation_id  # the same reservation in two slots
    with pytest.raises(AssertionError):
        slots.check_integrity()
