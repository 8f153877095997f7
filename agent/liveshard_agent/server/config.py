"""The agent process's configuration: environment variables, overridable by flags (never the
token: a secret on the command line is visible to every process on the node).

    LIVESHARD_JOB      the job's name
    LIVESHARD_MEMBER   this agent's member name (the pod's name)
    LIVESHARD_POD_IP   the address it serves on and hosts stores on (the pod's IP)
    LIVESHARD_PORT     the API's port (default 7070)
    LIVESHARD_METRICS_PORT  the port of its Prometheus metrics (default 9400; 0: none)
    LIVESHARD_METRICS_HOST  the address its metrics are served on (default: the pod IP)
    LIVESHARD_LISTEN   a gRPC address (unix:PATH) that replaces LIVESHARD_POD_IP:LIVESHARD_PORT
                       as the API's: a member of a pod of several is reached through the pod's
                       supervisor (`pod`) only
    LIVESHARD_POD_MEMBERS  the members in this pod (default 1); from 2, this process is the pod's
                       supervisor: it starts one agent per member and serves their APIs and
                       metrics on the pod's ports
    LIVESHARD_TOKEN    the job's token; every call must carry it, and it seals what members act
                       on in the job's store (`engine.sealed`)
    LIVESHARD_CONFIG   JSON: what the job trains and how it switches (`JobConfig.from_json`)
    LIVESHARD_LOG_FORMAT  text (default) or json: one JSON object per log line
    LIVESHARD_TLS_CERT, LIVESHARD_TLS_KEY, LIVESHARD_TLS_CA
                       PEM: the agent's serving certificate, its key and the job's CA; all three
                       or none. With them the API is served over TLS and a caller must present a
                       client certificate the job's CA signed; without them, in plaintext

Parsing imports no torch, so a bad configuration is reported in a moment. Every error is a
`ConfigError` whose one-line message names the variable (and the field inside LIVESHARD_CONFIG).
This module owns parsing and checking; it must not start anything.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from liveshard_core import logs
from liveshard_core.errors import InvalidInput
from liveshard_core.job import DEFAULT_METRICS_PORT, DEFAULT_PORT, JobConfig


class ConfigError(InvalidInput):
    """A configuration the agent cannot start with; the message names the variable and field."""


@dataclass(frozen=True)
class Tls:
    """The API's mutual TLS: the serving certificate and key, and the CA whose client
    certificates are accepted (PEM)."""

    cert: bytes
    key: bytes = field(repr=False)
    ca: bytes


TLS_VARIABLES = ("LIVESHARD_TLS_CERT", "LIVESHARD_TLS_KEY", "LIVESHARD_TLS_CA")
_PEM_MARKERS = ("CERTIFICATE-----", "PRIVATE KEY-----", "CERTIFICATE-----")


@dataclass(frozen=True)
class AgentConfig:
    job: str
    member: str
    pod_ip: str
    port: int
    token: str = field(repr=False)
    job_config: JobConfig
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: no metrics
    log_format: str = "text"  # one of liveshard_core.logs.FORMATS
    tls: Tls | None = None  # None: the API in plaintext
    pod_members: int = 1  # from 2: the pod's supervisor (`pod`), not an agent
    listen: str | None = None  # the API's address instead of the pod IP and port
    metrics_host: str = ""  # "": the pod IP

    @property
    def address(self) -> str:
        """The address gRPC binds: LIVESHARD_LISTEN, or the pod IP, never a wildcard (pods on
        the local cluster share one port space)."""
        if self.listen is not None:
            return self.listen
        host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip
        return f"{host}:{self.port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liveshard-agent",
        description="The agent of one worker pod: trains its part of the job and serves the "
        "liveshard.v1.Agent API. Configured by LIVESHARD_* environment variables; these flags "
        "override them (the token has no flag: set LIVESHARD_TOKEN).",
    )
    parser.add_argument("--job", help="the job's name (LIVESHARD_JOB)")
    parser.add_argument("--member", help="this agent's member name (LIVESHARD_MEMBER)")
    parser.add_argument("--pod-ip", help="the address to serve on (LIVESHARD_POD_IP)")
    parser.add_argument("--port", help=f"the API's port (LIVESHARD_PORT, {DEFAULT_PORT})")
    parser.add_argument("--config", help="the job's JSON configuration (LIVESHARD_CONFIG)")
    parser.add_argument(
        "--log-format", help="text or json: one JSON object per log line (LIVESHARD_LOG_FORMAT)"
    )
    parser.add_argument(
        "--metrics-port",
        help=f"the port of /metrics; 0 turns metrics off (LIVESHARD_METRICS_PORT, "
        f"{DEFAULT_METRICS_PORT})",
    )
    return parser


def load(environ: Mapping[str, str], argv: list[str] | None = None) -> AgentConfig:
    """The configuration from `environ` and the command line; ConfigError if any is wrong."""
    args = _parser().parse_args(argv)

    def value(variable: str, flag: str | None, default: str | None = None) -> str:
        got = flag if flag is not None else environ.get(variable, default)
        if got is None or not got.strip():
            raise ConfigError(f"{variable}: required, and not set")
        return got.strip()

    job = value("LIVESHARD_JOB", args.job)
    member = value("LIVESHARD_MEMBER", args.member)
    pod_ip = _ip("LIVESHARD_POD_IP", value("LIVESHARD_POD_IP", args.pod_ip))
    metrics_host = _ip("LIVESHARD_METRICS_HOST", value("LIVESHARD_METRICS_HOST", None, pod_ip))
    port = _port("LIVESHARD_PORT", value("LIVESHARD_PORT", args.port, str(DEFAULT_PORT)), 1)
    metrics_port = _port(
        "LIVESHARD_METRICS_PORT",
        value("LIVESHARD_METRICS_PORT", args.metrics_port, str(DEFAULT_METRICS_PORT)),
        0,
    )
    if metrics_port == port:
        raise ConfigError(f"LIVESHARD_METRICS_PORT: {port} is the API's port (LIVESHARD_PORT)")
    pod_members = _pod_members(value("LIVESHARD_POD_MEMBERS", None, "1"), metrics_port, port)
    listen = environ.get("LIVESHARD_LISTEN", "").strip() or None
    if listen is not None and not listen.startswith("unix:"):
        raise ConfigError(f"LIVESHARD_LISTEN: {listen!r} must be a Unix socket (unix:PATH)")
    token = environ.get("LIVESHARD_TOKEN", "")
    if not token:
        raise ConfigError("LIVESHARD_TOKEN: required, and not set (the job's token)")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        # gRPC metadata carries printable ASCII only: a client could never present it.
        raise ConfigError("LIVESHARD_TOKEN: must be printable ASCII without whitespace")
    try:
        job_config = JobConfig.from_json(value("LIVESHARD_CONFIG", args.config))
    except InvalidInput as err:
        raise ConfigError(f"LIVESHARD_CONFIG: {err}") from None
    log_format = value("LIVESHARD_LOG_FORMAT", args.log_format, "text")
    if log_format not in logs.FORMATS:
        raise ConfigError(
            f"LIVESHARD_LOG_FORMAT: {log_format!r} must be one of {', '.join(logs.FORMATS)}"
        )
    return AgentConfig(
        job, member, pod_ip, port, token, job_config, metrics_port, log_format, _tls(environ),
        pod_members, listen, metrics_host,
    )  # fmt: skip


def _tls(environ: Mapping[str, str]) -> Tls | None:
    """The API's TLS material, when all of LIVESHARD_TLS_* are set; ConfigError when only some
    are, or one is no PEM of its kind."""
    values = [environ.get(variable, "").strip() for variable in TLS_VARIABLES]
    if not any(values):
        return None
    missing = [v for v, got in zip(TLS_VARIABLES, values, strict=True) if not got]
    if missing:
        raise ConfigError(
            f"{missing[0]}: required when any of {', '.join(TLS_VARIABLES)} is set "
            f"(all three, or none for plaintext)"
        )
    for variable, got, marker in zip(TLS_VARIABLES, values, _PEM_MARKERS, strict=True):
        if "-----BEGIN " not in got or marker not in got:
            raise ConfigError(f"{variable}: not a PEM {marker.rstrip('-').lower()}")
    cert, key, ca = (v.encode() + b"\n" for v in values)
    return Tls(cert, key, ca)


def _ip(variable: str, text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ConfigError(f"{variable}: {text!r} is not an IP address") from None
    return text


def _pod_members(text: str, metrics_port: int, port: int) -> int:
    """LIVESHARD_POD_MEMBERS as a count; ConfigError if it is none, or if the members'
    metrics ports (the pod's metrics port + 1 + k) are no ports or take the API's."""
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"LIVESHARD_POD_MEMBERS: {text!r} must be an integer from 1 up")
    count = int(text)
    members_ports = range(metrics_port + 1, metrics_port + 1 + count)
    if count > 1 and metrics_port and (members_ports[-1] > 65535 or port in members_ports):
        raise ConfigError(
            f"LIVESHARD_METRICS_PORT: the pod's {count} members serve their metrics on ports "
            f"{members_ports[0]}..{members_ports[-1]}, which must be below 65536 and not the "
            f"API's ({port})"
        )
    return count


def _port(variable: str, text: str, lowest: int) -> int:
    """`text` as a port number from `lowest` up; ConfigError naming `variable` otherwise."""
    if not text.isdigit() or not lowest <= int(text) <= 65535:
        raise ConfigError(f"{variable}: {text!r} must be a port number in {lowest}..65535")
    return int(text)
