"""Settings of a gateway process."""

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.nats_client import NatsClientOptions
from shared.registry import DEFAULT_MISS_LIMIT


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway settings (CLI flags); the served model name defaults to the model folder's name."""

    model_dir: Path  # tokenizer + chat template come from here
    served_model_name: str = ""  # "" → model_dir's folder name
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsClientOptions | None = None  # credentials and TLS; None: from the environment
    gateway_id: str = ""  # "" → a fresh unique id; workers send this gateway's tokens to it
    queue_timeout_s: float = 60.0  # how long a request may wait in the scheduler's queue
    batch_queue_timeout_s: float = 3600.0  # ... a batch one (x-tison-priority: batch)
    request_timeout_s: float = 600.0  # from arrival to the last token
    miss_limit: int = DEFAULT_MISS_LIMIT  # missed heartbeats before a worker counts as dead
    dead_grace_s: float = 1.5  # an assigned worker never heard of this long is dead too
    max_model_len: int = 0  # used while no worker reports one; 0 → the tokenizer's limit
    api_key: str = field(default="", repr=False)  # "" → no key; else `Authorization: Bearer`
    max_body_bytes: int = 0  # larger bodies get a 413 unread; 0 → sized from the context
    tool_call_parser: str = "auto"  # a shared.tool_calls name, "auto" (detect) or "none"
    batch_runners: int = 8  # batch lines this gateway runs at once (services/batch); 0: none

    def __post_init__(self) -> None:
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", Path(self.model_dir).name)
        if not self.gateway_id:
            object.__setattr__(self, "gateway_id", f"gw-{uuid.uuid4().hex[:12]}")
        timeouts = (self.queue_timeout_s, self.batch_queue_timeout_s, self.request_timeout_s)
        if min(timeouts) <= 0 or self.dead_grace_s < 0:
            raise ValueError("timeouts must be > 0")
        if self.batch_runners < 0:
            raise ValueError("batch_runners must be >= 0")
        if self.miss_limit < 1 or self.max_model_len < 0 or self.max_body_bytes < 0:
            raise ValueError("miss_limit must be >= 1, max_model_len and max_body_bytes >= 0")

    def body_limit(self, context_tokens: int) -> int:
        """max_body_bytes, or 64 bytes a token of the context (a prompt of token ids as JSON,
        or text with every character escaped, fits), 1 MiB at least."""
        return self.max_body_bytes or max(1 << 20, 64 * context_tokens)
