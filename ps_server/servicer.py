"""The gRPC edge of a shard: decode requests, call the store, encode replies, map errors.

Every handler is wrapped by `_map_errors`, the one place where PSError
subclasses become gRPC status codes (with the class name in the trailing
metadata key `torchps-error`) and anything unexpected becomes INTERNAL, so a
bad request never takes the server down.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import grpc

from . import codec
from .errors import InternalServerError, MalformedStreamError, PSError
from .proto import ps_pb2, ps_pb2_grpc
from .store import NewVariable, VariableStore

__all__ = ["ParameterServerServicer", "ERROR_METADATA_KEY"]

_LOGGER = logging.getLogger(__name__)
ERROR_METADATA_KEY = "torchps-error"


def _abort(context: grpc.ServicerContext, exc: PSError) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))


def _handle(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, PSError):
        _LOGGER.debug("%s rejected: %s", method, exc)
        _abort(context, exc)
    elif isinstance(exc, grpc.RpcError) or not context.is_active():
        _LOGGER.info("%s: the client went away mid-call; nothing was applied", method)
        context.abort(grpc.StatusCode.CANCELLED, "the client cancelled the call")
    else:
        _LOGGER.exception("%s failed unexpectedly", method)
        _abort(context, InternalServerError(f"{method} failed on the shard: {type(exc).__name__}: {exc}"))


def _map_errors(method):
    """Maps exceptions of a unary or streaming-response handler to gRPC statuses."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def streaming(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - the edge maps everything
                _handle(context, method.__name__, exc)
        return streaming

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            _handle(context, method.__name__, exc)
    return unary


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Serves one shard's VariableStore over the ParameterServer service."""

    def __init__(self, store: VariableStore, index: int, *, max_chunk_bytes: int):
        self.store = store
        self.index = index
        self.max_chunk_bytes = max_chunk_bytes

    @_map_errors
    def CreateVariables(self, request_iterator, context):
        requests: list[NewVariable] = []
        spec = None
        assembler = codec.ChunkAssembler()
        for message in request_iterator:
            if message.HasField("spec"):
                assembler.finish()
                spec = message.spec
                if not spec.name:
                    raise MalformedStreamError("a VariableSpec without a name")
            if message.HasField("chunk"):
                if spec is None or message.chunk.name != spec.name:
                    raise MalformedStreamError(
                        f"chunk for {message.chunk.name!r} does not follow a spec of that name")
                done = assembler.add(message.chunk, meta=spec.meta)
                if done is not None:
                    requests.append(NewVariable(spec.name, done[1], spec.optimizer.name, dict(spec.optimizer.hyperparams)))
        assembler.finish()
        if spec is not None and (not requests or requests[-1].name != spec.name):
            raise MalformedStreamError(f"stream ended before the initial value of {spec.name!r}")
        created = self.store.create(requests)
        return ps_pb2.CreateResponse(created=created)

    @_map_errors
    def Pull(self, request, context):
        names = list(request.names) or self.store.names()
        for name in names:
            self.store.get(name)  # NOT_FOUND before anything is sent
        chunk_bytes = min(request.chunk_bytes or codec.DEFAULT_CHUNK_BYTES, self.max_chunk_bytes)
        step = self.store.step
        for name in names:
            pieces, version = self.store.read(name, lambda t: list(codec.encode_chunks(name, t, chunk_bytes)))
            pieces[0].version = version
            for piece in pieces:
                yield ps_pb2.PullResponse(chunk=piece, step=step)

    @_map_errors
    def Push(self, request_iterator, context):
        header = None
        grads = {}
        assembler = codec.ChunkAssembler(begin=self.store.check_gradient)
        for message in request_iterator:
            if message.HasField("header"):
                if header is not None:
                    raise MalformedStreamError("a Push stream carries its header twice")
                header = message.header
            elif header is None:
                raise MalformedStreamError("a Push stream must start with a header")
            if message.HasField("chunk"):
                done = assembler.add(message.chunk)
                if done is not None:
                    grads[done[0]] = done[1]
        assembler.finish()
        if header is None:
            raise MalformedStreamError("empty Push stream: no header")
        if not context.is_active():
            raise MalformedStreamError("the client went away before the push completed")
        step, versions = self.store.apply(grads, header.step_increment)
        return ps_pb2.PushResponse(step=step, versions=versions)

    @_map_errors
    def UpdateOptimizer(self, request, context):
        updated = self.store.set_hyperparams(list(request.names), dict(request.hyperparams))
        return ps_pb2.UpdateOptimizerResponse(updated=updated)

    @_map_errors
    def ListVariables(self, request, context):
        names = list(request.names)
        if names and request.wait_seconds > 0:
            self.store.wait_for(names, request.wait_seconds)
        wanted = set(names)
        infos = []
        for name in self.store.names():
            if wanted and name not in wanted:
                continue
            variable = self.store.get(name)
            infos.append(ps_pb2.VariableInfo(spec=variable.spec, version=variable.version, nbytes=variable.nbytes))
        return ps_pb2.ListResponse(variables=infos, step=self.store.step)

    @_map_errors
    def GetStatus(self, request, context):
        names = self.store.names()
        return ps_pb2.StatusResponse(
            index=self.index, step=self.store.step, num_variables=len(names),
            total_bytes=sum(self.store.get(n).nbytes for n in names), pid=os.getpid())
