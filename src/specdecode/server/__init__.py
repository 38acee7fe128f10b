"""An OpenAI-compatible HTTP server over `SpeculativeDecoder.stream` (`specdecode serve`).

Needs the `serve` extra (fastapi, uvicorn, pydantic). Importing this package is cheap and imports
none of them; `create_app` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # lazy, so that `specdecode --help` works without the serve extra
    if name == "create_app":
        from specdecode.server.app import create_app  # optional: fastapi (specdecode[serve])

        return create_app
    raise AttributeError(name)
