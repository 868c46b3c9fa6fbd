"""One call's decode steps, resumable, and the lease by which calls share a pipeline's engines.

A pipeline has one set of engines (their KV caches) and one proposer per method: one generation
at a time can use them. A lock held for a whole stream would let a stream that its reader
abandoned (or merely forgot to close) block every later call. Instead each *step* takes them:

* a generation that has just run a step keeps a short lease on the engines (``LEASE_S``), so a
  stream whose reader comes back quickly runs on without interruption, and ``generate``, which
  reads its own steps back to back, is never interrupted;
* once the lease has run out (a slow reader, or a stream nobody reads any more), the call that has
  waited longest takes the engines (first come, first served, so no call waits for ever); a call from
  the thread that holds the lease may take them at once (that thread is evidently not reading the
  stream);
* a generation that lost the engines goes on later from its own context (prompt + the tokens it
  emitted): it prefills its prompt again as before, feeds the tokens it emitted through decode passes
  (``loop.Call.decoded``), and continues with the same sampling generator, so nothing is lost
  (``Generation.resumes`` counts how often);
* cancelling a generation, or closing it, frees the engines at once, from any thread; one that is
  waiting for them notices a cancel within ``POLL_S``.

Resuming does not change what is generated: the cache is rebuilt with the bits it held (the prompt prefilled by
the same path, the emitted tokens by chains of decoding's own rounding), so greedy tokens are the ones an
uninterrupted call gives and sampling keeps its draws. A prefill of the emitted tokens would not do: where the
device's verdict says a prefill rounds unlike decoding (``reuse_matches_prefill`` false: another prefill runtime,
wider passes), the answer went another way after a resume (the default gguf bundle on an AVX-512 CPU: 8 of 410
greedy calls of a 600-call soak with KV reuse and the prompt cache off, every one a resumed call; 2026-12-06).
With KV reuse the prompt part is whatever the reused prefix held, as for any reusing call. Light: no model code
here.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Protocol

from specdec_edge.errors import SpecdecError
from specdec_edge.sampling import make_rng
from specdec_edge.speculative.loop import Call, Contexts, Emitted, decode
from specdec_edge.speculative.stats import Stats, add_stats

if TYPE_CHECKING:
    from specdec_edge.runtime.base import Engine
    from specdec_edge.speculative.acceptance import AcceptanceRule
    from specdec_edge.speculative.proposal import Proposer

LEASE_S = 0.25  # how long a generation keeps the engines between two of its steps
POLL_S = 0.05  # how often a waiting generation looks at its cancel flag


class EngineLease:
    """What the pipelines over one set of engines share: who runs the next step, whose context the
    caches hold, and whether the engines were closed."""

    def __init__(self):
        self.cond = threading.Condition()
        self.holder: int | None = None  # the generation running a step now, or holding the lease
        self.holder_thread: int | None = None  # the thread that ran its last step
        self.running = False  # a step is in progress (the engines are in use)
        self.until = 0.0  # when the holder's lease ends (time.monotonic)
        self.cached: int | None = None  # the generation whose context the caches and proposers hold
        self.closed = False
        self.waiting: collections.deque[int] = collections.deque()  # generations waiting for a step, in order
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def acquire(self, gen: int, cancel: threading.Event) -> bool:
        """Wait until generation ``gen`` may run a step, and mark the engines in use; False (nothing
        taken) when it is cancelled or the engines are closed first. Waiting generations take the
        engines in the order they asked (first come, first served), so none waits for ever."""
        me = threading.get_ident()
        with self.cond:
            if self.holder != gen:
                self.waiting.append(gen)
            try:
                while True:
                    if cancel.is_set() or self.closed:
                        return False
                    if self.holder == gen:  # its own lease: go on
                        break
                    free = self.holder is None or self.holder_thread == me or time.monotonic() >= self.until
                    if not self.running and free and self.waiting[0] == gen:
                        break  # its turn; a holder whose reader is away resumes later
                    wait = POLL_S  # a cancel is noticed within it; the engines freed wake the queue at once
                    if self.waiting[0] == gen and not self.running:  # next in line: wake when the lease ends
                        wait = min(POLL_S, max(self.until - time.monotonic(), 0.0) + 1e-3)
                    self.cond.wait(wait)
            finally:
                if gen in self.waiting:
                    self.waiting.remove(gen)
                    self.cond.notify_all()  # the next in line may go
            self.holder, self.holder_thread, self.running = gen, me, True
            return True

    def release(self, gen: int, keep: bool, cancel: threading.Event) -> None:
        """After a step of ``gen``: keep a lease on the engines (it goes on) or free them (it ended or
        was cancelled)."""
        with self.cond:
            self.running = False
            if keep and not cancel.is_set():
                self.until = time.monotonic() + LEASE_S
            elif self.holder == gen:
                self.holder = None
            self.cond.notify_all()

    def drop(self, gen: int) -> None:
        """Free ``gen``'s lease now (a step it is running still ends first, then frees them itself)."""
        with self.cond:
            if self.holder == gen and not self.running:
                self.holder = None
                self.cond.notify_all()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the engines for the block, as a generation holds them for a step: every use of the caches that is
        no call's own (measuring step costs, saving or loading a prefix) goes through it. After it the caches hold
        no call's context (``cached``): a call it interrupted rebuilds its own context and goes on exactly."""
        gen, cancel = self.new_id(), threading.Event()
        if not self.acquire(gen, cancel):
            raise closed_error()
        try:
            yield
        finally:
            self.cached = None
            self.release(gen, False, cancel)

    def close(self) -> None:
        """No step may start any more; wait for a running one to end."""
        with self.cond:
            self.closed = True
            while self.running:
                self.cond.wait()
            self.holder = self.cached = None
            self.cond.notify_all()


@dataclass(eq=False)
class Decoder:
    """What one method's calls decode with (``engines.Engines.decoder`` builds it): the engine the loop
    drives (the target, or a feature tap over it), the method's proposer and acceptance rule, the
    speculation length, the eos ids, and the lease on the engines it shares with the other methods.
    Closing the engines sets ``engine``, ``proposer`` and ``engines`` to None."""

    engine: Engine | None
    proposer: Proposer | None
    rule: AcceptanceRule
    k: int
    eos_ids: frozenset
    lease: EngineLease
    engines: SharedEngines | None = None  # what a call asks before it decodes (``engines.Engines``)


class SharedEngines(Contexts, Protocol):
    """What a generation asks of the engines it shares (``engines.Engines``): ``claim`` sets the caches to hold
    nothing of another owner's context; ``restore_best`` (``loop.Contexts``) restores a stored context."""

    def claim(self, owner, keep: bool = True) -> None: ...


class Generation:
    """The decode steps of one call: an iterator of ``Emitted`` that takes the engines one step at a
    time (see the module docstring). ``stats`` (the result's) stays current after every step."""

    def __init__(self, decoder: Decoder, prompt_ids: list[int], call: Call, stats: Stats, owner=None):
        """``call``: what the call asks (``loop.Call``: its length, sampling, ``reuse``, history store; the
        decoder's ``k``, eos ids and rule); ``owner``: whose calls it may reuse the context of (the server: the
        API key's)."""
        self.decoder, self.lease = decoder, decoder.lease
        self.reuse = call.reuse  # keep the prefix the caches hold from earlier calls (``decode``'s reuse)
        self.owner = owner
        self.id = self.lease.new_id()
        self.context = [int(t) for t in prompt_ids]  # prompt + every token emitted so far
        self.prompt_tokens = len(self.context)
        self.call, self.params, self.left = call, call.params, call.max_new_tokens
        self.rng = make_rng(call.params.seed)
        self.stats = stats
        self.cancelled = threading.Event()
        self.resumes = 0  # times it went on after another call had used the engines (also in stats.resumes)
        self.done = False
        self._steps = None  # the running ``decode`` generator
        self._earlier: Stats | None = None  # what the runs before the last resume did
        self._run_stats = stats  # what the current run does (the result's own stats until a resume)
        self.history = call.history  # the store it drafts from and is added to when it ends (None: none)

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Emitted:
        if self.done:
            raise StopIteration
        if not self.lease.acquire(self.id, self.cancelled):
            return self._end("cancelled")
        try:
            if self._steps is None or self.lease.cached != self.id:
                self._start()
            step = next(self._steps)
        except BaseException:
            self.lease.cached = None  # the caches' state is unknown now
            self.lease.release(self.id, False, self.cancelled)
            self.done, self._steps = True, None
            raise
        self.context.extend(step.tokens)
        self.left -= len(step.tokens)
        self._publish()
        if step.finish_reason is not None:
            self.done, self._steps = True, None
            self._remember()
        self.lease.release(self.id, not self.done, self.cancelled)
        return step

    def _start(self) -> None:
        """Prefill this generation's context (again, after another call used the engines: its emitted tokens through
        decode passes, ``loop.Call.decoded``) and run on."""
        run = self.decoder
        if self._steps is not None:
            self.resumes += 1
            self._earlier = add_stats(self._earlier or Stats(), self._run_stats)
            self._run_stats = Stats()
        if run.engines is not None:
            run.engines.claim(self.owner, self.reuse)  # nothing of another owner's context is reused, restored or timed
        run.proposer.claim(self.owner)  # nor what a proposer learned from another owner's calls
        # what is left of it; what it generated so far is fed again through decode passes (``Call.decoded``)
        call = replace(self.call, max_new_tokens=self.left, decoded=len(self.context) - self.prompt_tokens)
        self._steps = decode(
            run.engine, run.proposer, self.context, call, rng=self.rng, stats=self._run_stats, contexts=run.engines
        )
        self.lease.cached = self.id

    def _publish(self) -> None:
        if self._earlier is None:  # one run so far: decode wrote into the result's stats itself
            return
        merged = add_stats(self._earlier, self._run_stats)
        merged.prompt_tokens, merged.resumes = self.prompt_tokens, self.resumes
        for f in fields(Stats):
            setattr(self.stats, f.name, getattr(merged, f.name))

    def _end(self, reason: str) -> Emitted:
        self.close()
        return Emitted([], reason)

    def cancel(self) -> None:
        """Stop at the next step (safe from any thread) and free the engines now unless a step is running."""
        self.cancelled.set()
        self.lease.drop(self.id)

    def close(self) -> None:
        """End this generation (from the thread reading it)."""
        self.done, self._steps = True, None
        self.lease.drop(self.id)
        self._remember()

    def _remember(self) -> None:
        """Add the prompt and what was generated to the history store, once."""
        history, self.history = self.history, None
        if history is not None:
            history.add(self.context)


def closed_error() -> SpecdecError:
    return SpecdecError("this pipeline was closed; load the bundle again with Pipeline.load(...).")
