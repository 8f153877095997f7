"""The level-based reconcile loop of one job: each pass reads the job, parses its spec, observes
its pods and agents, decides the next idempotent step (`decide`, pure) and carries it out (`act`),
writing the job's status once.

Everything the next pass needs is in the job's status (`world.Record`), so a restarted operator
resumes where the last one stopped; handlers only wake this loop.
"""

from __future__ import annotations

import time

from liveshard_core.errors import InvalidInput

from . import publish
from .act import Events, Executor
from .agents import AgentClient
from .conditions import Conditions
from .decide import decide
from .kube import Kube
from .observation import Job
from .observe import observe
from .spec import JobSpec
from .world import Record


class JobController:
    """Reconciles one ElasticTrainingJob; `reconcile` is one pass."""

    def __init__(self, kube: Kube, namespace: str, name: str, events: Events) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.clients: dict[str, AgentClient] = {}  # one per pod, kept across passes
        self.executor = Executor(kube, namespace, name, events, self.clients)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()

    def reconcile(self) -> bool:
        """One pass; False once the job is gone."""
        body = self.kube.get_job(self.namespace, self.name)
        if body is None:
            return False
        status = body.get("status") or {}
        if Conditions(status.get("conditions") or [], 0).terminal():
            return True  # Succeeded and Failed are for good
        try:
            spec = JobSpec.parse(body["spec"])
            model = spec.model_spec()
        except (InvalidInput, KeyError, TypeError, ValueError) as err:
            self.executor.write(publish.invalid_spec(body, str(err), time.time()))
            return True
        self.executor.ensure_objects(body)
        token = self.executor.token()
        seen = observe(self.kube, self.namespace, self.name, token, spec.port, self.clients)
        record = Record.from_dict(status.get("reconfiguration") or {})
        # The time is read once, after observing, so that every rule of the pass sees the same.
        self.executor.run(decide(seen, record, Job(body, spec, model), time.time()))
        return True
