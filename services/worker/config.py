"""Settings of a real (model-running) worker process."""

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.nats_client import NatsClientOptions
from shared import subjects
from shared.engine.config import DEFAULT_KV_CACHE_BYTES
from shared.transfer.handoff import TRANSPORTS

ROLES = ("prefill", "decode", "colocated")
WEIGHTS_FROM = ("auto", "disk", "peer")
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tison"
# Token budget of a step. A colocated step mixes the decode rows with a prompt chunk, and every
# stream waits for that chunk: a smaller budget bounds the stall (ITL) at some prefill speed. A
# prefill worker's chunks of 512 let the first prompts of a burst go to decode while the rest
# are computed (2048: the burst's prompts finished together and the workers took turns idling).
STEP_TOKENS = {"prefill": 512, "decode": 2048, "colocated": 128}


def default_worker_id(role: str) -> str:
    """Unique per process, so a restarted worker is a new worker to the registries."""
    host = socket.gethostname().replace(".", "-")
    return f"{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # prefill | decode | colocated (prefill and decode in one engine)
    model_dir: Path
    dtype: str = "auto"
    device: str = "auto"  # EngineConfig.device: cpu | cuda | cuda:N | auto
    gpu_memory_utilization: float = 0.9  # EngineConfig's: each GPU's share for this worker
    enforce_eager: bool = False  # decode op by op (EngineConfig.decode_graphs off)
    resident_codec: bool = False  # EngineConfig's: layer weights stay compressed on the device
    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsClientOptions | None = None  # credentials and TLS; None: from the environment
    worker_id: str = ""  # "" -> default_worker_id(role)
    served_model_name: str = ""  # "" -> the model folder's name
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    memory_bytes: int | None = None  # per rank: weights + KV pool + reserve (EngineConfig)
    enable_prefix_caching: bool = True  # EngineConfig's: computed full pages stay cached
    num_pages: int | None = None
    page_size: int = 16
    max_num_batched_tokens: int = 0  # 0: the role's STEP_TOKENS
    max_num_seqs: int = 256
    max_model_len: int | None = None
    heartbeat_s: float = 0.5
    # a reservation whose KV has not arrived by then is dropped, its pages freed
    reservation_lease_s: float = 120.0
    kv_secret: str = ""  # shared secret of the TCP and dist KV transports ("" -> both off)
    kv_transport: str = "auto"  # prefill: auto | shm | tcp | dist | cuda_ipc
    kv_host: str = "127.0.0.1"  # decode: address the TCP and dist KV servers listen on
    shm_dir: Path = Path("/dev/shm")
    tp: int = 1  # tensor-parallel ranks per pipeline stage
    pp: int = 1  # pipeline stages
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None: an even split
    ep: bool = False  # MoE layers: whole experts spread over the TP ranks
    dp: int = 1  # data-parallel attention ranks, MoE experts spread over them
    allow_oversubscribe: bool = False  # more ranks than CPU cores
    cpus: tuple[int, ...] = ()  # cores of this worker's ranks (`tison up` plans them); (): any
    # disk: model_dir's weights; peer: a running worker's of the same served model name, over
    # its weights server (shared/peer); auto: disk if model_dir is a folder, else a peer
    weights_from: str = "auto"
    weights_wait_s: float = 60.0  # peer: how long to wait for a worker to announce the model
    weights_timeout_s: float = 120.0  # peer: a peer silent this long mid-load fails the load
    cache_dir: Path = DEFAULT_CACHE_DIR  # peer: the small files of a model go under it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        if self.weights_from not in WEIGHTS_FROM:
            raise ValueError(
                f"weights_from must be one of {WEIGHTS_FROM}, got {self.weights_from!r}"
            )
        if self.heartbeat_s <= 0 or self.reservation_lease_s <= 0 or self.weights_timeout_s <= 0:
            raise ValueError("heartbeat_s, reservation_lease_s and weights_timeout_s must be > 0")
        if not self.max_num_batched_tokens:
            object.__setattr__(self, "max_num_batched_tokens", STEP_TOKENS[self.role])
        if not self.worker_id:
            object.__setattr__(self, "worker_id", default_worker_id(self.role))

    def role_ids(self) -> dict[str, str]:
        """Worker id per role this process serves."""
        return subjects.role_ids(self.role, self.worker_id)

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name
