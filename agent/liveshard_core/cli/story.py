"""A job's story as `liveshard timeline` draws it, whatever it was read from: the steps (loss,
tokens per second, layout, and when the source knows it, the time), the reconfigurations (where,
what, the pause, the bytes moved, committed or aborted), and the drawing of it as one PNG.

The sources fill it in: `timeline` from `liveshard-local --json` lines, `timeline_job` from a
job's status on a cluster. This module reads nothing but the story it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..layout.layout import parse_degrees

_BANDS = ("#e8eef7", "#f4ede2")
_COMMITTED = {"color": "#555555", "ls": "-"}
_ABORTED = {"color": "red", "ls": "--"}


@dataclass(frozen=True)
class Step:
    step: int  # the step trained
    loss: float
    tokens_per_second: float | None  # None: the source could not measure it (a first sample)
    layout: str
    seconds: float | None = None  # since the story began, when the source knows it


@dataclass(frozen=True)
class Reconfiguration:
    step: int  # the first step trained after it
    label: str
    pause_seconds: float
    committed: bool
    bytes_moved: int = 0


@dataclass(frozen=True)
class Story:
    steps: list[Step]
    reconfigurations: list[Reconfiguration]
    title: str = ""  # what the story is of, when the source names it (a job)


def short_layout(layout: str) -> str:
    """`dp=2,tp=2,pp=1,ep=1,zero=1,pp_layers=2:2` as `dp=2 tp=2 zero=1 (4 members)`."""
    d = parse_degrees(layout)
    shown = [f"{k}={v}" for k, v in (("dp", d.dp), ("tp", d.tp), ("pp", d.pp), ("ep", d.ep))
             if v != 1]  # fmt: skip
    members = d.world_size
    return f"{' '.join([*shown, f'zero={d.zero}'])} ({members} member{'s' if members != 1 else ''})"


def bands(steps: list[Step]) -> list[tuple[int, int, str]]:
    """Runs of consecutive steps in one layout: (first step, last step, layout)."""
    out: list[tuple[int, int, str]] = []
    for s in steps:
        if out and out[-1][2] == s.layout:
            out[-1] = (out[-1][0], s.step, s.layout)
        else:
            out.append((s.step, s.step, s.layout))
    return out


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def draw(story: Story, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, rate_ax) = plt.subplots(
        2, 1, sharex=True, figsize=(12, 7), constrained_layout=True
    )
    steps = [s.step for s in story.steps]
    loss_ax.plot(steps, [s.loss for s in story.steps], color="#1f4e9c", lw=1.4)
    loss_ax.set_ylabel("loss")
    rates = [math.nan if s.tokens_per_second is None else s.tokens_per_second
             for s in story.steps]  # fmt: skip
    rate_ax.plot(steps, rates, color="#2e7d32", lw=1.0)
    rate_ax.set_ylabel("tokens / s")
    rate_ax.set_xlabel("step")
    runs = bands(story.steps)
    for index, (first, last, layout) in enumerate(runs):
        # A band reaches the next one: a sparse series (a job's) leaves steps unsampled.
        end = runs[index + 1][0] - 0.5 if index + 1 < len(runs) else last + 0.5
        for ax in (loss_ax, rate_ax):
            ax.axvspan(first - 0.5, end, color=_BANDS[index % 2], zorder=0)
        # Two rows of names, so that the names of narrow bands side by side do not overlap.
        loss_ax.text((first - 0.5 + end) / 2, 1.01 + 0.07 * (index % 2), short_layout(layout),
                     ha="center", va="bottom", fontsize=8,
                     transform=loss_ax.get_xaxis_transform())  # fmt: skip
    for change in story.reconfigurations:
        style = _COMMITTED if change.committed else _ABORTED
        for ax in (loss_ax, rate_ax):
            ax.axvline(change.step - 0.5, lw=1.2, **style)
        moved = f", {_size(change.bytes_moved)} moved" if change.bytes_moved else ""
        what, arrow, target = change.label.rpartition(" -> ")  # what it was, what it went to
        label = f"{what}\n-> {target}" if arrow else change.label
        rate_ax.annotate(f"{label}\npause {change.pause_seconds:.3f} s{moved}",
                         (change.step - 0.5, 0.97), xycoords=rate_ax.get_xaxis_transform(),
                         rotation=90, ha="right", va="top", fontsize=7, color=style["color"],
                         bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1})  # fmt: skip
    timed = [(s.step, s.seconds) for s in story.steps if s.seconds is not None]
    if len(timed) == len(story.steps) and len(timed) > 1:
        span = timed[-1][1] - timed[0][1]
        unit, scale = ("minutes", 60.0) if span >= 120 else ("seconds", 1.0)
        at, times = np.array([t[0] for t in timed]), np.array([t[1] for t in timed]) / scale
        clock = rate_ax.secondary_xaxis(
            -0.22, functions=(lambda x: np.interp(x, at, times),
                              lambda t: np.interp(t, times, at)),
        )  # fmt: skip
        # Ticks only where there are samples: past them the mapping stands still.
        ticks = MaxNLocator(8).tick_values(0.0, float(times[-1]))
        clock.set_xticks([t for t in ticks if 0 <= t <= times[-1]])
        clock.set_xlabel(f"{unit} since the first sample")
    fig.suptitle(
        f"{story.title + ': ' if story.title else ''}{story.steps[-1].step + 1} steps, "
        f"{len(story.reconfigurations)} reconfigurations, "
        f"final loss {story.steps[-1].loss:.4f}",
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
