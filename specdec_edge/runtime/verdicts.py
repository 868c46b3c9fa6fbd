"""Batch invariance, measured on the device that runs the graph: does a token's result depend on the pass?

Speculative decoding is exact only if verifying a token among draft tokens gives the bits plain
decoding gives it. Kernels pick another code path (and rounding) for another pass shape:

* kernels have one path for a single row and another for several: GroupQueryAttention on every CPU measured,
  MatMulNBits on some (an AVX2 EPYC; not at accuracy level 4 on a Zen 5 with AVX-512 VNNI). Graphs that pad
  their attention op to two rows inside (``CachedEngine.attention_rows``, export/graph.py) run a one-row pass with
  every other op at one row; where that pass's logits and K/V equal the first row of a two-row pass, one-row
  passes run so (``min_pass_width`` 1, ``one_row_form`` "one row, attention padded to 2"), else the engine
  pads the whole pass to two rows (``min_pass_width`` 2, "padded to 2");
* MLAS's SGEMM picks its K and N strides from the matrix sizes (``MlasSgemmOperation``: while
  ``StrideN / 2 >= N`` it halves the N stride and doubles the K stride). Attention's Q.K^T product has
  N = the pass's key count (past + S) and K = the head size, so a head wider than 128 (Gemma 3: 256)
  is summed in one K block while the pass holds at most 64 keys and in two blocks of 128 above that:
  a token's scores round differently when its pass's key count crosses 64. Plain decoding computes the
  token at position p with p + W keys (W = ``Engine.plain_rows``: ``min_pass_width``, or 2 where the graph pads
  a one-row pass's attention inside); a verify pass that holds it and crosses
  the boundary does not. These *key-count boundaries* are found by sweeping the key count around the
  candidates (powers of two, the sliding window) with one token's row, and the decode loop then cuts
  any proposal whose pass would straddle one (``Engine.max_rows``), so every row keeps plain
  decoding's rounding;
* kernels that vectorize over the keys in blocks of 4-16 with a scalar tail (ONNX Runtime's arm64 attention:
  blocks of 4) round a row by its pass's key count *modulo the block*: the last row of a verify pass has no
  masked key after it, plain decoding's (padded) row has one, and whenever the row's key count is 3 mod 4
  the two split the keys differently. Every width up to ``RESIDUE_WIDTHS`` is checked after
  ``RESIDUE_PERIOD`` consecutive cache lengths; the residues where a width does not match plain decoding
  (``bad_residues``) go to the engine, which never runs such a pass (``Engine.max_rows``);
* fused attention rounds a tree row slightly differently from its branch run as a chain;
* a call that reuses the cache of an earlier one (``decode(reuse=True)``) keeps K/V that decode passes wrote (an
  answer's, at widths 1..k+1) and prefills the rest from where the common prefix ends, while a fresh call
  prefills the whole context in chunks of ``PREFILL_CHUNK``: ``reuse_matches_prefill`` says whether the two give
  the same bits (``_reuse_rows_match``). Where they do not, output with reuse equals plain decoding's with reuse,
  but may differ from a fresh call's at a near-tie (counted as today).

``measure`` compares, bit for bit, the logits rows of tokens computed in passes of every width up to
``MAX_WIDTH`` (chains) and in token trees against the pass plain decoding uses, at short contexts and
across every candidate boundary, with the boundaries found applied as the runtime applies them. The
verdict (``exactness.Verdict``) belongs to the device: export records the export machine's; on any
other device (``runtime/device.py``: CPU model and features, provider, GPU, ONNX Runtime version,
threads) ``device_verdict`` measures it again, once, in seconds, and caches it in
``<cache>/verdicts/`` (atomically, with a checksum over the verdict, the bundle digest and the device; a damaged or
edited file is measured again). ``exactness.py`` decides what runs.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import manifest_digest as bundle_digest
from specdec_edge.exactness import Verdict
from specdec_edge.progress import Progress, report
from specdec_edge.runtime.base import PREFILL_CHUNK, RESIDUE_PERIOD, RESIDUE_WIDTHS, CachedEngine, prefill
from specdec_edge.runtime.device import device_key
from specdec_edge.runtime.ov_prefill import prefill_setting
from specdec_edge.runtime.tree import path_to, tree_inputs
from specdec_edge.user_cache import cache_dir

VERDICT_FORMAT = 5  # bumped when what is measured changes: cached verdicts of other formats are measured again
CHAIN_WIDTHS = (1, 2, 3, 4, 5, 8, 12, 16, 32, 64)  # the widest is what a verify pass may have (MAX_VERIFY)
CONTEXTS = (7, 40)
RESIDUE_FROM = 41  # the residue sweep's cache lengths: RESIDUE_FROM .. RESIDUE_FROM + RESIDUE_PERIOD - 1
CANDIDATES = (16, 32, 64, 128, 256, 512, 1024)  # key counts where kernels may change their blocking
NEAR_WIDTHS = (3, 8, 16)  # the widths checked across the candidates and boundaries
FULL_SWEEP = 320  # every key count up to this is swept (kernels block by 16..128 there)
MAX_BOUNDARIES = 16  # more than this is no blocking pattern: such a graph is not batch invariant
DECODED_FROM = 8  # the reuse check's decode passes write every slot from here on (an answer crossing every key count)
SPAN = 24  # one sweep covers the key counts q+2 .. q+SPAN+1 after q slots
# A tree over the pending token: three children, two grandchildren under the first child (parents, topological).
TREE = [-1, 0, 0, 0, 1, 1]


class _Probe:
    """One engine under measurement, its cache holding a random context."""

    def __init__(self, engine: CachedEngine, seed: int, longest: int = 0):
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.vocab_size
        self.rows = 0
        self.longest = longest  # the longest context any check needs (prefilled once where the cache is host memory)
        self.context: np.ndarray | None = None
        self._snapshot: np.ndarray | None = None
        self._filled = 0

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, n)

    def fill(self, length: int) -> np.ndarray:
        """Commit ``length`` tokens of one random context (the same context every call) and return them.

        Prefilled once, in chunks; where the engine's cache is host memory its ``snapshot`` is ``restore``d on later
        calls (the passes in between overwrote slots after their contexts; a pass writes the slots it reads beyond
        the context), else the context is prefilled anew."""
        engine = self.engine
        if self._snapshot is not None and length <= self._filled:
            engine.restore(self._snapshot, self.context[:length])
            return self.context[:length]
        host = _host_cache(engine)
        upto = min(max(length, self.longest), engine.capacity - 1) if host else length
        if self.context is None or len(self.context) < upto:
            self.context = self.rng.integers(0, self.vocab, upto)
        prefill(engine, self.context[:upto])
        self._filled = upto
        if host:
            self._snapshot = engine.snapshot()
        engine.rollback(length)
        return self.context[:length]

    def run(self, past: int, tokens, positions=None, bias=None) -> np.ndarray:
        """Logits [S, V] of one uncommitted pass after ``past`` slots (a copy); the length stays at ``past``."""
        self.engine.rollback(past)
        self.rows += len(tokens)
        return np.array(self.engine.run(np.asarray(tokens), positions, bias).logits, dtype=np.float32)

    def canonical(self, past: int, token: int) -> np.ndarray:
        """The row plain decoding computes for ``token`` after ``past`` slots (a one-token pass, padded as the
        engine pads it)."""
        return self.run(past, [token])[0]


def _chain_rows_match(probe: _Probe, past: int, tokens: np.ndarray, known: dict | None = None) -> tuple[bool, float]:
    """Every row of one chain pass (of a wide pass, a few rows) against plain decoding's row for it, given the
    same earlier slots (this pass's own K/V of the rows before it).

    ``known`` (one dict per ``past``, shared by the passes after it): plain decoding's rows already computed, keyed
    by what they are computed from (the row, its token and, where the cache is host memory, the bits of the K/V
    this pass wrote before it), so that passes of several widths over the same tokens compute each once. A row
    whose earlier K/V differ between two widths is computed for each: the comparison stays the same."""
    rows = probe.run(past, tokens)
    engine = probe.engine
    width = len(tokens)
    checked = {0, 1, width // 2, width - 1} & set(range(width))
    ok, worst = True, 0.0
    for j in sorted(checked, reverse=True):  # a plain pass at past+j overwrites slots from past+j on only
        key = _row_inputs(engine, past, j, int(tokens[j])) if known is not None else None
        if key is not None and key in known:
            want = known[key]
        else:
            engine.rollback(past)
            engine.commit(j)
            want = probe.canonical(past + j, int(tokens[j]))
            if key is not None:
                known[key] = want
        ok &= bool(np.array_equal(rows[j], want))
        worst = max(worst, float(np.abs(rows[j] - want).max()))
    engine.rollback(past)
    return ok, worst


def _row_inputs(engine: CachedEngine, past: int, j: int, token: int) -> tuple | None:
    """What plain decoding's row for ``token`` after ``past + j`` slots depends on beyond the first ``past`` (the
    same context for every pass after ``past``): the K/V of slots past .. past+j-1, by their bits. None where those
    cannot be read cheaply (a device cache) and j > 0."""
    if j == 0:
        return (0, token, b"")
    kv = engine.host_kv(past, past + j)
    return None if kv is None else (j, token, hashlib.sha256(kv.tobytes()).digest())


def _tree_rows_match(probe: _Probe, past: int, parents: list[int]) -> tuple[bool, float]:
    """Every node of one tree pass against its branch run as a chain."""
    tokens = probe.tokens(len(parents))
    positions, bias = tree_inputs(parents, past)
    rows = probe.run(past, tokens, positions, bias)
    ok, worst = True, 0.0
    for node in range(len(parents)):
        chain = probe.run(past, tokens[path_to(parents, node)])[-1]
        ok &= bool(np.array_equal(rows[node], chain))
        worst = max(worst, float(np.abs(rows[node] - chain).max()))
    return ok, worst


def _reuse_rows_match(probe: _Probe, widths=(1, 2, 3, 5, 4, 8)) -> tuple[bool, float]:
    """A context whose slots from ``DECODED_FROM`` on decode passes wrote (chains of ``widths`` rows, cut as the loop
    cuts them: across every key count and boundary up to past the first prefill chunk), and one whose last two
    thirds were prefilled after a reused prefix, against a fresh chunked prefill of the same tokens: the K/V of every
    slot where the cache is host memory, and the next token's row."""
    engine = probe.engine
    n = min(PREFILL_CHUNK + 48, engine.capacity - max(widths) - 2)
    if n <= DECODED_FROM:
        return True, 0.0
    context = probe.tokens(n + 1)

    def fresh(kept: int = 0):
        prefill(engine, context[:n], kept=kept)
        return _state(probe, n, int(context[n]))

    want = fresh()
    states = [fresh(n // 3)]  # the rest prefilled after a reused prefix
    prefill(engine, context[:DECODED_FROM])  # the rest written by decode passes
    i = 0
    while engine.length < n:
        width = min(widths[i % len(widths)], n - engine.length, engine.max_rows() or n)
        engine.run(context[engine.length : engine.length + width])
        engine.commit(width)
        i += 1
    states.append(_state(probe, n, int(context[n])))
    ok, worst = True, 0.0
    for got in states:
        for a, b in zip(got, want):
            ok &= bool(np.array_equal(a, b))
            worst = max(worst, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()))
    engine.reset()
    return ok, worst


def _state(probe: _Probe, n: int, token: int) -> list[np.ndarray]:
    """What a cache of ``n`` slots holds: its K/V (host caches) and the row plain decoding computes after it."""
    engine = probe.engine
    kv = engine.host_kv(0, n)
    kv = [] if kv is None else [kv]
    row = probe.canonical(n, token)
    engine.rollback(n)
    return [*kv, row]


def _single_rows_match(probe: _Probe, lengths) -> tuple[bool, float]:
    """A one-row pass (as the graph runs it: its attention padded inside where ``CachedEngine.attention_rows`` is 2)
    against the first row of a two-row pass, after each of ``lengths`` - 1 slots: the logits row and, where the cache
    is host memory, the K/V it wrote in every layer."""
    ok, worst = True, 0.0
    for past, pending in _descending(probe, lengths):
        one = [probe.run(past, [pending])[0], *_slot(probe.engine, past)]
        two = [probe.run(past, [pending, *probe.tokens(1)])[0], *_slot(probe.engine, past)]
        for a, b in zip(one, two):
            ok &= bool(np.array_equal(a, b))
            worst = max(worst, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()))
    return ok, worst


def _slot(engine: CachedEngine, slot: int) -> list[np.ndarray]:
    """The K/V of one cache slot in every layer (a copy), where the cache is host memory; else nothing."""
    kv = engine.host_kv(slot, slot + 1)
    return [] if kv is None else [kv[..., 0, :]]


def one_row_form(engine: CachedEngine) -> str:
    """How ``engine`` runs a one-row pass under its measured padding: "one row, attention padded to 2" (the graph
    pads its attention op, ``CachedEngine.attention_rows``), "one row" or "padded to N"."""
    pad = max(engine.min_width, getattr(engine, "pad_to", 0) or 0)  # GPU engines pad to a width of their own
    if pad > 1:
        return f"padded to {pad}"
    return f"one row, attention padded to {engine.attention_rows}" if engine.attention_rows > 1 else "one row"


def _random_tree(rng: np.random.Generator, nodes: int) -> list[int]:
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, nodes)]


def _host_cache(engine: CachedEngine) -> bool:
    """Whether ``engine`` hands out its K/V cheaply (``CachedEngine.host_kv``: a host-memory cache): then K/V are
    compared too and contexts restored from a snapshot; else logits only, and contexts prefilled anew."""
    return engine.host_kv(0, 0) is not None


def _row_signature(probe: _Probe, past: int, tokens: np.ndarray) -> np.ndarray:
    """What one pass computes for its first row: its K/V in every layer after the first where the engine's cache
    is host memory (cheap: no LM head over every row; every layer's attention shows in the next layer's K/V),
    else its logits row."""
    engine = probe.engine
    if _host_cache(engine):
        engine.rollback(past)
        engine.run(tokens, logits_to_keep=1)
        return engine.host_kv(past, past + 1)[1:, ..., 0, :]
    return probe.run(past, tokens)[0]


def _changes(probe: _Probe, q: int, tokens: np.ndarray, lo: int, hi: int, sig_lo, sig_hi, found: set) -> None:
    """Add to ``found`` every key count in (q+lo, q+hi] where the first row's signature changes, by bisection
    (a kernel's blocking changes at a key count and stays: equal ends mean no change between them)."""
    if np.array_equal(sig_lo, sig_hi):
        return
    if hi - lo == 1:
        found.add(q + hi)
        return
    mid = (lo + hi) // 2
    sig_mid = _row_signature(probe, q, tokens[:mid])
    _changes(probe, q, tokens, lo, mid, sig_lo, sig_mid, found)
    _changes(probe, q, tokens, mid, hi, sig_mid, sig_hi, found)


def find_boundaries(probe: _Probe, candidates: tuple[int, ...]) -> list[int] | None:
    """Key counts B at which one token's row changes (a pass over B keys rounds unlike one over B - 1).

    One token at position q is computed in passes of 2 .. SPAN+1 rows, so that only the key count changes, for
    every key count up to ``FULL_SWEEP`` and around each larger candidate. None when a row depends on the other
    tokens of its pass (activations quantized per tensor): then no pass of two or more rows is exact."""
    engine = probe.engine
    starts = set(range(1, min(FULL_SWEEP, engine.capacity), SPAN - 1))  # windows overlap by one key count
    starts |= {c - SPAN // 2 for c in candidates if c > FULL_SWEEP}
    starts = sorted(q for q in starts if q >= 1 and q + SPAN + 1 <= engine.capacity)
    if not starts:
        return []
    probe.fill(starts[-1])
    found: set = set()
    for q in reversed(starts):  # a pass after q slots writes only slots from q on: later starts are lower
        tokens = probe.tokens(SPAN + 1)
        first, last = _row_signature(probe, q, tokens[:2]), _row_signature(probe, q, tokens)
        _changes(probe, q, tokens, 2, SPAN + 1, first, last, found)
        others = np.concatenate([tokens[:1], probe.tokens(SPAN)])  # the same first token, other partners
        if not np.array_equal(_row_signature(probe, q, others), last):
            return None
    return sorted(found)


def _bad_residues(probe: _Probe, max_width: int) -> tuple[dict[int, list[int]], int]:
    """For every width 2 .. min(max_width, RESIDUE_WIDTHS): the residues (mod RESIDUE_PERIOD) of the cache lengths
    after which a chain pass of that width does not match plain decoding's rows, over two periods of consecutive
    lengths (the boundaries applied, as in decoding); and the widest width up to which both periods found the same
    residues. A width whose mismatches do not repeat with the period follows no kernel block: it and every wider
    width are not exact (the second value is then below it; 1 when two rows already fail so)."""
    engine = probe.engine
    top = min(max_width, RESIDUE_WIDTHS)
    lengths = range(RESIDUE_FROM, RESIDUE_FROM + 2 * RESIDUE_PERIOD)
    if top < 2 or lengths[-1] + top > engine.capacity:
        return {}, max_width
    seen: dict[int, tuple[set, set]] = {w: (set(), set()) for w in range(2, top + 1)}
    for past, pending in _descending(probe, lengths):
        limit = min(engine.max_rows(past) or top, top)
        chain, known = np.array([pending, *probe.tokens(top - 1)]), {}  # every width: a prefix of one chain
        for width in range(2, limit + 1):
            ok, _ = _chain_rows_match(probe, past, chain[:width], known)
            if not ok:
                seen[width][(past - RESIDUE_FROM) // RESIDUE_PERIOD].add(past % RESIDUE_PERIOD)
    regular = 1
    for width in range(2, top + 1):
        if seen[width][0] != seen[width][1]:
            break
        regular = width
    bad = {w: sorted(seen[w][0]) for w in range(2, regular + 1) if seen[w][0]}
    return bad, (max_width if regular == top else regular)


def _descending(probe: _Probe, lengths) -> list[tuple[int, int]]:
    """(past, pending token) for each context length, longest first, over one random context filled once: a pass
    after ``past`` slots writes only slots from ``past`` on, which the shorter contexts after it never read."""
    lengths = sorted(set(lengths), reverse=True)
    if not lengths:
        return []
    context = probe.fill(lengths[0])
    return [(n - 1, int(context[n - 1])) for n in lengths]


def measure(
    engine: CachedEngine, *, seed: int = 0, candidates: tuple[int, ...] = CANDIDATES, widths=CHAIN_WIDTHS
) -> dict:
    """The verdict for ``engine``'s graph on this device (see the module docstring), as a JSON-able dict with
    ``batch_invariant``, ``min_pass_width``, ``tree_invariant``, ``max_width``, ``boundaries`` and what was
    compared. The engine is left with the measured padding and boundaries applied, its cache empty."""
    start = time.perf_counter()
    probe = _Probe(engine, seed, longest=max(CONTEXTS + tuple(c + SPAN for c in candidates)))
    engine.min_width, engine.boundaries, engine.max_width, engine.bad_residues = 1, (), None, {}
    widths = [w for w in widths if max(CONTEXTS) + w <= engine.capacity]
    fits = lambda n, ws: n >= 2 and n + max(ws) <= engine.capacity  # noqa: E731
    near = [c - 3 for c in candidates]
    # 1. a single row against two rows (kernels' one-row paths: attention's, MatMulNBits' on some CPUs), logits and K/V
    single_ok, worst_single = _single_rows_match(probe, [n for n in (*CONTEXTS, *near) if fits(n, widths)])
    engine.min_width = 1 if single_ok else 2
    # 2. key-count boundaries; then every width (at short contexts) or a few (across each candidate and boundary),
    # and token trees, with the boundaries applied as the decode loop applies them (no pass straddles one)
    found = find_boundaries(probe, candidates)
    partners_matter = found is None or len(found) > MAX_BOUNDARIES
    boundaries = [] if partners_matter else found
    engine.boundaries = tuple(boundaries)
    near += [n for b in boundaries for n in (b - engine.plain_rows, b + 1)]
    cases = {n: widths for n in CONTEXTS if fits(n, widths)}
    cases.update({n: NEAR_WIDTHS for n in near if n not in cases and fits(n, NEAR_WIDTHS)})
    failed, worst_multi = set(), 0.0  # the chain widths that failed anywhere
    for past, pending in _descending(probe, cases):
        limit = engine.max_rows(past) or engine.capacity
        chain, known = np.array([pending, *probe.tokens(max(cases[past + 1]) - 1)]), {}
        for width in cases[past + 1]:
            ok, worst = _chain_rows_match(probe, past, chain[: min(width, limit)], known)
            failed |= set() if ok else {width}
            worst_multi = max(worst_multi, worst)
    # the widest pass that matched, with every narrower width measured matching too (wider ones are cut to it)
    good = [w for w in widths if w >= 2 and not any(f <= w for f in failed)]
    max_width = 1 if partners_matter else max(good, default=1)
    engine.max_width = max_width
    # ... and after every cache length modulo the kernels' key blocks (wider passes are not swept: cut to the swept)
    swept = max_width
    bad_residues, max_width = _bad_residues(probe, max_width)
    if max_width < min(swept, RESIDUE_WIDTHS):  # mismatches at a width that follow no period: it is not exact
        failed.add(max_width + 1)
    if bad_residues:
        max_width = min(max_width, RESIDUE_WIDTHS)
        engine.bad_residues = {w: frozenset(r) for w, r in bad_residues.items()}
        if len(bad_residues.get(2, ())) == RESIDUE_PERIOD:  # two rows never match: no pass of two or more is exact
            max_width = 1
    engine.max_width = max_width
    tree_ok, worst_tree = max_width >= 2, 0.0
    for past, _ in _descending(probe, cases) if tree_ok else []:
        limit = min(engine.max_rows(past) or max_width, max_width)
        trees = [TREE, _random_tree(probe.rng, 24)] if cases[past + 1] is widths else [TREE]
        for parents in trees:
            ok, worst = _tree_rows_match(probe, past, parents[:limit])
            tree_ok &= ok
            worst_tree = max(worst_tree, worst)
    # 3. a reused cache (decode passes' K/V, a prefill after the reused prefix) against a fresh prefill
    reuse_ok, worst_reuse = _reuse_rows_match(probe)
    engine.reset()
    return {
        "batch_invariant": max_width >= 2,
        "min_pass_width": engine.min_width,
        "tree_invariant": bool(tree_ok),
        "max_width": max_width,
        "failed_widths": sorted(failed),
        "rows_depend_on_partners": partners_matter,
        "boundaries": boundaries,
        "residue_period": RESIDUE_PERIOD,
        "bad_residues": {str(w): r for w, r in bad_residues.items()},
        "single_row_matches": bool(single_ok),
        "one_row_form": one_row_form(engine),
        "single_row_max_abs_diff": worst_single,
        "multi_row_max_abs_diff": worst_multi,
        "tree_max_abs_diff": worst_tree,
        "reuse_matches_prefill": reuse_ok,
        "reuse_max_abs_diff": worst_reuse,
        "contexts": sorted(cases),
        "widths": widths,
        "rows_compared": probe.rows,
        "seconds": round(time.perf_counter() - start, 2),
    }


def to_verdict(measured: dict, device: dict) -> Verdict:
    """The ``exactness.Verdict`` of a ``measure`` result on ``device``."""
    keys = ("batch_invariant", "min_pass_width", "tree_invariant", "max_width")
    details = {k: v for k, v in measured.items() if k not in keys}
    return Verdict(**{k: measured[k] for k in keys}, device=device, details=details)


# ---- the per-device cache


def verdict_path(bundle_digest: str, graph_path: str, device: dict) -> Path:
    key = json.dumps([VERDICT_FORMAT, bundle_digest, graph_path, device_key(device)])
    return cache_dir() / "verdicts" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def verdict_checksum(digest: str, graph_path: str, verdict: dict) -> str:
    """sha256 of a cached verdict with the bundle digest, graph and device it holds for: an accidental edit of the
    file (a changed width, boundary or flag would make speculation inexact silently) no longer matches."""
    key = json.dumps([VERDICT_FORMAT, digest, graph_path, verdict], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()


def load_verdict(path: Path, digest: str, graph_path: str, device: dict) -> Verdict | None:
    """The cached verdict at ``path`` if it is whole, matches its checksum and is for this bundle, graph and device;
    else None (then it is measured again)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != VERDICT_FORMAT:
            return None
        if (data.get("bundle"), data.get("graph")) != (digest, graph_path):
            return None
        if data.get("checksum") != verdict_checksum(digest, graph_path, data.get("verdict")):
            return None
        verdict = Verdict.from_json(data.get("verdict"))
    except (OSError, ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return None
    return verdict if verdict.device == device else None


def save_verdict(path: Path, digest: str, graph_path: str, verdict: Verdict) -> Path | None:
    """Write the verdict and its checksum atomically; None (and nothing written) where the cache cannot be
    written."""
    data = {"format": VERDICT_FORMAT, "bundle": digest, "graph": graph_path, "verdict": verdict.to_json()}
    data["checksum"] = verdict_checksum(digest, graph_path, data["verdict"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1))
    except OSError:
        return None
    return path


def cached_verdicts(root: str | Path) -> list[dict]:
    """Every cached verdict of the bundle at ``root`` (any device), as stored: for ``info``."""
    digest = bundle_digest(root)
    found = []
    for path in sorted((cache_dir() / "verdicts").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            whole = data.get("checksum") == verdict_checksum(digest, data.get("graph"), data.get("verdict"))
            if data.get("format") == VERDICT_FORMAT and data.get("bundle") == digest and whole:
                found.append({"graph": data["graph"], **Verdict.from_json(data["verdict"]).to_json()})
        except (OSError, ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            continue
    return found


def device_verdict(
    root: str | Path,
    recorded: Verdict,
    graph_path: str,
    engine: CachedEngine,
    device: dict,
    *,
    progress: Progress | None = None,
) -> Verdict:
    """The verdict that holds for ``engine`` on ``device``: the one export ``recorded`` if it was measured on this
    very device (by a version that checks the key residues), else the cached one, else measured now (seconds;
    cached; ``progress`` gets a line before and after). The engine gets its padding and boundaries from it.

    Where another runtime prefills (``engine.prefiller``) and this device's verdict with the target graph prefilling
    is known (recorded or cached), only the check a prefill runtime changes is measured (``with_prefiller``)."""
    if recorded.device == device and "residue_period" in recorded.details:  # measured by this version, here
        verdict = recorded
    else:
        digest = bundle_digest(root)
        path = verdict_path(digest, graph_path, device)
        verdict = load_verdict(path, digest, graph_path, device)
        if verdict is None:
            other = ", ".join(k for k in device if recorded.device.get(k) != device[k]) or "device"
            damaged = f"; the cached one, {path}, is damaged or edited" if path.exists() else ""
            base = _without_prefiller(recorded, digest, graph_path, engine, device)
            what = "verification is exact here" if base is None else "a reused cache matches a fresh prefill here"
            report(
                progress,
                f"specdec-edge: checking on {device.get('name')} ({device.get('provider')}, threads "
                f"{device.get('threads')}) that {what} (the bundle was checked with another {other}{damaged}); "
                "once per device and setting, seconds to a minute",
            )
            verdict = to_verdict(measure(engine), device) if base is None else with_prefiller(base, engine, device)
            saved = save_verdict(path, digest, graph_path, verdict)
            where = f"; cached in {saved}" if saved else " (the cache is not writable: measured again next time)"
            report(progress, f"specdec-edge: checked in {verdict.details.get('seconds')} s{where}")
    apply(engine, verdict)
    return verdict


def _without_prefiller(
    recorded: Verdict, digest: str, graph_path: str, engine: CachedEngine, device: dict
) -> Verdict | None:
    """This device's verdict with the target graph prefilling (the device identity without the prefill runtime's
    part, ``prefill_setting``), where export recorded it or it is cached; None where another runtime does
    not prefill, or that verdict is not known."""
    setting = prefill_setting(engine)
    provider = str(device.get("provider") or "")
    if not setting or not provider.endswith(setting) or provider == setting:
        return None
    base = {**device, "provider": provider[: -len(setting)]}
    if recorded.device == base and "residue_period" in recorded.details:
        return recorded
    return load_verdict(verdict_path(digest, graph_path, base), digest, graph_path, base)


def with_prefiller(base: Verdict, engine: CachedEngine, device: dict) -> Verdict:
    """``base`` (this device's verdict with the target graph prefilling) for ``engine``, whose prefill passes another
    runtime runs: the reuse check measured again, every other check kept.

    What a prefill runtime changes is the K/V a prompt's prefill writes. The decode-side checks compare passes of
    several widths against plain decoding's over one cache, whatever wrote it: the rows' rounding depends on the
    pass's kernels and shapes, which prefill does not touch. The reuse check compares a cache written partly by decode
    passes with a fresh prefill: that one depends on the prefill runtime and is measured (``_reuse_rows_match``)."""
    start = time.perf_counter()
    apply(engine, base)
    probe = _Probe(engine, seed=0)
    same, worst = _reuse_rows_match(probe)
    engine.reset()
    details = {
        **base.details,
        "reuse_matches_prefill": same,
        "reuse_max_abs_diff": worst,
        "decode_checks_from": base.device.get("provider"),  # the setting whose decode-side checks these are
        "seconds": round(time.perf_counter() - start, 2),
    }
    return Verdict(base.batch_invariant, base.min_pass_width, base.tree_invariant, base.max_width, device, details)


def apply(engine: CachedEngine, verdict: Verdict) -> None:
    """Give ``engine`` the padding and the key-count boundaries ``verdict`` measured."""
    engine.min_width = verdict.min_pass_width
    engine.boundaries = tuple(verdict.details.get("boundaries", ()))
    residues = verdict.details.get("bad_residues") or {}
    engine.bad_residues = {int(w): frozenset(r) for w, r in residues.items()}
    engine.max_width = verdict.max_width
