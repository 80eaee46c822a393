"""The decode worker's slot bookkeeping: which slot belongs to which request, and in what state.

No torch here. A slot goes FREE -> RESERVED (waiting for KV, under a lease)
-> ACTIVE (in the running batch) -> FREE. Every query has its mutation beside
it (`can_reserve`/`reserve`, `is_reserved`/`activate`), and `check_integrity`
verifies the invariants; tests call it after every scenario.

Where the KV is paged (`blocks`), a slot is a row of the batch and the
reservation also holds a block table from the block pool, sized up front for
the prompt and max_new_tokens (so a running sequence never outgrows its
memory: the policy that replaces vLLM's preemption here), its leading blocks
taken from the prefix cache where the prompt's blocks are published. The
blocks are published once the KV has landed (activate) and released with the
slot; otherwise a slot's table is the slot itself.
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .kv_blocks import BlockPool, NoFreeBlocks


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"
    ACTIVE = "active"


class SlotError(Exception):
    """A reservation that is unknown, expired or in the wrong state for the call."""


@dataclass
class Reservation:
    reservation_id: str
    request_id: str
    slot: int
    prompt_len: int
    lease_deadline: float
    state: SlotState = SlotState.RESERVED
    table: list[int] = field(default_factory=list)  # its blocks ([slot] where the KV is not paged)
    cached_tokens: int = 0  # leading prompt positions already held (prefix cache hits): no KV is sent for them
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks, published on activate


class SlotManager:
    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic, blocks: BlockPool | None = None):
        if num_slots < 1:
            raise ValueError("num_slots must be at least 1")
        self.num_slots, self.blocks = num_slots, blocks
        self._clock = clock
        self._owner: list[str | None] = [None] * num_slots
        self._by_id: dict[str, Reservation] = {}
        self._ids = (f"r{n}-{uuid.uuid4().hex[:8]}" for n in itertools.count())

    # -- queries ---------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self._owner.count(None)

    def count(self, state: SlotState) -> int:
        return sum(1 for r in self._by_id.values() if r.state is state)

    def get(self, reservation_id: str) -> Reservation | None:
        return self._by_id.get(reservation_id)

    def can_reserve(self, block_hashes: list[bytes] = (), total_blocks: int = 0) -> bool:
        return None in self._owner and (self.blocks is None or self.blocks.can_allocate(list(block_hashes), total_blocks))

    def expired(self) -> list[Reservation]:
        """Reservations still waiting for their KV after their lease ran out."""
        now = self._clock()
        return [r for r in self._by_id.values() if r.state is SlotState.RESERVED and r.lease_deadline <= now]

    # -- mutations -------------------------------------------------------
    def reserve(self, request_id: str, prompt_len: int, lease_seconds: float, block_hashes: list[bytes] = (), total_blocks: int = 0) -> Reservation:
        """A slot, and where the KV is paged a table of total_blocks blocks, the cached prefix
        of block_hashes (the prompt's full blocks) first."""
        # The lowest free slot keeps the running slots packed together, so the
        # decode step can often read the cache through a view instead of a gather.
        slot = self._owner.index(None) if None in self._owner else None
        if slot is None:
            raise SlotError("no free slot")
        reservation = Reservation(next(self._ids), request_id, slot, prompt_len, self._clock() + lease_seconds, table=[slot])
        if self.blocks is not None:
            try:
                reservation.table, hits = self.blocks.allocate(list(block_hashes), total_blocks)
            except NoFreeBlocks as exc:
                raise SlotError(f"no room for {total_blocks} KV blocks: {exc}") from None
            reservation.cached_tokens = min(hits * self.blocks.block_size, prompt_len)
            reservation.block_hashes = list(block_hashes)
        self._owner[slot] = reservation.reservation_id
        self._by_id[reservation.reservation_id] = reservation
        return reservation

    def is_reserved(self, reservation_id: str) -> bool:
        r = self._by_id.get(reservation_id)
        return r is not None and r.state is SlotState.RESERVED

    def activate(self, reservation_id: str) -> Reservation:
        if not self.is_reserved(reservation_id):
            raise SlotError(f"reservation {reservation_id!r} is not waiting for KV")
        reservation = self._by_id[reservation_id]
        reservation.state = SlotState.ACTIVE
        if self.blocks is not None:  # the prompt's KV is complete: its full blocks may serve later prompts
            self.blocks.publish(reservation.table, reservation.block_hashes)
        return reservation

    def release(self, reservation_id: str) -> bool:
        """Frees the slot; False when it was already free (release is idempotent)."""
        reservation = self._by_id.pop(reservation_id, None)
        if reservation is None:
            return False
        self._owner[reservation.slot] = None
        if self.blocks is not None:
            self.blocks.release(reservation.table)
        return True

    # -- invariants ------------------------------------------------------
    def check_integrity(self) -> None:
        owners = [o for o in self._owner if o is not None]
        assert len(owners) == len(set(owners)), "a reservation owns two slots"
        assert set(owners) == set(self._by_id), "slot owners and reservations disagree"
        for r in self._by_id.values():
            assert self._owner[r.slot] == r.reservation_id, f"slot {r.slot} not owned by {r.reservation_id}"
        if self.blocks is not None:
            self.blocks.check_integrity()
            held = collections.Counter(b for r in self._by_id.values() for b in r.table)
            assert held.keys() <= {b for b in range(1, self.blocks.num_blocks)}, "a table holds the null block or a block past the pool"
            assert len(held) == self.blocks.used_blocks, "blocks in use that no reservation holds"
            assert all(self.blocks.references(b) == n for b, n in held.items()), "a block's references are not its reservations"
