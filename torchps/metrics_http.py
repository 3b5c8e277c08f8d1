"""The /metrics endpoint every role serves (prometheus_client's HTTP server, one registry per process role)."""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["serve_metrics"]


def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                  watch: Callable[[threading.Thread], None] | None = None) -> int:
    """Starts /metrics for `registry` (a daemon thread) on host:port (0: a free port; an IPv6 host may be
    bracketed); returns the port. `watch(thread)` is given the server's thread (a shard supervises it). OSError
    if it cannot bind."""
    server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    if watch is not None:
        watch(thread)
    return server.server_port
