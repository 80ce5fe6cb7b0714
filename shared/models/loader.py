"""Build a model from a folder and load its weights, each rank reading only its shards."""

import re
from pathlib import Path

import torch
from torch import nn

from shared.errors import ModelFolderError
from shared.models.config import ModelConfig
from shared.models.layers.attention_backend import AttentionBackend
from shared.models.layers.linear import default_weight_loader
from shared.models.packing import prepare_cpu_linears
from shared.models.quant import open_checkpoint
from shared.models.registry import model_class
from shared.models.resident import ResidentWeights
from shared.parallel.group import SINGLE, TPGroup
from shared.parallel.pipeline import WHOLE_MODEL, PPStage

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(?:(\d+)\.)?(\w+)(?:\.weight)?$")  # (expert number, tensor)
_SKIPPED = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    tp: TPGroup = SINGLE,
    stage: PPStage = WHOLE_MODEL,
    device: torch.device | str = "cpu",
    attention: AttentionBackend | None = None,  # None: the model's default for the CPU
    weights=None,  # a checkpoint to read instead of the folder's (shared/peer's PeerCheckpoint)
    resident_codec: bool = False,  # the layers' linear weights stay encoded (models/resident.py)
    fused_decode: bool = True,  # CPU bf16: decode steps in one C call where the layers fit
) -> nn.Module:
    """The model's parameters and buffers are made on `device`; the checkpoint's tensors are
    copied there as they are read. `weights` is closed once loaded, as the folder's is."""
    cls = model_class(cfg.architecture)
    device = torch.device(device)
    with device:  # the default device of every tensor the layers make
        model = cls(cfg, dtype=dtype, tp=tp, stage=stage, attention=attention)
    checkpoint = open_checkpoint(model_dir, cfg.raw, weights)  # dequantizes quantized linears
    source = str(model_dir)
    try:
        resident = None
        if resident_codec:
            params = dict(model.named_parameters(remove_duplicate=False))
            targets = _targets(model, checkpoint.names(), params, stage, source)
            resident = ResidentWeights(model, checkpoint, targets)
        load_weights(model, checkpoint, stage, source, whole=tp.size == 1, device=device)
        if resident is not None:
            resident.attach(model, checkpoint)
    finally:
        checkpoint.close()
    if dtype == torch.bfloat16 and device.type == "cpu":
        prepare_cpu_linears(model, fused_decode)
    return model.eval()


def load_weights(
    model: nn.Module,
    checkpoint,
    stage: PPStage,
    source: str,
    whole: bool = True,
    device: torch.device | str = "cpu",
) -> None:
    """Copies the checkpoint's tensors into the model's parameters, each through its
    weight_loader; a stage skips the tensors of layers it does not own. A checkpoint with
    `tensors(names, whole)` hands them over pipelined (read and decoded ahead of the
    placement; a compressed folder's decoded on `device` when that is a GPU); any other needs
    names() and get() (or get_slice, lazy: only the rank's slice is read). whole: the rank
    needs each tensor whole (no TP), so reading it whole is best."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_word_embeddings
    targets = _targets(model, checkpoint.names(), params, stage, source)
    tensors = getattr(checkpoint, "tensors", None)
    if tensors is None:
        read = getattr(checkpoint, "get_slice", checkpoint.get)
        pairs = ((stored, read(stored)) for stored in targets)
    elif getattr(checkpoint, "decodes_on_gpus", False) and torch.device(device).type == "cuda":
        pairs = tensors(list(targets), whole, device=torch.device(device))
    else:
        pairs = tensors(list(targets), whole)
    loaded: set[str] = set()
    try:
        for stored, tensor in pairs:
            target, shard_id = targets[stored]
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ModelFolderError(source, f"tensor {stored!r}: {e}") from e
            loaded.add(target)
    finally:
        getattr(pairs, "close", lambda: None)()  # stops a pipeline's threads
    if tied and "model.embed_tokens.weight" in loaded:
        loaded.add("lm_head.weight")  # the same tensor as the embedding
    missing = [n for n in params if n not in loaded]
    for module_name, module in model.named_modules():  # a stacked parameter's missing parts
        check = getattr(module, "missing_weights", None)
        missing += [f"{module_name} {part}" for part in check()] if check else []
    if missing:
        raise ModelFolderError(source, f"missing weights: {', '.join(sorted(missing)[:8])}")


def _targets(model: nn.Module, names, params: dict, stage: PPStage, source: str) -> dict:
    """Checkpoint name -> (our parameter, its loader's shard id) of each tensor this stage
    loads, in the checkpoint's order."""
    tied = model.config.tie_word_embeddings
    # a family whose checkpoints nest or rename its tensors maps each name (None: not ours)
    rename = getattr(model, "checkpoint_name", lambda name: name)
    targets = {}
    for stored in names:
        name = rename(stored)
        if name is None or name.endswith(_SKIPPED) or (tied and name == "lm_head.weight"):
            continue
        layer = _LAYER.search(name)
        if layer and not stage.owns(int(layer.group(1))):
            continue
        target, shard_id = _target(name, model)
        if tied and target == "model.embed_tokens.weight" and target not in params:
            target = "lm_head.weight"  # a last stage without the embedding: its LM head
        if target not in params:
            if target.startswith(("model.embed_tokens", "model.norm", "lm_head")):
                continue  # held by another pipeline stage
            raise ModelFolderError(source, f"unexpected tensor {stored!r} in the checkpoint")
        targets[stored] = (target, shard_id)
    return targets


def _target(name: str, model: nn.Module) -> tuple[str, object]:
    """Our parameter and its loader's shard id for a checkpoint tensor. In order: the model's
    renamed_modules (Mixtral's block_sparse_moe is our mlp); expert tensors, `experts.{e}.X` or
    all experts' `experts.X`, where expert_params maps X to (our FusedMoE parameter, kind)
    (shard id (e or None, kind), see layers/moe.py); merged linears (stacked_params)."""
    renamed = getattr(model, "renamed_modules", {})
    parts = [renamed.get(part, part) for part in name.split(".")]
    name = ".".join(parts)
    expert = _EXPERT.search(name)
    experts = getattr(model, "expert_params", {})
    if expert and expert.group(2) in experts:
        param, kind = experts[expert.group(2)]
        number = None if expert.group(1) is None else int(expert.group(1))
        return f"{name[: expert.start()]}.experts.{param}", (number, kind)
    stacked = model.stacked_params
    for i, part in enumerate(parts):
        if part in stacked:
            merged, shard_id = stacked[part]
            return ".".join(parts[:i] + [merged] + parts[i + 1 :]), shard_id
    return name, None
