"""Results: samples per side of a comparison, summaries, target checks, markdown and JSON."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Below this many samples a p99 means nothing; the spread (min..max) is shown instead.
P99_MIN_SAMPLES = 50


@dataclass
class Summary:
    """Median and tail of one side's samples."""

    n: int
    median: float
    p99: float | None
    low: float
    high: float

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        ordered = sorted(samples)
        p99 = None
        if len(ordered) >= P99_MIN_SAMPLES:
            # Nearest rank: the smallest sample with at least 99% of them at or below it.
            p99 = ordered[max(0, -(-99 * len(ordered) // 100) - 1)]
        return cls(len(ordered), statistics.median(ordered), p99, ordered[0], ordered[-1])


@dataclass
class Side:
    """One contender of a comparison: the agent, the floor, a peer, or an extra data point."""

    name: str
    role: str  # "agent", "floor", "peer" or "info"
    samples: list[float] = field(default_factory=list)
    # CPU seconds per GiB moved (server side + client side), one per sample.
    cpu_per_gib: list[float] = field(default_factory=list)
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> Summary | None:
        return Summary.of(self.samples) if self.samples and not self.skipped else None


@dataclass
class Target:
    """A goal of the issue, checked against the summaries of a comparison."""

    text: str
    # Returns (what was measured, met?) or None when a side it needs was skipped.
    check: Callable[[Comparison], tuple[str, bool] | None]


@dataclass
class Comparison:
    """Sides measured interleaved in the same run, with the targets that apply to them."""

    key: str
    title: str
    unit: str
    higher_is_better: bool
    sides: list[Side] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    def side(self, name: str) -> Side:
        for side in self.sides:
            if side.name == name:
                return side
        raise KeyError(name)

    def median(self, name: str) -> float | None:
        summary = self.side(name).summary
        return summary.median if summary else None

    def by_role(self, role: str) -> list[Side]:
        return [side for side in self.sides if side.role == role]

    def ratio(self, name: str, other: str) -> float | None:
        """median(name) / median(other), whichever direction is better."""
        a, b = self.median(name), self.median(other)
        if a is None or b is None or b == 0:
            return None
        return a / b

    def results(self) -> list[tuple[str, str, bool | None]]:
        out: list[tuple[str, str, bool | None]] = []
        for target in self.targets:
            checked = target.check(self)
            if checked is None:
                out.append((target.text, "not measured (a side was skipped)", None))
            else:
                out.append((target.text, checked[0], checked[1]))
        return out


def fmt(value: float | None, unit: str = "") -> str:
    """A number with 3 significant digits (or a dash)."""
    if value is None:
        return "-"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def side_row(comparison: Comparison, side: Side) -> list[str]:
    unit = comparison.unit
    summary = side.summary
    if summary is None:
        return [side.name, f"skipped: {side.skipped or 'no samples'}", "", "", "", "", ""]
    if summary.p99 is not None:
        tail = f"p99 {fmt(summary.p99)}"
    else:
        tail = f"{fmt(summary.low)}..{fmt(summary.high)}"
    floors = comparison.by_role("floor")
    vs_floor = (
        ratio_text(comparison.ratio(side.name, floors[0].name))
        if floors and side.role != "floor"
        else ""
    )
    vs_peers = ""
    if side.role == "agent":
        parts = []
        for peer in comparison.by_role("peer"):
            r = comparison.ratio(side.name, peer.name)
            if r is not None:
                parts.append(f"{peer.name} {ratio_text(r)}")
        vs_peers = ", ".join(parts)
    cpu = fmt(Summary.of(side.cpu_per_gib).median) if side.cpu_per_gib else ""
    return [
        side.name,
        f"{fmt(summary.median, unit)}",
        tail,
        vs_floor,
        vs_peers,
        cpu,
        str(summary.n),
    ]


def markdown(comparisons: list[Comparison], header: dict[str, Any]) -> str:
    """The results as markdown: one table of sides, one of targets."""
    source = header.get("agent_source") or {}
    changed = len(source.get("uncommitted") or [])
    lines = [
        f"Run {header['when']} on {header['machine']}; placement {header['placement']}; "
        f"agent at {source.get('commit')} (+{changed} uncommitted files)."
    ]
    lines += ["", f"Parameters: {header['params_text']}", ""]
    lines.append(
        "| comparison | side | median | p99 or min..max | vs floor | agent vs peers "
        "| CPU s/GiB | n |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for comparison in comparisons:
        first = True
        for side in comparison.sides:
            title = f"{comparison.title} ({'higher' if comparison.higher_is_better else 'lower'}"
            title += " is better)"
            cells = [title if first else "", *side_row(comparison, side)]
            lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
            first = False
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    for comparison in comparisons:
        for text, measured, met in comparison.results():
            mark = {True: "yes", False: "**no**", None: "-"}[met]
            lines.append(f"| {cell(text)} | {cell(measured)} | {mark} |")
    notes = [f"- {comparison.title}: {n}" for comparison in comparisons for n in comparison.notes]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def to_json(comparisons: list[Comparison], header: dict[str, Any]) -> dict[str, Any]:
    """Everything measured, raw samples included, for later analysis."""
    out: dict[str, Any] = {**header, "comparisons": []}
    for comparison in comparisons:
        sides = []
        for side in comparison.sides:
            summary = side.summary
            floors = comparison.by_role("floor")
            entry: dict[str, Any] = {
                "name": side.name,
                "role": side.role,
                "skipped": side.skipped,
                "summary": None if summary is None else summary.__dict__,
                "ratio_to_floor": (comparison.ratio(side.name, floors[0].name) if floors else None),
                "ratio_to_peers": {
                    peer.name: comparison.ratio(side.name, peer.name)
                    for peer in comparison.by_role("peer")
                },
                "cpu_s_per_gib": (
                    Summary.of(side.cpu_per_gib).__dict__ if side.cpu_per_gib else None
                ),
                "samples": side.samples,
                "extra": side.extra,
            }
            sides.append(entry)
        out["comparisons"].append(
            {
                "key": comparison.key,
                "title": comparison.title,
                "unit": comparison.unit,
                "higher_is_better": comparison.higher_is_better,
                "params": comparison.params,
                "sides": sides,
                "targets": [
                    {"target": text, "measured": measured, "met": met}
                    for text, measured, met in comparison.results()
                ],
                "notes": comparison.notes,
            }
        )
    return out
