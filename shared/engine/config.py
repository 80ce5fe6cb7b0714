"""EngineConfig: everything one engine instance needs, validated at construction."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.codec.checkpoint import is_compressed_dir
from shared.engine import device as devices
from shared.errors import InvalidRequestError
from shared.models.layers.attention_backend import BACKENDS
from shared.parallel.shape import ParallelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_MEMORY_RESERVE_BYTES = 1 << 30  # a CPU rank's activations and workspaces
GRAPH_MODES = ("auto", "on", "off")  # EngineConfig.decode_graphs


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    dtype: str = (
        "auto"  # float32 | bfloat16 | float16 | auto (the checkpoint's, float32 if unknown;
        # a float16 checkpoint runs in bfloat16 on a CPU: torch_dtype)
    )
    page_size: int = 16  # tokens per KV page
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # memory budget of the KV pool
    num_pages: int | None = None  # exact pool size; overrides kv_cache_bytes (tests, transfers)
    # each rank's memory for weights + KV pool + memory_reserve_bytes: the pool takes what the
    # weights leave (shared/engine/footprint.py, tison plan's calculator); overrides
    # kv_cache_bytes, not num_pages
    memory_bytes: int | None = None
    memory_reserve_bytes: int = DEFAULT_MEMORY_RESERVE_BYTES  # activations, workspaces
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill cap)
    # background (batch) requests' prompt tokens a step at most: a request arriving while they
    # prefill waits for a short step only
    max_background_tokens: int = 64
    max_num_seqs: int = 256  # running requests at most
    max_model_len: int | None = None  # prompt + output cap; default: max_position_embeddings
    seed: int = 0  # seeds of requests that set none are drawn from this
    kv_shm_path: Path | None = None  # put the KV pool in this /dev/shm file (decode workers)
    tp: int = 1  # tensor-parallel ranks per stage
    pp: int = 1  # pipeline stages
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None: an even split
    ep: bool = False  # MoE layers: whole experts spread over each stage's TP ranks
    # data-parallel attention ranks (shared/engine/data_parallel.py): each its own requests and
    # KV pool, the MoE layers' experts spread over them
    dp: int = 1
    allow_oversubscribe: bool = False  # allow more ranks (dp * tp * pp) than CPU cores
    kv_push: bool = False  # prefill workers: every rank writes its KV into decode workers' pools
    kv_transport: str = "auto"  # kv_push: auto | shm | tcp | dist | cuda_ipc (transfer/handoff.py)
    kv_secret: str = field(default="", repr=False)  # kv_push over TCP; never in to_json_dict
    # host:port of a running worker's weights server (shared/peer): every rank reads its
    # tensors from it, authenticated with kv_secret; model_dir holds the small files only
    weights_peer: str = ""
    weights_timeout_s: float = 120.0  # a weights peer silent this long mid-load fails the load
    cpus: tuple[int, ...] = ()  # pin the ranks to these cores, an even share each; (): unpinned
    # where every rank's tensors live (weights, KV pool, steps): cpu | cuda (rank r on the r-th
    # visible GPU) | cuda:N (one rank) | auto (cuda if torch sees a GPU); shared/engine/device.py
    device: str = "cpu"
    # cuda: each rank's weights, reserve and KV pool take this share of its GPU's memory (the
    # pool what the others leave), unless memory_bytes or num_pages says otherwise
    gpu_memory_utilization: float = 0.9
    # decode steps replayed from captured CUDA graphs (shared/engine/graphs.py): auto (on CUDA),
    # on (also on the CPU, through the same static buffers: how the tests check them), off
    # (eager: on the CPU also without the fused decoder's one call, layer by layer, op by op)
    decode_graphs: str = "auto"
    attention_backend: str = "auto"  # auto (by device and dtype) | cpu_kernels | cuda | torch
    # chunked layers (Llama 4) keep only their chunk's KV, in page groups of the one pool
    # (shared/kv/chunk_cache.py): engines of any T x P shape that push no KV (decode workers
    # and engines without a handoff). None: wherever that holds; True: required; False: never
    cap_chunked_kv: bool | None = None
    # full pages of computed KV stay cached after their requests (shared/kv/prefix_cache.py):
    # a request computes only its uncached suffix (with capped chunked layers: as far as their
    # window's pages are cached too)
    enable_prefix_caching: bool = True
    # a compressed folder's (tison compress) decoder-layer linear weights stay encoded on the
    # device and are decoded into shared scratch just before each layer runs
    # (shared/models/resident.py): weights take ~their compressed size plus one layer's.
    # One rank; decode steps run eagerly (no decode graphs)
    resident_codec: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "device", devices.resolve(self.device))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError("gpu_memory_utilization", "must be in (0, 1]")
        if self.decode_graphs not in GRAPH_MODES:
            raise InvalidRequestError(
                "decode_graphs",
                f"must be one of {', '.join(GRAPH_MODES)}; got {self.decode_graphs!r}",
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                "dtype", f"must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}"
            )
        if self.attention_backend not in BACKENDS:
            raise InvalidRequestError(
                "attention_backend",
                f"must be one of {', '.join(BACKENDS)}; got {self.attention_backend!r}",
            )
        for name in (
            "page_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs",
            "max_background_tokens",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise InvalidRequestError(name, "must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise InvalidRequestError("num_pages", "must be >= 1")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise InvalidRequestError("memory_bytes", "must be >= 1")
        if self.memory_reserve_bytes < 0:
            raise InvalidRequestError("memory_reserve_bytes", "must be >= 0")
        if self.weights_timeout_s <= 0:
            raise InvalidRequestError("weights_timeout_s", "must be > 0")
        if self.weights_peer and not self.kv_secret:
            raise InvalidRequestError(
                "weights_peer", "weights from a peer need the shared secret (TISON_KV_SECRET)"
            )
        if self.kv_shm_path is not None:
            object.__setattr__(self, "kv_shm_path", Path(self.kv_shm_path))
            if self.on_gpu:
                raise InvalidRequestError(
                    "kv_shm_path", "a KV pool in shared memory is a CPU pool (GPU pools: cuda_ipc)"
                )
        object.__setattr__(self, "pp_layers", self.parallel.pp_layers)  # validates the shape
        object.__setattr__(self, "cpus", tuple(self.cpus))
        if self.cap_chunked_kv and not self._can_cap_chunked_kv:
            raise InvalidRequestError(
                "cap_chunked_kv",
                "capped chunked layers are for engines that push no KV only "
                "(not with kv_push: a prefill worker writes whole page lists)",
            )
        if self.resident_codec:
            self._check_resident_codec()
        if self.cpus and len(self.cpus) < self.parallel.world_size and not self.allow_oversubscribe:
            raise InvalidRequestError(
                "cpus",
                f"{len(self.cpus)} CPUs for {self.parallel.world_size} ranks "
                "(one core per rank at least, or allow_oversubscribe)",
            )

    def _check_resident_codec(self) -> None:
        """InvalidRequestError naming what resident_codec cannot run with."""
        if self.parallel.world_size != 1:
            raise InvalidRequestError(
                "resident_codec",
                f"one rank only (tp = pp = dp = 1); got tp={self.tp}, pp={self.pp}, dp={self.dp}",
            )
        if self.decode_graphs == "on":
            raise InvalidRequestError(
                "decode_graphs",
                "resident_codec plans each layer's decode on the host: decode steps run eagerly "
                "(decode_graphs auto or off)",
            )
        if self.weights_peer:
            raise InvalidRequestError("weights_peer", "resident_codec reads the planes from disk")
        if not is_compressed_dir(self.model_dir):
            raise InvalidRequestError(
                "resident_codec", f"{self.model_dir} is not a compressed folder (tison compress)"
            )

    @property
    def _can_cap_chunked_kv(self) -> bool:
        return not self.kv_push

    @property
    def caps_chunked_kv(self) -> bool:
        """Whether chunked layers keep only their window's KV (if the model has them)."""
        return self.cap_chunked_kv is not False and self._can_cap_chunked_kv

    def rank_device(self, rank: int = 0) -> torch.device:
        """Where rank `rank`'s tensors live."""
        return devices.rank_device(self.device, rank, self.parallel.world_size)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def uses_graphs(self) -> bool:
        """Whether decode steps replay captured graphs (static buffers on the CPU)."""
        if self.resident_codec:  # the weights' decode is planned on the host, layer by layer
            return False
        return self.decode_graphs == "on" or (self.decode_graphs == "auto" and self.on_gpu)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            self.tp, self.pp, self.pp_layers, self.allow_oversubscribe, self.ep, self.dp
        )

    def to_json_dict(self) -> dict:
        """Plain values (paths as strings), for the other ranks' command line."""
        fields = dataclasses.asdict(self)
        del fields["kv_secret"]  # the other ranks read it from their environment (ranks.py)
        return {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}

    def torch_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        """The dtype the model runs in. auto: the checkpoint's, but bfloat16 for a float16
        checkpoint on a CPU, as vLLM's CPU backend does: CPUs have no fast float16 matmul, and
        Tison's kernels take bfloat16 and float32 (float16's range fits bfloat16's)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        dtype = DTYPES.get(checkpoint_dtype, torch.float32)
        return torch.bfloat16 if dtype == torch.float16 and not self.on_gpu else dtype
