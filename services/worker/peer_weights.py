"""Where a worker's weights come from (`--weights-from disk | peer | auto`), and serving its own
to new workers of the same model: a WeightsServer beside the TCP KV server, announced on
weights_ask (NATS request/reply) to a worker that asks for the model by its served name."""

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg

from services.nats_client import connect_nats
from services.worker.config import WorkerConfig
from shared import protocol, subjects
from shared.errors import ProtocolError, WeightsPeerError
from shared.peer.client import fetch_files
from shared.peer.server import WeightsServer
from shared.protocol import WeightsAskMsg, WeightsOfferMsg
from shared.transfer.auth import SecretRefusedError

log = logging.getLogger(__name__)
ASK_TIMEOUT_S = 1.0  # one ask; asked again until config.weights_wait_s


@dataclass(frozen=True)
class Weights:
    """Where the engine reads the model: a folder, and a peer's weights server or ""."""

    model_dir: Path  # the model folder, or the cache folder of the peer's small files
    peer: str = ""  # host:port (EngineConfig.weights_peer); "": the folder's weights


def from_peer(config: WorkerConfig) -> bool:
    """auto: disk when the model folder is there, else a peer."""
    if config.weights_from == "auto":
        return not Path(config.model_dir).is_dir()
    return config.weights_from == "peer"


async def resolve_weights(config: WorkerConfig) -> Weights:
    """The folder (disk), or a peer's small files fetched into the cache and its endpoint."""
    if not from_peer(config):
        return Weights(Path(config.model_dir))
    if not config.kv_secret:
        raise WeightsPeerError(
            f"--weights-from peer (model {config.name!r}) needs the shared secret "
            "TISON_KV_SECRET, the one the running workers hold"
        )
    offer = await find_peer(config)
    cache = config.cache_dir / "peer-models" / _safe(config.name)
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        files = await asyncio.to_thread(
            fetch_files, offer.endpoint, config.kv_secret.encode(), cache, config.weights_timeout_s
        )
    except SecretRefusedError:
        raise WeightsPeerError(_refused(config, offer)) from None
    except TimeoutError:
        raise WeightsPeerError(
            f"weights peer {offer.endpoint} sent nothing for {config.weights_timeout_s:g} s "
            "(stopped, or its host cut off)"
        ) from None
    except OSError as e:
        raise WeightsPeerError(f"weights peer {offer.endpoint} broke off: {e}") from e
    log.info(
        "model %r from peer %s (%s, %s): %d files into %s in %.2f s",
        config.name, offer.worker_id, offer.endpoint,
        "compressed" if offer.compressed else "raw", len(files), cache,
        time.perf_counter() - start,
    )  # fmt: skip
    return Weights(cache, offer.endpoint)


async def find_peer(config: WorkerConfig) -> WeightsOfferMsg:
    """The first running worker that answers for the model, asked until weights_wait_s."""
    nc = await connect_nats(config.nats_url, f"tison-{config.worker_id}-weights", config.nats)
    ask = protocol.encode(WeightsAskMsg(config.name))
    deadline = time.monotonic() + config.weights_wait_s
    try:
        while time.monotonic() < deadline:
            try:
                reply = await nc.request(subjects.weights_ask(), ask, timeout=ASK_TIMEOUT_S)
                offer = protocol.decode(reply.data, WeightsOfferMsg)
                if offer.model == config.name:
                    return offer
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ProtocolError):
                await asyncio.sleep(0.2)
    finally:
        await nc.close()
    raise WeightsPeerError(
        f"no running worker announced the weights of model {config.name!r} within "
        f"{config.weights_wait_s:g} s (--weights-from {config.weights_from}: the model folder "
        f"{config.model_dir} is not used); start one with the model folder and TISON_KV_SECRET"
    )


def _refused(config: WorkerConfig, offer: WeightsOfferMsg) -> str:
    return (
        f"weights peer {offer.endpoint} ({offer.worker_id}) refused the secret: "
        f"TISON_KV_SECRET differs from the running workers' (model {config.name!r})"
    )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "model"


class WeightsAnnouncer:
    """A worker's weights server, and its answers to weights_ask for its model."""

    def __init__(self, nc, config: WorkerConfig, server: WeightsServer, endpoint: str):
        self.nc, self.config, self.server = nc, config, server
        self.offer = WeightsOfferMsg(
            config.worker_id, config.name, endpoint, server.source.compressed
        )

    @classmethod
    async def start(cls, nc, config: WorkerConfig, model_dir: Path) -> "WeightsAnnouncer":
        server = await asyncio.to_thread(WeightsServer, model_dir, config.kv_secret.encode())
        endpoint = server.start(config.kv_host, toward=config.nats_url)
        announcer = cls(nc, config, server, endpoint)
        await nc.subscribe(subjects.weights_ask(), cb=announcer._on_ask)
        log.info("serving the weights of %r to peers on %s", config.name, endpoint)
        return announcer

    @protocol.on_message(WeightsAskMsg)
    async def _on_ask(self, ask: WeightsAskMsg, msg: Msg) -> None:
        if ask.model == self.config.name and msg.reply:
            await self.nc.publish(msg.reply, protocol.encode(self.offer))

    def close(self) -> None:
        self.server.close()
