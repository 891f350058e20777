"""Which network interface a rank's gloo pairs should listen on.

Gloo, unless GLOO_SOCKET_IFNAME names an interface, listens on the address this machine's hostname
resolves to and tells its peers that address. Many Linux images map the hostname to 127.0.1.1 (or
127.0.0.1) in /etc/hosts, so across nodes every rank advertises loopback and the group never forms:
a "connection refused" or a timeout after `fault.detect_timeout_s`. Ray already knows an address by
which other nodes reach this one (its node IP); the interface that holds it is the one to use.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Optional

_SIOCGIFADDR = 0x8915  # Linux: read an interface's IPv4 address


def interface_ipv4(name: str) -> Optional[str]:
    """The IPv4 address of interface `name`, or None (no address, or not Linux)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_with_address(address: str) -> Optional[str]:
    """The name of this machine's interface whose IPv4 address is `address`, or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if interface_ipv4(name) == address), None)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a hostname
        return address == "localhost"
