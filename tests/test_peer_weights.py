"""Weights from a peer (shared/peer) over a real WeightsServer on loopback: a model loaded from
it equals the disk load parameter for parameter (raw float32, compressed float32 and bf16, FP8
folders; a PP stage; TP ranks, which fetch only their slices; TP=2 ranks each reading for
themselves, generating as from disk); a wrong secret is refused and the server serves on; the
server gives out only the files and tensors its index lists; a peer dying mid-load fails the
load with an error naming it, and so does one that goes silent mid-load (stopped, its host cut
off: the connection stays open), after the read timeout; no thread is left."""

import socket
import threading
import time

import pytest
import torch

from shared.checkpoint import Checkpoint
from shared.codec.folder import compress_dir
from shared.engine.llm import LLM
from shared.errors import ModelFolderError, WeightsPeerError
from shared.models.config import ModelConfig
from shared.models.loader import load_model
from shared.parallel.group import SINGLE, TPGroup
from shared.parallel.pipeline import WHOLE_MODEL, PPStage
from shared.peer import wire
from shared.peer.ahead import Siblings
from shared.peer.client import PeerCheckpoint, connect, fetch_files, for_stage, request
from shared.peer.server import WeightsServer
from shared.sampling.params import SamplingParams

from quant_helpers import quantize_fp8, save_bf16
from waiting import wait_until

SECRET = b"peer-secret"


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    """raw (float32), compressed, a bf16 copy compressed (what checkpoints mostly are), FP8."""
    out = tmp_path_factory.mktemp("peer")
    compress_dir(tiny_llama, out / "compressed")
    compress_dir(save_bf16(tiny_llama, out / "bf16"), out / "bf16-compressed")
    quantize_fp8(tiny_llama, out / "fp8", block=(16, 16))
    return {
        "raw": tiny_llama,
        "compressed": out / "compressed",
        "bf16-compressed": out / "bf16-compressed",
        "fp8": out / "fp8",
    }


@pytest.fixture(scope="module")
def servers(folders):
    started = {kind: WeightsServer(path, SECRET) for kind, path in folders.items()}
    endpoints = {kind: s.start() for kind, s in started.items()}
    yield started, endpoints
    for s in started.values():
        s.close()


def load(model_dir, weights=None, stage=WHOLE_MODEL, tp=SINGLE):
    cfg = ModelConfig.from_dir(model_dir)
    dtype = torch.bfloat16 if cfg.torch_dtype == "bfloat16" else torch.float32
    return load_model(model_dir, cfg, dtype, tp, stage, weights=weights)


def assert_same_parameters(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert p.dtype == pb[name].dtype and torch.equal(p, pb[name]), name


@pytest.mark.parametrize("kind", ["raw", "compressed", "bf16-compressed", "fp8"])
def test_a_model_from_a_peer_equals_the_disk_load(folders, servers, kind):
    """Bit for bit; an FP8 folder's scales come along and dequantize as from disk."""
    _, endpoints = servers
    peer = PeerCheckpoint(endpoints[kind], SECRET)
    assert_same_parameters(load(folders[kind], peer), load(folders[kind]))
    disk = Checkpoint.open(folders[kind])
    stored = sum(_nbytes(disk.get(name)) for name in peer.names())
    if "compressed" in kind:  # the planes travel as stored, smaller than the tensors
        assert peer.bytes_received < stored
    else:
        assert peer.bytes_received == stored


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("kind", ["raw", "bf16-compressed", "fp8"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_rank_from_a_peer_holds_the_shard_of_the_disk_load(folders, servers, kind, rank):
    """A TP rank's weight_loaders narrow PeerSlices as they narrow a folder's lazy slices, and
    only the rank's rows or columns cross the wire: about half of the model at TP=2 (the
    norms, replicated, whole), raw bytes however the folder stores them."""
    _, endpoints = servers
    tp = TPGroup(rank, 2)
    peer = PeerCheckpoint(endpoints[kind], SECRET, sliced=True)
    assert_same_parameters(load(folders[kind], peer, tp=tp), load(folders[kind], tp=tp))
    disk = Checkpoint.open(folders[kind])
    decoded = sum(_nbytes(disk.get(name)) for name in disk.names())
    assert 0.45 * decoded < peer.bytes_received < 0.55 * decoded
    # the first layer's narrows wait a round trip; the later layers' were asked ahead
    layers = ModelConfig.from_dir(folders[kind]).num_layers
    assert layers >= 2 and peer.round_trips <= peer.narrows / layers + 2, peer.round_trips


def test_a_slice_outside_the_tensor_is_refused_and_the_server_serves_on(servers):
    """Checked by the client before it asks; a request the server cannot cut is answered with
    an error and the connection closed, and the next connection is served. The tensors a
    compressed folder decoded for slices are let go when the last connection closes."""
    server, endpoints = servers
    peer = PeerCheckpoint(endpoints["compressed"], SECRET, sliced=True)
    lazy = peer.get_slice("model.embed_tokens.weight")
    rows, cols = lazy.shape
    with pytest.raises(ValueError, match=f"rows 0..{rows + 1} of dimension 0"):
        lazy.narrow(0, 0, rows + 1)
    with pytest.raises(ValueError, match="no dimension 2"):
        lazy.narrow(2, 0, 1)
    assert torch.equal(lazy.narrow(-1, 3, 5), peer.get("model.embed_tokens.weight")[:, 3:8])
    peer.close()
    with connect(endpoints["compressed"], SECRET) as sock:
        ask = {"op": "slice", "name": "model.embed_tokens.weight", "dim": 0, "start": rows}
        with pytest.raises(wire.PeerError):
            request(sock, dict(ask, length=4))
    with connect(endpoints["compressed"], SECRET) as sock:
        header, _ = request(sock, dict(ask, start=0, length=4))
        assert header["shape"] == [4, cols] and header["coded"] is None
        assert server["compressed"].source.decoded_bytes() > 0  # for the other ranks
    wait_until(lambda: server["compressed"].source.decoded_bytes() == 0, 10, "decoded let go")


def test_a_pipeline_stage_reads_only_its_layers(tiny_llama, servers):
    _, endpoints = servers
    stage = PPStage(rank=1, size=2, start_layer=1, end_layer=None)
    peer = PeerCheckpoint(endpoints["compressed"], SECRET, for_stage(stage))
    assert_same_parameters(load(tiny_llama, peer, stage), load(tiny_llama, stage=stage))
    whole = PeerCheckpoint(endpoints["compressed"], SECRET)
    whole.get_many(whole.names())
    assert 0 < peer.bytes_received < whole.bytes_received
    whole.close()


def test_two_tp_ranks_read_from_the_peer_and_generate_as_from_disk(tiny_llama, servers, tmp_path):
    """Rank 0 and its rank process each open their own PeerCheckpoint (EngineConfig.weights_peer,
    the secret through the environment); model_dir holds the fetched small files only."""
    _, endpoints = servers
    fetched = fetch_files(endpoints["compressed"], SECRET, tmp_path / "cache")
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not list((tmp_path / "cache").glob("*.safetensors"))
    prompts, greedy = ["def fibonacci(n):", "The quick brown fox"], SamplingParams(max_tokens=12)
    with LLM(tiny_llama, dtype="float32") as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy)]
    options = dict(tp=2, allow_oversubscribe=True, kv_secret=SECRET.decode())
    with LLM(tmp_path / "cache", "float32", weights_peer=endpoints["compressed"], **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected


def test_a_wrong_secret_is_refused_and_the_server_serves_on(tiny_llama, servers):
    server, endpoints = servers
    refused = server["raw"].refused
    with pytest.raises(WeightsPeerError, match="refused the secret"):
        PeerCheckpoint(endpoints["raw"], b"a guess")
    wait_until(lambda: server["raw"].refused == refused + 1, 10, "the refusal counted")
    peer = PeerCheckpoint(endpoints["raw"], SECRET)
    assert torch.equal(
        peer.get("model.norm.weight"), Checkpoint.open(tiny_llama).get("model.norm.weight")
    )
    peer.close()


@pytest.mark.parametrize(
    "path", ["../config.json", "/etc/passwd", "model.safetensors", "", "tokenizer.json/.."]
)
def test_only_the_listed_small_files_are_served(servers, path):
    _, endpoints = servers
    with connect(endpoints["raw"], SECRET) as sock:
        index, _ = request(sock, {"op": "index"})
        assert "config.json" in [f for f, _ in index["files"]]
        assert not any(f.endswith(".safetensors") for f, _ in index["files"])
        with pytest.raises(wire.PeerError, match="no file"):
            request(sock, {"op": "file", "path": path})
    with connect(endpoints["raw"], SECRET) as sock:  # a new connection is served
        header, data = request(sock, {"op": "file", "path": "config.json"})
        assert b"hidden_size" in data


def test_an_unknown_tensor_or_request_is_refused(servers):
    _, endpoints = servers
    peer = PeerCheckpoint(endpoints["compressed"], SECRET)
    with pytest.raises(ModelFolderError, match="no tensor"):
        peer.get("../../etc/passwd")
    peer.close()
    with connect(endpoints["compressed"], SECRET) as sock:
        with pytest.raises(wire.PeerError, match="unknown request"):
            request(sock, {"op": "read", "path": "/etc/passwd"})


def test_garbage_before_the_handshake_is_dropped(servers):
    server, endpoints = servers
    host, port = endpoints["raw"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.recv(32)
        sock.sendall(b"\xff" * 64)
        assert sock.recv(1) == b"\x00"  # refused
    peer = PeerCheckpoint(endpoints["raw"], SECRET)
    assert len(peer.names()) > 0
    peer.close()


class FailingServer(WeightsServer):
    """Answers a request for tensors with the first two, then fails as `fail` does."""

    def _answer(self, sock: socket.socket, header: dict) -> None:
        if header.get("op") != "tensors":
            return super()._answer(sock, header)
        for name in header["names"][:2]:
            frame, parts = wire.tensor_frame(self.source.encoded(str(name)))
            wire.send_frame(sock, frame, parts)
        self.fail(sock)

    def fail(self, sock: socket.socket) -> None:
        raise NotImplementedError


class DyingServer(FailingServer):
    """Its connection drops after the first tensors, as a killed peer's does."""

    def fail(self, sock: socket.socket) -> None:
        sock.shutdown(socket.SHUT_RDWR)
        raise ConnectionError("killed")


@pytest.mark.parametrize("kind", ["raw", "compressed"])
def test_a_peer_dying_mid_load_fails_the_load_with_a_clear_error(folders, kind):
    """The load ends with an error naming the peer, not a hang, and leaves no thread behind."""
    server = DyingServer(folders[kind], SECRET)
    endpoint = server.start()
    before = set(threading.enumerate())
    try:
        cfg = ModelConfig.from_dir(folders["raw"])
        with pytest.raises((WeightsPeerError, ModelFolderError)) as failed:
            load_model(folders["raw"], cfg, torch.float32, weights=PeerCheckpoint(endpoint, SECRET))
        assert endpoint in str(failed.value), failed.value
        wait_until(lambda: set(threading.enumerate()) <= before, 10, "the loader's threads to end")
    finally:
        server.close()


class SilentServer(FailingServer):
    """Sends nothing after the first tensors, the connection left open: a peer stopped
    (SIGSTOP, a hung process) or on a host cut off without a reset."""

    def __init__(self, *args):
        super().__init__(*args)
        self.released = threading.Event()

    def fail(self, sock: socket.socket) -> None:
        self.released.wait(60)
        raise ConnectionError("released")

    def close(self) -> None:
        self.released.set()
        super().close()


def test_a_peer_silent_mid_load_fails_the_load_after_the_read_timeout(folders):
    server = SilentServer(folders["compressed"], SECRET)
    endpoint = server.start()
    before = set(threading.enumerate())
    try:
        cfg = ModelConfig.from_dir(folders["raw"])
        peer = PeerCheckpoint(endpoint, SECRET, read_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(WeightsPeerError, match="sent nothing for 1 s") as failed:
            load_model(folders["raw"], cfg, torch.float32, weights=peer)
        assert endpoint in str(failed.value)
        assert time.monotonic() - started < 30  # the timeout, not the 120 s default
        loader = [
            t for t in threading.enumerate() if t not in before and t.name.startswith("peer-")
        ]
        wait_until(lambda: not any(t.is_alive() for t in loader), 10, "the loader's threads to end")
    finally:
        server.close()


def test_siblings_are_later_tensors_of_the_same_name_pattern_and_shape():
    """What a narrow guesses for: the same tensor of the next layers and experts that the rank
    loads, of the same shape (a dense layer's MLP beside a MoE layer's is not one)."""
    names = [
        "model.layers.0.mlp.experts.0.w1.weight", "model.layers.0.mlp.experts.1.w1.weight",
        "model.layers.1.mlp.experts.0.w1.weight", "model.layers.2.mlp.experts.0.w1.weight",
        "model.layers.3.mlp.experts.0.w1.weight", "model.norm.weight",
    ]  # fmt: skip
    shapes = {name: (8, 4) for name in names} | {names[3]: (16, 4), "model.norm.weight": (4,)}
    siblings = Siblings(names, shapes, wanted=lambda n: ".layers.4." not in n)

    def after(s, name, start=0):
        return [n for _, n in s.after(name, start)]

    assert after(siblings, names[0]) == [names[1], names[2], names[4]]
    assert after(siblings, names[0], start=3) == [names[4]]  # positions in the group
    assert after(siblings, names[2]) == [names[4]] and not after(siblings, names[3])
    stage = Siblings(names, shapes, wanted=lambda n: ".layers.3." not in n)
    assert after(stage, names[1]) == [names[2]] and names[4] not in stage.order
