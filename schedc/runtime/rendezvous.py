"""The TCPStore that a job's processes meet at (`schedc run`'s ranks, `schedc train`'s job).

torch's TCPStore server (the libuv one) names every client that connects by
its address, on its only thread. Listening on IPv6, its default, makes a
local client "::ffff:127.0.0.1", which /etc/hosts does not list: a reverse
DNS query, and a resolver that drops one stalls every store operation of the
job for its timeout (5 s by default). To see whether a machine's resolver
does: time `socket.getnameinfo(("::ffff:127.0.0.1", 0), 0)` a few dozen
times. `serve_store` listens on a socket of its own, IPv4 unless the host
is IPv6 only, and hands it over, so no such lookup happens.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def serve_store(host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> dist.TCPStore:
    """A store server on host:port (port 0: a free one; `.port` says which). OSError when the
    address is not this machine's or the port is taken; RuntimeError from torch otherwise."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=1024)
    try:
        return dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach())
    finally:
        listener.close()  # (a no-op once detached; closes it if torch refused it)


def connect_store(address: str, timeout: float) -> dist.TCPStore:
    """A client of the store at ``host:port``."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
