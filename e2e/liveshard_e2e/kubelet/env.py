"""A container's environment, built as the real kubelet builds it (pkg/kubelet/kubelet_pods.go).

Pure functions over the pod as a plain dict (the API's JSON); lookups of ConfigMaps and Secrets
are passed in, so this module never talks to the API server.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

Lookup = Callable[[str, str], Mapping[str, str] | None]
"""(kind, name) -> the object's data, decoded, or None when it does not exist."""

_VAR = re.compile(r"\$\$|\$\(([^)]*)\)")


class EnvError(ValueError):
    """The environment cannot be built yet (a missing ConfigMap, Secret or key)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known names are replaced, ``$$`` gives ``$``, and a
    reference to an unknown name is left as it is."""

    def repl(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(repl, text)


_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(value: str | int | float) -> Decimal:
    """A resource quantity ('500m', '2Gi', '1') as a Decimal in base units."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)]:
            return Decimal(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return Decimal(text)


def _field(pod: Mapping[str, Any], path: str) -> str:
    meta = pod.get("metadata", {})
    status = pod.get("status", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    raise EnvError(f"unsupported fieldRef.fieldPath {path!r}")


def _resource(
    container: Mapping[str, Any], ref: Mapping[str, Any], node_alloc: Mapping[str, str]
) -> str:
    kind, _, name = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(name)
    if value is None and kind == "limits":
        value = node_alloc.get(name)  # an unset limit reads as the node's allocatable
    if value is None:
        value = "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:  # the API server defaults an unset divisor to "0", meaning 1
        divisor = Decimal(1)
    return str(math.ceil(parse_quantity(value) / divisor))


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    base: Mapping[str, str],
    lookup: Lookup,
    node_allocatable: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of ``container``: ``base`` (PATH, service host and the like), then
    ``envFrom`` sources, then ``env`` in order, each value ``$(VAR)``-expanded against what came
    before."""
    env: dict[str, str] = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind in ("configMapRef", "secretRef"):
            ref = source.get(kind)
            if ref is None:
                continue
            data = lookup(kind, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise EnvError(f"{kind} {ref['name']!r} not found")
            for key, value in data.items():
                env[prefix + key] = value
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = _resource(container, source["resourceFieldRef"], node_allocatable or {})
        else:
            kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
            if kind not in source:
                raise EnvError(f"env {name!r}: unsupported valueFrom {sorted(source)}")
            ref = source[kind]
            data = lookup("configMapRef" if kind == "configMapKeyRef" else "secretRef", ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                what = "not found" if data is None else f"has no key {ref['key']!r}"
                raise EnvError(f"env {name!r}: {kind} {ref['name']!r} {what}")
            env[name] = data[ref["key"]]
    return env


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """``command + args`` with ``$(VAR)`` expansion; images have no entrypoint here."""
    command = container.get("command") or []
    if not command:
        raise EnvError(
            f"container {container.get('name')!r} has no command: the process kubelet runs "
            "commands, not images, so spec.containers[].command is required"
        )
    return [expand(part, env) for part in [*command, *(container.get("args") or [])]]


def decode_secret(data: Mapping[str, str] | None) -> dict[str, str]:
    """A Secret's ``data`` (base64) as text."""
    return {k: base64.b64decode(v).decode(errors="replace") for k, v in (data or {}).items()}
