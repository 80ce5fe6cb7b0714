"""The `tison` command restarts itself once with glibc's huge-page tunable (shared/huge_pages)."""

import os
import subprocess
import sys

import pytest

from shared import huge_pages


def test_restart_wanted_once_and_only_on_request_mode(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    monkeypatch.setattr(sys, "platform", "linux")
    mode.write_text("always [madvise] never\n")
    assert huge_pages.wants_restart({})
    assert huge_pages.wants_restart({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert not huge_pages.wants_restart({"GLIBC_TUNABLES": f"x=1:{huge_pages.TUNABLE}"})
    mode.write_text("[always] madvise never\n")  # huge pages without asking: nothing to do
    assert not huge_pages.wants_restart({})
    mode.unlink()
    assert not huge_pages.wants_restart({})


@pytest.mark.skipif(not huge_pages.wants_restart(), reason="THP is not in madvise mode here")
def test_process_restarts_with_the_tunable_and_keeps_its_arguments():
    code = (
        "import os, sys; from shared.huge_pages import restart_with_huge_pages; "
        "restart_with_huge_pages(); print(os.environ['GLIBC_TUNABLES'], sys.argv[1:])"
    )
    env_tunables = "glibc.malloc.arena_max=4"
    out = subprocess.run(
        [sys.executable, "-c", code, "a", "b c"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GLIBC_TUNABLES": env_tunables},
    ).stdout
    assert out.strip() == f"{env_tunables}:{huge_pages.TUNABLE} ['a', 'b c']"
