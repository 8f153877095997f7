"""The process kubelet's environment rules, as pure functions (no cluster needed)."""

from __future__ import annotations

import pytest

from liveshard_e2e.kubelet.env import (
    EnvError,
    command_line,
    container_env,
    expand,
    parse_quantity,
)

POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "a"}},
    "spec": {"nodeName": "node-0"},
    "status": {"podIP": "127.1.0.1"},
}


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$A $", env) == "$A $"


def test_env_order_sources_and_optional_refs() -> None:
    data = {("configMapRef", "cm"): {"x": "1"}}
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "P_"}],
        "env": [
            {"name": "LATER", "value": "$(EARLIER)"},
            {"name": "EARLIER", "value": "e"},
            {"name": "USE", "value": "$(P_x)/$(EARLIER)"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "no", "key": "k", "optional": True}},
            },
            {
                "name": "MEM",
                "valueFrom": {
                    "resourceFieldRef": {"resource": "requests.memory", "divisor": "1Mi"}
                },
            },
        ],
        "resources": {"requests": {"memory": "1Gi"}},
    }
    env = container_env(POD, container, {"PATH": "/bin"}, lambda kind, name: data.get((kind, name)))
    assert env["LATER"] == "$(EARLIER)"  # only earlier variables expand
    assert env["USE"] == "1/e"
    assert env["IP"] == "127.1.0.1"
    assert env["SA"] == "default"
    assert "OPT" not in env
    assert env["MEM"] == "1024"
    assert env["PATH"] == "/bin"


def test_missing_required_reference_is_an_error() -> None:
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}],
    }
    with pytest.raises(EnvError, match="nope"):
        container_env(POD, container, {}, lambda kind, name: None)


def test_command_is_required_and_expanded() -> None:
    assert command_line(
        {"name": "c", "command": ["echo", "$(A)"], "args": ["$(B)"]}, {"A": "1", "B": "2"}
    ) == ["echo", "1", "2"]
    with pytest.raises(EnvError, match="command"):
        command_line({"name": "c"}, {})


def test_quantities() -> None:
    assert parse_quantity("500m") * 1000 == 500
    assert parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity("3") == 3
