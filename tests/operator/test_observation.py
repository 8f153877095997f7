"""What a pass makes of a pod as the API server returns it: leaving, gone, ready, its role."""

from __future__ import annotations

from typing import Any

import pytest
from liveshard_operator.observation import node_leaving, pod_of

from tests.operator.values import standby


def raw(**fields: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "p0", "creationTimestamp": "2024-01-01T00:00:00Z",
                     "labels": {"liveshard.io/role": "member"}},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }  # fmt: skip
    for path, value in fields.items():
        section, key = path.split("__")
        pod[section][key] = value
    return pod


@pytest.mark.parametrize(
    ("fields", "leaving_nodes", "leaving", "gone"),
    [
        ({}, set(), False, False),
        ({"metadata__deletionTimestamp": "2024-01-01T00:01:00Z"}, set(), True, False),
        ({"status__conditions": [{"type": "DisruptionTarget", "status": "True"}]}, set(), True,
         False),
        ({}, {"n1"}, True, False),  # on a cordoned or NoExecute-tainted node
        ({"status__phase": "Failed"}, set(), False, True),
        ({"status__phase": "Succeeded"}, set(), False, True),
    ],
)  # fmt: skip
def test_leaving_and_gone(
    fields: dict[str, Any], leaving_nodes: set[str], leaving: bool, gone: bool
) -> None:
    pod = pod_of(raw(**fields), leaving_nodes, standby())
    assert (pod.leaving, pod.gone, pod.role, pod.ip) == (leaving, gone, "member", "10.0.0.1")
    assert pod.deleting == ("metadata__deletionTimestamp" in fields)
    assert pod.standing_by == (not leaving and not gone)


def test_a_gone_pod_ended_when_its_last_container_did() -> None:
    ended = [
        {"name": n, "state": {"terminated": {"exitCode": 137, "finishedAt": at}}}
        for n, at in (("agent", "2024-01-01T00:02:00Z"), ("sidecar", "2024-01-01T00:03:00Z"))
    ]
    pod = pod_of(raw(status__phase="Failed", status__containerStatuses=ended), set(), None)
    assert pod.ended == CREATED + 180
    running = pod_of(raw(status__containerStatuses=ended[:1]), set(), None)
    assert running.ended == 0.0  # a pod still running has not ended, whatever a container did


def test_nodes_that_send_their_pods_away() -> None:
    assert node_leaving({"spec": {"unschedulable": True}})
    assert node_leaving({"spec": {"taints": [{"key": "k", "effect": "NoExecute"}]}})
    assert not node_leaving({"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}})
    assert not node_leaving({})


def test_a_pod_whose_agent_does_not_answer_is_not_ready() -> None:
    pod = pod_of(raw(), set(), None, "agent p0: UNAVAILABLE")
    assert not pod.ready and not pod.standing_by and pod.error == "agent p0: UNAVAILABLE"


CREATED = 1704067200.0  # raw()'s creationTimestamp


@pytest.mark.parametrize(
    ("conditions", "since", "unschedulable"),
    [
        ([], CREATED, ""),  # not judged by the scheduler yet
        ([{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2024-01-01T00:01:40Z"}],
         CREATED + 100, ""),
        ([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
           "message": "0/3 nodes are available: 3 Insufficient cpu."}],
         CREATED, "Unschedulable: 0/3 nodes are available: 3 Insufficient cpu."),
        ([{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}],
         CREATED, "SchedulingGated"),
    ],
)  # fmt: skip
def test_what_the_scheduler_said(
    conditions: list[dict[str, Any]], since: float, unschedulable: str
) -> None:
    pod = pod_of(raw(status__conditions=conditions), set(), None)
    assert (pod.since, pod.unschedulable) == (since, unschedulable)


def ended(exit_code: int, reason: str, message: str = "") -> dict[str, Any]:
    return {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}


def agent(state: dict[str, Any], last: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The agent container's status: its state, and its last run's."""
    return [{"name": "agent", "state": state, "lastState": last or {}}]


MISSING = "loading\nliveshard-agent: LIVESHARD_CONFIG: training: /x: no such file\n"


@pytest.mark.parametrize(
    ("status", "failure"),
    [
        ({"containerStatuses": agent({"running": {}})}, ""),
        ({"phase": "Succeeded", "containerStatuses": agent(ended(0, "Completed"))}, ""),  # released
        ({"phase": "Failed", "containerStatuses": agent(ended(137, "OOMKilled"))},
         "container agent: OOMKilled, exit code 137"),
        ({"phase": "Failed", "containerStatuses": agent(ended(2, "Error", MISSING))},
         "container agent: Error, exit code 2: loading | liveshard-agent: LIVESHARD_CONFIG: "
         "training: /x: no such file"),
        ({"phase": "Failed", "initContainerStatuses": [{"name": "fetch", "state": ended(1, "")}]},
         "container fetch: Error, exit code 1"),
        ({"containerStatuses": agent({"waiting": {"reason": "CrashLoopBackOff"}},
                                     ended(128, "StartError", "exec: no such file"))},
         "container agent: crash-looping, last StartError, exit code 128: exec: no such file"),
        # The kubelet retries the pull: nothing the worker did.
        ({"containerStatuses": agent({"waiting": {"reason": "ImagePullBackOff"}})}, ""),
        # Ended from outside: the pod's own reason.
        ({"phase": "Failed", "reason": "Evicted", "containerStatuses": agent(ended(137, "Error"))},
         ""),
    ],
)  # fmt: skip
def test_how_a_container_failed(status: dict[str, Any], failure: str) -> None:
    pod = pod_of(raw(**{f"status__{k}": v for k, v in status.items()}), set(), None)
    assert pod.failure == failure


def test_a_long_termination_message_keeps_its_last_lines() -> None:
    message = "\n".join(f"line {i}" for i in range(100))
    status = agent(ended(1, "Error", message))
    pod = pod_of(raw(status__phase="Failed", status__containerStatuses=status), set(), None)
    assert pod.failure == "container agent: Error, exit code 1: line 97 | line 98 | line 99"
