"""compose.yaml read as Docker Compose reads it, so that what the multi-host harness runs is the
deployment file itself: `${VAR}` / `${VAR:-default}` / `${VAR:?message}` interpolation from an
environment, YAML anchors and `<<` merges, each service's command, environment, volumes, ports,
dependencies, restart policy, configs (`content:` or `file:`) and deploy section, and the
image's ENTRYPOINT from the Dockerfile it builds.

    spec = Compose.load(REPO_ROOT / "compose.yaml", env)
    spec.services["decode"].argv            # ["tison", "decode", "--model", "/model", ...]
    spec.order()                            # services after those they depend on
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$\$")


class ComposeError(ValueError):
    """compose.yaml (or its Dockerfile) says something this reader cannot run; names where."""


def interpolate(text: str, env: dict[str, str], where: str = "compose.yaml") -> str:
    """Compose's variable substitution: ${X}, ${X:-default} (unset or empty), ${X-default}
    (unset), ${X:?message} / ${X?message} (an error), $$ (a literal $)."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m["name"], m["op"], m["arg"] or ""
        value = env.get(name)
        missing = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else value
        if op in (":?", "?") and missing:
            raise ComposeError(f"{where}: ${{{name}}} must be set: {arg or 'required'}")
        return value or ""

    return _VAR.sub(one, text)


@dataclass(frozen=True)
class Volume:
    source: str  # a host path (absolute, resolved against the compose file) or a named volume
    target: str  # the path inside the container
    read_only: bool
    named: bool


@dataclass(frozen=True)
class Service:
    name: str
    argv: list[str]  # entrypoint + command, as the container runs it
    environment: dict[str, str]
    volumes: list[Volume]
    ports: list[tuple[int, int]]  # (published, container)
    depends_on: list[str]
    image: str
    deploy: dict = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)
    restart: str = "no"  # no | always | unless-stopped | on-failure[:N]
    configs: list[tuple[str, str]] = field(default_factory=list)  # (config name, target path)

    def restarts_after(self, returncode: int, restarts: int) -> bool:
        """Whether Compose starts the container again after it exited with `returncode`,
        having restarted it `restarts` times already (never after a stop it was asked for)."""
        if self.restart in ("always", "unless-stopped"):
            return True
        if self.restart.startswith("on-failure"):
            limit = self.restart.partition(":")[2]
            return returncode != 0 and (not limit or restarts < int(limit))
        return False

    def port(self, container_port: int) -> int:
        """The container port published as `container_port`'s host side, or itself."""
        for published, inside in self.ports:
            if inside == container_port:
                return published
        return container_port


@dataclass(frozen=True)
class Compose:
    path: Path
    services: dict[str, Service]
    header: str  # the file's leading comment block (its documentation)
    configs: dict[str, str] = field(default_factory=dict)  # name -> its content

    @classmethod
    def load(cls, path: Path, env: dict[str, str]) -> "Compose":
        path = Path(path).resolve()
        text = path.read_text()
        doc = _substituted(yaml.safe_load(text), env, str(path))
        if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
            raise ComposeError(f"{path}: no services: mapping")
        header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
        services = {
            name: _service(name, body or {}, path.parent, env)
            for name, body in doc["services"].items()
        }
        configs = {
            name: _config(name, body, path.parent) for name, body in _mapping(doc, "configs", path)
        }
        for svc in services.values():
            for dep in svc.depends_on:
                if dep not in services:
                    raise ComposeError(f"{path}: {svc.name} depends on unknown service {dep!r}")
            for name, _ in svc.configs:
                if name not in configs:
                    raise ComposeError(f"{path}: {svc.name} uses unknown config {name!r}")
        spec = cls(path, services, header, configs)
        spec.order(tuple({p for svc in services.values() for p in svc.profiles}))  # no cycles
        return spec

    def order(self, profiles: tuple[str, ...] = ()) -> list[str]:
        """Service names, each after the services it depends on; those of a profile not asked
        for left out (as `docker compose up` does)."""
        active = {
            n for n, s in self.services.items() if not s.profiles or set(s.profiles) & set(profiles)
        }
        done: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in path:
                raise ComposeError(f"{self.path}: dependency cycle {' -> '.join(path + (name,))}")
            if name in done:
                return
            for dep in self.services[name].depends_on:
                visit(dep, path + (name,))
            done.append(name)

        for name in self.services:
            if name in active:
                visit(name, ())
        return done


def _substituted(node, env: dict[str, str], where: str):
    """Every string of the parsed file interpolated (values only, as Compose does: comments and
    keys are left alone)."""
    if isinstance(node, str):
        return interpolate(node, env, where)
    if isinstance(node, list):
        return [_substituted(v, env, where) for v in node]
    if isinstance(node, dict):
        return {k: _substituted(v, env, where) for k, v in node.items()}
    return node


def _service(name: str, body: dict, root: Path, env: dict[str, str]) -> Service:
    where = f"compose.yaml services.{name}"
    command = body.get("command", [])
    if isinstance(command, str):
        raise ComposeError(f"{where}.command: write it as a list (exec form), not {command!r}")
    if "build" in body:
        entry = _entrypoint(root / _build_dockerfile(body["build"]))
    else:
        entry = body.get("entrypoint", [])
    environment = body.get("environment", {}) or {}
    if isinstance(environment, list):
        environment = dict(
            item.split("=", 1) if "=" in item else (item, env.get(item, "")) for item in environment
        )
    depends = body.get("depends_on", []) or []
    return Service(
        name=name,
        argv=[str(a) for a in (*entry, *command)],
        environment={str(k): "" if v is None else str(v) for k, v in environment.items()},
        volumes=[_volume(v, root, where) for v in body.get("volumes", []) or []],
        ports=[_port(p, where) for p in body.get("ports", []) or []],
        depends_on=list(depends) if isinstance(depends, list) else list(depends),
        image=str(body.get("image", "")),
        deploy=body.get("deploy", {}) or {},
        profiles=list(body.get("profiles", []) or []),
        restart=_restart(body.get("restart", "no"), where),
        configs=[_config_use(c, where) for c in body.get("configs", []) or []],
    )


def _mapping(doc: dict, key: str, path: Path):
    section = doc.get(key) or {}
    if not isinstance(section, dict):
        raise ComposeError(f"{path}: {key}: must be a mapping")
    return section.items()


def _config(name: str, body, root: Path) -> str:
    """A top-level config's content: `content:` inline, or the `file:` it names."""
    if isinstance(body, dict) and isinstance(body.get("content"), str):
        return body["content"]
    if isinstance(body, dict) and isinstance(body.get("file"), str):
        return (root / body["file"]).read_text()
    raise ComposeError(f"compose.yaml configs.{name}: give it content: or file:")


def _config_use(spec, where: str) -> tuple[str, str]:
    """(config name, path in the container) of a service's configs entry."""
    if isinstance(spec, str):
        return spec, f"/{spec}"
    if isinstance(spec, dict) and isinstance(spec.get("source"), str):
        return spec["source"], str(spec.get("target", f"/{spec['source']}"))
    raise ComposeError(f"{where}.configs: {spec!r} is not NAME or {{source, target}}")


def _restart(policy, where: str) -> str:
    policy = "no" if policy is False else str(policy)
    if policy in ("no", "always", "unless-stopped") or re.fullmatch(r"on-failure(:\d+)?", policy):
        return policy
    raise ComposeError(
        f"{where}.restart: {policy!r} is not no, always, unless-stopped or on-failure[:N]"
    )


def _build_dockerfile(build) -> str:
    if isinstance(build, str):
        return f"{build}/Dockerfile"
    return f"{build.get('context', '.')}/{build.get('dockerfile', 'Dockerfile')}"


def _entrypoint(dockerfile: Path) -> list[str]:
    """The exec-form ENTRYPOINT of a Dockerfile (the last one)."""
    if not dockerfile.exists():
        raise ComposeError(f"{dockerfile}: the Dockerfile a service builds is missing")
    found = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    if not found:
        return []
    try:
        return [str(a) for a in json.loads(found[-1][len("ENTRYPOINT") :].strip())]
    except json.JSONDecodeError:
        raise ComposeError(
            f"{dockerfile}: ENTRYPOINT must be exec form, got {found[-1]!r}"
        ) from None


def _volume(spec, root: Path, where: str) -> Volume:
    if not isinstance(spec, str):
        raise ComposeError(f"{where}.volumes: write {spec!r} as SOURCE:TARGET[:ro]")
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ComposeError(f"{where}.volumes: {spec!r} is not SOURCE:TARGET[:ro]")
    source, target = parts[0], parts[1]
    named = not source.startswith((".", "/", "~"))
    if not named:
        source = str((root / Path(source).expanduser()).resolve())
    return Volume(source, target, len(parts) == 3 and parts[2] == "ro", named)


def _port(spec, where: str) -> tuple[int, int]:
    parts = str(spec).split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        return int(parts[-2]), int(parts[-1])
    except ValueError:
        raise ComposeError(f"{where}.ports: {spec!r} is not [HOST:]CONTAINER") from None
