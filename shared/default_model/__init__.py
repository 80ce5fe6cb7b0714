"""The default model that ships with Tison, trained by `shared.default_model.train`."""

from pathlib import Path

from shared.errors import ModelFolderError

MODEL_NAME = "tison-tiny-stdlib"


def default_model_dir() -> Path:
    """The packaged default model folder; raises ModelFolderError if it is not installed."""
    path = Path(__file__).resolve().parent / MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelFolderError(str(path / name), "default model file missing")
    return path
