"""What a step costs on this device, as ``auto`` reads it: the target's verify pass over width and context, and
each proposer's own work (``CostModel``). Pure: measuring and caching them is ``specdec_edge/api/step_costs.py``'s.

``auto`` (``speculative/auto.py``) chooses each step's proposal by expected tokens per second, so it
needs the price of a pass of every width it might verify. That price depends on the device, the
provider and the threads far more than on the model's size: on a 2-core CPU a 32-row pass costs
several 1-row passes, on a GPU about one. So it is measured, not assumed.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import asdict, dataclass, field


def interp(x: float, xs: list, ys: list) -> float:
    """``np.interp`` at one point (linear between the measured points, clamped at the ends), in plain Python:
    numpy's per-call cost is most of it for a handful of points."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    j = bisect_right(xs, x) - 1
    return float((ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (x - xs[j]) + ys[j])


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
        """Seconds of one target pass of ``width`` rows after ``context`` tokens (interpolated; contexts clamped to
        the measured ones, widths past the widest extrapolated).

        ``auto`` asks this for a handful of widths a dozen times a step at one context: the answers at the
        last context asked are kept (``_at``), as interpolating costs more than the rest of a choice."""
        at = getattr(self, "_at", None)
        if at is None or at[0] != context:
            at = self._at = (context, {})
        seconds = at[1].get(width)
        if seconds is None:
            by_width = [self._by_width(width, row) for row in self.seconds]
            seconds = at[1][width] = interp(context, self.contexts, by_width)
        return seconds

    def _by_width(self, width: int, row: list[float]) -> float:
        """One context's seconds at ``width``: interpolated; past the widest measured width, the last measured step's
        cost per row goes on (a device without trees measures only chains' widths, ``api/step_costs.py``)."""
        widths = self.widths
        if width <= widths[-1] or len(widths) < 2:
            return interp(width, widths, row)
        per_row = max(row[-1] - row[-2], 0.0) / (widths[-1] - widths[-2])
        return row[-1] + per_row * (width - widths[-1])

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
