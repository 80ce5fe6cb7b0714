"""`tison gateway` and `tison scheduler` never import torch (~2 s of a 2-core machine per
process, and a gateway or scheduler host need not have it): their whole path through the
`tison` command (huge-page restart, the TISON_CPU_ISA cap, the parser, the service) runs here
in processes where importing torch fails and says so in the log."""

import subprocess
import sys

import openai

from shared.proc import stop_processes

from services_harness import REPO_ROOT, Services

TORCH_IMPORTED = "TORCH IMPORTED"
# Run first in each process under test: any import of torch or a submodule fails, loudly.
NO_TORCH = f"""
import sys
import traceback

assert "torch" not in sys.modules


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            print("{TORCH_IMPORTED}", *traceback.format_stack(), file=sys.stderr, flush=True)
            raise ImportError(name + ": this process must not import torch")


sys.meta_path.insert(0, NoTorch())
"""
# As the `tison` entry point runs: main() with no argv reads sys.argv and may restart itself.
TISON = NO_TORCH + "from services.cli import main\nsys.exit(main())\n"


def test_the_no_torch_launch_fails_on_an_import_of_torch():
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH + "import torch.nn\n"], capture_output=True, text=True
    )
    assert done.returncode != 0 and TORCH_IMPORTED in done.stderr


def test_gateway_and_scheduler_commands_parse_without_torch():
    for command in ("gateway", "scheduler"):
        done = subprocess.run(
            [sys.executable, "-c", TISON, command, "--help"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"usage: tison {command}" in done.stdout
        assert TORCH_IMPORTED not in done.stderr


def test_gateway_and_scheduler_serve_and_stop_without_torch(tmp_path, tiny_llama):
    with Services(tmp_path, tiny_llama) as s:
        scheduler = s.scheduler(launch=TISON)
        s.fake_worker("prefill", "prefill")
        s.fake_worker("decode", "decode")
        gateway = s.gateway(launch=TISON)
        s.wait_healthy()
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0)
        done = client.completions.create(model=tiny_llama.name, prompt="Hello", max_tokens=4)
        assert done.usage.completion_tokens == 4
        assert stop_processes([gateway, scheduler], 10) == [], s.logs()
        assert (gateway.returncode, scheduler.returncode) == (0, 0), s.logs()
        for name in ("gateway", "scheduler"):
            assert TORCH_IMPORTED not in (tmp_path / f"{name}.log").read_text(), s.logs()
