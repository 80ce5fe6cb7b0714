"""A 500-line batch under `tison up` survives kill -9 of the scheduler, the decode worker and
the prefill worker (one at a time; `tison up` restarts each) and of the nats-server: it
completes with every line's result exactly once, nothing lost, each equal to the same request
sent interactively."""

import json
import os
import signal
import subprocess
import sys

import openai
from test_up import Up, cmdline, descendants

from services_harness import REPO_ROOT, free_port
from waiting import wait_until

CHAT = "/v1/chat/completions"
PROMPTS = [f"Write item {i}:" for i in range(25)]
LINES = 500


def child(up: Up, name: str) -> int:
    for pid in descendants(up.proc.pid):
        args = cmdline(pid)
        if name == "nats-server" and "nats-server" in args[0]:
            return pid
        if name in args[2:4] and "services.cli" in args:
            return pid
    raise AssertionError(f"no {name} child of tison up")


def test_a_batch_survives_kills_of_every_process_exactly_once(tiny_llama, tmp_path):
    up = Up(tiny_llama, free_port(), "--state-dir", str(tmp_path / "state"))
    try:
        up.wait_serving()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="x", max_retries=0
        )
        model = tiny_llama.name

        def body(prompt: str) -> dict:
            messages = [{"role": "user", "content": prompt}]
            return {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}

        text = "\n".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                        "body": body(PROMPTS[i % len(PROMPTS)])})
            for i in range(LINES)
        )  # fmt: skip
        upload = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint=CHAT, completion_window="24h"
        )

        def done() -> int:
            try:
                return client.batches.retrieve(batch.id).request_counts.completed
            except openai.APIError:  # NATS restarting: the gateway answers 503
                return -1

        killed = []
        for victim, at in [("scheduler", 40), ("decode", 120), ("prefill", 200)]:
            wait_until(lambda at=at: done() >= at, 240, f"{at} lines done, then kill {victim}")
            pid = child(up, victim)
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, pid, done()))
        wait_until(lambda: done() >= 280, 240, "280 lines done before killing nats-server")
        os.kill(child(up, "nats-server"), signal.SIGKILL)
        killed.append(("nats-server", 0, done()))
        wait_until(lambda: done() == LINES, 300, "every line done", interval=1.0)
        assert all(progress < LINES for _, _, progress in killed), killed  # killed mid-batch

        final = client.batches.retrieve(batch.id)
        assert final.status == "completed"
        counts = final.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
        out = [
            json.loads(x) for x in client.files.content(final.output_file_id).content.splitlines()
        ]
        ids = [o["custom_id"] for o in out]
        assert len(ids) == LINES and set(ids) == {f"r{i}" for i in range(LINES)}
        expected = {}
        for prompt in PROMPTS:
            reply = client.chat.completions.create(**body(prompt))
            expected[prompt] = reply.choices[0].message.content
        for o in out:
            prompt = PROMPTS[int(o["custom_id"][1:]) % len(PROMPTS)]
            got = o["response"]["body"]["choices"][0]["message"]["content"]
            assert got == expected[prompt], o["custom_id"]
        secret = tmp_path / "state" / "batch.password"
        assert secret.stat().st_mode & 0o077 == 0
        # A batch client over NATS alone, as the batch user that `tison up` made
        # the restarted server's: the killed one left its ports file behind
        ports = max((tmp_path / "state").glob("*.ports"), key=lambda p: p.stat().st_mtime)
        url = json.loads(ports.read_text())["nats"][0]
        login = ["--nats-url", url, "--nats-user", "batch", "--nats-password-file", str(secret)]
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "batch", "status", batch.id, *login],
            capture_output=True, cwd=REPO_ROOT, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr.decode()
        assert json.loads(status.stdout)["request_counts"]["completed"] == LINES
    finally:
        assert up.stop() == 0
