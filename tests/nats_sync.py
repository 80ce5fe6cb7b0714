"""Waiting until a subscription is live on the server, for tests that then publish on another
connection."""


async def subscribed(nc) -> None:
    """Return once the server holds every SUB `nc` has queued.

    nats-py (2.16) writes a flush's PING straight to the socket, ahead of the commands still
    queued for its flusher task, so the PONG of one flush can come back before the server has
    read a SUB queued just before it; a message published then on another connection finds no
    subscriber ("no responders", or it is dropped). The first flush has handed the queued
    commands to the socket by the time its PONG arrives; the second PING follows them, so its
    PONG proves the server took them. One connection needs none of this: the server reads a
    connection's commands in order."""
    await nc.flush()
    await nc.flush()
