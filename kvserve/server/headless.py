"""A headless node of a model split over several machines (`kvserve serve ... --nnodes N --node-rank R --headless`,
which runs vLLM's own headless runner: `kvserve/server/launch.py`) watches its head node.

vLLM's headless runner waits for the head node's engine forever: with the head node gone (killed, its machine off),
the workers here sat in their queue and the process never ended, so a supervisor never restarted it. kvserve watches
the head node's rendezvous port (`--master-addr`:`--master-port`, the torch.distributed store the head node's first
worker serves for as long as it lives): once it has answered and then refuses `MISSES` polls in a row, this node says
why, stops its workers and exits with status 1. (The head node notices a dead headless node at its next step: that
step fails with gloo's "Connection closed by peer", the engine stops and `kvserve serve` exits 1.)
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

EVERY_S = 2.0
MISSES = 3


def reachable(address: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def watch_head(address: str, port: int, every_s: float = EVERY_S, misses: int = MISSES) -> threading.Thread:
    """Start the watch (a daemon thread): it ends this node once the head node, seen up, is gone."""

    def watch() -> None:
        while not reachable(address, port):  # not up yet: vLLM's own start-up waits and times out for this part
            time.sleep(every_s)
        missed = 0
        while missed < misses:
            time.sleep(every_s)
            missed = 0 if reachable(address, port) else missed + 1
        stop_node(f"the head node's rendezvous port {address}:{port} refused {misses} polls {every_s:g} s apart")

    thread = threading.Thread(target=watch, name="kvserve-head-watch", daemon=True)
    thread.start()
    return thread


def stop_node(reason: str) -> None:
    import psutil

    print(f"kvserve: this headless node stops: {reason}; the head node is gone", file=sys.stderr, flush=True)
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    os._exit(1)
