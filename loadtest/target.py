"""The endpoint under test: URL, model, API flavour, and the loopback-only guard."""

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from loadtest.workloads import RequestSpec
from shared.errors import InvalidRequestError

APIS = ("completions", "chat")


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible server and how to talk to it."""

    base_url: str  # "http://127.0.0.1:8000" or ".../v1"
    model: str  # the served model name sent in every body
    api: str = "completions"  # "completions" (/v1/completions) or "chat" (/v1/chat/completions)
    stream: bool = True
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    timeout_s: float = 600.0  # per request
    api_key: str = ""
    extra: tuple[tuple[str, object], ...] = ()  # more body fields (a server's own extensions)

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise InvalidRequestError("api", f"must be one of {APIS}, got {self.api!r}")
        if urlsplit(self.base_url).scheme not in ("http", "https"):
            raise InvalidRequestError("base_url", f"{self.base_url!r} is not an http(s) URL")
        if self.timeout_s <= 0:
            raise InvalidRequestError("timeout_s", "must be > 0")

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/")
        root = root if root.endswith("/v1") else root + "/v1"
        return f"{root}/{'chat/completions' if self.api == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict:
        """The JSON body of one request."""
        body: dict = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": 0.0}
        if self.api == "chat" and spec.messages:
            body["messages"] = [{"role": role, "content": text} for role, text in spec.messages]
        elif self.api == "chat":
            system = [{"role": "system", "content": spec.prefix}] if spec.prefix else []
            body["messages"] = [*system, {"role": "user", "content": spec.text}]
        elif spec.prompt_ids:  # token ids: the prompt is exactly these, no re-tokenization
            body["prompt"] = list(spec.prompt_ids)
        else:
            body["prompt"] = spec.prefix + spec.text
        if self.stream:
            body["stream"] = True
            # the running usage counts each event's tokens (servers that lack it ignore it)
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **dict(self.extra)}


def check_loopback(url: str, allow_remote: bool = False) -> None:
    """Refuse a target whose host is not (or does not resolve only to) a loopback address."""
    if allow_remote:
        return
    host = urlsplit(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise InvalidRequestError("base_url", f"cannot resolve {host!r}: {e}") from None
    remote = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if remote or not addresses:
        raise InvalidRequestError(
            "base_url",
            f"{host!r} is not a loopback address ({', '.join(remote)}); "
            "pass --allow-remote to load a remote server",
        )
