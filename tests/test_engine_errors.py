"""Bad input gets an exception that names the field, file or limit; the engine keeps serving."""

import json
import shutil

import pytest

from shared.engine.llm import LLM
from shared.errors import (
    InvalidRequestError,
    ModelFolderError,
    PromptTooLongError,
    UnsupportedArchitectureError,
)
from shared.sampling.params import SamplingParams

from engine_helpers import GREEDY_32, hf_greedy, make_prompts, new_engine, run_all


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logprobs", 50),
        ("seed", "x"),
        ("stop", [""]),
        ("temperature", float("nan")),
    ],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and field in str(e.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_bad_requests_fail_alone_while_others_run(tiny_llama):
    prompts = make_prompts([5, 9, 20])
    refs = hf_greedy(tiny_llama, prompts)
    engine = new_engine(tiny_llama, max_model_len=128, num_pages=16)
    engine.add_request("0", prompts[0], GREEDY_32)
    outputs = {s.request.request_id: s.new_token_ids for s in engine.step()}
    with pytest.raises(PromptTooLongError, match="max_model_len") as e:
        engine.add_request("long", list(range(3, 131)), GREEDY_32)
    assert e.value.limit == 127
    engine.add_request("1", prompts[1], GREEDY_32)
    with pytest.raises(InvalidRequestError, match=r"token ids must be integers in \[0, 384\)"):
        engine.add_request("bad-id", [5, 384], GREEDY_32)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.add_request("empty", [], GREEDY_32)
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request("0", prompts[2], GREEDY_32)
    engine.add_request("2", prompts[2], GREEDY_32)
    run_all(engine, outputs)
    assert [outputs[str(i)] for i in range(3)] == refs
    assert engine.num_pages_used == 0


def test_prompt_larger_than_the_kv_pool(tiny_llama):
    engine = new_engine(tiny_llama, num_pages=2)  # 32 token slots
    with pytest.raises(PromptTooLongError, match="KV cache pool capacity of 31"):
        engine.add_request("a", list(range(3, 43)), GREEDY_32)
    engine.add_request(
        "b", [5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )
    (req,) = engine.requests.values()
    run_all(engine)
    assert req.finish_reason.value == "length" and req.num_tokens == 32  # capped by the pool


def _copy_model(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, file",
    [
        (lambda d: (d / "config.json").unlink(), "config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "model.safetensors"),
        (lambda d: _truncate(d / "model.safetensors"), "model.safetensors"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda d: _edit_config(d, lambda c: c.pop("hidden_size")), "config.json"),
    ],
)
def test_broken_model_folder_names_the_file(tiny_llama, tmp_path, damage, file):
    model_dir = _copy_model(tiny_llama, tmp_path)
    damage(model_dir)
    with pytest.raises(ModelFolderError) as e:
        LLM(model_dir, dtype="float32")
    assert file in str(e.value)


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _copy_model(tiny_llama, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(model_dir, dtype="float32")


def test_unsupported_architecture_lists_the_supported(tiny_llama, tmp_path):
    model_dir = _copy_model(tiny_llama, tmp_path)
    _edit_config(model_dir, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedArchitectureError) as e:
        LLM(model_dir, dtype="float32")
    assert "GPT2LMHeadModel" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_sharded_checkpoint_loads_the_same(tiny_llama, tmp_path):
    """model.safetensors.index.json with several shards gives the same tokens."""
    from safetensors.torch import load_file, save_file

    model_dir = _copy_model(tiny_llama, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, model_dir / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts = make_prompts([7, 12])
    engine = new_engine(model_dir)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY_32)
    outputs = run_all(engine)
    assert [outputs["0"], outputs["1"]] == hf_greedy(tiny_llama, prompts)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_config(model_dir, change):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))
