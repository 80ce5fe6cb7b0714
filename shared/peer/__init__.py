"""Weights from a peer: a running worker serves its model folder read-only over an
authenticated TCP channel (server.py); a new worker's ranks read their tensors from it
(client.py, PeerCheckpoint) instead of a shared model store. wire.py is the format."""
