"""The engines of one loaded bundle, shared by every pipeline over them, and how a bundle's are opened.

``Engines`` holds what does not depend on the method: the target and draft engines, the trained heads,
the device's exactness verdict (applied to the target), where ``auto``'s step costs come from, and the
lease by which calls take turns on the engines (``generation.py``). ``Pipeline`` (one method over them)
keeps an ``Engines`` and builds its method's ``Decoder`` from it; ``Pipeline.with_method`` shares it, and
``close()`` frees every engine and every decoder built over them at once. ``open_engines`` opens a bundle's.
Light: no model code here.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import numpy as np

from specdec_edge.api.generation import Decoder, EngineLease
from specdec_edge.api.prompt_cache import (
    DEFAULT_MB,
    MIN_GAIN,
    MIN_TOKENS,
    PromptCache,
    Snapshot,
    decode_file,
    encode,
    prefix_digest,
    snapshot_problem,
)
from specdec_edge.api.step_costs import WIDTHS, CostKey, device_costs
from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import manifest_digest
from specdec_edge.bundle.schema import Manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.exactness import Verdict
from specdec_edge.progress import Progress
from specdec_edge.runtime.base import (
    DEFAULT_GPU,
    CachedEngine,
    Engine,
    GpuOptions,
    SnapshotEngine,
    common_prefix,
    prefill,
)
from specdec_edge.runtime.device import device_identity
from specdec_edge.runtime.factory import open_engine
from specdec_edge.runtime.head_graphs import HeadGraph, load_head_graphs
from specdec_edge.runtime.ov_prefill import prefill_setting
from specdec_edge.runtime.prefill_choice import choose_prefill, open_prefillers
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.verdicts import apply, device_verdict, measure, to_verdict
from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.proposal import Proposer
from specdec_edge.speculative.table import NgramTable

# (the engine the loop drives, the proposers whose own cost to measure, how to hold the engines while measuring,
# the widths to measure) -> the device's step costs
StepCosts = Callable[[Engine, Mapping[str, Proposer], Callable[[], AbstractContextManager], tuple[int, ...]], CostModel]

# Rows of the synthetic prompt ``Engines.warm_up`` prefills: above every prefill runtime's ``min_rows`` (64)
WARM_ROWS = 128


class Engines:
    """One bundle's opened engines, their device's verdict and step costs, and the lease over them.

    ``verdict`` None (engines opened by hand): measured on the target now (``open_engines`` caches it per
    device). ``step_costs`` None: ``auto`` measures them when it is built, and nothing is cached. Whatever
    measures on the engines holds their lease meanwhile (``EngineLease.holding``): a call it interrupts goes on
    from its own context, never from what the measurement left in the caches.
    ``prompt_cache``: the store of earlier contexts' snapshots (``prompt_cache.py``), or None for none.
    ``digest``: the bundle's manifest digest, which prefix files are keyed by (None: engines built by hand, which
    save and load none).
    ``target``: a backend (``runtime.base.CachedEngine``: the verdict is measured on it and applied to it);
    ``draft``: any engine that takes snapshots (``SnapshotEngine``). The loop drives either through ``Engine``.
    """

    def __init__(
        self,
        target: CachedEngine,
        draft: SnapshotEngine | None = None,
        heads: dict[str, HeadGraph] | None = None,
        *,
        verdict: Verdict | None = None,
        step_costs: StepCosts | None = None,
        prompt_cache: PromptCache | None = None,
        digest: str | None = None,
        table: NgramTable | None = None,
    ):
        self.lease = EngineLease()
        self.owner = None  # whose context the caches hold: a call's ``owner`` (the API's own calls: None)
        if verdict is None:
            with self.lease.holding():
                verdict = to_verdict(measure(target), {})
        apply(target, verdict)
        self.target, self.draft, self.heads, self.verdict = target, draft, dict(heads or {}), verdict
        self._step_costs = step_costs or (
            lambda engine, proposers, hold, widths: device_costs(None, engine, proposers, hold, widths=widths)
        )
        self.capacity = min(e.capacity for e in (target, draft) if e is not None)
        self.prompt_cache = prompt_cache
        self.digest = digest
        self.table = table  # the bundle's n-gram table (speculative/table.py), or None
        self._decoders: weakref.WeakSet[Decoder] = weakref.WeakSet()  # every method's, to free on close
        self._warm = False  # ``warm_up`` ran

    def step_costs(
        self, engine: Engine, proposers: Mapping[str, Proposer], widths: tuple[int, ...] = WIDTHS
    ) -> CostModel:
        """``auto``'s step costs on this device: cached, else measured now on ``engine`` under the lease, at
        ``widths`` (``step_costs.CHAIN_WIDTHS`` where only chains are verified)."""
        return self._step_costs(engine, proposers, self.lease.holding, widths)

    def claim(self, owner, keep: bool = True) -> None:
        """Before a call of ``owner`` (under its lease): where the caches hold another owner's context, set it aside
        for that owner (``keep``: the prompt cache keeps it, tagged) and forget it, so that the call reuses,
        restores and times nothing of another owner's text (the server's owners are its API keys)."""
        if owner == self.owner:
            return
        if keep:
            self.keep()  # tagged with the owner it belongs to
        self._forget()
        self.owner = owner

    def _forget(self) -> None:
        """Empty every engine's cache (the target, the draft, the decoders' feature taps)."""
        for engine in {self.target, self.draft, *(d.engine for d in self._decoders)} - {None}:
            engine.reset()

    def warm_up(self) -> float:
        """Make ready now what a first long prompt would otherwise wait for: the prefill runtime (``--prefill``),
        compiled and its first pass checked against the target graph's (OpenVINO: ~2.5 s to compile, and a first
        long prompt took 5.0 s against 0.7 s for the next, machine B, 2026-12-05), on a synthetic prompt of
        ``WARM_ROWS`` ids whose slots are then dropped. Returns the seconds it took: 0 where nothing prefills through
        another runtime, or it is ready already. A prefill runtime that fails under ``--prefill auto`` is dropped
        here, as at a first prompt (later passes run in ONNX Runtime); under ``openvino`` its error is raised."""
        prefiller = getattr(self.target, "prefiller", None)
        if prefiller is None or self._warm:
            return 0.0
        start = time.perf_counter()
        rows = min(WARM_ROWS, self.capacity - 1)
        ids = np.random.default_rng(0).integers(3, self.target.vocab_size, size=rows).tolist()
        with self.lease.holding():
            # From slot 0, whatever a call left in the caches (chat warms up in a thread, which may get the engines
            # after its first message): that context goes to its owner's prompt cache, as before another's call.
            self.keep()
            self._forget()
            try:
                self.target.prefill_run(ids, logits_to_keep=1)
            finally:
                self._forget()
        self._warm = True
        return time.perf_counter() - start

    def decoder(self, engine: Engine, proposer: Proposer, rule, k: int, eos_ids) -> Decoder:
        """A method's ``Decoder`` over these engines (freed with them)."""
        decoder = Decoder(engine, proposer, rule, k, eos_ids, self.lease, self)
        self._decoders.add(decoder)
        return decoder

    # ---- the prompt cache: snapshots of contexts, taken and restored here, kept in ``prompt_cache``

    def capture(self, tap: FeatureTap | None = None) -> Snapshot:
        """What the engines hold now: the target's slots, the features of a tap that holds all of them (``tap``, else
        any tap over the target among the decoders), the draft's slots; tagged with their owner."""
        target, draft = self.target, self.draft
        tokens = list(target.held)
        snap = Snapshot(tokens, target.snapshot(), owner=self.owner)
        taps = [tap] if tap is not None else [d.engine for d in self._decoders if isinstance(d.engine, FeatureTap)]
        for t in taps:
            if t.engine is target and t.reusable(tokens) == len(tokens):
                snap.features, snap.layer_features = t.snapshot_features()
                break
        if draft is not None and draft.can_snapshot and draft.held:
            snap.draft_tokens, snap.draft_kv = list(draft.held), draft.snapshot()
        return snap

    def restore(self, snap: Snapshot, n: int, want: list[int], tap: FeatureTap | None = None) -> None:
        """Make the engines hold the first ``n`` tokens of ``snap`` (they start ``want``), copying only the slots the
        live caches do not hold already; the draft's too, where the snapshot has more of ``want`` than it."""
        target, draft = self.target, self.draft
        tokens = snap.tokens[:n]
        start = target.reusable(tokens)
        target.restore(snap.kv, tokens, start)
        if tap is not None and snap.features is not None:
            tap.restore_features(snap.features, snap.layer_features, tokens, min(start, tap.reusable(tokens)))
        if draft is not None and draft.can_snapshot and snap.draft_kv is not None:
            d = common_prefix(snap.draft_tokens, want)
            live = draft.reusable(want)
            if d > live:
                draft.restore(snap.draft_kv, snap.draft_tokens[:d], live)

    def keep(self) -> None:
        """Store what the engines hold now in the prompt cache (their owner's), unless it is shorter than
        ``MIN_TOKENS`` (it prefills in a pass or two) or a stored snapshot of that owner covers it."""
        cache, held = self.prompt_cache, self.target.held
        if cache is None or cache.limit <= 0 or not self.target.can_snapshot or held is None or len(held) < MIN_TOKENS:
            return
        snap = self.capture()
        if not cache.covered(snap):
            cache.put(snap)

    def restore_best(self, engine: Engine, context: list[int]) -> int:
        """Before a call that reuses (``decode`` asks, under the call's lease): keep what the target holds if the
        call would lose it, then restore the owner's stored context that shares the most with ``context`` where it
        keeps at least ``MIN_GAIN`` tokens more than the live cache. ``engine``: the one the call's loop drives (the
        target or a feature tap over it). Returns the tokens restored (0: none)."""
        cache, target = self.prompt_cache, self.target
        if cache is None or cache.limit <= 0 or not target.can_snapshot:
            return 0
        want = context[:-1]
        tap = engine if isinstance(engine, FeatureTap) else None
        # chosen first: keeping the live one may evict it; only the caller's own (``claim`` set the owner)
        snap, n = cache.best(want, features=tap is not None, owner=self.owner)
        if target.reusable(want) < len(target.held or ()):
            self.keep()
        live = engine.reusable(want)
        if snap is None or n < live + MIN_GAIN:
            return 0
        self.restore(snap, n, want, tap)
        cache.restored += 1
        return n - live

    def save_prefix(self, engine: Engine, ids: list[int], path: str | Path) -> Path:
        """Prefill ``ids`` (reusing what the caches hold) through ``engine`` (the target or a feature tap, whose
        features are saved too) and the draft, and write their snapshot to ``path`` atomically."""
        digest = prefix_digest(self)
        if not self.target.can_snapshot:
            raise SpecdecError(
                f"prefix files need KV snapshots, which {type(self.target).__name__} does not take; use provider "
                "cpu, cuda or tensorrt."
            )
        with self.lease.holding():
            self.claim(None)  # the API's own context (a server's owners' are set aside for them)
            prefill(engine, ids, kept=engine.reusable(ids))
            if self.draft is not None:
                prefill(self.draft, ids, kept=self.draft.reusable(ids))
            snap = self.capture(engine if isinstance(engine, FeatureTap) else None)
        write_atomic(path, encode(snap, digest))
        return Path(path)

    def load_prefix(self, engine: Engine, path: str | Path) -> int:
        """Read a prefix file (refused if it is for another bundle, or damaged), store it in the prompt cache (where
        there is one) and make the engines hold it now. Returns its token count."""
        snap = decode_file(Path(path), prefix_digest(self), self.target.vocab_size)
        if problem := snapshot_problem(self, snap):  # every array, before anything is restored or stored
            raise SpecdecError(
                f"prefix file {path} does not fit these engines ({problem}); save it again with Pipeline.save_prefix."
            )
        if self.draft is None:  # engines without the bundle's draft: its slots are of no use here
            snap.draft_tokens = snap.draft_kv = None
        with self.lease.holding():
            self.claim(None)
            if self.target.reusable(snap.tokens) < len(self.target.held or ()):
                self.keep()  # what the engines hold now is overwritten next
            self.restore(snap, len(snap.tokens), snap.tokens, engine if isinstance(engine, FeatureTap) else None)
            if self.prompt_cache is not None:
                self.prompt_cache.put(snap)
        return len(snap.tokens)

    def decoders(self) -> list[Decoder]:
        """The decoders built over these engines (every method's that is still in use)."""
        return list(self._decoders)

    @property
    def closed(self) -> bool:
        return self.lease.closed

    def close(self) -> None:
        """No step starts any more (a running one ends first); every engine and decoder is let go."""
        self.lease.close()
        self.target = self.draft = self.prompt_cache = None
        self.heads = {}
        for decoder in list(self._decoders):
            decoder.engine = decoder.proposer = decoder.engines = None  # they hold the engines too


def open_engines(
    root: Path,
    manifest: Manifest,
    *,
    provider: str,
    cpu: CpuThreads,
    gpu: GpuOptions = DEFAULT_GPU,
    progress: Progress | None = None,
    prompt_cache_mb: float = DEFAULT_MB,
    prefill: str = "onnxruntime",
) -> Engines:
    """The engines of the bundle at ``root``, with the exactness verdict of this device (cached per device,
    ``runtime/verdicts.py``), its step costs (cached per bundle, device and thread pool, ``step_costs.py``; both
    key on one device identity, ``runtime/device.py``)
    and a prompt cache of ``prompt_cache_mb`` MB (0: none); measuring the verdict or the costs is reported to
    ``progress`` (``progress.py``). ``prefill``: which runtime runs the target's prefill passes
    (``runtime/ov_prefill.py``); the verdict and the costs are measured, and cached, with it."""
    share = manifest.draft is not None or bool(manifest.heads)  # GPU engines: their CPU fallback must not spin
    settings = dict(provider=provider, cpu=cpu, gpu=gpu)
    target = open_engine(root, manifest.target.graph, share_process=share, **settings)
    draft = None
    if manifest.draft is not None:
        draft = open_engine(root, manifest.draft.graph, share_process=True, role="draft", **settings)
    graph = manifest.target.graph
    prefillers = open_prefillers(prefill, provider, root, graph, cpu)
    if prefill == "auto" and prefillers:  # only where one measured faster here (cached per device)
        candidates = "".join(p.setting for p in prefillers)
        measured_on = device_identity(provider + candidates, str(cpu.threads or "default"))
        target.prefiller = choose_prefill(root, graph.path, target, prefillers, measured_on, progress)
    else:
        target.prefiller = prefillers[0] if prefillers else None
    # CUDA graphs change what a pass costs and how it rounds, another prefill runtime what a prefilled cache holds:
    # their measurements are kept apart
    setting = provider + ("+cuda-graph" if gpu.cuda_graph else "") + prefill_setting(target)
    device = device_identity(setting, str(cpu.threads or "default"))
    verdict = device_verdict(root, graph.verdict, graph.path, target, device, progress=progress)
    key = CostKey.for_bundle(root, device, cpu.spinning)  # the same device identity

    def step_costs(engine: Engine, proposers: Mapping[str, Proposer], hold, widths) -> CostModel:
        keyed = replace(key, candidates=tuple(proposers), widths=tuple(widths))
        return device_costs(keyed, engine, proposers, hold, progress=progress)

    heads = load_head_graphs(root, manifest.heads, cpu)
    cache = PromptCache(int(prompt_cache_mb * 2**20)) if prompt_cache_mb else None
    table = None if manifest.ngram_table is None else NgramTable.load(root / manifest.ngram_table)
    return Engines(
        target, draft, heads, verdict=verdict, step_costs=step_costs, prompt_cache=cache, digest=manifest_digest(root),
        table=table,
    )  # fmt: skip
