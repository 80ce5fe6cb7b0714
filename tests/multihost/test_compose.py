"""loadtest/compose.py reads compose.yaml as Docker Compose does (pure: runs on every machine)."""

import pytest

from loadtest.compose import Compose, ComposeError, interpolate
from loadtest.multihost import COMPOSE_FILE, REPO_ROOT


def test_interpolation_follows_compose():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}-${UNSET}-$${SET}", env) == "x--${SET}"
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET:-d}", env) == "d  d d"
    assert interpolate("${SET:?must}", env) == "x"
    with pytest.raises(ComposeError, match=r"\$\{EMPTY\} must be set: give it"):
        interpolate("${EMPTY:?give it}", env)


def test_the_deployment_file_runs_every_role_with_its_secrets():
    env = {"TISON_API_KEY": "key", "TISON_NATS_TOKEN": "tok", "TISON_KV_SECRET": "kv"}
    spec = Compose.load(COMPOSE_FILE, env)
    assert spec.order() == ["nats", "scheduler", "prefill", "decode", "gateway"]
    nats = spec.services["nats"]
    # the server requires the token, read from a config file: never on its command line
    assert "tok" not in nats.argv and nats.configs == [("nats-auth", "/etc/nats/auth.conf")]
    assert nats.argv[nats.argv.index("-c") + 1] == "/etc/nats/auth.conf"
    assert 'token: "tok"' in spec.configs["nats-auth"]
    for role in ("scheduler", "prefill", "decode", "gateway"):
        svc = spec.services[role]
        assert svc.argv[:2] == ["tison", role]  # the Dockerfile's ENTRYPOINT, then the command
        assert svc.environment["TISON_NATS_TOKEN"] == "tok"
        assert svc.environment["TISON_KV_SECRET"] == "kv"
        assert svc.argv[svc.argv.index("--nats-url") + 1] == "nats://nats:4222"
        assert svc.depends_on == ["nats"]
        assert svc.restart == "unless-stopped"  # a worker killed comes back (test_hosts)
    assert spec.services["gateway"].environment["TISON_API_KEY"] == "key"
    assert "TISON_API_KEY" not in spec.services["decode"].environment
    # workers listen on every interface, so peers on other hosts reach their KV and weights
    for role in ("prefill", "decode"):
        argv = spec.services[role].argv
        assert argv[argv.index("--kv-host") + 1] == "0.0.0.0"
    model = spec.services["decode"].volumes[0]
    assert (model.target, model.read_only, model.named) == ("/model", True, False)
    assert model.source == str(REPO_ROOT / "shared/default_model/tison-tiny-stdlib")
    assert spec.services["gateway"].port(8000) == 8000
    assert "--scale decode=N" in spec.header


def test_defaults_and_overrides_of_the_model_folder(tmp_path):
    spec = Compose.load(COMPOSE_FILE, {"TISON_MODEL_DIR": str(tmp_path)})
    assert spec.services["prefill"].volumes[0].source == str(tmp_path)
    assert 'token: "change-me-nats"' in spec.configs["nats-auth"]  # the documented default


BAD_FILES = [
    ("volumes: {}\n", "no services"),
    ("services:\n  a: {image: x, depends_on: [db]}\n", "unknown service 'db'"),
    (
        "services:\n  a: {image: x, depends_on: [b]}\n  b: {image: x, depends_on: [a]}\n",
        "cycle a -> b -> a",
    ),
    ("services:\n  a: {image: x, command: run me}\n", r"services\.a\.command: write it as a list"),
    ("services:\n  a: {build: ./nowhere}\n", "Dockerfile a service builds is missing"),
    ("services:\n  a: {image: x, ports: [web]}\n", r"services\.a\.ports"),
    ("services:\n  a: {image: x, configs: [c]}\n", "a uses unknown config 'c'"),
    (
        "configs:\n  c: {}\nservices:\n  a: {image: x, configs: [c]}\n",
        "configs.c: give it content: or file:",
    ),
    ("services:\n  a: {image: x, restart: sometimes}\n", r"services\.a\.restart: 'sometimes'"),
]


@pytest.mark.parametrize(("text", "error"), BAD_FILES)
def test_bad_files_name_what_is_wrong(tmp_path, text, error):
    path = tmp_path / "compose.yaml"
    path.write_text(text)
    with pytest.raises(ComposeError, match=error):
        Compose.load(path, {})


def test_restart_policies_follow_compose(tmp_path):
    path = tmp_path / "compose.yaml"
    path.write_text(
        "services:\n  a: {image: x}\n  b: {image: x, restart: always}\n"
        "  c: {image: x, restart: 'on-failure:2'}\n  d: {image: x, restart: on-failure}\n"
    )
    a, b, c, d = Compose.load(path, {}).services.values()
    assert not a.restarts_after(1, 0) and b.restarts_after(0, 99)
    assert c.restarts_after(137, 1) and not c.restarts_after(137, 2) and not c.restarts_after(0, 0)
    assert d.restarts_after(1, 1000) and not d.restarts_after(0, 0)


def test_profiles_leave_services_out_unless_asked(tmp_path):
    path = tmp_path / "compose.yaml"
    path.write_text(
        "services:\n  a: {image: x}\n  g: {image: x, profiles: [gpu], depends_on: [a]}\n"
    )
    spec = Compose.load(path, {})
    assert spec.order() == ["a"]
    assert spec.order(("gpu",)) == ["a", "g"]
