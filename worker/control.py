"""ps-launch's control socket: a running local job's workers added and removed from another shell.

    ps-launch scale --job-dir /tmp/ps-launch-abc123 --workers 4    # the folder the launcher printed

The launcher listens on a unix socket in its job folder (DIR/control.sock;
the folder is mode 0700, so only its user can connect). A request is one JSON
line, {"workers": N}; the launcher's main thread, which owns the processes,
takes it on its next pass, adds or removes workers, and answers one JSON
line once that is done ({"workers": N, "added": [...], "removed": [...]} or
{"error": "..."}), so the command's exit code says whether it happened: 0
done, 2 refused (one line why), 1 no launcher answering there.

Why a socket and not a control file: the command gets an answer (refused,
or done once removed workers have left), nothing polls a file, and there is
no half-written file to misread; the folder's mode does the access control.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import socket
import sys
import threading
from typing import Callable

from ..cli import USAGE_ERROR, ArgumentParser

__all__ = ["CONTROL_SOCKET", "ControlServer", "scale_main"]

CONTROL_SOCKET = "control.sock"
REPLY_TIMEOUT_SECONDS = 120.0  # a request the launcher did not answer by then (it ended) gets an error
MAX_REQUEST_BYTES = 4096


class Request:
    """One request, waiting for the launcher's main thread to answer it."""

    def __init__(self, body: dict):
        self.body = body
        self.reply: dict | None = None
        self.done = threading.Event()

    def answer(self, reply: dict) -> None:
        self.reply = reply
        self.done.set()


class ControlServer:
    """Accepts requests on DIR/control.sock in a thread of its own; the owner answers them with
    `serve_pending(handler)` from its own thread. close() stops it and answers what is left with an error."""

    def __init__(self, folder: pathlib.Path):
        self.path = folder / CONTROL_SOCKET
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        self._sock.listen(8)
        self._pending: queue.Queue[Request] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ps-launch-control", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                line = conn.makefile("rb").readline(MAX_REQUEST_BYTES)
                body = json.loads(line)
                if not isinstance(body, dict):
                    raise ValueError("not an object")
            except (OSError, ValueError) as exc:
                reply = {"error": f"not a request: {exc}"}
            else:
                request = Request(body)
                self._pending.put(request)
                if self._closed.is_set():
                    self._drain()
                answered = request.done.wait(REPLY_TIMEOUT_SECONDS)
                reply = request.reply if answered else {"error": "the launcher did not answer in time"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass  # the caller is gone: what was done is done

    def serve_pending(self, handler: Callable[[dict], dict]) -> None:
        """Answers every request waiting, each with handler(body) (run in the caller's thread). Never blocks
        for a request that is not there."""
        while True:
            try:
                request = self._pending.get_nowait()
            except queue.Empty:
                return
            request.answer(handler(request.body))

    def _drain(self) -> None:
        while True:
            try:
                self._pending.get_nowait().answer({"error": "the job has ended"})
            except queue.Empty:
                return

    def close(self) -> None:
        """Stops accepting and answers what waits with an error. Idempotent."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._drain()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def request(folder: str | os.PathLike, body: dict, timeout: float = REPLY_TIMEOUT_SECONDS + 10) -> dict:
    """Sends `body` to the launcher of the job folder `folder` and returns its answer. OSError if no launcher
    listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(pathlib.Path(folder) / CONTROL_SOCKET))
        sock.sendall(json.dumps(body).encode() + b"\n")
        line = sock.makefile("rb").readline()
    if not line:
        raise OSError("the launcher closed the connection without an answer")
    return json.loads(line)


def scale_main(argv: list[str]) -> int:
    """`ps-launch scale --job-dir DIR --workers N`: 0 done, 2 refused or a usage error, 1 nobody answering."""
    parser = ArgumentParser(prog="ps-launch scale", description="Add or remove workers of a running ps-launch "
                            "job (see torchps.worker.control).")
    parser.add_argument("--job-dir", required=True, help="the job folder the launcher printed at start")
    parser.add_argument("--workers", required=True, type=int, help="the workers to run from now on (the chief "
                        "included when it is worker 0): more start and join, fewer leave (the newest first)")
    args: argparse.Namespace = parser.parse_args(argv)
    if args.workers < 0:
        parser.error(f"--workers must be >= 0. Received: {args.workers}")
    try:
        reply = request(args.job_dir, {"workers": args.workers})
    except (OSError, ValueError) as exc:
        print(f"ps-launch scale: no launcher answers in {args.job_dir}: {exc}", file=sys.stderr)
        return 1
    if "error" in reply:
        print(f"ps-launch scale: {reply['error']}", file=sys.stderr)
        return USAGE_ERROR
    print(f"[launch] workers: {reply['workers']} (added {', '.join(reply['added']) or 'none'}; removed "
          f"{', '.join(reply['removed']) or 'none'})", flush=True)
    return 0
