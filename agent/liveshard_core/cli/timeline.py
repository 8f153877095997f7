"""`liveshard timeline`: a job's story as one PNG.

From the JSON lines of `liveshard-local --json` (`--events FILE`): the loss and the tokens per
second over the steps, each layout the job trained in as a band (named by its degrees and its
member count), and each reconfiguration as a line marked with what it was (a switch, a recovery
from lost members) and its pause; aborted ones dashed, in red. Lines of other events are read
and ignored; a line that is not a JSON object, or a step event without its fields, is refused
naming the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidInput
from ..layout.layout import parse_degrees

_STEP_FIELDS = ("step", "loss", "layout", "step_seconds", "tokens")
_BANDS = ("#e8eef7", "#f4ede2")
_COMMITTED = {"color": "#555555", "ls": "-"}
_ABORTED = {"color": "red", "ls": "--"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("timeline", help="draw a job's story (loss, tokens/s, layouts, "
                       "reconfigurations) as a PNG")  # fmt: skip
    p.add_argument("--events", required=True, metavar="FILE",
                   help="the JSON lines of liveshard-local --json")  # fmt: skip
    p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Step:
    step: int
    loss: float
    tokens_per_second: float
    layout: str


@dataclass(frozen=True)
class Reconfiguration:
    step: int
    label: str
    pause_seconds: float
    committed: bool


@dataclass(frozen=True)
class Story:
    steps: list[Step]
    reconfigurations: list[Reconfiguration]


def run(args: Any) -> dict[str, Any]:
    story = read_events(Path(args.events))
    draw(story, Path(args.out))
    return {
        "out": args.out,
        "steps": len(story.steps),
        "layouts": len(bands(story.steps)),
        "reconfigurations": len(story.reconfigurations),
    }


def read_events(path: Path) -> Story:
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise InvalidInput(f"--events {path}: {err.strerror}") from None
    steps, changes = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            event = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{where}: not a JSON line: {err}") from None
        if not isinstance(event, dict):
            raise InvalidInput(f"{where}: expected a JSON object, got {type(event).__name__}")
        if event.get("event") == "step":
            steps.append(_step(event, where))
        elif event.get("event") == "switch":
            changes.append(_reconfiguration(event, where))
    if not steps:
        raise InvalidInput(f"--events {path}: no step events; give liveshard-local --json lines")
    return Story(steps, changes)


def _step(event: dict[str, Any], where: str) -> Step:
    missing = [k for k in _STEP_FIELDS if k not in event]
    if missing:
        raise InvalidInput(f"{where}: a step event without {missing}")
    seconds = float(event["step_seconds"])
    rate = float(event["tokens"]) / seconds if seconds > 0 else 0.0
    return Step(int(event["step"]), float(event["loss"]), rate, str(event["layout"]))


def _reconfiguration(event: dict[str, Any], where: str) -> Reconfiguration:
    if "step" not in event or "to" not in event:
        raise InvalidInput(f"{where}: a switch event without step or to")
    lost = event.get("lost") or []
    kind = f"recovery (lost {', '.join(lost)})" if lost else "switch"
    target = short_layout(str(event["to"]))
    committed = event.get("result") == "committed"
    label = f"{kind} -> {target}" if committed else f"{kind} aborted"
    pause = float(event.get("pause_seconds") or 0.0)
    return Reconfiguration(int(event["step"]), label, pause, committed)


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


def draw(story: Story, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, rate_ax) = plt.subplots(
        2, 1, sharex=True, figsize=(12, 7), constrained_layout=True
    )
    steps = [s.step for s in story.steps]
    loss_ax.plot(steps, [s.loss for s in story.steps], color="#1f4e9c", lw=1.4)
    loss_ax.set_ylabel("loss")
    rate_ax.plot(steps, [s.tokens_per_second for s in story.steps], color="#2e7d32", lw=1.0)
    rate_ax.set_ylabel("tokens / s")
    rate_ax.set_xlabel("step")
    for index, (first, last, layout) in enumerate(bands(story.steps)):
        for ax in (loss_ax, rate_ax):
            ax.axvspan(first - 0.5, last + 0.5, color=_BANDS[index % 2], zorder=0)
        loss_ax.text((first + last) / 2, 1.01, short_layout(layout), ha="center", va="bottom",
                     fontsize=8, transform=loss_ax.get_xaxis_transform())  # fmt: skip
    for change in story.reconfigurations:
        style = (
            {"color": "#555555", "ls": "-"} if change.committed else {"color": "red", "ls": "--"}
        )
        for ax in (loss_ax, rate_ax):
            ax.axvline(change.step - 0.5, lw=1.2, **style)
        rate_ax.annotate(f"{change.label}\npause {change.pause_seconds:.3f} s",
                         (change.step - 0.5, 0.97), xycoords=rate_ax.get_xaxis_transform(),
                         rotation=90, ha="right", va="top", fontsize=7, color=style["color"],
                         bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1})  # fmt: skip
    fig.suptitle(
        f"{len(story.steps)} steps, {len(story.reconfigurations)} reconfigurations, "
        f"final loss {story.steps[-1].loss:.4f}",
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
