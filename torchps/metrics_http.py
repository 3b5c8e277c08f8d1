"""The /metrics endpoint every role serves (prometheus_client's HTTP server, one registry per process role)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["serve_metrics"]


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Starts /metrics for `registry` (a daemon thread) on host:port (0: a free port; an IPv6 host may be
    bracketed); returns the port. OSError if it cannot bind."""
    server, _thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return server.server_port
