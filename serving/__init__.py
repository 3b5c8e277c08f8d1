"""Serving replicas (ps-serve): read-only copies of a training job's model that follow its changes, and their
Python client (ServingClient). See docs/guide/serving.md. Imported lazily: ps-serve checks its flags before
torch and gRPC are loaded."""

__all__ = ["ServingClient", "Rows", "Dense"]


def __getattr__(name: str):
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
