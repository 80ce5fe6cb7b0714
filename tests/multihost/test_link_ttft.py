"""loadtest/scenarios/link_ttft.py runs end to end, small: the bundled model, a short prompt,
one round, unlimited and one limited rate (its figures are the scenario's, not asserted)."""

import json

import pytest

from loadtest import netns
from loadtest.scenarios import link_ttft
from shared.default_model import default_model_dir

WHY = netns.unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"multi-host harness: {WHY}")
def test_the_scenario_reports_every_rate(tmp_path):
    argv = ["--rounds", "1", "--rates", "1", "--prompt-tokens", "300"]
    assert link_ttft.main([*argv, "--model", str(default_model_dir()), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "link_ttft.md").read_text()
    assert "| unlimited |" in text and "| 1 | 23 |" in text, text  # 3 KiB a token: 1/43 of 8B's
    data = json.loads((tmp_path / "link_ttft.json").read_text())
    assert set(data["ttft_s"]) == {"0.0", "1.0"}
    # the limited request's KV crossed the prefill host's link: ~300 tokens x 3 KiB
    assert data["wire_bytes"]["1.0"][0] > 300 * 3072


def test_kv_bytes_per_token_follows_the_config():
    eight_b = {"num_hidden_layers": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    eight_b["num_attention_heads"] = 32
    assert link_ttft.kv_bytes_per_token(eight_b) == link_ttft.REFERENCE_KV_BYTES
