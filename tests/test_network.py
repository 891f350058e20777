"""Which interface gloo listens on across nodes (elixir_ray/cluster/network.py), read from this
machine's real interfaces."""

import socket
import sys

import pytest

from elixir_ray.cluster.network import interface_ipv4, interface_with_address, is_loopback

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads interfaces with a Linux ioctl")


@linux
def test_the_loopback_address_is_found_on_the_loopback_interface():
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_ipv4("lo") == "127.0.0.1"


@linux
def test_every_interface_with_an_address_is_found_by_it():
    found = {name: interface_ipv4(name) for _, name in socket.if_nameindex()}
    assert any(found.values())
    for name, address in found.items():
        if address is not None:
            assert interface_ipv4(interface_with_address(address)) == address


def test_an_address_this_machine_does_not_have_finds_no_interface():
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: never assigned
    assert interface_ipv4("no-such-if0") is None


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("localhost", True),
    ("192.0.2.2", False), ("10.1.2.3", False), ("head-node", False),
])
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback
