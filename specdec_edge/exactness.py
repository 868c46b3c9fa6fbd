"""The one place that decides what runs exactly: given a target graph's verdict on the device it runs on,
the method's proposal shape and ``allow_inexact``, may it run, with which minimum pass width, trees or
chains only, and what is logged. Export, ``add_heads``, ``Pipeline`` (and through it the GPU engines,
``chat``, ``generate``, ``serve``), ``info`` and ``bench`` ask here and restate nothing.

Speculative decoding is exact only if a token's logits and K/V are bit-identical whichever pass
computes them: the 1- or 2-row pass of plain decoding, or row j of a wider verify pass. Whether they are
depends on the kernels of the device (``runtime/verdicts.py`` measures it, at export and again on every
other device). A ``Verdict`` is what was measured:

* ``batch_invariant``: every chain row from ``min_pass_width`` up to ``max_width`` rows, at every measured
  key range (across the kernels' block boundaries), matched plain decoding bit for bit;
* ``min_pass_width``: 2 when a single-row pass rounds differently from wider ones (the runtime then
  pads one-row passes to two; plain decoding pads too, so both go through the same kernels); 1 where a one-row pass
  (its attention padded to two rows inside graphs that do so: ``details["one_row_form"]``) matched;
* ``tree_invariant``: token-tree rows matched their branches run as chains.

The rules (``decide``):

=====================================  ==================================================================
verdict                                what runs
=====================================  ==================================================================
batch invariant, trees invariant       every method
batch invariant, float graph, trees    chains exactly; trees too: fused attention rounds a tree row by ~1e-5
not invariant                          in fp32/fp16 logits, which only a near-tie can turn into another token
                                       (the loop logs near-ties)
batch invariant, quantized graph,      chains only: activation rounding turns a tree's rounding into whole
trees not invariant                    logits; tree methods are refused (``--allow-inexact`` runs them)
not batch invariant                    plain only; speculation is refused (``--allow-inexact`` runs it)
=====================================  ==================================================================

The padding (``min_pass_width``), the widest pass (``max_width``: wider proposals are cut to it) and the
key-count boundaries go to the engine (``runtime.verdicts.apply``; the decode loop asks ``Engine.max_rows``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec_edge.errors import SpecdecError

FLOAT_DTYPES = ("fp32", "fp16")


@dataclass(frozen=True)
class Verdict:
    """What ``runtime/verdicts.py`` measured for one target graph on one device (see the module docstring). A bundle
    records the export machine's as ``GraphSpec.verdict`` (``bundle/schema.py`` writes and reads its manifest form)."""

    batch_invariant: bool
    min_pass_width: int
    tree_invariant: bool
    max_width: int  # the widest pass measured; wider ones are never run exactly
    device: dict = field(default_factory=dict)  # runtime/device.py: what it was measured on
    details: dict = field(default_factory=dict)  # what was compared: rows, widths, boundaries, worst differences

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Verdict:
        """A verdict from its JSON form; ``ValueError`` names a missing or mistyped field."""
        if not isinstance(data, dict):
            raise ValueError("a verdict is a JSON object")
        for name, kind in (("batch_invariant", bool), ("tree_invariant", bool), ("device", dict), ("details", dict)):
            if not isinstance(data.get(name), kind):
                raise ValueError(f"verdict field {name!r} = {data.get(name)!r}")
        bounds = data["details"].get("boundaries", [])
        if not isinstance(bounds, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bounds
        ):
            raise ValueError(f"verdict boundaries = {bounds!r}")
        residues = data["details"].get("bad_residues", {})
        if not isinstance(residues, dict) or not all(
            str(w).isdigit() and isinstance(r, list) and all(isinstance(x, int) and 0 <= x < 1 << 16 for x in r)
            for w, r in residues.items()
        ):
            raise ValueError(f"verdict bad_residues = {residues!r}")
        for name in ("min_pass_width", "max_width"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
                raise ValueError(f"verdict field {name!r} = {value!r}")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Decision:
    """What the policy allows for one method on one verdict."""

    speculate: bool  # proposals may be verified (False: plain steps only)
    trees: bool  # proposals may branch
    inexact: bool = False  # runs although its output may differ from plain decoding (allow_inexact)
    note: str | None = None  # logged once at load: what is only exact to float rounding, or inexact


def trees_exact(verdict: Verdict, dtype: str) -> bool:
    """Whether token trees may be verified on this graph without ``allow_inexact`` (float graphs round a tree
    row by ~1e-5 only, near-ties logged; quantized graphs need tree rows bit-identical). Exported heads record
    their branching tree where this holds, else a chain (topk 1)."""
    return verdict.batch_invariant and (verdict.tree_invariant or dtype in FLOAT_DTYPES)


def decide(
    verdict: Verdict, dtype: str, *, speculative: bool, branches: bool = False, allow_inexact: bool = False
) -> Decision:
    """May a method run on a graph with ``verdict``? ``speculative``: it proposes tokens; ``branches``: its
    proposals are token trees. Returns the ``Decision``, or raises ``SpecdecError`` naming the fixes."""
    where = _where(verdict)
    if not speculative:
        return Decision(False, False)
    if not verdict.batch_invariant:
        if not allow_inexact:
            raise SpecdecError(
                f"this bundle's {dtype} target is not batch invariant {where}: verifying several tokens in one pass "
                "changes its output, so speculative decoding would not be exact. Use method 'plain', re-export the "
                "bundle with this version of specdec-edge, or pass --allow-inexact (allow_inexact=True) to accept "
                "the difference."
            )
        return Decision(True, True, True, f"INEXACT: the target is not batch invariant {where}")
    if branches and not trees_exact(verdict, dtype):
        if not allow_inexact:
            raise SpecdecError(
                f"this method proposes token trees, and this bundle's {dtype} target verifies only chain-shaped "
                f"proposals bit for bit {where} (tree rows round differently), so its output could differ from "
                "plain decoding. Use a chain: method 'pld' or 'draft', or EAGLE/pld-eagle with -o topk=1 (what "
                "such bundles record); or pass --allow-inexact (allow_inexact=True)."
            )
        return Decision(True, True, True, f"INEXACT: token trees round differently {where}")
    note = None
    if branches and not verdict.tree_invariant:
        note = f"token trees are exact to float rounding {where} (near-ties are logged)"
    return Decision(True, trees_exact(verdict, dtype), False, note)


def trees_allowed(verdict: Verdict, dtype: str, allow_inexact: bool = False) -> bool:
    """Whether proposers may be built to branch (before one is built: ``decide`` checks what it proposes)."""
    return trees_exact(verdict, dtype) or allow_inexact


def default_runs_plain(verdict: Verdict) -> bool:
    """The bundle's default method must run: on a graph that is not batch invariant it is plain."""
    return not verdict.batch_invariant


def describe(verdict: Verdict, dtype: str) -> str:
    """One line for ``info``: what the verdict lets run."""
    if not verdict.batch_invariant:
        return (
            "NOT batch invariant: speculation is refused (--allow-inexact runs it and may change the output)"
            + _reuse(verdict)
        )
    form = verdict.details.get("one_row_form")
    if form and form != "one row":
        pad = f"; one-row passes {'run as ' if form.startswith('one row') else ''}{form}"
    else:
        pad = f"; one-row passes padded to {verdict.min_pass_width}" if verdict.min_pass_width > 1 else ""
    if verdict.tree_invariant:
        trees = ", token trees too"
    elif dtype in FLOAT_DTYPES:
        trees = ", token trees to float rounding (near-ties logged)"
    else:
        trees = "; token trees round differently, so tree methods need --allow-inexact (chains stay exact)"
    chains = f"batch invariant up to {verdict.max_width} rows{pad}: chains are verified bit for bit"
    return chains + trees + _residues(verdict) + _reuse(verdict)


def _residues(verdict: Verdict) -> str:
    """The widths that round unlike plain decoding after some cache lengths (modulo the kernels' key blocks)."""
    bad = verdict.details.get("bad_residues") or {}
    if not bad:
        return ""
    period = verdict.details.get("residue_period")
    widths = ", ".join(
        f"{w} rows after {r} mod {period} slots" for w, r in sorted(bad.items(), key=lambda x: int(x[0]))
    )
    return f"; rows round by their pass's key count modulo {period}, so these passes run as narrower ones: {widths}"


def _reuse(verdict: Verdict) -> str:
    """What the verdict says of a reused cache against a fresh prefill (verdicts measured before it say nothing)."""
    same = verdict.details.get("reuse_matches_prefill")
    if same is None:
        return ""
    if same:
        return "; a reused KV prefix equals a fresh prefill bit for bit"
    return (
        "; a reused KV prefix differs from a fresh prefill in the last bits (output with reuse equals plain "
        "decoding's with reuse; against a call without reuse a near-tie may differ)"
    )


def _where(verdict: Verdict) -> str:
    device = verdict.device.get("name")
    return f"on {device}" if device else "on this device"
