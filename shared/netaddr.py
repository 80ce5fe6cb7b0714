"""The address a server listening on every interface tells its peers to dial.

A worker's KV and weights servers bound to 0.0.0.0 advertise the source address of this host's
route toward the NATS server: every peer reaches NATS, so that interface is one they can reach
too (a host's name often resolves to 127.0.1.1, which no other host can dial)."""

import socket
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::", "")


def route_source(host: str) -> str | None:
    """This host's address on its route toward `host` (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:  # unresolvable, or no route
        return None


def dial_address(bound: tuple, toward_url: str = "") -> str:
    """host:port for peers of a server bound to `bound` (host, port, ...): the bound host unless it
    is a wildcard, then the route source toward the first server of `toward_url` (nats://...),
    else what this host's name resolves to."""
    host, port = bound[0], bound[1]
    if host not in WILDCARDS:
        return f"{host}:{port}"
    first = toward_url.split(",")[0].strip()
    target = urlsplit(first if "://" in first else f"nats://{first}").hostname if first else None
    source = route_source(target) if target else None
    return f"{source or socket.gethostbyname(socket.gethostname())}:{port}"
