"""The address a wildcard-bound KV or weights server advertises (shared/netaddr.py)."""

import socket

from shared.netaddr import dial_address


def test_a_bound_address_is_advertised_as_it_is():
    assert dial_address(("10.1.2.3", 5000), "nats://10.9.9.9:4222") == "10.1.2.3:5000"


def test_a_wildcard_advertises_the_route_toward_nats():
    assert dial_address(("0.0.0.0", 7), "nats://127.0.0.1:4222") == "127.0.0.1:7"
    urls = "nats://user:pw@127.0.0.1:4222, nats://127.0.0.2:4222"  # the first server's route
    assert dial_address(("0.0.0.0", 7), urls) == "127.0.0.1:7"
    assert dial_address(("0.0.0.0", 7), "127.0.0.1:4222") == "127.0.0.1:7"  # no scheme


def test_without_a_route_it_falls_back_to_the_hosts_name():
    named = socket.gethostbyname(socket.gethostname())
    assert dial_address(("0.0.0.0", 7), "nats://no-such-host.invalid:4222") == f"{named}:7"
    assert dial_address(("0.0.0.0", 7), "") == f"{named}:7"
