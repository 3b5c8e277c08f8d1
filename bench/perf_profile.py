"""perf record -g of the machine for part of a timed window, and where given processes' CPU went, by kind.

    recording = Recording({"ps-0": pid, "worker-0": pid}, folder, delay=1.0, seconds=4.0)  # returns at once
    ...                                           # the window runs
    recording.finish()                            # waits for perf: FOLDER/perf.data, perf.log, targets.json
    summary = summarize_folder(folder)            # {name: summarize(data, pid)}, also FOLDER/summary.json

Standard library only: bench/tf_peer.py records with it under TensorFlow's
interpreter, bench/dataplane.py under torchps's. The recording is system-wide
(`perf record -a`: one event per CPU; following each process's threads with
-p instead made perf spin on the fds of threads that ended) and each target is
read from it alone (`perf report --pid PID --no-children --sort dso,sym`: self
time per symbol, as a share of that process's samples). Each symbol's share is
summed into the first of GROUPS whose rule matches, beside the top symbols, the
kernel's share and the cores the process kept busy meanwhile.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import subprocess

PERF = shutil.which("perf") or "/usr/bin/perf"
FREQUENCY = 499  # samples per second per CPU: a few hundred a second is plenty, and light on 2 cores
TOP = 30
REPORT_TIMEOUT = 300.0

# (group, kernel symbol pattern, user-space pattern on "dso symbol"); None: never. Order matters.
GROUPS = (
    ("kernel socket copy",
     r"copy_user|_copy_to_iter|_copy_from_iter|copy_page_to_iter|copy_page_from_iter|rep_movs|skb_copy|"
     r"csum_partial_copy|^memcpy|^__memcpy|memcpy_orig|^memmove", None),
    ("context switches / futex",
     r"schedule|switch|futex|wake_up|ttwu|finish_task|pick_next|enqueue_task|dequeue_task|update_curr|"
     r"select_task_rq|sched|idle", r"futex|__lll_|pthread_cond|pthread_mutex|sched_yield|RunQueue|EigenEnvironment|"
                                    r"ThreadPool"),
    ("malloc / page faults",
     r"page_fault|clear_page|do_anonymous|handle_mm_fault|alloc_pages|get_page_from_freelist|rmqueue|zap_pte|"
     r"unmap_page|free_pages|release_pages|free_unref|mmap|munmap|madvise|memcg|lru|folio|do_user_addr_fault|"
     r"pte_alloc|vma|mm_populate|page_add|page_remove",
     r"\bmalloc|\bfree\b|cfree|realloc|calloc|_int_malloc|_int_free|tcache|sysmalloc|arena|memalign|"
     r"operator new|operator delete|\bmmap|munmap|madvise|malloc_consolidate|unlink_chunk"),
    ("memcpy", None, r"memcpy|memmove"),
    ("python interpreter", None, r"^(lib)?python\d|^\S+ _?Py"),
    ("grpc / protobuf / ssl", None, r"grpc|protobuf|_message\.|upb|libssl|libcrypto|boringssl|tsi_|chttp2|gpr_|"
                                    r"absl|aes|gcm|sha256"),
    ("tensor kernels (torch, TF's Eigen)", None, r"libtorch|libc10|libgomp|libiomp|mkl|Eigen|at::|c10::"),
)
OTHER = "other"
LINE = re.compile(r"^\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+\[([^\]]+)\]\s+(.*?)\s*$")


class Recording:
    """`perf record -a -g` starting `delay` s from now for `seconds` s, in the background; `targets` (name: pid)
    are the processes summarize_folder() reads from it. Starting returns at once; finish() waits for perf
    (killing it if it still runs `seconds` + 60 s later)."""

    def __init__(self, targets: dict[str, int], folder, *, delay: float, seconds: float):
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.seconds = seconds
        (self.folder / "targets.json").write_text(json.dumps({"pids": targets, "seconds": seconds}) + "\n")
        script = (f"sleep {max(0.0, delay):.2f}; exec {shlex.quote(PERF)} record -a -g -F {FREQUENCY} "
                  f"-o {shlex.quote(str(self.folder / 'perf.data'))} -- sleep {seconds:.2f}")
        with open(self.folder / "perf.log", "w") as log:
            self.proc = subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)

    def finish(self) -> None:
        try:
            self.proc.wait(timeout=self.seconds + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def group_of(kind: str, dso: str, symbol: str) -> str:
    for name, kernel, user in GROUPS:
        if kind == "k":
            if kernel and re.search(kernel, symbol):
                return name
        elif user and re.search(user, f"{dso} {symbol}"):
            return name
    return OTHER


def summarize(data: pathlib.Path, pid: int, seconds: float) -> dict:
    """Self-time shares of process `pid` in one perf.data: {"samples", "cores", "groups": {group: %},
    "kernel_percent", "top": [...]}; {"error": why} where perf recorded or reported nothing for it."""
    if not data.exists():
        log = data.with_name("perf.log")
        return {"error": f"no {data.name}: {log.read_text()[-500:] if log.exists() else 'perf did not run'}"}
    report = subprocess.run([PERF, "report", "-i", str(data), "--pid", str(pid), "--percentage", "relative",
                             "--no-children", "--sort", "dso,sym", "--stdio", "-g", "none", "-n"],
                            capture_output=True, text=True, timeout=REPORT_TIMEOUT)
    groups = {name: 0.0 for name, _, _ in GROUPS} | {OTHER: 0.0}
    top, kernel, samples = [], 0.0, 0
    for line in report.stdout.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        percent, count, dso, kind, symbol = float(match[1]), int(match[2]), match[3], match[4], match[5]
        group = group_of(kind, dso, symbol)
        groups[group] += percent
        kernel += percent if kind == "k" else 0.0
        samples += count
        if len(top) < TOP:
            top.append({"percent": percent, "dso": dso, "symbol": symbol, "group": group})
    if not top:
        return {"error": f"perf report gave no samples of pid {pid}: {(report.stderr or report.stdout)[-500:]}"}
    return {"pid": pid, "samples": samples, "cores": round(samples / (FREQUENCY * seconds), 2),
            "groups": {k: round(v, 2) for k, v in groups.items()}, "kernel_percent": round(kernel, 2), "top": top}


def summarize_folder(folder) -> dict:
    """summarize() of each of a Recording's targets, by name; written to FOLDER/summary.json too."""
    folder = pathlib.Path(folder)
    if not (folder / "targets.json").exists():
        return {"recording": {"error": f"nothing recorded in {folder}"}}
    targets = json.loads((folder / "targets.json").read_text())
    out = {name: summarize(folder / "perf.data", pid, targets["seconds"]) for name, pid in targets["pids"].items()}
    (folder / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
