"""A scenario's result: printed as JSON, and written to --out when given."""

import json
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
