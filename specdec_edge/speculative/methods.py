"""The one registry of speculative methods: what proposes, how it is accepted, what it needs, its options.

Each method is one ``Method`` record in ``METHODS``. ``Pipeline``, the CLI (choices and help
texts), ``bench``, ``info`` and the README's methods table all read it, and a test keeps them in
agreement. To add a method: write its proposer (a ``speculative.proposal.Proposer``), then add
one record here; the acceptance rule is an object the decode loop applies
(``speculative.acceptance``), so a method never changes the loop.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import Engine
from specdec_edge.speculative.acceptance import AcceptanceRule, ExactAcceptance, TypicalAcceptance
from specdec_edge.speculative.auto import AutoProposer, Candidate
from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.eagle import Eagle3Proposer, EagleProposer
from specdec_edge.speculative.history import MAX_MATCH, HistoryLookupProposer, HistoryProposer
from specdec_edge.speculative.lookahead import LookaheadProposer
from specdec_edge.speculative.lookup import PromptLookupProposer
from specdec_edge.speculative.medusa import MEDUSA_TREE, MedusaProposer
from specdec_edge.speculative.predictors import (
    Calibrated,
    history_predictor,
    lookahead_predictor,
    medusa_predictor,
    pld_predictor,
)
from specdec_edge.speculative.proposal import Proposer
from specdec_edge.speculative.proposers import DraftModelProposer, EmptyProposer, FirstOfProposer
from specdec_edge.speculative.table import NgramTable, TableProposer

if TYPE_CHECKING:  # only for type hints: the head sessions live in runtime/
    from specdec_edge.runtime.head_graphs import HeadGraph

HEAD_METHODS = ("eagle", "eagle3", "medusa")  # the kinds of trained heads a bundle can carry (``needs`` entries)
# What a missing requirement takes, for errors and the docs table.
HOW_TO_GET = {
    "draft": "`export --draft`",
    "eagle": "EAGLE heads: `train-draft --method eagle`, `export --heads`",
    "medusa": "Medusa heads: `train-draft --method medusa`, `export --heads`",
    "eagle3": "EAGLE-3 heads: `train-draft --method eagle3`, `export --heads`",
}


@dataclass(frozen=True)
class Option:
    """One method option (``-o name=value``, or ``Pipeline.load(name=value)``), checked before use."""

    name: str
    kind: str  # "int" | "float" | "bool" | "tree" (a list of rank paths, e.g. [[0], [1], [0, 0]])
    default: Any  # None: the bundle's recorded tree setting, else the proposer's own default
    help: str
    low: float | None = None  # the smallest valid value (ints and floats)
    strict: bool = False  # the value must exceed ``low``
    high: float | None = None  # the largest valid value (bounds the proposer's work and memory)
    for_rule: bool = False  # an option of the acceptance rule, not of the proposer

    def describe(self) -> str:
        """``"an integer >= 1"``-style text for errors and help."""
        what = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "tree": f"a list of up to {MAX_TREE_PATHS} rank paths (ranks 0 to {MAX_TREE_PATHS - 1}) such as "
            "[[0], [1], [0, 0]]",
        }[self.kind]
        if self.low is not None and self.high is not None:
            what += f" from {self.low:g} to {self.high:g}" if not self.strict else f" in ({self.low:g}, {self.high:g}]"
        elif self.low is not None:
            what += f" {'>' if self.strict else '>='} {self.low:g}"
        return what

    def parse(self, method: str, value: Any) -> Any:
        """``value`` as this option's type, or a SpecdecError that names the method, option and valid values."""
        parsed = _PARSERS[self.kind](value)
        bad = (
            parsed is None
            or (self.low is not None and (parsed <= self.low if self.strict else parsed < self.low))
            or (self.high is not None and parsed > self.high)
        )
        if bad:
            default = "the bundle's setting" if self.default is None else json.dumps(self.default)
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise SpecdecError(
                f"bad option for method {method!r}: {self.name}={shown} is invalid; use "
                f"{self.describe()} (default: {default})."
            )
        return parsed


def _int(value):
    if isinstance(value, str):
        value = value.strip()  # more than 30 digits is out of every range (and int() refuses 4300+ digits)
        return int(value) if value.lstrip("+-").isdigit() and len(value) <= 30 else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value):
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _bool(value):
    if isinstance(value, bool):
        return value
    return {"true": True, "false": False}.get(str(value).strip().lower())


def _tree(value):
    if isinstance(value, str):
        if len(value) > 16 * MAX_TREE_PATHS**2:  # longer than the largest tree written out
            return None
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_TREE_PATHS:
        return None
    paths = [
        p
        for p in value
        if isinstance(p, (list, tuple))
        and 0 < len(p) <= MAX_TREE_PATHS
        and all(_int(r) is not None and 0 <= _int(r) < MAX_TREE_PATHS for r in p)
    ]
    return [[int(r) for r in p] for p in paths] if len(paths) == len(value) else None


MAX_TREE_PATHS = 64  # a tree option: at most this many paths, of this depth, of ranks below it (a verify pass)
_PARSERS = {"int": _int, "float": _float, "bool": _bool, "tree": _tree}


@dataclass(frozen=True)
class Resources:
    """What a bundle provides for building proposers."""

    target: Engine  # the engine the decode loop drives (a ``FeatureTap`` when the method reads features)
    draft: Engine | None = None
    heads: Mapping[str, HeadGraph] = field(default_factory=dict)
    trees: bool = True  # proposals may branch (False: the target verifies only chains bit for bit)
    # The device's step costs (``speculative/costs.py``), given the proposers whose own cost to measure.
    costs: Callable[[Mapping[str, Proposer]], CostModel] | None = None
    # The calls may pass a history store (``prefill``'s ``history``; ``speculative/history.py``): ``auto`` then has
    # a candidate drafting from it.
    history: bool = False
    table: NgramTable | None = None  # the bundle's n-gram table of the model's own text (``table.py``)


@dataclass(frozen=True)
class Method:
    """One speculative method: its proposer, acceptance rule, requirements and options."""

    name: str
    summary: str  # one line for CLI help, `info` and the README table
    build: Callable[[Resources, dict], Proposer]  # (resources, checked proposer options) -> proposer
    options: tuple[Option, ...] = ()
    needs: tuple[str, ...] = ()  # "draft" and/or head methods ("eagle", "medusa")
    rule: type[AcceptanceRule] = ExactAcceptance  # built with the options marked ``for_rule``
    speculative: bool = True  # False for plain decoding (no proposal; k is ignored)
    uses_heads: bool = False  # reads the target's features whenever the bundle has trained heads (auto)
    default_k: int = 4  # the deepest proposal, unless k is given

    @property
    def lossy(self) -> bool:
        """Sampling output no longer follows the target's distribution (greedy stays exact)."""
        return self.rule.lossy

    @property
    def reads_features(self) -> bool:
        """The proposer reads the target's hidden states (trained heads)."""
        return any(n in HEAD_METHODS for n in self.needs)

    def taps_features(self, heads: Iterable[str]) -> bool:
        """The decode loop must keep the target's features, for a bundle with these heads."""
        return self.reads_features or (self.uses_heads and any(h in HEAD_METHODS for h in heads))

    def missing(self, has_draft: bool, heads: Iterable[str], where: str = "this bundle") -> str | None:
        """Why a bundle with a draft model (or not) and these heads cannot run this method, or None."""
        heads = set(heads)
        for need in self.needs:
            if need == "draft" and not has_draft:
                return f"{where} has no draft model; use method 'pld' or 'plain', or export with --draft."
            if need in HEAD_METHODS and need not in heads:
                return (
                    f"{where} has no {need} heads; train them with `specdec-edge train-draft --method {need}` "
                    "and export with --heads, or use method 'pld'."
                )
        return None

    def check_options(self, options: Mapping[str, Any]) -> tuple[dict, dict]:
        """``(proposer options, rule options)``: every given option checked, defaults filled in where set."""
        known = {o.name: o for o in self.options}
        unknown = [name for name in options if name not in known]
        if unknown:
            valid = ", ".join(known) or "none"
            raise SpecdecError(
                f"bad option for method {self.name!r}: it has no option {unknown[0]!r} (its options: {valid})."
            )
        proposer, rule = {}, {}
        for o in self.options:
            value = o.parse(self.name, options[o.name]) if o.name in options else o.default
            if value is not None:
                (rule if o.for_rule else proposer)[o.name] = value
        return proposer, rule

    def acceptance(self, rule_options: Mapping[str, Any]) -> AcceptanceRule:
        return self.rule(**rule_options)


# ---- the proposers' options (shared by the methods that combine them)


def min_ngram(default: int) -> Option:
    """The ``min_ngram`` option of prompt lookup (1 alone; 2 where another proposer takes the rest)."""
    return Option("min_ngram", "int", default, "shortest n-gram matched", low=1, high=64)


PLD_OPTIONS = (Option("max_ngram", "int", 3, "longest n-gram matched", low=1, high=64), min_ngram(1))
MIN_MATCH = Option("min_match", "int", 4, "shortest match in the history store proposed", low=1, high=MAX_MATCH)
LOOKAHEAD_OPTIONS = (
    Option("window", "int", 4, "Jacobi window columns", low=1, high=64),
    Option("ngram", "int", 3, "n-gram size of the pool", low=2, high=16),
    Option("guesses", "int", 4, "pool n-grams verified per step", low=0, high=64),
    Option("prompt_ngrams", "bool", True, "seed the pool with the prompt's n-grams"),
    Option("seed", "int", 0, "seed of the initial window guesses", low=0, high=2**63 - 1),
)
EAGLE_OPTIONS = (
    Option("topk", "int", None, "children per expanded node (bundle default, else 3)", low=1, high=64),
    Option("nodes", "int", None, "tree nodes verified (bundle default, else 5)", low=1, high=64),
    Option("depth", "int", None, "tree depth (bundle default, else k)", low=1, high=64),
)
MEDUSA_OPTIONS = (Option("tree", "tree", None, "rank paths of the static tree (bundle default)"),)
TYPICAL_OPTIONS = (
    Option(
        "epsilon", "float", 0.09, "typical acceptance: probability floor", low=0, strict=True, high=1, for_rule=True
    ),
    Option("delta", "float", 0.3, "typical acceptance: entropy factor", low=0, strict=True, for_rule=True),
)


def _eagle(res: Resources, options: dict) -> Proposer:
    head = res.heads["eagle"]
    return EagleProposer(head, res.target, **{**head.defaults, **options})


def _eagle3(res: Resources, options: dict) -> Proposer:
    head = res.heads["eagle3"]
    return Eagle3Proposer(head, res.target, **{**head.defaults, **options})


def _medusa(res: Resources, options: dict) -> Proposer:
    head = res.heads["medusa"]
    return MedusaProposer(head, res.target, **{**head.defaults, **options})


def _pld_then(head_builder):
    """A builder of prompt lookup where an n-gram repeats, else the head ``head_builder`` makes (pld-eagle*)."""

    def build(res: Resources, options: dict) -> Proposer:
        pld = {k: v for k, v in options.items() if k in ("max_ngram", "min_ngram")}
        head = {k: v for k, v in options.items() if k not in pld}
        return FirstOfProposer(PromptLookupProposer(**pld), head_builder(res, head))

    return build


_pld_eagle, _pld_eagle3 = _pld_then(_eagle), _pld_then(_eagle3)


def _history(res: Resources, options: dict) -> Proposer:
    return HistoryLookupProposer(**options)


def auto_candidates(res: Resources, options: dict) -> list[Candidate]:
    """The proposers ``auto`` chooses among on a bundle: prompt lookup always; drafts from history where the
    pipeline keeps it; the bundle's n-gram table; the draft model and the trained heads the bundle has;
    lookahead where trees are verified exactly. On chain-only bundles the heads propose chains (EAGLE with
    topk 1, Medusa's top-1 path)."""
    pld = {k: v for k, v in options.items() if k in ("max_ngram", "min_ngram")}
    candidates = [Candidate("pld", PromptLookupProposer(**pld), pld_predictor())]
    if res.history:  # left out of seeded sampling's fixed rule: its drafts depend on earlier calls
        history = HistoryProposer(options.get("min_match", MIN_MATCH.default))
        candidates.append(Candidate("history", history, history_predictor(), fixed=False))
    if res.table is not None:  # a guess almost always: pays where a pass has a row to spare (a padded step)
        candidates.append(Candidate("table", TableProposer(res.table), Calibrated()))
    if res.draft is not None:
        candidates.append(Candidate("draft", DraftModelProposer(res.draft), Calibrated()))
    for name, proposer in (("eagle", EagleProposer), ("eagle3", Eagle3Proposer)):
        if name in res.heads:
            head = res.heads[name]
            shape = {"topk": head.defaults.get("topk", 3), "nodes": 32} if res.trees else {"topk": 1, "nodes": 32}
            eagle = proposer(head, res.target, **{**head.defaults, **shape})
            fixed = head.defaults.get("nodes", 5) if res.trees else None  # seeded sampling: the bundle's tree size
            candidates.append(Candidate(name, eagle, Calibrated(), fixed_width=fixed))
    if "medusa" in res.heads:
        head = res.heads["medusa"]
        tree = head.defaults.get("tree") or MEDUSA_TREE
        if not res.trees:
            tree = [p for p in tree if not any(p)]  # the top-1 path: a chain
        candidates.append(Candidate("medusa", MedusaProposer(head, res.target, tree=tree), medusa_predictor()))
    if res.trees:
        candidates.append(Candidate("lookahead", LookaheadProposer(), lookahead_predictor(), fixed=False))
    return candidates


def _auto(res: Resources, options: dict) -> Proposer:
    candidates = auto_candidates(res, options)
    if res.costs is None:
        raise SpecdecError("method 'auto' needs the device's step costs; load it through Pipeline.load.")
    costs = res.costs({c.name: c.proposer for c in candidates})
    for c in candidates:
        c.cost_s = costs.proposers.get(c.name, 0.0)
    return AutoProposer(candidates, costs, trees=res.trees)


_METHODS = (
    Method(
        "plain", "nothing: the same loop, one token per target pass", lambda res, o: EmptyProposer(), speculative=False
    ),
    Method(
        "auto",
        "each step, the proposer, width and tree with the most expected tokens per second on this device "
        "(or a plain step)",
        _auto,
        (*PLD_OPTIONS, MIN_MATCH),
        uses_heads=True,
        # 10, not 6: where the answer copies its input (an edit of a given text) prompt lookup's chains run long;
        # 2.42x against 2.30x plain there, the same elsewhere (docs/lab/corpus-and-table.md, 2026-12-06)
        default_k=10,
    ),
    Method(
        "draft",
        "a smaller model with the same tokenizer, k tokens per step",
        lambda res, o: DraftModelProposer(res.draft),
        needs=("draft",),
    ),
    Method(
        "pld",
        "prompt lookup: continuation of the latest earlier occurrence of the last n-gram",
        lambda res, o: PromptLookupProposer(**o),
        PLD_OPTIONS,
    ),
    Method(
        "history",
        "prompt lookup over this call and over earlier calls' prompts and outputs (the pipeline's history "
        "store): the longer match proposes",
        _history,
        (*PLD_OPTIONS, MIN_MATCH),
        default_k=8,
    ),
    Method(
        "lookahead",
        "Jacobi guesses + n-gram pool, verified as one token tree",
        lambda res, o: LookaheadProposer(**o),
        LOOKAHEAD_OPTIONS,
    ),
    Method(
        "eagle",
        "an EAGLE head (one decoder layer over the target's features) grows a dynamic token tree",
        _eagle,
        EAGLE_OPTIONS,
        needs=("eagle",),
    ),
    Method("medusa", "Medusa heads propose a static token tree", _medusa, MEDUSA_OPTIONS, needs=("medusa",)),
    Method(
        "medusa-typical",
        "Medusa with typical acceptance: LOSSY when sampling (greedy stays exact)",
        _medusa,
        MEDUSA_OPTIONS + TYPICAL_OPTIONS,
        needs=("medusa",),
        rule=TypicalAcceptance,
    ),
    Method(
        "pld-eagle",
        "prompt lookup where a 2+ token n-gram repeats, else the EAGLE head",
        _pld_eagle,
        (PLD_OPTIONS[0], min_ngram(2), *EAGLE_OPTIONS),
        needs=("eagle",),
    ),
    Method(
        "eagle3",
        "an EAGLE-3 head (one decoder layer over fused low/mid/high target features) grows a dynamic token tree",
        _eagle3,
        EAGLE_OPTIONS,
        needs=("eagle3",),
    ),
    Method(
        "pld-eagle3",
        "prompt lookup where a 2+ token n-gram repeats, else the EAGLE-3 head",
        _pld_eagle3,
        (PLD_OPTIONS[0], min_ngram(2), *EAGLE_OPTIONS),
        needs=("eagle3",),
    ),
)
METHODS: dict[str, Method] = {m.name: m for m in _METHODS}


def get_method(name: str) -> Method:
    """The registry record of ``name``, or an error listing the methods."""
    if name not in METHODS:
        raise SpecdecError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}.")
    return METHODS[name]


def available_methods(has_draft: bool, heads: Iterable[str]) -> list[str]:
    """The methods a bundle with a draft model (or not) and these heads can run."""
    heads = list(heads)
    return [m.name for m in METHODS.values() if m.missing(has_draft, heads) is None]


def default_method(recorded: str | None = None) -> str:
    """The method a bundle runs when none is asked for: the one its manifest records (``recorded``, from
    `export --default-method`), else ``auto``, which runs whatever the bundle has (heads and draft model
    included; prompt lookup at least)."""
    return recorded or "auto"


def methods_table() -> str:
    """The README's methods table (Markdown), generated from the registry."""
    rows = ["| method | what proposes | needs | options (default) |", "|---|---|---|---|"]
    for m in METHODS.values():
        needs = "; ".join(HOW_TO_GET[n] for n in m.needs) or "–"
        options = (
            ", ".join(f"`{o.name}` ({'bundle' if o.default is None else json.dumps(o.default)})" for o in m.options)
            or "–"
        )
        rows.append(f"| `{m.name}` | {m.summary} | {needs} | {options} |")
    return "\n".join(rows) + "\n"


def options_help() -> str:
    """One line per method with options, for `-o` help texts."""
    return "; ".join(f"{m.name}: {', '.join(o.name for o in m.options)}" for m in METHODS.values() if m.options)
