"""The agent's life once configured: pre-warm, serve, run the member, exit when released.

In order: initialise the device (importing this module imports torch: together they are the
pre-warm a standing-by pod does before it is needed), build the member (no store yet), start the
gRPC server and the metrics' HTTP server on the pod IP, report ready, then run the member's loop
on the main thread until a Release stops it. If the loop fails the agent reports FAILED and keeps
serving its status until it is released or killed. This module wires the parts; it holds no
training or API logic.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace

import torch

from liveshard_core.errors import InvalidInput, LiveshardError
from liveshard_core.job import Deadlines
from liveshard_core.layout.layout import Layout

from ..data.builtin import job_model
from ..engine.record import context_logger
from ..engine.sealed import Seal
from ..engine.world import host_store
from ..export import export
from ..runtime.events import Checkpointed, Event, Report
from ..runtime.loop import run_member
from ..runtime.member import Member
from . import listen
from .certs import ServingCertificate
from .config import AgentConfig, ConfigError
from .inbox import CommandInbox
from .metrics import Metrics
from .reporter import Reporter, observe
from .requests import Job
from .rpc import start_server
from .service import AgentService
from .status import StatusBoard

log = logging.getLogger(__name__)

_STOP_GRACE = 5.0  # seconds for calls in flight (the Release's answer) when the server stops
# Seconds a discarded agent's member gets to reach a step boundary before the process exits
# anyway: a member inside a collective whose peers have exited would wait out its op deadline.
DISCARD_EXIT = 5.0


def device_of(choice: str | None) -> torch.device:
    """The agent's device, initialised: a CUDA context is created now, not at the first step.
    The kubelet makes the pod's GPU the only visible one, so it is cuda:0."""
    if choice == "cpu" or (choice is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"LIVESHARD_CONFIG: device='cuda', but no CUDA device is visible "
            f"(CUDA_VISIBLE_DEVICES={visible!r})"
        )
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    return device


def serve(config: AgentConfig, board: StatusBoard) -> int:
    """Run the agent until it is released; the exit status (0, or 1 if its member failed)."""
    job_config = config.job_config
    device = device_of(job_config.device)
    spec = job_config.model_spec(device.type)
    try:
        member = Member(
            name=config.member, spec=spec, settings=job_config.training, device=device,
            deadlines=job_config.deadlines, job=config.job,
            hf=job_model(job_config), pretrained=job_config.pretrained,
            seal=Seal.of(config.token, config.job),
        )  # fmt: skip
    except InvalidInput as err:  # the data file: missing, or too short for the sequence length
        raise ConfigError(f"LIVESHARD_CONFIG: training: {err}") from None
    layouts: dict[int, Layout] = {}
    metrics = Metrics(config.job, config.member, job_config.training)
    reporter = Reporter(
        member, board, config.job, layouts.get, metrics, job_config.rebalance.window_steps
    )
    inbox = CommandInbox(reporter.boundary)

    def use_deadlines(deadlines: Deadlines) -> None:  # on the loop's thread, between commands
        member.deadlines = deadlines

    serving = ServingCertificate(config.tls) if config.tls is not None else None
    service = AgentService(
        job=Job(config.member, spec, job_config.training, job_config.deadlines,
                job_config.budget_bytes),
        job_name=config.job, pod_ip=config.pod_ip, board=board, inbox=inbox, layouts=layouts,
        use_deadlines=use_deadlines, host_store=host_store, serving=serving,
    )  # fmt: skip
    logger = context_logger(log, job=config.job, epoch=-1, member=config.member)
    try:
        server = start_server(service, config.token, config.address, serving)
    except RuntimeError as err:  # grpc's: the address is not this host's, or the port is taken
        logger.error("cannot serve on %s: %s", config.address, err)
        return 1
    metrics_server = listen.serve_metrics(metrics.registry, config, logger)
    fingerprint = serving.fingerprint if serving is not None else ""
    board.update(
        lambda s: replace(
            s, ready=True, observed=observe(member, s.observed, layouts.get), serving=fingerprint
        )
    )
    logger.info(
        "ready: serving liveshard.v1.Agent on %s, device %s, model %s (%s)",
        config.address, device, spec.config.name, spec.config.param_dtype.value,
    )  # fmt: skip
    status = 0
    stopped = threading.Event()
    threading.Thread(
        target=_exit_when_discarded, args=(service.discarded, stopped, logger), daemon=True
    ).start()
    try:
        run_member(member, inbox, exporting(reporter, logger))
    except Exception as err:  # a broken world or a bug: report it, keep serving the status
        reporter.fail(f"{type(err).__name__}: {err}")
        service.released.wait()
        status = 1
    finally:
        stopped.set()
        board.close()
        server.stop(_STOP_GRACE).wait()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
    reporter.log.info("released: exiting with status %s", status)
    return status


def _exit_when_discarded(
    discarded: threading.Event,
    stopped: threading.Event,
    logger: logging.LoggerAdapter[logging.Logger],
) -> None:
    """Once the agent is discarded, give its member `DISCARD_EXIT` seconds to stop, then end
    the process: its state is to be dropped, so nothing is lost by not waiting."""
    discarded.wait()
    if not stopped.wait(DISCARD_EXIT):
        logger.warning("discarded: the member did not stop within %s s; exiting now", DISCARD_EXIT)
        logging.shutdown()
        os._exit(0)


def exporting(report: Report, logger: logging.LoggerAdapter[logging.Logger]) -> Report:
    """`report`, with a checkpoint asked to be exported written as a Hugging Face directory
    first, by the member of rank 0 once every member has saved its part (it runs on the member's
    loop, so the job's last step is reported DONE only after its export)."""

    def report_exported(event: Event) -> None:
        if isinstance(event, Checkpointed) and event.report and event.export_to:
            try:
                export(event.path, event.export_to)
                logger.info("checkpoint %s exported to %s", event.number, event.export_to)
            except (LiveshardError, OSError) as err:
                event = replace(event, export_error=f"{type(err).__name__}: {err}")
                logger.error("checkpoint %s not exported: %s", event.number, event.export_error)
        report(event)

    return report_exported
