"""The Python client of a serving replica (ps-serve): lookups of embedding rows and reads of dense variables
from its current version, its status, and the admin's hold, resume and rollback.

Every call blocks for at most the client's `timeout`; a replica that cannot
be reached raises ServerUnavailableError, one that refuses raises the
PSError it named (client/errors.py), and nothing changes on either side. A
reply is one consistent version: the rows and tensors of one call all come
from the version it names.
"""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import torch

from .. import codec
from ..client.channels import secured_channel
from ..client.errors import error_from_rpc
from ..errors import InvalidArgumentError
from ..proto import ps_pb2, ps_pb2_grpc
from ..security import INSECURE, Security

__all__ = ["ServingClient", "Rows", "Dense"]

_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


@dataclasses.dataclass(frozen=True)
class Rows:
    """A lookup's answer: rows[i] of ids[i] (zeros where the table holds none: held[i] False), from `version`,
    which reflects training step `step`."""

    rows: torch.Tensor
    held: torch.Tensor
    version: int
    step: int


@dataclasses.dataclass(frozen=True)
class Dense:
    """Dense variables of one version."""

    tensors: dict[str, torch.Tensor]
    version: int
    step: int


class ServingClient:
    """Calls one serving replica at `address` (HOST:PORT) with `security` (the job's credentials, a task of the
    serving, worker or chief role). Thread-safe; close() (or `with`) ends it."""

    def __init__(self, address: str, *, security: Security = INSECURE, timeout: float = 30.0):
        self.address, self.timeout = address, timeout
        self._channel = secured_channel(address, security, _OPTIONS)
        self._stub = ps_pb2_grpc.ServingStub(self._channel)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"ps-serve at {self.address}") from None

    def lookup(self, table: str, ids: torch.Tensor) -> Rows:
        """The rows of `ids` (1-D int64, any order, repeats allowed) of `table` in the replica's current version.
        UnknownVariableError for a table it does not hold."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise InvalidArgumentError(f"ids must be a 1-D int64 tensor; got {getattr(ids, 'dtype', type(ids))}")
        reply = self._call(self._stub.Lookup, ps_pb2.ServingLookupRequest(
            table=table, ids=ids.cpu().numpy().astype("<i8").tobytes()))
        dtype = codec.torch_dtype(reply.dtype)
        rows = torch.frombuffer(bytearray(reply.rows), dtype=dtype).reshape(len(ids), reply.dim) if reply.rows \
            else torch.zeros(len(ids), reply.dim, dtype=dtype)
        held = torch.from_numpy(np.frombuffer(reply.held, dtype=np.uint8).astype(bool))
        return Rows(rows, held, reply.version, reply.step)

    def dense(self, names: list[str] | None = None) -> Dense:
        """The dense variables `names` (None: every one) of the current version."""
        reply = self._call(self._stub.GetDense, ps_pb2.DenseRequest(names=names or []))
        tensors = {t.name: codec.dense_tensor(t.meta, np.frombuffer(t.data, dtype=np.uint8).copy())
                   for t in reply.tensors}
        return Dense(tensors, reply.version, reply.step)

    def status(self) -> ps_pb2.ServingStatus:
        return self._call(self._stub.GetServingStatus, ps_pb2.ServingStatusRequest())

    def control(self, action: int, step: int = 0) -> ps_pb2.ServingControl:
        """An admin's ServingControl (HOLD, RESUME, ROLLBACK to `step`); the replica's status after it."""
        return self._call(self._stub.ControlServing, ps_pb2.ServingControl(action=action, step=step))

    def hold(self) -> ps_pb2.ServingStatus:
        return self.control(ps_pb2.ServingControl.HOLD)

    def resume(self) -> ps_pb2.ServingStatus:
        return self.control(ps_pb2.ServingControl.RESUME)

    def rollback(self, step: int) -> ps_pb2.ServingStatus:
        """Back to the newest kept version at or before training step `step`, held there; ServingVersionError
        if every kept version is newer."""
        return self.control(ps_pb2.ServingControl.ROLLBACK, step)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ServingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
