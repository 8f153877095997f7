"""The Kubernetes objects of a job, rendered by pure functions (a dry run of what is created).

- worker pods: the job's pod template, its first container running the agent, with the
  environment the agent reads, owned by the job, labelled with the job and the pod's role
  (`standby` until the pod is a member of the world in effect, then `member`);
- the job's token Secret (every agent call carries the token);
- the job's two TLS Secrets (the agent API's mutual TLS, `pki`): `<job>-agent-tls`, what every
  worker holds (the CA certificate, the serving certificate and its key), and
  `<job>-operator-tls`, what only the operator reads (the CA's key, the operator's client pair);
  or, where cert-manager issues them, the job's cert-manager Issuers and Certificates that make
  those Secrets (`cert_manager_objects`);
- a PodDisruptionBudget, so a drain takes the job's pods one at a time;
- a NetworkPolicy, so that only the job's own workers and the operator reach its workers
  (`network_policy`).
"""

from __future__ import annotations

import copy
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from liveshard_core.job import DEFAULT_METRICS_PORT

from . import pki
from .spec import JobSpec

GROUP = "liveshard.io"
VERSION = "v1alpha1"
PLURAL = "elastictrainingjobs"
KIND = "ElasticTrainingJob"
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
# The members a worker pod runs (absent: one, named as the pod); see `pod_members`.
MEMBERS_ANNOTATION = f"{GROUP}/members"
MEMBER, STANDBY = "member", "standby"
TOKEN_KEY = "token"
# The keys of the TLS Secrets, as kubernetes.io/tls and cert-manager name them.
CA_CERT, CA_KEY, TLS_CERT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
# A job annotated with a new value here has its CA rotated; the operator's Secret records the
# value handled last.
ROTATE_CA, ROTATED_FOR = f"{GROUP}/rotate-ca", f"{GROUP}/ca-rotated-for"
# The agent's TLS variables, each from a key of the agent TLS Secret.
TLS_ENV = {
    "LIVESHARD_TLS_CERT": TLS_CERT,
    "LIVESHARD_TLS_KEY": TLS_KEY,
    "LIVESHARD_TLS_CA": CA_CERT,
}


def owner(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def secret_name(job_name: str) -> str:
    return f"{job_name}-token"


def agent_tls_name(job_name: str) -> str:
    return f"{job_name}-agent-tls"


def operator_tls_name(job_name: str) -> str:
    return f"{job_name}-operator-tls"


def token_secret(job: dict[str, Any]) -> dict[str, Any]:
    return _secret(job, secret_name(job["metadata"]["name"]), {TOKEN_KEY: secrets.token_hex(32)})


def agent_tls_secret(
    job: dict[str, Any], ca_cert: bytes, cert: bytes, key: bytes
) -> dict[str, Any]:
    """What every worker of the job gets: never the CA's key, never a client certificate."""
    data = {CA_CERT: ca_cert, TLS_CERT: cert, TLS_KEY: key}
    return _secret(job, agent_tls_name(job["metadata"]["name"]), _text(data))


def operator_tls_secret(
    job: dict[str, Any], ca_cert: bytes, ca_key: bytes, cert: bytes, key: bytes
) -> dict[str, Any]:
    """The CA (to issue the workers' certificate) and the operator's client pair."""
    data = {CA_CERT: ca_cert, CA_KEY: ca_key, TLS_CERT: cert, TLS_KEY: key}
    return _secret(job, operator_tls_name(job["metadata"]["name"]), _text(data))


CERT_MANAGER = "cert-manager.io"


def ca_name(job_name: str) -> str:
    """The job's CA under cert-manager: its Certificate, Secret and the Issuer it backs."""
    return f"{job_name}-ca"


@dataclass(frozen=True)
class IssuerRef:
    """A cert-manager issuer: the job's own CA Issuer, or one of the user's that issues every
    job's certificates (`liveshard-operator --cert-manager-issuer`)."""

    name: str
    kind: str = "Issuer"
    group: str = CERT_MANAGER

    def __str__(self) -> str:
        group = "" if self.group == CERT_MANAGER else f".{self.group}"
        return f"{self.kind}{group} {self.name}"


def cert_manager_objects(
    job: dict[str, Any], issuer: IssuerRef | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The job's cert-manager objects, in the order they are needed, as (resource, object): a
    self-signed Issuer, the job's own CA from it (its key kept across renewals, so what it signed
    stays trusted), a CA Issuer of that CA, and from it the workers' serving certificate and the
    operator's client certificate in the Secrets the operator would otherwise write (same names,
    keys, usages, key type and validities as `pki`'s; cert-manager puts `ca.crt` beside each
    pair). With the user's `issuer`, the two certificates alone, of it. Every object is owned by
    the job."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    ca = ca_name(name)
    hours = {
        "duration": _hours(pki.VALIDITY.total_seconds()),
        "renewBefore": _hours(pki.RENEW_BEFORE.total_seconds()),
    }

    def certificate(
        secret: str, by: IssuerRef, spec: dict[str, Any], rotation: str = "Always"
    ) -> dict[str, Any]:
        body = {
            "secretName": secret,
            "issuerRef": {"name": by.name, "kind": by.kind, "group": by.group},
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": rotation},
        }
        return _cert_manager(job, "Certificate", secret, {**body, **spec})

    leaves = [
        ("certificates", certificate(agent_tls_name(name), issuer or IssuerRef(ca), {
            "commonName": pki.AGENT_NAME, "dnsNames": [pki.server_name(name, namespace)],
            "usages": ["digital signature", "server auth"], **hours,
        })),
        ("certificates", certificate(operator_tls_name(name), issuer or IssuerRef(ca), {
            "commonName": pki.OPERATOR_NAME, "usages": ["digital signature", "client auth"],
            **hours,
        })),
    ]  # fmt: skip
    if issuer is not None:
        return leaves
    return [
        ("issuers", _cert_manager(job, "Issuer", f"{name}-selfsigned", {"selfSigned": {}})),
        ("certificates", certificate(ca, IssuerRef(f"{name}-selfsigned"), {
            "isCA": True, "commonName": pki.CA_NAME,
            "duration": _hours(pki.CA_VALIDITY.total_seconds()),
            "renewBefore": _hours(pki.CA_RENEW_BEFORE.total_seconds()),
            "usages": ["digital signature", "cert sign", "crl sign"],
        }, rotation="Never")),
        ("issuers", _cert_manager(job, "Issuer", ca, {"ca": {"secretName": ca}})),
        *leaves,
    ]  # fmt: skip


def _hours(seconds: float) -> str:
    return f"{round(seconds / 3600)}h"


def _cert_manager(
    job: dict[str, Any], kind: str, name: str, spec: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": f"{CERT_MANAGER}/v1",
        "kind": kind,
        "metadata": {
            "name": name,
            "labels": {JOB_LABEL: job["metadata"]["name"]},
            "ownerReferences": [owner(job)],
        },
        "spec": spec,
    }


def _text(data: dict[str, bytes]) -> dict[str, str]:
    return {key: value.decode() for key, value in data.items()}


def annotation(obj: dict[str, Any], key: str) -> str:
    """The value of annotation `key` of `obj` ("" when it has none)."""
    return str(((obj.get("metadata") or {}).get("annotations") or {}).get(key, ""))


def _secret(job: dict[str, Any], name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "labels": {JOB_LABEL: job["metadata"]["name"]},
            "ownerReferences": [owner(job)],
        },
        "type": "Opaque",
        "stringData": data,
    }


def serves_tls(pod: dict[str, Any]) -> bool:
    """Whether the pod's agent was given the TLS Secret (pods an operator without TLS created,
    which keep running across its upgrade, serve in plaintext)."""
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return any(e.get("name") == "LIVESHARD_TLS_CERT" for e in containers[0].get("env") or [])


def disruption_budget(job: dict[str, Any]) -> dict[str, Any]:
    name = job["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": {JOB_LABEL: name}, "ownerReferences": [owner(job)]},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {JOB_LABEL: name}}},
    }


@dataclass(frozen=True)
class Isolation:
    """Who may reach a job's workers besides its own: the operator's pods (by namespace and
    labels) on the agent's port, and `metrics_from` (NetworkPolicyPeers; empty: anyone) on the
    `metrics` port."""

    namespace: str
    labels: dict[str, str]
    metrics_from: list[dict[str, Any]] = field(default_factory=list)


def network_policy(job: dict[str, Any], spec: JobSpec, isolation: Isolation) -> dict[str, Any]:
    """The job's NetworkPolicy: its workers accept every port from each other (the agents' API,
    the c10d stores, the collectives), the agent's port from the operator, the `metrics` port
    from `isolation.metrics_from`, and nothing else."""
    name = job["metadata"]["name"]
    workers = {"podSelector": {"matchLabels": {JOB_LABEL: name}}}
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": isolation.namespace}},
        "podSelector": {"matchLabels": dict(isolation.labels)},
    }
    metrics: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": DEFAULT_METRICS_PORT}]}
    if isolation.metrics_from:
        metrics["from"] = copy.deepcopy(isolation.metrics_from)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": {JOB_LABEL: name}, "ownerReferences": [owner(job)]},
        "spec": {
            **workers,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [workers]},
                {"from": [operator], "ports": [{"protocol": "TCP", "port": spec.port}]},
                metrics,
            ],
        },
    }


# The workers' defaults where the template sets none: the "restricted" Pod Security Standard
# (the agent image runs as 65532) and a read-only root filesystem, with /tmp (the agent image's
# HOME and working directory: caches, scratch files, a pod's members' sockets) an emptyDir.
POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
AGENT_SECURITY = {
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}  # fmt: skip
SCRATCH = "liveshard-tmp"  # the emptyDir at /tmp that goes with AGENT_SECURITY
POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"  # scheduler-plugins' coscheduling
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
# Volcano's, used when the workers' schedulerName is volcano.
VOLCANO = "volcano"
VOLCANO_POD_GROUP_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"


def volcano(spec: JobSpec) -> bool:
    """Whether the workers are Volcano's to schedule (`template.spec.schedulerName`)."""
    return (spec.template.get("spec") or {}).get("schedulerName") == VOLCANO


def pod_group_resource(spec: JobSpec) -> str:
    """The PodGroup kind's resource for `Kube` (scheduler-plugins' or Volcano's)."""
    return "podgroups.scheduling.volcano.sh" if volcano(spec) else "podgroups"


def pod_group(job: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """The job's PodGroup (spec.scheduling.gang): the scheduler places none of its pods until it
    can place minReplicas of them together, so the job never holds part of its minimum.
    Volcano's when the workers' scheduler is Volcano (in the queue their template's annotation
    names), else scheduler-plugins' (with the pending timeout as its schedule timeout)."""
    name = job["metadata"]["name"]
    group: dict[str, Any] = {"minMember": spec.pods(spec.min_replicas)}
    if volcano(spec):
        annotations = (spec.template.get("metadata") or {}).get("annotations") or {}
        if annotations.get(VOLCANO_QUEUE_ANNOTATION):
            group["queue"] = annotations[VOLCANO_QUEUE_ANNOTATION]
    elif spec.pending_timeout:  # how long the scheduler tries to place the group at once
        group["scheduleTimeoutSeconds"] = int(spec.pending_timeout)
    return {
        "apiVersion": VOLCANO_POD_GROUP_API if volcano(spec) else POD_GROUP_API,
        "kind": "PodGroup",
        "metadata": {"name": name, "labels": {JOB_LABEL: name}, "ownerReferences": [owner(job)]},
        "spec": group,
    }


def selector(job_name: str) -> str:
    """The scale subresource's selector: the members of the world in effect."""
    return f"{JOB_LABEL}={job_name},{ROLE_LABEL}={MEMBER}"


def worker_pod(job: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """A new worker pod, standing by until it joins a world."""
    name = job["metadata"]["name"]
    template = copy.deepcopy(spec.template)
    metadata = template.get("metadata") or {}
    pod_spec = template.get("spec") or {}
    containers = pod_spec.get("containers") or [{"name": "agent"}]
    agent = containers[0]
    agent.setdefault("name", "agent")
    agent.setdefault("command", ["liveshard-agent"])
    per_pod = spec.members_per_pod
    agent["env"] = [
        *(agent.get("env") or []), *_agent_env(name, spec), *_threads(agent, per_pod),
        *([{"name": "LIVESHARD_POD_MEMBERS", "value": str(per_pod)}] if per_pod > 1 else []),
    ]  # fmt: skip
    ports = agent.setdefault("ports", [])
    for port_name, number in (("agent", spec.port), ("metrics", DEFAULT_METRICS_PORT)):
        if not any(p.get("containerPort") == number for p in ports):
            ports.append({"name": port_name, "containerPort": number})
    agent.setdefault(
        "readinessProbe",
        {"tcpSocket": {"port": spec.port}, "periodSeconds": 2, "failureThreshold": 3},
    )
    if "securityContext" not in agent:
        agent["securityContext"] = copy.deepcopy(AGENT_SECURITY)
        if not any(m.get("mountPath") == "/tmp" for m in agent.get("volumeMounts") or []):
            agent.setdefault("volumeMounts", []).append({"name": SCRATCH, "mountPath": "/tmp"})
            pod_spec.setdefault("volumes", []).append({"name": SCRATCH, "emptyDir": {}})
    # An agent that cannot start says why in its last log lines (a configuration it refuses): the
    # kubelet keeps them as its termination message, which the operator reports.
    agent.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    pod_spec["containers"] = containers
    pod_spec.setdefault("securityContext", copy.deepcopy(POD_SECURITY))
    # The agent never calls the API server: worker code gets no credential for it.
    pod_spec.setdefault("automountServiceAccountToken", False)
    # Spread over nodes (a preference): a node's loss takes fewer members, and a mirrored
    # shard's two holders can be put on two nodes.
    pod_spec.setdefault("topologySpreadConstraints", [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {JOB_LABEL: name}},
    }])  # fmt: skip
    # A crashed agent has lost its state: the operator replaces the pod, nothing restarts it.
    pod_spec["restartPolicy"] = "Never"
    # Long enough for the job to move a leaving pod's state out before it is killed.
    grace = spec.deadlines.prepare + spec.deadlines.switch + 60
    pod_spec.setdefault("terminationGracePeriodSeconds", int(grace))
    labels = {**(metadata.get("labels") or {}), JOB_LABEL: name, ROLE_LABEL: STANDBY}
    annotations = dict(metadata.get("annotations") or {})
    if per_pod > 1:
        annotations[MEMBERS_ANNOTATION] = str(per_pod)
    if spec.gang and volcano(spec):
        annotations[VOLCANO_GROUP_ANNOTATION] = name
    elif spec.gang:
        labels[POD_GROUP_LABEL] = name
    kept = ("name", "labels", "annotations", "namespace")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **{k: v for k, v in metadata.items() if k not in kept},
            **({"annotations": annotations} if annotations else {}),
            "generateName": f"{name}-",
            "labels": labels,
            "ownerReferences": [owner(job)],
        },
        "spec": pod_spec,
    }


def cpu_count(quantity: Any) -> int | None:
    """Whole CPUs of a Kubernetes CPU quantity (`500m`, `2`, `1.5`), rounded up, at least 1;
    None when it is not one."""
    text = str(quantity).strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None
    return max(1, math.ceil(cores)) if math.isfinite(cores) and cores > 0 else None


def pod_members(pod: dict[str, Any]) -> list[str]:
    """The members a worker pod runs: the pod itself, or `<pod>-<k>` for each of the
    `MEMBERS_ANNOTATION` members it was created with."""
    name = pod["metadata"]["name"]
    count = annotation(pod, MEMBERS_ANNOTATION)
    if not count.isdigit() or int(count) <= 1:
        return [name]
    return [f"{name}-{k}" for k in range(int(count))]


def _threads(agent: dict[str, Any], members: int) -> list[dict[str, Any]]:
    """torch's intra-op threads for the CPUs the container has (its CPU limit, else its
    request; shared by its `members`), unless the user set them: by default torch starts a
    thread per core of the node, and members sharing a node would then slow each other's
    collectives to a crawl."""
    if any(e.get("name") == "OMP_NUM_THREADS" for e in agent.get("env") or []):
        return []
    resources = agent.get("resources") or {}
    cpus = [cpu_count((resources.get(k) or {}).get("cpu", "")) for k in ("limits", "requests")]
    threads = next((c for c in cpus if c is not None), None)
    if threads is None:
        return []
    return [{"name": "OMP_NUM_THREADS", "value": str(max(threads // members, 1))}]


def _agent_env(job_name: str, spec: JobSpec) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    return [
        {"name": "LIVESHARD_JOB", "value": job_name},
        {"name": "LIVESHARD_MEMBER", "valueFrom": field("metadata.name")},
        {"name": "LIVESHARD_POD_IP", "valueFrom": field("status.podIP")},
        {"name": "LIVESHARD_PORT", "value": str(spec.port)},
        {
            "name": "LIVESHARD_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": secret_name(job_name), "key": TOKEN_KEY}},
        },
        *(
            {
                "name": variable,
                "valueFrom": {"secretKeyRef": {"name": agent_tls_name(job_name), "key": key}},
            }
            for variable, key in TLS_ENV.items()
        ),
        {"name": "LIVESHARD_CONFIG", "value": spec.agent_config()},
    ]
