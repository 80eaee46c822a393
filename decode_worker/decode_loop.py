"""The continuous-batching step loop of the decode worker.

Requests join the running batch when their KV and first token are in the slot
(`admit`) and leave the moment they finish or are evicted. Every step runs all
active slots together, rows sorted by slot as NxDI requires.

Async mode (the default) overlaps host and device, as NxDI's `async_mode`:

    host:    build k+1 | submit k+1 | process k (stops, publish) | build k+2 ...
    device:  ... step k ...........| step k+1 ..................| step k+2

Step k+1 takes its input tokens straight from step k's output on the device,
so it is submitted before the host has seen step k's tokens. A sequence that
stops on a token at step k (EOS, a stop id) has therefore computed one extra
token at step k+1, which is dropped. Length limits are known in advance and
cost no extra step. A slot is handed back (`on_retired`) only once no step in
flight still touches it, so a new request's KV can never be overwritten.

Step k's host work waits until step k+1 has launched: on a CPU, until k+1's Python is
done and its one call into native_step.c runs without the GIL (Backend.signals_launch).
Otherwise this thread's and the event loop's Python (publishing k's tokens) hold the GIL
while k+1 takes its turns to start, and k+1 waits; at one stream on two cores that wait was
1-3 ms of a 15 ms step. Other device work queued ahead of k+1 (`run_on_device`: a colocated
prefill) releases the wait as it starts, so k's tokens never wait for it.

A request admitted (or evicted) while step k runs still joins (or leaves)
step k+1: until k ends, k+1 only waits on the device thread, and is cancelled
and built again with the new rows (`_take_in_arrivals`).

A step that raises fails its rows (an event with `error`, the cause named) and
the loop goes on; step k+1, built on k's output, then takes no token from it
(its rows are failed already and its tokens dropped). Steps that keep failing,
or one that raises DeviceLost (disagg/engine/faults.py), put the decode loop in
`failure`: every row is failed, nothing more is scheduled, and `on_fatal` tells
the worker, which drains and exits.

A constrained row (Sequence.matcher) gets its mask where its input token is known
without a host round trip: on the device thread, each step advances the rows'
matchers by the step's input tokens and fills one bitmask for the batch (on an
accelerator on the mask thread, while the model computes the logits); the sampler
applies it (disagg/engine/constraints/rows.py). Unconstrained rows share the step unmasked.

A speculating row (Sequence.speculation, disagg/engine/speculation) takes its guesses
into the step as rows of its own, after its input token, over its own block table;
the step's tokens it keeps follow its newest token, so a step with guesses is
processed before the next is built (async mode pauses while rows guess; a row whose
guesses keep missing rests, and the loop runs ahead again).

A backend that speculates inside its step (Backend.tokens_per_step > 1: NxDI's fused speculation on
Neuron) returns each row's kept tokens, then -1: the loop proposes nothing and builds no guess rows,
and processes every step before it builds the next, since each row's next position depends on how
many tokens it kept. Every sequence is started on the backend before its first step
(Backend.starts_every_sequence: the draft's K/V of its context).

Nothing here runs on the gRPC event loop: the loop has its own thread and the
model runs on a single device thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
from prometheus_client import CollectorRegistry

from disagg.engine.backends import Backend, StepInputs
from disagg.engine.constraints.rows import RowMatcher, step_bitmask
from disagg.engine.faults import FailureStreak, describe
from disagg.engine.requests import FinishReason, Sampling, Stopping, TokenLogprobs, token_finish
from disagg.engine.sampler import SampleOutput, params_row
from disagg.engine.speculation import SpeculationConfig
from disagg.engine.speculation.payoff import StepPayoff
from disagg.engine.speculation.proposers import NgramProposer
from disagg.engine.speculation.rows import RowSpeculation
from disagg.engine.threads import pin_this_thread
from disagg.rpc.metrics import DecodeMetrics

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    key: str  # the reservation id: how events find their stream
    slot: int
    prompt_len: int
    first_token: int
    sampling: Sampling
    stopping: Stopping  # max_new_tokens counts from first_token
    step_offset: int = 0  # sampling counter of first_token (tokens generated on an earlier worker)
    context_ids: tuple[int, ...] = ()  # the prompt_len ids behind the KV, when a penalty needs them
    table: tuple[int, ...] = ()  # its block table, where the backend pages its KV (else its slot is its KV)
    matcher: RowMatcher | None = None  # its constraint's matcher, having consumed the tokens before first_token
    speculation: RowSpeculation | None = None  # its proposer, where it speculates
    generated: int = 1  # tokens the host has seen, the first one included
    scheduled: int = 1  # tokens seen plus tokens being computed
    in_flight: int = 0  # steps submitted and not yet processed that include this row
    last_token: int = -1  # the newest token the host has seen
    done: bool = False  # finished or evicted: its later tokens are dropped

    def __post_init__(self):
        self.last_token = self.first_token

    def token_history(self) -> tuple[list[int], list[int]]:
        """(prompt ids, ids generated so far, first_token included): what penalties count."""
        split = len(self.context_ids) - self.step_offset
        return list(self.context_ids[:split]), [*self.context_ids[split:], self.first_token]


@dataclass(frozen=True)
class TokenEvent:
    key: str
    token_ids: list[int]
    finish: FinishReason
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    error: str = ""  # the step failed this request: the cause (no tokens, no finish)


@dataclass
class _Step:
    rows: list[Sequence]
    output: Future  # -> SampleOutput of one row per sequence and guess
    guesses: list[list[int]]  # per sequence, its guesses this step (rows after its input token's)
    first_row: list[int]  # per sequence, its input token's row in the output
    launched: threading.Event  # set once the step no longer needs the GIL, or has ended

    @property
    def speculative(self) -> bool:
        return any(self.guesses)


@dataclass
class DecodeLoopStats:
    steps: int = 0
    tokens: int = 0
    dropped_tokens: int = 0  # async extra tokens after a stop
    proposed_tokens: int = 0  # speculative guesses scored
    accepted_tokens: int = 0  # of those, kept
    rebuilt_steps: int = 0  # queued steps built again to take in requests that arrived
    device_seconds: float = 0.0
    last_batch_size: int = 0
    step_seconds: list[float] = field(default_factory=list)  # recent device step times


class DecodeLoop:
    def __init__(
        self,
        backend: Backend,
        publish: Callable[[list[TokenEvent]], None],
        on_retired: Callable[[list[str]], None],
        async_mode: bool = True,
        metrics: DecodeMetrics | None = None,
        device_cpus: frozenset[int] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        decode_step: Callable[[StepInputs], SampleOutput] | None = None,
        speculation: SpeculationConfig | None = None,
        proposer=None,
    ):
        # A backend that guesses inside its step (tokens_per_step > 1) gets no guess rows: its speculation is its own.
        self.fused = backend.tokens_per_step > 1
        self.speculation = None if self.fused else speculation
        # Guesses: the draft model's or EAGLE head's (speculation/draft.py, eagle.py; given by the worker) or prompt lookup's.
        self.proposer = proposer if proposer is not None or self.speculation is None else NgramProposer()
        self._after_step = getattr(self.proposer, "after_step", None)
        self._payoff = StepPayoff() if self.speculation is not None else None  # whether guessing pays, per batch size
        self._last_taken_in: float | None = None  # when the loop last took in a step's output (None after idle)
        self._last_guessed = False  # whether that step had guesses
        self.backend = backend
        self._decode_step = decode_step or backend.decode_step  # the worker may put the test-only fault hook in front
        self._on_fatal = on_fatal or (lambda cause: None)
        self._streak = FailureStreak()
        self.failure: str | None = None  # set once steps cannot be trusted: why
        self.max_seq_len = backend.info.max_seq_len
        self.async_mode = async_mode
        self._publish = publish
        self._on_retired = on_retired
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # a command came in, or the running step ended
        self._active: dict[int, Sequence] = {}  # slot -> sequence
        self._retiring: list[Sequence] = []
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device", initializer=pin_this_thread, initargs=(device_cpus,))
        self._launch_lock = threading.Lock()  # guards the two below, shared by the loop and the device thread
        self._awaited: threading.Event | None = None  # the queued step's launch the loop waits for
        self._other_work = False  # run_on_device work runs on the device thread now
        self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-masks")  # the only thread that steps matchers
        self._masks_inline = str(getattr(backend, "device", "cpu")) == "cpu"
        self._last_output: torch.Tensor | None = None  # touched only on the device thread
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._stopping = False
        self._resumed_from_idle = True  # the next step follows an empty batch: no host gap to count
        self._last_step_end: float | None = None  # device thread only
        self.stats = DecodeLoopStats()
        self.metrics = metrics or DecodeMetrics(CollectorRegistry())

    # -- called from any thread -----------------------------------------
    def start(self) -> None:
        self._thread.start()

    def admit(self, seq: Sequence) -> None:
        self._send("admit", seq)

    def evict(self, key: str) -> None:
        self._send("evict", key)

    def stop(self) -> None:
        self._send("stop", None)
        self._thread.join(timeout=30)
        self._device.shutdown(wait=True)
        self._masks.shutdown(wait=True)

    def device_failed(self, cause: str) -> None:
        """Device work beside the steps (a colocated prefill) says the device cannot be trusted: as a fatal step."""
        self._send("device_failed", cause)

    def run_on_device(self, fn, *args):
        """Runs fn on the device thread between steps (colocated prefill); a concurrent future."""
        return self._device.submit(self._other_work_on_device, fn, *args)

    def _other_work_on_device(self, fn, *args):
        # A step queued behind this work counts as launched: the host work of the step before it goes on now.
        with self._launch_lock:
            self._other_work = True
            if self._awaited is not None:
                self._awaited.set()
        try:
            return fn(*args)
        finally:
            with self._launch_lock:
                self._other_work = False

    @property
    def active_count(self) -> int:
        return len(self._active)

    def _send(self, verb: str, arg) -> None:
        self._inbox.put((verb, arg))
        self._wake.set()

    # -- the loop thread -------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # the loop's own bookkeeping broke: no later step can be trusted
            log.exception("decode loop failed")
            self._fail_all(f"decode loop failed: {describe(exc)}")
            self._retire(everything=True)
            while not self._stopping:  # fail what is admitted until the worker stops us
                self._drain_inbox(block=True)
                self._retire(everything=True)

    def _serve(self) -> None:
        in_flight: _Step | None = None
        while True:
            if in_flight is None and not self._active:
                self._last_taken_in = None  # the next step follows an idle wait: not a step's own time
            self._drain_inbox(block=in_flight is None and not self._active and not self._stopping)
            if self._stopping:
                break
            if in_flight is not None and (self.fused or self._guessing_next(in_flight)):
                # Guesses follow each row's newest token, and a fused step's rows go on from the tokens they kept:
                # the host must see them first.
                self._process(in_flight)
                in_flight = None
                self._retire()
            rows = self._schedulable()
            step = self._submit(rows, in_flight) if rows else None
            if in_flight is not None:
                step = self._take_in_arrivals(step, in_flight)
                if step is not None:
                    self._wait_for_launch(step)
                self._process(in_flight)  # host work of step k while step k+1 runs
            if step is not None and not self.async_mode:
                self._process(step)
                step = None
            in_flight = step
            self._retire()
        if in_flight is not None:
            self._process(in_flight)
        self._retire(everything=True)

    def _wait_for_launch(self, step: _Step) -> None:
        """Until step (k+1) has launched (set at the latest when it ends, _device_step), unless other
        device work runs ahead of it (_other_work_on_device)."""
        with self._launch_lock:
            if self._other_work:
                return
            self._awaited = step.launched
        step.launched.wait()
        with self._launch_lock:
            self._awaited = None

    def _guessing_next(self, in_flight: _Step) -> bool:
        """Whether the next step should wait for in_flight's tokens: it guessed (its rows' tokens
        are not known yet), or a row would guess next, in a batch small enough to speculate."""
        if in_flight.speculative:
            return True
        return self._worth_guessing()

    def _worth_guessing(self) -> bool:
        """Whether the next step should guess: speculation on, a batch small enough, and rows ready to guess
        whose recent guesses were kept enough to pay for the wait (any, alone or nearly: it costs next to nothing)."""
        if self.speculation is None or len(self._active) > self.speculation.max_batch:
            return False
        ready = [s.speculation for s in self._active.values() if s.speculation is not None and s.speculation.ready]
        batch = len(self._active)
        if batch <= self.speculation.rest_above or not ready:
            return bool(ready)
        expected = sum(row.expected for row in ready)
        promising = expected >= self.speculation.worth_share * batch
        return self._payoff.worth_guessing(batch, batch + expected, promising)

    def _measure_payoff(self, step: _Step, taken_in: float, emitted: int) -> None:
        """The step's share of the loop's time: since the step before it was taken in (async: the pipeline's
        period; with guesses: the wait, the proposals and the step), with what it emitted. Not the first step
        without guesses after one with them: it ran alone, before the pipeline filled again, so its time is
        not the async period that steps without guesses are measured by."""
        if self._payoff is not None and self._last_taken_in is not None and (step.speculative or not self._last_guessed):
            self._payoff.observe(len(step.rows), step.speculative, taken_in - self._last_taken_in, emitted)
        self._last_taken_in, self._last_guessed = taken_in, step.speculative

    def _take_in_arrivals(self, queued: _Step | None, running: _Step) -> _Step | None:
        """Until step k (`running`) ends, step k+1 (`queued`) only waits behind it on the
        device thread. A command that comes in meanwhile rebuilds k+1 with it, so a new
        request's first decode step is k+1: otherwise it would wait for k+1 as well, a
        whole step more before its second token. A step that has started cannot be
        cancelled (Future.cancel), and then it runs as built."""
        running.output.add_done_callback(lambda _: self._wake.set())
        while True:
            self._wake.wait()
            self._wake.clear()
            if running.output.done():
                return queued
            if self._inbox.empty():
                continue
            if queued is not None:
                if not queued.output.cancel():
                    return queued
                self._unsubmit(queued)
            self._drain_inbox(block=False)
            rows = [] if self._stopping else self._schedulable()
            queued = self._submit(rows, running) if rows else None
            self.stats.rebuilt_steps += 1

    def _unsubmit(self, step: _Step) -> None:
        """Undoes `_submit` for a step cancelled before it ran."""
        for s, guesses in zip(step.rows, step.guesses):
            s.scheduled -= 1
            s.in_flight -= 1
            if guesses:  # the draft's K/V of its guesses is not the sequence's
                s.speculation.draft_seen = min(s.speculation.draft_seen, len(s.speculation.tokens))

    def _drain_inbox(self, block: bool) -> None:
        self._resumed_from_idle |= block
        try:
            command = self._inbox.get(block=block)
            while True:
                self._apply(*command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, verb: str, arg) -> None:
        if verb == "stop":
            self._stopping = True
        elif verb == "admit":
            self._admit(arg)
        elif verb == "evict":
            seq = self._find(arg)
            if seq is not None:
                self._finish(seq)
        elif verb == "device_failed":
            self._fail_all(arg)
        elif verb == "start_failed":
            seq, exc = arg
            if self._active.get(seq.slot) is seq:
                self._fail_rows([seq], f"decode step failed: {describe(exc)}")
                self._count_failure(exc)

    def _find(self, key: str) -> Sequence | None:
        return next((s for s in self._active.values() if s.key == key), None)

    def _admit(self, seq: Sequence) -> None:
        if self.failure is not None:
            self._fail_rows([seq], f"decode worker stopped serving: {self.failure}")
            return
        # The first token came from prefill; it may already end the request.
        reason = token_finish(seq.first_token, 1, seq.prompt_len + 1, seq.stopping, self.max_seq_len)
        self._active[seq.slot] = seq
        if seq.table:
            # Queued on the device thread as the penalty state below: the slot's new table
            # lands after every step of its previous owner, before this sequence's first.
            placed = self._device.submit(self.backend.set_block_table, seq.slot, list(seq.table))
            placed.add_done_callback(lambda done: self._start_done(seq, done))
        if seq.sampling.penalized or self.backend.starts_every_sequence:
            # Queued on the device thread: after every step that still held the slot's
            # previous owner, before the first step of this one.
            started = self._device.submit(self.backend.start_sequence, seq.slot, *seq.token_history())
            started.add_done_callback(lambda done: self._start_done(seq, done))
        if reason is not FinishReason.NONE:
            self._publish([TokenEvent(seq.key, [], reason)])
            self._finish(seq)

    def _start_done(self, seq: Sequence, done: Future) -> None:
        """Device thread: a sequence whose penalty state could not be set up fails like a step."""
        if not done.cancelled() and done.exception() is not None:
            # Before any step of this row ends (they run after this on the device thread):
            # none of its tokens, computed without its penalties, is published.
            seq.done = True
            self._send("start_failed", (seq, self.backend.device_error(done.exception())))

    def _fail_rows(self, rows: list[Sequence], message: str) -> None:
        """Ends these rows with an error event; their slots are retired as any finished row's."""
        for seq in rows:
            self._finish(seq)
        if rows:
            self._publish([TokenEvent(seq.key, [], FinishReason.NONE, error=message) for seq in rows])

    def _count_failure(self, exc: BaseException) -> None:
        if self.failure is None and self._streak.failed(exc):
            self._fail_all(self._streak.cause(exc, "steps"))

    def _fail_all(self, cause: str) -> None:
        """The device cannot be trusted: every row fails, nothing more is scheduled, the worker is told."""
        if self.failure is None:
            self.failure = cause
            log.error("decode worker stops serving: %s", cause)
            self._on_fatal(cause)
        self._fail_rows(list(self._active.values()), f"decode worker stopped serving: {cause}")

    def _step_failed(self, step: _Step, exc: BaseException) -> None:
        """A step raised: its rows end with the cause, the other requests go on."""
        log.error("decode step of %d rows failed: %s", len(step.rows), describe(exc), exc_info=exc)
        for seq in step.rows:
            seq.in_flight -= 1
        self._fail_rows([s for s in step.rows if not s.done], f"decode step failed: {describe(exc)}")
        self._count_failure(exc)

    def _finish(self, seq: Sequence) -> None:
        seq.done = True
        self._active.pop(seq.slot, None)
        self._retiring.append(seq)

    def _retire(self, everything: bool = False) -> None:
        ready = [s for s in self._retiring if everything or s.in_flight == 0]
        if ready:
            self._retiring = [s for s in self._retiring if s not in ready]
            self._on_retired([s.key for s in ready])

    def _schedulable(self) -> list[Sequence]:
        # A row joins the step only if the token it would produce is allowed, so
        # length limits never cost an extra step, even in async mode.
        if self.failure is not None:
            return []
        rows = [
            s
            for s in self._active.values()
            if s.scheduled < s.stopping.max_new_tokens and s.prompt_len + s.scheduled < self.max_seq_len
        ]
        return sorted(rows, key=lambda s: s.slot)

    def _submit(self, rows: list[Sequence], previous: _Step | None) -> _Step:
        prev_index = {id(s): previous.first_row[i] for i, s in enumerate(previous.rows)} if previous else {}
        # Where each sequence's input token is: a row of the previous step's output, or the host (-1).
        from_prev = [prev_index.get(id(s), -1) for s in rows]
        guesses = self._guesses(rows, from_prev)
        counts = [1 + len(g) for g in guesses]
        first_row = list(itertools.accumulate(counts[:-1], initial=0))
        # A sequence's rows: its input token at its position, then each guess at the positions after it.
        ids = [t for i, s in enumerate(rows) for t in [s.last_token if from_prev[i] < 0 else 0, *guesses[i]]]
        positions = [s.prompt_len + s.scheduled - 1 + j for i, s in enumerate(rows) for j in range(counts[i])]
        slots = [s.slot for i, s in enumerate(rows) for _ in range(counts[i])]
        each = [i for i, count in enumerate(counts) for _ in range(count)]  # the sequence of each row
        row_from_prev = [from_prev[i] if j == 0 else -1 for i, count in enumerate(counts) for j in range(count)]
        inputs = StepInputs(
            slots=torch.tensor(slots),
            positions=torch.tensor(positions),
            input_ids=torch.tensor(ids),
            params=torch.tensor([params_row(rows[i].sampling) for i in each], dtype=torch.float32),
            seeds=torch.tensor([rows[i].sampling.seed for i in each]),
            # The sampling counter of the token each row produces: a guess's row draws as the step without guesses would there.
            steps=torch.tensor([s.step_offset + s.scheduled + j for i, s in enumerate(rows) for j in range(counts[i])]),
            kv_len=max(positions) + 1,
            min_position=min(positions),
            contiguous_from=slots[0] if len(slots) == len(rows) and slots[-1] - slots[0] == len(slots) - 1 else None,
            penalized=any(s.sampling.penalized for s in rows),
            top_logprobs=max(s.sampling.logprobs for s in rows),
            greedy=all(s.sampling.is_greedy for s in rows),
            guess_index=torch.tensor([j for count in counts for j in range(count)]) if len(ids) > len(rows) else None,
        )
        for s in rows:
            s.scheduled += 1
            s.in_flight += 1
        # A speculating row's matcher on each of its rows: advanced by its input token, then by each guess in turn.
        matchers = [rows[i].matcher for i, count in enumerate(counts) for _ in range(count)]
        matchers = matchers if any(m is not None for m in matchers) else None
        launched = threading.Event()
        inputs.on_launch = launched.set
        output = self._device.submit(self._device_step, inputs, torch.tensor(row_from_prev), self._resumed_from_idle, matchers)
        self._resumed_from_idle = False
        return _Step(rows, output, guesses, first_row, launched)

    def _guesses(self, rows: list[Sequence], from_prev: list[int]) -> list[list[int]]:
        """Each sequence's guesses: only where its input token is on the host (the guesses follow
        it), the batch small enough, and as many as its length limits leave room for."""
        if self.speculation is None:
            return [[] for _ in rows]
        if not self._worth_guessing():
            for s in rows:
                if s.speculation is not None:
                    s.speculation.step_without_guesses()
            return [[] for _ in rows]
        wanted: dict[int, tuple[RowSpeculation, int]] = {}
        for i, (s, prev) in enumerate(zip(rows, from_prev)):
            if s.speculation is None:
                continue
            if prev >= 0:  # its input token is still on the device
                s.speculation.step_without_guesses()
                continue
            # The step produces tokens scheduled+1 .. scheduled+1+g: within max_new_tokens and max_seq_len.
            room = min(s.stopping.max_new_tokens - s.scheduled - 1, self.max_seq_len - s.prompt_len - s.scheduled - 1)
            count = s.speculation.wanted(room, may_rest=len(rows) > self.speculation.rest_above)
            if count:
                wanted[i] = (s.speculation, count)
        proposed = self._propose(list(wanted.values())) if wanted else []
        out = [[] for _ in rows]
        for i, guesses in zip(wanted, proposed):
            out[i] = guesses
            if not guesses:
                wanted[i][0].no_proposal()
        return out

    def _propose(self, wanted: list[tuple[RowSpeculation, int]]) -> list[list[int]]:
        if not self.proposer.on_device:
            return self.proposer.propose(wanted)
        # The draft model runs where models run: on the device thread, after the step it follows.
        return self._device.submit(self.proposer.propose, wanted).result()

    def _device_step(self, inputs: StepInputs, from_prev: torch.Tensor, after_idle: bool, matchers: list[RowMatcher | None] | None) -> SampleOutput:
        if not self.backend.signals_launch:
            inputs.on_launch()
        try:
            return self._run_step(inputs, from_prev, after_idle, matchers)
        finally:
            inputs.on_launch()  # a step that failed before it launched, or a backend that did not say

    def _run_step(self, inputs: StepInputs, from_prev: torch.Tensor, after_idle: bool, matchers: list[RowMatcher | None] | None) -> SampleOutput:
        # Runs on the device thread, in submission order, so _last_output is the
        # previous step's output whenever from_prev points into it.
        start = time.perf_counter()
        if not after_idle and self._last_step_end is not None:
            # Device idle while a busy batch waited on the host: what async mode hides.
            self.metrics.host_gap.observe(start - self._last_step_end)
        # After a failed step there is no output to carry: the rows that would take one
        # were in that step, are failed already, and their tokens here are dropped.
        last, self._last_output = self._last_output, None  # None until this step has an output
        if last is not None and bool((from_prev >= 0).any()):  # the carried tokens: a gather on the device, part of the step
            device = last.device  # the host's tensors join it there (CUDA)
            from_prev = from_prev.to(device)
            carried = last[from_prev.clamp(min=0)]
            inputs.input_ids = torch.where(from_prev >= 0, carried, inputs.input_ids.to(device))
        if matchers is not None:
            guess_rows = None if inputs.guess_index is None else (inputs.guess_index > 0).tolist()
            inputs.token_bitmask = self._step_masks(matchers, inputs.input_ids.tolist(), guess_rows)
        output = self._decode_step(inputs)
        if self._after_step is not None:  # EAGLE's head keeps the step's hidden states (speculation/eagle.py)
            self._after_step(inputs.slots, inputs.positions)
        self._last_output = output.token_ids
        self._last_step_end = time.perf_counter()
        elapsed = self._last_step_end - start
        self.metrics.step.observe(elapsed)
        self.stats.device_seconds += elapsed
        self.stats.step_seconds = (self.stats.step_seconds + [elapsed])[-256:]
        return output

    def _emit(self, seq: Sequence, kept: list[int], rows: list) -> TokenEvent:
        """The sequence's event for the tokens it keeps from a step, up to the first that ends it."""
        taken, taken_logprobs, reason = [], [], FinishReason.NONE
        for token, row in zip(kept, rows):
            seq.generated += 1
            taken.append(token)
            if row is not None:
                taken_logprobs.append(TokenLogprobs(token, row[0], tuple(row[1])))
            reason = token_finish(token, seq.generated, seq.prompt_len + seq.generated, seq.stopping, self.max_seq_len)
            if reason is not FinishReason.NONE:
                break
        seq.scheduled += len(taken) - 1  # the step was scheduled as one token
        seq.last_token = taken[-1]
        if seq.speculation is not None:
            seq.speculation.extend(taken)
        if reason is not FinishReason.NONE:
            self._finish(seq)
        return TokenEvent(seq.key, taken, reason, taken_logprobs if taken_logprobs else None)

    def _fused_kept(self, row: list[int]) -> tuple[list[int], list[None]]:
        """A fused step's row: its tokens up to the first -1 (NxDI's padding), counted as its step's guesses (all
        positions but the input's) and the kept ones less the target's own. No logprobs (the backend refuses them)."""
        kept = row[: row.index(-1)] if -1 in row else row
        self._count_guesses(len(row) - 1, len(kept) - 1)
        return kept, [None] * len(kept)

    def _count_guesses(self, proposed: int, accepted: int) -> None:
        self.stats.proposed_tokens += proposed
        self.stats.accepted_tokens += accepted
        self.metrics.count_speculation(proposed, accepted)

    def _step_masks(self, matchers: list[RowMatcher | None], input_ids: list[int], guess_rows: list[bool] | None) -> Callable[[], torch.Tensor]:
        """Device thread: the step's bitmask, for the backend to take after the logits. On an
        accelerator it is filled on the mask thread while the logits compute; on the CPU, here
        and now: the model shares the cores, and a hand-off between threads costs more than it hides."""
        vocab = self.backend.info.vocab_size
        if self._masks_inline:
            bitmask = step_bitmask(matchers, input_ids, vocab, guess_rows)
            return lambda: bitmask
        return self._masks.submit(step_bitmask, matchers, input_ids, vocab, guess_rows).result

    def _process(self, step: _Step) -> None:
        try:
            output: SampleOutput = step.output.result()
            tokens = output.token_ids.tolist()  # the one host/device sync of a step
            taken_in = time.perf_counter()
            logprobs = output.rows([s.sampling.logprobs for s, g in zip(step.rows, step.guesses) for _ in range(1 + len(g))])
        except Exception as exc:  # whatever the step raised (device, allocation, bounds check): its rows fail, the loop goes on
            self._step_failed(step, self.backend.device_error(exc))
            return
        self._streak.succeeded()
        events = []
        for seq, guesses, first in zip(step.rows, step.guesses, step.first_row):
            seq.in_flight -= 1
            if seq.done:
                self.stats.dropped_tokens += 1
                continue
            if self.fused:
                events.append(self._emit(seq, *self._fused_kept(tokens[first])))
                continue
            produced = tokens[first : first + 1 + len(guesses)]
            kept = seq.speculation.kept(guesses, produced) if guesses else produced
            if guesses:
                self._count_guesses(len(guesses), len(kept) - 1)
                if seq.matcher is not None:  # this step's masks are done with (the step was processed first): no other thread holds it
                    seq.matcher.keep_guesses(len(kept) - 1)
            events.append(self._emit(seq, kept, logprobs[first : first + len(kept)]))
        self._measure_payoff(step, taken_in, sum(len(e.token_ids) for e in events))
        self.stats.steps += 1
        self.stats.tokens += sum(len(e.token_ids) for e in events)
        self.stats.last_batch_size = len(step.rows)
        self.metrics.tokens.inc(sum(len(e.token_ids) for e in events))
        self.metrics.batch_size.set(len(step.rows))
        if events:
            self._publish(events)
