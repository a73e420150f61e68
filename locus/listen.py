"""Listening sockets bound before a server starts (`locus serve`, `locus route`): a busy port or a
bad host is then one line naming the address and the OS's reason, before any slow start-up work,
and uvicorn takes the bound sockets over."""

from __future__ import annotations

import socket


class ListenError(Exception):
    """The server cannot listen where it was asked to (the message names the address and why)."""


def address(host: str, port: int) -> str:
    """host:port, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listeners(host: str, port: int, backlog: int | None = None) -> list[socket.socket]:
    """Bind every address `host` resolves to, as asyncio's create_server would (SO_REUSEADDR,
    IPv6 sockets IPv6-only), and listen, so a connection made before uvicorn takes over waits in
    the backlog (`backlog` connections; None: Python's default). Port 0 takes a free port, the same one
    on every address."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {address(host, port)}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):  # resolvers may repeat an address
            if sockets:  # the first bind chose the port when port 0 asked for any
                addr = (addr[0], bound_port(sockets), *addr[2:])
            sock = open_socket(family, kind, proto)
            if sock is not None:
                sockets.append(sock)
                sock.bind(addr)
                sock.listen(*(() if backlog is None else (backlog,)))
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ListenError(f"cannot listen on {address(host, port)}: {exc.strerror or exc}") from None
    if not sockets:
        raise ListenError(f"cannot listen on {address(host, port)}: no address of it takes a TCP socket here")
    return sockets


def open_socket(family: int, kind: int, proto: int) -> socket.socket | None:
    try:
        sock = socket.socket(family, kind, proto)
    except OSError:  # a family this host lacks (IPv6 switched off): asyncio skips it too
        return None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
    if family == socket.AF_INET6:  # one socket per family, as asyncio binds them, not a dual-stack one
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
    return sock


def bound_port(sockets: list[socket.socket]) -> int:
    return sockets[0].getsockname()[1]
