#!/usr/bin/env python
"""A tiny call's CPU: torchps's push, pull and exchange of a few hundred bytes beside gRPC's own floor.

    python bench/calls.py --json bench/results/calls.json     # 2,000 calls each, about a minute
    python bench/calls.py --calls 300                           # a try

torchps: one ps-server shard (LocalCluster, --torch-threads 1) and this
process's PSClient with a Linear(16, 4) (68 floats, SGD); each of push(),
pull() and exchange() (PushPull: push and pull in one call) run `--calls`
times in a row after 200 warm-up calls; then a push of a model of
`--variables` small tensors (Linear(8, 8)s: 72 floats each pair), what a
shard does per variable, `--calls` / 10 times. The floor: a server process whose
one unary method returns its 100-byte request, on grpc.aio (what a shard
runs) and on the synchronous server, called `--calls` times in a row from a
synchronous channel here. For each: wall time per call, this process's CPU
per call and the server's (/proc). Calls run one at a time, as a worker's
step makes them, so every call pays its wake-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pathlib
import sys
import time

import grpc

from pullpush import cpu_seconds, environment, log

METHOD = "/bench.Floor/Echo"


def _floor_server(kind: str, port_q) -> None:
    handler = grpc.method_handlers_generic_handler("bench.Floor", {"Echo": grpc.unary_unary_rpc_method_handler(
        _echo_async if kind == "aio" else (lambda request, context: request))})
    if kind == "aio":
        async def serve():
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((handler,))
            port_q.put(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            await server.wait_for_termination()
        asyncio.run(serve())
    else:
        from concurrent import futures
        server = grpc.server(futures.ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers((handler,))
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()


async def _echo_async(request, context):
    return request


def timed(call, calls: int, pids) -> dict:
    """Wall and CPU per call (ms) of `calls` calls in a row, after 200 warm-up calls."""
    for _ in range(200):
        call()
    server0, client0, started = cpu_seconds(pids), time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    wall, client1, server1 = time.perf_counter() - started, time.process_time(), cpu_seconds(pids)
    return {"wall_ms": 1e3 * wall / calls, "client_cpu_ms": 1e3 * (client1 - client0) / calls,
            "server_cpu_ms": 1e3 * (server1 - server0) / calls}


def bench_floor(kind: str, calls: int) -> dict:
    context = mp.get_context("spawn")  # a fresh interpreter: no grpc state forked from this one
    port_q = context.Queue()
    proc = context.Process(target=_floor_server, args=(kind, port_q), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(METHOD)
            return timed(lambda: echo(b"x" * 100, timeout=10), calls, [proc.pid])
    finally:
        proc.kill()


def bench_torchps(calls: int, variables: int) -> dict:
    import torch
    from pullpush import start_cluster
    from torchps.client import Optimizer, PSClient
    from torchps.security import INSECURE

    torch.set_num_threads(1)
    local = start_cluster(1, None, server_args=["--torch-threads", "1"])
    try:
        pids = [proc.pid for proc in local.procs]
        with PSClient(local.cluster, security=INSECURE) as client:
            model = torch.nn.Linear(16, 4)
            binding = client.register_module(model, Optimizer("sgd", lr=1e-3), create=True)
            for parameter in model.parameters():
                parameter.grad = torch.full_like(parameter, 1e-3)
            figures = {name: timed(call, calls, pids) for name, call in
                       (("push", binding.push), ("pull", binding.pull), ("exchange", binding.exchange))}
            many = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(variables // 2)))
            binding = client.register_module(many, Optimizer("sgd", lr=1e-3), create=True, prefix="many/")
            for parameter in many.parameters():
                parameter.grad = torch.full_like(parameter, 1e-3)
            figures[f"push_{variables}_variables"] = timed(binding.push, max(calls // 10, 1), pids)
            return figures
    finally:
        local.__exit__(None, None, None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls in a row per measurement (default 2000)")
    parser.add_argument("--variables", type=int, default=200,
                        help="small variables of the last push's model (default 200: a BERT-base has about 200)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results = {"torchps": bench_torchps(args.calls, args.variables)}
    log("torchps done")
    results["grpc_aio_floor"] = bench_floor("aio", args.calls)
    results["grpc_sync_floor"] = bench_floor("sync", args.calls)
    rows = [("torchps push", results["torchps"]["push"]), ("torchps pull", results["torchps"]["pull"]),
            ("torchps exchange (PushPull)", results["torchps"]["exchange"]),
            (f"torchps push of {args.variables} variables", results["torchps"][f"push_{args.variables}_variables"]),
            ("gRPC floor: grpc.aio server, 100-byte echo", results["grpc_aio_floor"]),
            ("gRPC floor: sync server, 100-byte echo", results["grpc_sync_floor"])]
    print("| call, one at a time | wall ms | client CPU ms | server CPU ms |\n| --- | --- | --- | --- |")
    for what, r in rows:
        print(f"| {what} | {r['wall_ms']:.3f} | {r['client_cpu_ms']:.3f} | {r['server_cpu_ms']:.3f} |")
    push = results["torchps"]["push"]
    targets = {"push_shard_cpu_ms <= 0.3": push["server_cpu_ms"] <= 0.3,
               "push_client_cpu_ms <= 0.3": push["client_cpu_ms"] <= 0.3}
    print("\n" + "\n".join(f"target {k}: {'met' if v else 'NOT met'}" for k, v in targets.items()))
    env = environment()
    results.update(calls=args.calls, variables=args.variables, targets=targets, environment=env, wall_seconds=time.monotonic() - started,
                   command=" ".join(["python", *sys.argv]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
