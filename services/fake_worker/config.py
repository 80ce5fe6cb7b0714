"""Settings of a fake worker process."""

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.nats_client import NatsClientOptions

ROLES = ("prefill", "decode", "both")


def default_worker_id(role: str) -> str:
    """Unique per process, so a restarted worker is a new worker to the registries."""
    host = socket.gethostname().replace(".", "-")
    return f"fake-{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class FakeWorkerConfig:
    """How the fake worker behaves; timings default to 0 (as fast as possible)."""

    role: str  # "prefill", "decode" or "both" (one of each in this process)
    model_dir: Path
    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsClientOptions | None = None  # credentials and TLS; None: from the environment
    worker_id: str = ""  # "" → default_worker_id(role); "both" appends -prefill / -decode
    served_model_name: str = ""  # "" → the model folder's name
    num_pages: int = 4096  # KV pool size of each role
    page_size: int = 16  # tokens per page
    step_s: float = 0.0  # decode step time
    prefill_token_s: float = 0.0  # prefill time per prompt token
    heartbeat_s: float = 0.5
    max_model_len: int = 0  # 0 → max_position_embeddings of the model
    eos_after: int | None = None  # emit EOS at this output index (unless ignore_eos)
    prefix_caching: bool = True  # name admitted prompts' pages and publish KV events (prefix.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.num_pages < 1 or self.page_size < 1 or self.heartbeat_s <= 0:
            raise ValueError("num_pages and page_size must be >= 1, heartbeat_s > 0")
        if self.step_s < 0 or self.prefill_token_s < 0 or self.max_model_len < 0:
            raise ValueError("timings and max_model_len must be >= 0")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", default_worker_id(self.role))

    def role_ids(self) -> dict[str, str]:
        """Worker id of each role this process runs."""
        if self.role == "both":
            return {"prefill": f"{self.worker_id}-prefill", "decode": f"{self.worker_id}-decode"}
        return {self.role: self.worker_id}
