"""The gRPC edge's CallContext (ps_server/edge.py) read from another thread after its call is over.

The soak found shards dying of a segfault in gRPC's Cython core: a stalled stream's watchdog (stalls.py) named
the stream's peer from its own thread, through grpc.aio's context, after the call had ended. CallContext now
reads the peer, metadata, auth context and deadline once, on the loop, when the call starts. Run in a child
process: before the fix it crashed (exit -11)."""

import subprocess
import sys

CHILD = r'''
import concurrent.futures, gc, threading
import grpc
from torchps.ps_server.edge import LoopServer, handler

pool = concurrent.futures.ThreadPoolExecutor(2)
kept = []

def body(request, context):
    kept.append(context)
    return request

echo = handler(body, name="Echo", inline=False, pool=pool, streaming=False,
               fail=lambda name, exc, context: (grpc.StatusCode.INTERNAL, str(exc), ()))

def make():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    return server

server = LoopServer(make, "edge-loop")
port = server.add_insecure_port("127.0.0.1:0")
server.start()
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    call = channel.unary_unary("/t.T/Echo")
    for _ in range(50):
        assert call(b"x", timeout=30, metadata=(("k", "v"),)) == b"x"
gc.collect()
seen = []

def read():  # every call is over: grpc.aio has let go of them
    for context in kept:
        seen.append((context.peer(), dict(context.invocation_metadata()).get("k"), context.time_remaining()))

reader = threading.Thread(target=read)
reader.start()
reader.join()
peer, value, left = seen[-1]
print(len(seen), peer.startswith("ipv4:127.0.0.1:"), value, 0 < left < 31)  # deadlines travel rounded up
server.stop(0).wait(10)
'''


def test_a_call_context_is_read_from_another_thread_after_its_call_ended():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.split() == ["50", "True", "v", "True"], run.stdout
