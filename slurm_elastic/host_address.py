"""This host's address as other nodes reach it: shared by the controller (where it listens) and a
server worker's wrapper (the endpoint it registers)."""

from __future__ import annotations

import ipaddress
import socket


def reachable_address() -> tuple[str, str]:
    """(address, how it was found): this host's name's address, or, where that is loopback (a stock
    Debian ``/etc/hosts`` maps the name to 127.0.1.1), the first IPv4 address of an interface that
    is up and neither loopback nor link-local (psutil reads them); loopback only where there is
    none (its "how" then starts with "loopback")."""
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = "127.0.0.1"
    if not ipaddress.ip_address(named).is_loopback:
        return named, "this host's name"
    for interface, address in interface_addresses():
        return address, (f"this host's name resolves to {named} (loopback), which other nodes cannot "
                         f"reach: the address of {interface}")
    return named, (f"loopback: this host's name resolves to {named} and no other interface is up; "
                   "other hosts cannot reach it")


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of the interfaces that are up, loopback and link-local left out."""
    import psutil  # here, not at the top: a worker step's wrapper imports this module at every start

    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    return [(name, a.address) for name, addresses in psutil.net_if_addrs().items() if name in up
            for a in addresses if a.family == socket.AF_INET
            and not (ip := ipaddress.ip_address(a.address)).is_loopback and not ip.is_link_local]
