"""The engines of one loaded bundle, shared by every pipeline over them, and how a bundle's are opened.

``Engines`` holds what does not depend on the method: the target and draft engines, the trained heads,
the device's exactness verdict (applied to the target), where ``auto``'s step costs come from, and the
lease by which calls take turns on the engines (``generation.py``). ``Pipeline`` (one method over them)
keeps an ``Engines`` and builds its method's ``Decoder`` from it; ``Pipeline.with_method`` shares it, and
``close()`` frees every engine and every decoder built over them at once. ``open_engines`` opens a bundle's.
Light: no model code here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from specdec_edge.api.generation import Decoder, EngineLease
from specdec_edge.api.prompt_cache import DEFAULT_MB, PromptCache
from specdec_edge.api.step_costs import CostKey, device_costs
from specdec_edge.bundle.hashes import manifest_digest
from specdec_edge.bundle.schema import Manifest
from specdec_edge.exactness import Verdict, recorded_verdict
from specdec_edge.progress import Progress
from specdec_edge.runtime.base import DEFAULT_GPU, Engine, GpuOptions
from specdec_edge.runtime.device import device_identity
from specdec_edge.runtime.factory import open_engine
from specdec_edge.runtime.head_graphs import HeadGraph, load_head_graphs
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.verdicts import apply, device_verdict, measure, to_verdict
from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.proposal import Proposer

# (the engine the loop drives, the proposers whose own cost to measure) -> the device's step costs
StepCosts = Callable[[Engine, Mapping[str, Proposer]], CostModel]


class Engines:
    """One bundle's opened engines, their device's verdict and step costs, and the lease over them.

    ``verdict`` None (engines opened by hand): measured on the target now (``open_engines`` caches it per
    device). ``step_costs`` None: ``auto`` measures them when it is built, and nothing is cached.
    ``prompt_cache``: the store of earlier contexts' snapshots (``prompt_cache.py``), or None for none.
    """

    def __init__(
        self,
        target: Engine,
        draft: Engine | None = None,
        heads: dict[str, HeadGraph] | None = None,
        *,
        verdict: Verdict | None = None,
        step_costs: StepCosts | None = None,
        prompt_cache: PromptCache | None = None,
    ):
        if verdict is None:
            verdict = to_verdict(measure(target), {})
        apply(target, verdict)
        self.target, self.draft, self.heads, self.verdict = target, draft, dict(heads or {}), verdict
        self.step_costs = step_costs or (lambda engine, proposers: device_costs(None, engine, proposers))
        self.capacity = min(e.capacity for e in (target, draft) if e is not None)
        self.lease = EngineLease()
        self.prompt_cache = prompt_cache
        self._decoders: weakref.WeakSet[Decoder] = weakref.WeakSet()  # every method's, to free on close

    def decoder(self, engine: Engine, proposer: Proposer, rule, k: int, eos_ids) -> Decoder:
        """A method's ``Decoder`` over these engines (freed with them)."""
        cache = self.prompt_cache
        prepare = None if cache is None else (lambda context: cache.prepare(self, engine, context))
        decoder = Decoder(engine, proposer, rule, k, eos_ids, self.lease, prepare)
        self._decoders.add(decoder)
        return decoder

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
            decoder.engine = decoder.proposer = decoder.prepare = None  # prepare holds the engine too


def open_engines(
    root: Path,
    manifest: Manifest,
    *,
    provider: str,
    cpu: CpuThreads,
    gpu: GpuOptions = DEFAULT_GPU,
    progress: Progress | None = None,
    prompt_cache_mb: float = DEFAULT_MB,
) -> Engines:
    """The engines of the bundle at ``root``, with the exactness verdict of this device (cached per device,
    ``runtime/verdicts.py``), its step costs (cached per bundle, provider, device and threads, ``step_costs.py``)
    and a prompt cache of ``prompt_cache_mb`` MB (0: none); measuring the verdict or the costs is reported to
    ``progress`` (``progress.py``)."""
    share = manifest.draft is not None or bool(manifest.heads)  # GPU engines: their CPU fallback must not spin
    settings = dict(provider=provider, cpu=cpu, gpu=gpu)
    target = open_engine(root, manifest.target.graph, share_process=share, **settings)
    draft = None
    if manifest.draft is not None:
        draft = open_engine(root, manifest.draft.graph, share_process=True, role="draft", **settings)
    graph = manifest.target.graph
    # CUDA graphs change what a pass costs and how it rounds: their measurements are kept apart
    setting = provider + ("+cuda-graph" if gpu.cuda_graph else "")
    device = device_identity(setting, str(cpu.threads or "default"))
    verdict = device_verdict(root, recorded_verdict(graph), graph.path, target, device, progress=progress)
    key = CostKey.for_bundle(root, setting, cpu.threads, cpu.spinning)

    def step_costs(engine: Engine, proposers: Mapping[str, Proposer]) -> CostModel:
        return device_costs(replace(key, candidates=tuple(proposers)), engine, proposers, progress=progress)

    heads = load_head_graphs(root, manifest.heads, cpu)
    cache = PromptCache(int(prompt_cache_mb * 2**20), manifest_digest(root)) if prompt_cache_mb else None
    return Engines(target, draft, heads, verdict=verdict, step_costs=step_costs, prompt_cache=cache)
