"""`liveshard timeline`: a job's story as one PNG (`story.draw`).

Two sources, exactly one given. The JSON lines of `liveshard-local --json` (`--events FILE`),
read here: the loss and the tokens per second over the steps, each layout the job trained in as
a band (named by its degrees and its member count), and each reconfiguration as a line marked
with what it was (a switch, a recovery from lost members), its pause and its bytes; aborted ones
dashed, in red. Lines of other events are read and ignored; a line that is not a JSON object, or
a step event without its fields, is refused naming the file and the line. Or a job on a cluster
(`--job NAME`), read with kubectl by `timeline_job`: its status's progress and history.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InvalidInput
from . import timeline_job
from .story import Reconfiguration, Step, Story, bands, draw, short_layout

_STEP_FIELDS = ("step", "loss", "layout", "step_seconds", "tokens")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("timeline", help="draw a job's story (loss, tokens/s, layouts, "
                       "reconfigurations) as a PNG")  # fmt: skip
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--events", metavar="FILE",
                        help="the JSON lines of liveshard-local --json")  # fmt: skip
    source.add_argument("--job", metavar="NAME",
                        help="an ElasticTrainingJob on a cluster, read with kubectl")  # fmt: skip
    p.add_argument("-n", "--namespace", help="the job's namespace (default: the context's)")
    p.add_argument("--kubeconfig", help="kubectl's --kubeconfig (default: KUBECONFIG, ~/.kube)")
    p.add_argument("--context", help="kubectl's --context")
    p.add_argument("--kubectl", default="kubectl", help="the kubectl binary (default: kubectl)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: Any) -> dict[str, Any]:
    if args.job is not None:
        story = timeline_job.read_job(
            timeline_job.Source(args.job, args.namespace, args.kubeconfig, args.context,
                                args.kubectl)
        )  # fmt: skip
    else:
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
    moved = int(event.get("network_bytes") or 0)
    return Reconfiguration(int(event["step"]), label, pause, committed, moved)
