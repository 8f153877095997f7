"""`liveshard timeline --job NAME`: a job's story from what the API server keeps of it.

The operator writes two series into the job's status: `progress` (a bounded series of samples:
time, step, loss, tokens per second, members, layout) and `history` (the last 20
reconfigurations: reason, layouts, step, pause, bytes, result, time). `story_of` turns them into
the story `story.draw` draws. Both name a step as `status.step` does, the next one to train:
a sample is drawn at the step before (the one its loss is of), and so is a reconfiguration, the
operator having seen it end at the same pass as the first sample in its new layout: its line
falls where that layout's band begins.

The job is read with the `kubectl` binary (an argument list, no shell), so the pure core imports
no Kubernetes client: kubectl's own configuration applies (`KUBECONFIG` from the environment,
`--kubeconfig`, `--context`). A missing kubectl, a job that does not exist and a job with no
progress yet are refused naming the problem.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import InvalidInput
from .story import Reconfiguration, Step, Story, short_layout

RESOURCE = "elastictrainingjobs.liveshard.io"
_READ_SECONDS = 60.0
_LABEL_CHARACTERS = 40
_DIRECTORY = re.compile(r"/\S*/")  # the folders of a path: `/a/b/suspend-1` -> `.../suspend-1`


@dataclass(frozen=True)
class Source:
    """Which job, and how kubectl reaches its cluster (None: kubectl's default)."""

    job: str
    namespace: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    kubectl: str = "kubectl"

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.job}" if self.namespace else self.job

    def command(self, binary: str) -> list[str]:
        """The kubectl command that prints the job as JSON."""
        out = [binary, "get", RESOURCE, self.job, "-o", "json"]
        for flag, value in (("--namespace", self.namespace), ("--kubeconfig", self.kubeconfig),
                            ("--context", self.context)):  # fmt: skip
            if value:
                out += [flag, value]
        return out


def read_job(source: Source) -> Story:
    """The story of `source`'s job as the API server has it now."""
    binary = shutil.which(source.kubectl)
    if binary is None:
        raise InvalidInput(
            f"--kubectl {source.kubectl!r}: no such program; `liveshard timeline --job` reads "
            "the job with kubectl: install it, or give its path with --kubectl"
        )
    try:
        done = subprocess.run(source.command(binary), capture_output=True, text=True,
                              timeout=_READ_SECONDS, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise InvalidInput(
            f"job {source.name}: kubectl did not answer in {_READ_SECONDS:.0f} s"
        ) from None
    error = done.stderr.strip()
    if done.returncode != 0 and "NotFound" in error:
        raise InvalidInput(f"job {source.name} does not exist: {error}")
    if done.returncode != 0:
        raise InvalidInput(f"job {source.name}: kubectl exited with {done.returncode}: {error}")
    try:
        body = json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise InvalidInput(f"job {source.name}: kubectl printed no JSON object: {err}") from None
    return story_of(body)


def story_of(body: dict[str, Any]) -> Story:
    """The story of an ElasticTrainingJob as the API server returned it."""
    meta = body.get("metadata") or {}
    name = "/".join(filter(None, (meta.get("namespace"), meta.get("name"))))
    status = body.get("status") or {}
    samples = status.get("progress") or []
    if not samples:
        phase = status.get("phase", "no status yet")
        raise InvalidInput(
            f"job {name} has no progress yet (phase: {phase}): status.progress fills once its "
            "members train, from an operator that writes it"
        )
    where = f"job {name}: status.progress"
    begun = _seconds(samples[0], where)
    steps = [_step(sample, begun, f"{where}[{index}]") for index, sample in enumerate(samples)]
    changes = [_reconfiguration(entry, f"job {name}: status.history[{index}]")
               for index, entry in enumerate(status.get("history") or [])]  # fmt: skip
    return Story(steps, changes, title=f"job {name}")


def _step(sample: dict[str, Any], begun: float, where: str) -> Step:
    try:
        rate = sample.get("tokensPerSecond")
        return Step(
            step=int(sample["step"]) - 1, loss=float(sample["loss"]),
            tokens_per_second=None if rate is None else float(rate),
            layout=str(sample["layout"]), seconds=_seconds(sample, where) - begun,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidInput(f"{where}: a sample without a valid {err}: {sample}") from None


def _reconfiguration(entry: dict[str, Any], where: str) -> Reconfiguration:
    missing = [k for k in ("step", "result", "to") if k not in entry]
    if missing:
        raise InvalidInput(f"{where}: an entry without {missing}: {entry}")
    committed = entry["result"] == "committed"
    reason = _brief(str(entry.get("reason", "")))
    label = f"{reason} -> {short_layout(str(entry['to']))}" if committed else f"{reason} aborted"
    return Reconfiguration(
        step=int(entry["step"]) - 1, label=label,
        pause_seconds=float(entry.get("pauseSeconds") or 0), committed=committed,
        bytes_moved=int(entry.get("bytesMoved") or 0),
    )  # fmt: skip


def _brief(reason: str) -> str:
    """A reason short enough to stand beside its line: a first world's is `start` (the layout
    policy's why is for `kubectl describe`), a resume's the checkpoint it resumes from, paths
    by their last part."""
    reason = _DIRECTORY.sub(".../", reason.split("; start with")[0])
    if reason.startswith("start with"):
        reason = "start"
    if len(reason) > _LABEL_CHARACTERS:
        reason = reason[: _LABEL_CHARACTERS - 3] + "..."
    return reason


def _seconds(sample: dict[str, Any], where: str) -> float:
    try:
        return datetime.fromisoformat(str(sample["time"])).timestamp()
    except (KeyError, ValueError):
        raise InvalidInput(f"{where}: a sample without a valid time: {sample}") from None
