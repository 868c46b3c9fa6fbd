"""Measuring and caching what a step costs on this device (the ``CostModel`` of ``speculative/costs.py``).

* the target's pass at widths 1..32 (``WIDTHS``; 1..8, ``CHAIN_WIDTHS``, where the device's verdict allows
  chains only: wider passes are priced by extrapolation, ``CostModel.verify``) at two context lengths
  (``CONTEXTS``, clamped to the cache), the least of a few interleaved runs each, after a warm-up -- a few seconds;
* each candidate proposer's propose + commit time, over a short real decode of a synthetic prompt.

The result is cached per bundle (the hash of its manifest, which lists every file's sha256), device (the identity
that keys the exactness verdicts too, ``runtime/device.py``: CPU model and features, GPU, provider, ONNX Runtime,
threads) and thread pool, in ``<cache>/costs/`` (``SPECDEC_EDGE_CACHE``, else ``~/.cache/specdec-edge``); any change
of those gives another key, so it is measured again. What takes a
while is reported through the package's one hook (``progress.py``). Above ``speculative`` and ``runtime``:
it drives the decode loop over real engines.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import manifest_digest
from specdec_edge.progress import Progress, report
from specdec_edge.runtime.base import Engine
from specdec_edge.runtime.device import device_key
from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.loop import decode, prefill
from specdec_edge.speculative.proposal import Proposer
from specdec_edge.speculative.stats import Stats
from specdec_edge.user_cache import cache_dir

COST_FORMAT = 5  # bumped when what is measured or keyed changes: older cache files are then ignored
# (2: keyed by the device identity the verdicts use; 3: the least of interleaved rounds, not consecutive medians;
# 4: a shorter context's curve capped by the longer one's; 5: keyed by the widths measured)
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
# Where trees are refused (``exactness.trees_allowed``), a pass verifies a chain: 1 + k rows, k = 10 for auto. The
# widths past 8 cost most of the measuring (on a 2-core AVX2 CPU 12-17 s of a first load, ~70 % of it in widths
# 10-32) and a chain seldom reaches them; their price is extrapolated from the last measured row's.
CHAIN_WIDTHS = tuple(w for w in WIDTHS if w <= 8)
CONTEXTS = (64, 512)
ROUNDS = (4, 8)  # interleaved rounds over the widths, least and most; each width keeps its least time
SETTLED = 0.02  # after the least rounds, measuring stops at a round that lowered no width's time by more than this


@dataclass(frozen=True)
class CostKey:
    """What the costs depend on; a change of any field means measuring again."""

    bundle: str  # sha256 of the bundle's manifest.json (which holds every file's sha256)
    # ``runtime.device.device_key`` of the device's identity (CPU model and features, GPU, provider, ONNX Runtime,
    # threads): the key the exactness verdicts are cached by too
    identity: str
    provider: str  # the rest names it for people (``info``, progress lines)
    device: str
    threads: str  # "2", or "default" (one per physical core), with ",sleeping" for per-session pools
    candidates: tuple[str, ...] = ()  # the proposers whose own cost was measured
    widths: tuple[int, ...] = WIDTHS  # the widths measured (CHAIN_WIDTHS where trees are refused)
    format: int = COST_FORMAT

    @classmethod
    def for_bundle(cls, root: str | Path, device: dict, spinning: bool, candidates=()) -> CostKey:
        """The key of the bundle at ``root`` on ``device`` (``runtime.device.device_identity``); ``spinning``: the
        thread pool spins between ops (False: per-session pools that sleep)."""
        threads = f"{device['threads']}{'' if spinning else ',sleeping'}"
        return cls(
            manifest_digest(root), device_key(device), device["provider"], device["name"], threads, tuple(candidates)
        )

    def filename(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20] + ".json"


def measure_verify(
    engine: Engine, widths=WIDTHS, contexts=CONTEXTS, rounds: tuple[int, int] = ROUNDS, clock=time.perf_counter
):
    """Least seconds of ``engine``'s pass at each width after each context length: ([contexts], [[seconds]]).

    The widths are timed in interleaved rounds (each round in another order) and each keeps its least time: another
    process's load only adds time, and a burst of it lands on one width's run of one round instead of on every run of
    a few neighbouring widths. ``rounds`` = (least, most): after the least, rounds go on while the last one still
    lowered some width's time by more than ``SETTLED``; a noisy machine gets more of them. A curve bent by load would
    stay in the cache and steer ``auto`` off the widths that pay (on 2 cores, consecutive medians taken during a
    burst priced 3 rows at 1.34x 2 rows, not ~1.1x)."""
    vocab = engine.vocab_size
    widest = max(widths)
    usable = sorted(c for c in contexts if c + widest <= engine.capacity) or [max(engine.capacity - widest, 1)]
    rng = np.random.default_rng(0)
    ids = {width: rng.integers(0, vocab, size=width) for width in widths}
    seconds = []
    for context in usable:
        prefill(engine, rng.integers(0, vocab, size=context).tolist())
        engine.run(ids[widest])  # warm-up at the widest shape
        best = dict.fromkeys(widths, float("inf"))
        for r in range(rounds[1]):
            order = list(widths) if r % 2 == 0 else list(reversed(widths))
            shift = (r // 2) % len(order)
            lowered = False
            for width in order[shift:] + order[:shift]:
                engine.run(ids[width])  # untimed: a pass right after another shape pays for the change
                t0 = clock()
                engine.run(ids[width])  # not committed: every run lands in the same slots
                spent = clock() - t0
                lowered |= spent < best[width] * (1 - SETTLED)
                best[width] = min(best[width], spent)
            if r + 1 >= rounds[0] and not lowered:
                break
        seconds.append(nondecreasing([best[w] for w in widths]))
    engine.reset()
    for i in reversed(range(len(seconds) - 1)):  # a pass after fewer cached tokens never costs more: a context
        seconds[i] = [min(a, b) for a, b in zip(seconds[i], seconds[i + 1])]  # timed during a burst is capped
    return list(usable), seconds


def nondecreasing(values: list[float]) -> list[float]:
    """The closest nondecreasing sequence (pool adjacent violators): a wider pass never costs less, so a
    dip is noise (another process took the CPU while a narrower width was timed)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def measure_proposers(engine: Engine, proposers: Mapping[str, Proposer], steps: int = 12) -> dict[str, float]:
    """Seconds of each proposer's propose + commit per step, over a short greedy decode of a synthetic prompt."""
    prompt = np.random.default_rng(1).integers(0, engine.vocab_size, size=48).tolist()
    prompt = prompt + prompt[:16]  # a repeat, so that prompt lookup finds a match and proposes
    costs = {}
    for name, proposer in proposers.items():
        stats = Stats()
        for _ in decode(engine, proposer, prompt, max_new_tokens=steps, stats=stats):
            pass
        costs[name] = stats.draft_s / max(stats.steps, 1)
    engine.reset()
    return costs


def cost_path(key: CostKey) -> Path:
    return cache_dir() / "costs" / key.filename()


def load_costs(key: CostKey) -> CostModel | None:
    """The cached costs for ``key``, or None (never measured, or an unreadable file)."""
    try:
        model = CostModel.from_json(json.loads(cost_path(key).read_text()))
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None  # absent or damaged: measured again (and the file rewritten)
    return model if model.key == json.loads(json.dumps(asdict(key))) else None  # tuples come back as lists


def costs_of_bundle(root: str | Path) -> list[CostModel]:
    """Every cached cost model of the bundle at ``root`` (any provider, device or threads), for `info`."""
    digest = manifest_digest(root)
    found = []
    for path in sorted((cache_dir() / "costs").glob("*.json")):
        try:
            model = CostModel.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue
        if model.key.get("bundle") == digest and model.key.get("format") == COST_FORMAT:
            found.append(model)
    return found


def save_costs(key: CostKey, model: CostModel) -> Path | None:
    """Write ``model`` for ``key`` atomically (a temp file renamed into place); None where the cache cannot be
    written (a read-only home, a full disk, a directory in the way): the costs are then measured next time."""
    path = cost_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(model.to_json(), indent=1))
    except OSError:
        return None
    return path


def device_costs(
    key: CostKey | None,
    engine: Engine,
    proposers: Mapping[str, Proposer] | None = None,
    hold: Callable[[], AbstractContextManager] = nullcontext,
    *,
    widths: tuple[int, ...] = WIDTHS,
    progress: Progress | None = None,
) -> CostModel:
    """The cached costs for ``key``, measured now (and cached) if there are none; ``key`` None: measured at
    ``widths``, not cached (a key names its own widths).

    ``hold``: the engines' lease (``EngineLease.holding``), held while measuring: the measurement overwrites the
    caches that a call over the same engines may be using. ``progress`` gets one line before measuring and one
    after (``progress.py``; None: silent).
    """
    model = None if key is None else load_costs(key)
    if model is not None:
        return model
    where = "this device" if key is None else f"{key.device} ({key.provider}, threads {key.threads})"
    report(progress, f"specdec-edge: measuring step costs on {where}; once per bundle, a few seconds")
    start = time.perf_counter()
    widths = widths if key is None else key.widths
    with hold():
        contexts, seconds = measure_verify(engine, widths)
        proposer_costs = measure_proposers(engine, proposers or {})
    model = CostModel(list(widths), contexts, seconds, proposer_costs)
    model.measured_s = time.perf_counter() - start
    if key is None:
        report(progress, f"specdec-edge: measured in {model.measured_s:.1f} s")
        return model
    model.key = json.loads(json.dumps(asdict(key)))
    path = save_costs(key, model)
    where = f"cached in {path}"
    if path is None:
        where = (f"warning: cannot write {cost_path(key)}, so they are measured again next time (set "
                 "SPECDEC_EDGE_CACHE to a writable folder to keep them)")  # fmt: skip
    report(progress, f"specdec-edge: measured in {model.measured_s:.1f} s; {where}")
    return model
