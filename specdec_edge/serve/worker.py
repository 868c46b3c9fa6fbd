"""One pipeline, one worker thread: requests are generated in arrival order, one at a time.

The web side submits a ``Job`` and is told what happens through the job's ``notify`` callback;
the worker thread runs ``Pipeline.stream`` for it (generation is CPU-bound and blocking, so it
never runs on the event loop). The queue of waiting jobs is bounded: ``submit`` raises
``QueueFull`` beyond ``max_queue``, with a Retry-After estimate. ``Job.cancel()`` (client gone,
request timed out) stops a running generation at its next step through the stream's own
``cancel``, or skips the job if it has not started, so the next job starts at once.
No web framework here.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec_edge.api.pipeline import Admitted
from specdec_edge.api.streaming import GenerationResult, Stream
from specdec_edge.errors import SpecdecError

log = logging.getLogger("specdec_edge.serve")


class QueueFull(Exception):
    """Every queue slot is taken; ``retry_after`` (seconds) estimates when one frees up."""

    def __init__(self, retry_after: int):
        super().__init__(f"queue full, retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """One request's generation. ``notify(kind, value)`` is called from the worker thread with
    ("piece", text) for each text piece, then ("done", GenerationResult) or ("error", SpecdecError
    or another exception); a job cancelled before it started gets no call."""

    request: str | list[dict] | Admitted  # the server passes its ``Pipeline.admit`` result (tokenized, checked)
    options: dict  # Pipeline.stream keywords: temperature, top_k, top_p, seed, history, owner, ...
    notify: Callable[[str, object], None]
    client: int = 0  # whose request (the API key's index): its metrics are that client's
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: Stream | None = None

    def cancel(self) -> None:
        """Stop this job from any thread: skipped if waiting, stopped at its next step if running."""
        self.cancelled.set()
        stream = self.stream  # set by the worker; whichever of the two runs second sees the other's write
        if stream is not None:
            stream.cancel()


class Worker:
    """Runs jobs on ``pipe`` in one thread, in submission order; at most ``max_queue`` wait."""

    def __init__(
        self,
        pipe,
        max_queue: int,
        on_done: Callable[[GenerationResult | None, float, int], None] = lambda result, seconds, client: None,
    ):
        self.pipe = pipe  # its calls reuse the KV prefix the last one left where it reuses (``Pipeline.reuse``)
        self.on_done = on_done  # after every job that ran: (result, or None after an error; seconds; client)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running: Job | None = None
        self._mean_s = 1.0  # moving average of a job's duration, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="specdec-serve-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        return self._queue.qsize() + (self._running is not None)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(max(1, math.ceil(self._mean_s * self.depth))) from None

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every job and stop the thread (at the running job's next step)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        running = self._running
        if running is not None:
            running.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():
                continue
            self._running = job
            try:
                self._run(job)
            except BaseException:  # never ends the worker: the requests queued behind must still run
                log.exception("a request's generation failed")
            finally:
                self._running = None

    def _record(self, job: Job, result: GenerationResult | None, start: float) -> None:
        """Metrics of a job that ran, recorded before its client hears the outcome (so a client that
        reads /metrics after its response sees its own request counted, and no longer in the queue)."""
        seconds = time.perf_counter() - start
        self._mean_s = 0.8 * self._mean_s + 0.2 * seconds
        self._running = None  # not queued nor running any more: the queue depth a client reads next excludes it
        try:
            self.on_done(result, seconds, job.client)
        except Exception:  # metrics must never stop the worker
            log.exception("recording a finished generation failed")

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            stream = self.pipe.stream(job.request, **job.options)
            job.stream = stream
            if job.cancelled.is_set():  # cancelled while the stream was being made
                stream.cancel()
            with stream:
                for piece in stream:
                    job.notify("piece", piece)
            self._record(job, stream.result, start)
            job.notify("done", stream.result)
        except SpecdecError as e:  # the pipeline refused this request
            self._record(job, None, start)
            job.notify("error", e)
        except BaseException as e:  # a bug, or a native library's BaseException: report, log, keep serving
            log.exception("generation failed")
            self._record(job, None, start)
            try:
                job.notify("error", e)
            except BaseException:  # the job's own callback failed: nothing more to tell it
                log.exception("reporting a failed generation failed")
