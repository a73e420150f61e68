"""The rendezvous of an expert-parallel launch: where its store and sockets listen, and the launch's secret.

torch.distributed's TCPStore has no authentication: any client that reaches it may read, write or
list every key. So:
- *Bind.* The store rank 0 hosts listens only on the address the launch needs (a socket bound here,
  handed to TCPStore as its listening socket): 127.0.0.1 for `--ep-ranks`; under torchrun the local
  address that reaches MASTER_ADDR (torchrun's agent usually hosts the store itself: see
  docs/expert_parallel.md, "Exposure"). gloo's sockets (and NCCL's bootstrap) bind to the interface
  that holds that address (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless the operator set them).
- *Secret.* Every launch has a secret (`--ep-ranks`: drawn by rank 0 and handed to the ranks it
  starts in their environment; torchrun: LOCUS_EP_SECRET, the same on every node). Every value Locus
  itself reads from the store (an elastic regroup's survivors and their placement, a failed rank's
  reason) carries an HMAC of its key and bytes under the secret; a reader refuses any other value
  (`RendezvousRefused`), so a client without the secret cannot change what the ranks load. Locus's keys
  live under a prefix derived from the secret, apart from other tenants of the store.

What a peer without the secret can still do is deny service (delete keys, overwrite them with values
the ranks then refuse, or write torch's own process-group keys): the server then fails with an error,
never a wrong answer, and the store's port must still be firewalled to the cluster.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time
from datetime import timedelta

import torch.distributed as dist

from locus.errors import LocusError

log = logging.getLogger("locus.engine")
SECRET_ENV = "LOCUS_EP_SECRET"
MAC_BYTES = 32  # HMAC-SHA256


class RendezvousRefused(LocusError):
    """A value in the rendezvous store does not carry the launch's signature."""


def new_secret() -> str:
    return secrets.token_hex(32)


def loopback_listener() -> socket.socket:
    """A listening socket on 127.0.0.1 (a free port), for the store rank 0 of `--ep-ranks` hosts."""
    return _listener("127.0.0.1", 0)


def _listener(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise LocusError(f"the rendezvous store cannot listen on {address}:{port}: {exc.strerror}") from None
    sock.listen(1024)
    return sock


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine that traffic to `host` leaves from (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise LocusError(f"MASTER_ADDR {host!r} does not resolve: {exc.strerror}") from None
    family, _, _, _, target = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (Linux), else None."""
    if ipaddress.ip_address(address).version != 4:
        return None
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def pin_transport_interface(address: str) -> None:
    """gloo's sockets and NCCL's bootstrap on the interface holding `address` (the operator's own
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win)."""
    name = interface_of(address)
    if name is None:
        log.warning("no network interface holds %s: gloo picks its own (set GLOO_SOCKET_IFNAME)", address)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def open_store(rank: int, world: int, timeout: timedelta, listener: socket.socket | None = None):
    """The launch's TCPStore: rank 0 hosts it on `listener` (bound to the launch's address; the store
    takes the socket over), or connects to torchrun's agent store when the agent hosts one; the other
    ranks connect to MASTER_ADDR:MASTER_PORT."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if rank == 0 and not agent_store:
        if listener is None:  # no agent store: bind MASTER_PORT on the address that reaches MASTER_ADDR (this machine)
            listener = _listener(local_address_towards(host, port), port)
        return dist.TCPStore(host, port, world, True, timeout, wait_for_workers=True,
                             master_listen_fd=listener.detach(), use_libuv=True)
    if listener is not None:
        listener.close()
    return dist.TCPStore(host, port, world, False, timeout)


def launch_secret() -> str:
    """This launch's secret (LOCUS_EP_SECRET; `--ep-ranks` sets it for its ranks). Without one (a
    torchrun launch whose operator set none) the values are signed with an empty key: a warning says so."""
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        log.warning("%s is not set: the rendezvous store's values are not authenticated; set it to the same random "
                    "value on every node (docs/expert_parallel.md, \"Exposure\")", SECRET_ENV)
        return ""
    return secret


class SignedStore:
    """Locus's view of the rendezvous store: its keys under a prefix derived from the launch's secret,
    every value signed with it (see the module doc)."""

    def __init__(self, store, secret: str):
        self.store = store
        self._key = hashlib.sha256(b"locus-ep-key" + secret.encode()).digest()
        self.prefix = f"locus/ep/{hashlib.sha256(b'locus-ep-prefix' + secret.encode()).hexdigest()[:16]}/"

    def _mac(self, name: str, value: bytes) -> bytes:
        return hmac.new(self._key, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, name: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else value
        self.store.set(self.prefix + name, self._mac(name, data) + data)

    def check(self, name: str) -> bool:
        return self.store.check([self.prefix + name])

    def get_verified(self, name: str) -> bytes:
        """The value of `name`; RendezvousRefused if it does not carry the launch's signature."""
        raw = self.store.get(self.prefix + name)
        mac, data = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(name, data)):
            raise RendezvousRefused(f"the rendezvous store's {name!r} was not written by a rank of this launch "
                                    "(no valid signature): refused")
        return data

    def wait_get(self, name: str, timeout: float, cancelled=None) -> bytes:
        """Wait up to `timeout` seconds for a validly signed value of `name` (a forged one is logged and
        waited past: the rank that owns the key may still write it)."""
        deadline = time.monotonic() + timeout
        refused = None
        while True:
            if self.check(name):
                try:
                    return self.get_verified(name)
                except RendezvousRefused as exc:
                    if refused is None:
                        log.error("%s", exc)
                    refused = exc
            if time.monotonic() >= deadline:
                if refused is not None:
                    raise refused
                raise TimeoutError(f"the rendezvous store's {name!r} did not appear within {timeout:g} s")
            if cancelled is not None and cancelled():
                raise RecoveryCancelled("the server is stopping")
            time.sleep(0.005)

    def process_group_store(self, generation: int):
        """The store torch's process group of `generation` meets in (torch's own keys: not signed)."""
        return dist.PrefixStore(f"{self.prefix}g{generation}/pg/", self.store)


class RecoveryCancelled(LocusError):
    """The server stopped while the survivors of a lost rank were regrouping."""


_current: SignedStore | None = None  # this process's launch (report_failure / failure_cause read it)


def set_current(store: SignedStore | None) -> None:
    global _current
    _current = store


def current() -> SignedStore | None:
    return _current
