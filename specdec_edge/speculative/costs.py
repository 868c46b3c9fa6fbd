"""What a step costs on this device: the target's verify pass over width and context, each proposer's own work.

``auto`` (``speculative/auto.py``) chooses each step's proposal by expected tokens per second, so it
needs the price of a pass of every width it might verify. That price depends on the device, the
provider and the threads far more than on the model's size: on a 2-core CPU a 32-row pass costs
several 1-row passes, on a GPU about one. So it is measured, not assumed:

* the target's pass at widths 1..32 (``WIDTHS``) at two context lengths (``CONTEXTS``, clamped to the
  cache), the median of a few runs each, after a warm-up -- a couple of seconds;
* each candidate proposer's propose + commit time, over a short real decode of a synthetic prompt.

The result is cached per bundle (the hash of its manifest, which lists every file's sha256),
provider, device and thread setting, in ``<cache>/costs/`` (``SPECDEC_EDGE_CACHE``, else
``~/.cache/specdec-edge``); any change of those gives another key, so it is measured again.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle import manifest_digest
from specdec_edge.runtime.base import Engine
from specdec_edge.runtime.device import device_name
from specdec_edge.speculative.loop import decode, prefill
from specdec_edge.speculative.proposal import Proposer
from specdec_edge.speculative.stats import Stats
from specdec_edge.user_cache import cache_dir

COST_FORMAT = 1  # bumped when what is measured changes: older cache files are then ignored
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
CONTEXTS = (64, 512)
REPEATS = 3


@dataclass(frozen=True)
class CostKey:
    """What the costs depend on; a change of any field means measuring again."""

    bundle: str  # sha256 of the bundle's manifest.json (which holds every file's sha256)
    provider: str
    device: str
    threads: str  # "2", or "default" (one per physical core), with ",sleeping" for per-session pools
    candidates: tuple[str, ...] = ()  # the proposers whose own cost was measured
    format: int = COST_FORMAT

    @classmethod
    def for_bundle(cls, root: str | Path, provider: str, threads: int | None, spinning: bool, candidates=()) -> CostKey:
        digest = manifest_digest(root)
        return cls(digest, provider, device_name(provider), cls.thread_setting(threads, spinning), tuple(candidates))

    @staticmethod
    def thread_setting(threads: int | None, spinning: bool) -> str:
        return f"{threads or 'default'}{'' if spinning else ',sleeping'}"

    def filename(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20] + ".json"


@dataclass
class CostModel:
    """Measured seconds of a target pass per (context, width), and of each proposer's propose + commit."""

    widths: list[int]
    contexts: list[int]
    seconds: list[list[float]]  # [context][width]
    proposers: dict[str, float] = field(default_factory=dict)
    key: dict = field(default_factory=dict)
    measured_s: float = 0.0  # how long measuring took

    def verify(self, width: int, context: int) -> float:
        """Seconds of one target pass of ``width`` rows after ``context`` tokens (interpolated, clamped)."""
        by_width = [np.interp(width, self.widths, row) for row in self.seconds]
        return float(np.interp(context, self.contexts, by_width))

    def curve(self, context: int | None = None) -> list[tuple[int, float]]:
        """(width, cost relative to a 1-row pass) at ``context`` (default: the shortest measured)."""
        context = self.contexts[0] if context is None else context
        one = self.verify(1, context)
        return [(w, self.verify(w, context) / one) for w in self.widths]

    def describe(self) -> str:
        """Two lines for `info`/`bench`: the 1-row pass, and the relative cost of wider passes."""
        lines = []
        for context in self.contexts:
            points = ", ".join(f"{w}:{r:.2f}" for w, r in self.curve(context) if w in (2, 4, 8, 16, 32))
            lines.append(
                f"context {context}: 1 row {self.verify(1, context) * 1e3:.1f} ms; relative cost by width {points}"
            )
        if self.proposers:
            lines.append(
                "proposers (ms per step): " + ", ".join(f"{n} {s * 1e3:.2f}" for n, s in self.proposers.items())
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        """A cost model from its JSON form; ``ValueError`` names what is malformed (wrong types or lengths, a
        time that is not a positive finite number)."""
        if not isinstance(data, dict):
            raise ValueError("step costs are a JSON object")
        model = cls(**{k: data[k] for k in ("widths", "contexts", "seconds", "proposers", "key", "measured_s")})
        if not (
            _positive_ints(model.widths) and _positive_ints(model.contexts) and model.widths == sorted(model.widths)
        ):
            raise ValueError("step costs: widths and contexts must be positive integers")
        rows = model.seconds
        if not (isinstance(rows, list) and len(rows) == len(model.contexts)):
            raise ValueError("step costs: one row of seconds per context")
        if not all(isinstance(r, list) and len(r) == len(model.widths) and all(map(_seconds, r)) for r in rows):
            raise ValueError("step costs: every row needs a positive time per width")
        if not (isinstance(model.proposers, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e4
            for k, v in model.proposers.items()
        )):  # fmt: skip
            raise ValueError("step costs: proposers must map names to seconds")
        if not isinstance(model.key, dict):
            raise ValueError("step costs: key must be an object")
        return model


def _positive_ints(xs) -> bool:
    return (
        isinstance(xs, list) and bool(xs) and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in xs)
    )


def _seconds(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1e4


def measure_verify(engine: Engine, widths=WIDTHS, contexts=CONTEXTS, repeats: int = REPEATS, tick=None):
    """Median seconds of ``engine``'s pass at each width after each context length: ([contexts], [[seconds]])."""
    vocab = engine.vocab_size
    widest = max(widths)
    usable = [c for c in contexts if c + widest <= engine.capacity] or [max(engine.capacity - widest, 1)]
    rng = np.random.default_rng(0)
    seconds = []
    for context in usable:
        prefill(engine, rng.integers(0, vocab, size=context).tolist())
        engine.run(rng.integers(0, vocab, size=widest))  # warm-up at the widest shape
        row = []
        for width in widths:
            ids = rng.integers(0, vocab, size=width)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.run(ids)  # not committed: every run lands in the same slots
                times.append(time.perf_counter() - t0)
            row.append(float(np.median(times)))
            if tick:
                tick()
        seconds.append(nondecreasing(row))
    engine.reset()
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
    *,
    progress: Callable[[str], None] | None = None,
) -> CostModel:
    """The cached costs for ``key``, measured now (and cached) if there are none; ``key`` None: measured, not
    cached.

    ``progress`` gets one line before measuring and one after (default: printed to stderr).
    """
    model = None if key is None else load_costs(key)
    if model is not None:
        return model
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    where = "this device" if key is None else f"{key.device} ({key.provider}, threads {key.threads})"
    say(f"specdec-edge: measuring step costs on {where}; once per bundle, a few seconds")
    start = time.perf_counter()
    contexts, seconds = measure_verify(engine)
    proposer_costs = measure_proposers(engine, proposers or {})
    model = CostModel(list(WIDTHS), contexts, seconds, proposer_costs)
    model.measured_s = time.perf_counter() - start
    if key is None:
        say(f"specdec-edge: measured in {model.measured_s:.1f} s")
        return model
    model.key = json.loads(json.dumps(asdict(key)))
    path = save_costs(key, model)
    if path is None:
        say(f"specdec-edge: measured in {model.measured_s:.1f} s; warning: cannot write {cost_path(key)}, so they "
            "are measured again next time (set SPECDEC_EDGE_CACHE to a writable folder to keep them)")  # fmt: skip
    else:
        say(f"specdec-edge: measured in {model.measured_s:.1f} s; cached in {path}")
    return model
