"""CPU threads for every ONNX Runtime session of the process: one spinning pool, shared.

A pipeline runs several CPU sessions (the target, a draft model, draft heads) and an app may
load several pipelines. Two ways to give them threads (docs/lab/threads-and-overhead.md, "Thread pools"):

* spinning (default): one process-wide ONNX Runtime pool (``set_global_thread_pool_sizes``,
  sessions with ``use_per_session_threads = False``) whose workers spin between ops. Every
  session shares it: nothing is oversubscribed, no pass pays a wake-up, and idle head or draft
  sessions cost plain decoding nothing.
* not spinning: a pool per session whose workers sleep between ops (``allow_spinning=0``),
  so that several pools do not fight over the cores; a single-token pass then pays the
  wake-up latency. For apps that must leave the CPU idle between steps.

ONNX Runtime creates the process-wide pool once, and from then on refuses any CPU session of
the process that does not opt into it ("use_per_session_threads must be false when using a
global thread pool"). So:

* every session this package makes goes through ``sessions.create_session``, which opts in
  whenever the pool exists (``PROCESS_POOL.exists``);
* the pool is made by the first pipeline that asks for it, sized by its ``threads`` (None: one
  thread per physical core); later requests for another size share it and log a warning;
* if the application made the pool itself (``onnxruntime.set_global_thread_pool_sizes``),
  pipelines share the app's pool;
* if the application already has ONNX Runtime sessions of its own, no pool is made (its later
  sessions would be refused): pipelines then use a spinning pool per session that stops
  spinning when a run returns (``session.force_spinning_stop``), so pools do not fight.
  An app that creates its own sessions after loading a pipeline should build their options
  with ``app_session_options()`` -- or load pipelines with ``spinning=False``.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from dataclasses import dataclass

import onnxruntime as ort

from specdec_edge.errors import SpecdecError

log = logging.getLogger("specdec_edge")


@dataclass(frozen=True)
class CpuThreads:
    """How CPU sessions get their threads (``Pipeline.load(threads=..., spinning=...)``)."""

    threads: int | None = None  # intra-op threads; None: one per physical core (ONNX Runtime's default)
    spinning: bool = True  # share one process-wide spinning pool; False: sleeping per-session pools


DEFAULT_THREADS = CpuThreads()


# Sessions this package made: any other live InferenceSession belongs to the application.
OWN_SESSIONS: weakref.WeakSet = weakref.WeakSet()


def app_has_sessions() -> bool:
    """True when the process holds ONNX Runtime sessions that this package did not make."""
    kind = ort.InferenceSession  # type(), not isinstance(): some modules' objects warn when asked for __class__
    return any(issubclass(type(o), kind) and o not in OWN_SESSIONS for o in gc.get_objects())


class _ProcessPool:
    """The process-wide ONNX Runtime pool: who made it and how big it is (decided at most once)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: str | None = None  # "specdec-edge" | "application" | "declined" | "unavailable"
        self.threads: int | None = None

    @property
    def exists(self) -> bool:
        """Every CPU session of the process must now opt into the pool."""
        return self.owner in ("specdec-edge", "application")

    def join(self, threads: int | None) -> bool:
        """Make sure the pool exists (creating it with ``threads``); False when pipelines must not use it."""
        with self.lock:
            if self.owner is None:
                self.owner = self._create(threads)
            elif self.owner == "specdec-edge" and threads and self.threads and threads != self.threads:
                log.warning(
                    "the process-wide ONNX Runtime thread pool already has %d threads; this session shares "
                    "it (threads=%d is not applied)",
                    self.threads,
                    threads,
                )
            return self.exists

    def _create(self, threads: int | None) -> str:
        if app_has_sessions():
            log.info("the application has ONNX Runtime sessions of its own: no process-wide pool is made")
            return "declined"
        try:
            ort.set_global_thread_pool_sizes(int(threads or 0), 1)
        except Exception as e:  # onnxruntime raises its own pybind exception type
            if "already been created" in str(e):
                log.info("sharing the application's process-wide ONNX Runtime thread pool")
                return "application"
            log.warning("no process-wide ONNX Runtime thread pool (%s); using a pool per session", e)
            return "unavailable"
        self.threads = threads
        return "specdec-edge"


PROCESS_POOL = _ProcessPool()


def cpu_session_options(cpu: CpuThreads) -> ort.SessionOptions:
    """Options of a CPU session: full graph optimization, sequential execution, threads as ``cpu`` says."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if cpu.spinning and PROCESS_POOL.join(cpu.threads):
        opts.use_per_session_threads = False  # thread counts come from the pool (setting them here only warns)
        return opts
    opts.inter_op_num_threads = 1
    if cpu.threads:
        opts.intra_op_num_threads = int(cpu.threads)
    if cpu.spinning:  # no shared pool: spin while a run lasts, then sleep, so that pools do not fight
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    else:  # several sleeping pools in one process do not slow each other
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def app_session_options() -> ort.SessionOptions:
    """``SessionOptions`` for an application's own sessions, valid whether or not pipelines made the
    process-wide pool (ONNX Runtime refuses per-session threads once it exists)."""
    opts = ort.SessionOptions()
    if PROCESS_POOL.exists:
        opts.use_per_session_threads = False
    return opts


MAX_THREADS = 1024  # CPU threads a session may ask for (ONNX Runtime would try to start every one)


def check_threads(threads, spinning) -> CpuThreads:
    """``CpuThreads`` from user input, or an error that names the bad value."""
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS
    ):
        raise SpecdecError(
            f"threads={threads!r} is invalid: use an integer from 1 to {MAX_THREADS}, or None for one per core."
        )
    if not isinstance(spinning, bool):
        raise SpecdecError(f"spinning={spinning!r} is invalid: use True or False.")
    return CpuThreads(threads, spinning)
