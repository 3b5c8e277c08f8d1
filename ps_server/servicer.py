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

from . import codec, wire
from .errors import InternalServerError, MalformedStreamError, PSError
from .proto import ps_pb2, ps_pb2_grpc
from .store import NewVariable, VariableStore

__all__ = ["ParameterServerServicer", "add_to_server", "ERROR_METADATA_KEY"]

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
    """Serves one shard's VariableStore over the ParameterServer service.

    Register it with `add_to_server`, which uses wire.py's codecs for Pull's
    responses and Push's requests and the generated classes for the rest.
    """

    def __init__(self, store: VariableStore, index: int, *, max_chunk_bytes: int):
        self.store = store
        self.index = index
        self.max_chunk_bytes = max_chunk_bytes
        self._pool = codec.BufferPool()  # gradient buffers, reused across pushes

    @_map_errors
    def CreateVariables(self, request_iterator, context):
        requests: list[NewVariable] = []
        pending = None  # the spec whose initial value is arriving
        assembler = codec.ChunkAssembler()
        for message in request_iterator:
            if message.HasField("spec"):
                if pending is not None:
                    raise MalformedStreamError(f"no complete initial value for {pending.name!r} before the next spec")
                if not message.spec.name:
                    raise MalformedStreamError("a VariableSpec without a name")
                pending = message.spec
            if message.HasField("chunk"):
                if pending is None or message.chunk.name != pending.name:
                    raise MalformedStreamError(
                        f"chunk for {message.chunk.name!r} does not follow a spec of that name")
                done = assembler.add(message.chunk, meta=pending.meta)
                if done is not None:
                    optimizer = pending.optimizer
                    requests.append(NewVariable(pending.name, done[1], optimizer.name, dict(optimizer.hyperparams)))
                    pending = None
        if pending is not None:
            raise MalformedStreamError(f"stream ended before the initial value of {pending.name!r} was complete")
        created = self.store.create(requests)
        return ps_pb2.CreateResponse(created=created)

    @_map_errors
    def Pull(self, request, context):
        """Yields serialized PullResponse messages (see wire.py), each variable copied under its lock."""
        names = list(request.names) or self.store.names()
        for name in names:
            self.store.get(name)  # NOT_FOUND before anything is sent
        chunk_bytes = min(request.chunk_bytes or codec.DEFAULT_CHUNK_BYTES, self.max_chunk_bytes)
        step = self.store.step

        def encode(name: str, value, version: int) -> list[bytes]:
            meta = codec.meta_of(value)
            return [wire.encode_pull_response(name, meta if offset == 0 else None, offset, piece,
                                              version if offset == 0 else 0, step)
                    for offset, piece in codec.split(value, chunk_bytes)]

        for name in names:
            messages = self.store.read(name, lambda value, version: encode(name, value, version))
            yield from messages

    @_map_errors
    def Push(self, request_iterator, context):
        """Consumes decoded (header, chunk) pairs (see wire.py); applies only a complete, valid stream."""
        header = None
        grads = {}
        assembler = codec.ChunkAssembler(begin=self.store.check_gradient, pool=self._pool)
        try:
            for message_header, chunk in request_iterator:
                if message_header is not None:
                    if header is not None:
                        raise MalformedStreamError("a Push stream carries its header twice")
                    header = message_header
                elif header is None:
                    raise MalformedStreamError("a Push stream must start with a header")
                if chunk is not None:
                    done = assembler.add(chunk)
                    if done is not None:
                        grads[done[0]] = done[1]
            assembler.finish()
            if header is None:
                raise MalformedStreamError("empty Push stream: no header")
            step, versions = self.store.apply(grads, header.step_increment)
        finally:
            grads.clear()
            assembler.release()
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


def add_to_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Registers every RPC of ps.proto's ParameterServer service on `server`."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {
        "CreateVariables": grpc.stream_unary_rpc_method_handler(
            servicer.CreateVariables, ps_pb2.CreateRequest.FromString, ps_pb2.CreateResponse.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, ps_pb2.PullRequest.FromString, bytes),  # Pull yields serialized messages
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, wire.decode_push_request, ps_pb2.PushResponse.SerializeToString),
        "UpdateOptimizer": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateOptimizer, ps_pb2.UpdateOptimizerRequest.FromString,
            ps_pb2.UpdateOptimizerResponse.SerializeToString),
        "ListVariables": grpc.unary_unary_rpc_method_handler(
            servicer.ListVariables, ps_pb2.ListRequest.FromString, ps_pb2.ListResponse.SerializeToString),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, ps_pb2.StatusRequest.FromString, ps_pb2.StatusResponse.SerializeToString),
    }
    missing = {m.name for m in service.methods} ^ set(handlers)
    if missing:
        raise RuntimeError(f"servicer and ps.proto disagree on methods: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
