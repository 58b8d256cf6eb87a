"""`run_vllm_agent`: the agent process of an `--engine vllm` host (`cli.run_agent` hands over
to it). The same report sender, durable outbox and host-queue consumer as a Harli host; the
engine is vLLM (`run.start_vllm_host`). Every `--heartbeat-s` a heartbeat from vLLM's
figures (`VllmHost.snapshot`), every `--metrics-interval-s` a `metrics` report; the
supervisor's state and restarts are logged when they change (the heartbeat has no field for
them). Ends, stopping vLLM, when `stop` is set or the consumer gave up (exit status 3)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from gpu_runtime.agent.config import HOST_KEY_ENV, AgentConfig, AgentConfigError

logger = logging.getLogger("gpu_runtime.agent")
HOST_QUEUE_LOST_EXIT = 3


def run_vllm_agent(config: AgentConfig, stop: threading.Event, total_bytes: int) -> int:
    from kombu import Connection

    from gpu_runtime.agent.channel import CommandConsumer, ReportSender
    from gpu_runtime.agent.outbox import DiskOutbox
    from gpu_runtime.agent.vllm.run import start_vllm_host
    from gpu_runtime.contract.broker import broker_transport, broker_transport_options
    from gpu_runtime.contract.message_auth import message_key, message_sign
    from gpu_runtime.contract.protocol import report

    if config.host_key is None:
        raise AgentConfigError(
            f"a host key is required (--host-key-file or {HOST_KEY_ENV}): it signs every "
            "report and verifies every command"
        )
    key = message_key(config.host_key)
    options = broker_transport_options(config.broker_url, config.broker_dir)
    transport = broker_transport(config.broker_url)
    outbox = DiskOutbox(config.outbox_path(), config.outbox_max_reports, config.outbox_max_bytes)
    sender = ReportSender(config.broker_url, options, transport, outbox)
    sender.start()

    def send(message: dict[str, Any]) -> None:
        sender.send(message_sign(message, key))

    try:
        parts = start_vllm_host(config, send, total_bytes)
    except BaseException:
        sender.stop()
        outbox.close()
        raise
    connection = Connection(config.broker_url, transport=transport, transport_options=options)
    consumer = CommandConsumer(connection, config.host, parts.submit, key)
    consumer.start()
    print(f"agent {config.host} ready: {parts.server_url}", flush=True)
    status, last_state = 0, parts.host.engine_state()
    next_metrics = time.monotonic() + config.metrics_interval_s
    parts.host.metrics_report_fields()  # opens the first interval
    try:
        while not stop.is_set():
            if not consumer.alive():
                logger.critical("the host-queue consumer of %s has stopped; exiting", config.host)
                status = HOST_QUEUE_LOST_EXIT
                break
            fields = parts.host.snapshot().heartbeat_fields()
            send(report("heartbeat", config.host, server_url=parts.server_url, **fields))
            if time.monotonic() >= next_metrics:
                metrics = parts.host.metrics_report_fields()
                if metrics is not None:
                    send(report("metrics", config.host, **metrics))
                next_metrics = time.monotonic() + config.metrics_interval_s
            state = parts.host.engine_state()
            if state != last_state:
                logger.warning("vLLM engine %s (restarts %d)", state["state"], state["restarts"])
                last_state = state
            stop.wait(config.heartbeat_s)
    finally:
        consumer.stop()
        parts.stop()
        sender.stop()
        outbox.close()
    return status
