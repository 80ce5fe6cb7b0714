"""Exceptions raised by the library. Each names the field, file or limit at fault."""


class TisonError(Exception):
    """Base class of every error Tison raises on purpose."""


class ModelFolderError(TisonError):
    """A model folder is missing a file, or a file in it is corrupt. Names the file."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path


class UnsupportedArchitectureError(TisonError):
    """`architectures[0]` of config.json has no model family registered."""

    def __init__(self, architecture: str, supported: list[str]):
        names = ", ".join(sorted(supported))
        super().__init__(f"unsupported architecture {architecture!r}; supported: {names}")
        self.architecture = architecture


class InvalidRequestError(TisonError, ValueError):
    """A request or sampling value is invalid. `field` names it (OpenAI's `param`)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class PromptTooLongError(InvalidRequestError):
    """The prompt exceeds a hard limit: the model's context or what the KV pool can ever hold."""

    def __init__(self, num_tokens: int, limit: int, limit_name: str):
        super().__init__("prompt", f"{num_tokens} tokens exceed the {limit_name} of {limit} tokens")
        self.num_tokens = num_tokens
        self.limit = limit


class ProtocolError(TisonError):
    """A NATS message is malformed: not msgpack, wrong schema version or kind, bad field."""

    def __init__(self, kind: str, problem: str):
        super().__init__(f"{kind} message: {problem}")
        self.kind = kind


class ProcessStartError(TisonError):
    """A helper process (the nats-server binary, a service) is missing or did not start."""


class NatsOptionsError(TisonError):
    """A service's NATS credential or TLS option cannot be used (a missing file, half a pair)."""

    def __init__(self, flag: str, reason: str):
        super().__init__(f"{flag}: {reason}")
        self.flag = flag


class WeightsPeerError(TisonError):
    """Weights from a peer failed: none serves the model, it refused the secret, or it broke
    off. Names the model and the flag."""
