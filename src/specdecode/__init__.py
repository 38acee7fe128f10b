"""specdecode: lossless speculative decoding for Hugging Face causal language models.

The public names load on first use (module `__getattr__`), so that importing one submodule, e.g.
the decoding core `specdecode.core.decode`, does not import the engine, the drafters and the kernels
(docs/architecture.md, Invariants 5).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.core.request import GenerationRequest
    from specdecode.core.sampling import SamplingParams
    from specdecode.core.types import Draft, GenerationResult, Stats
    from specdecode.models.loading import LoadedModel, load_model
    from specdecode.runtime.engine import SpeculativeDecoder

# public name -> the module defining it
_EXPORTS = {
    "Draft": "specdecode.core.types",
    "GenerationRequest": "specdecode.core.request",
    "GenerationResult": "specdecode.core.types",
    "LoadedModel": "specdecode.models.loading",
    "SamplingParams": "specdecode.core.sampling",
    "SpeculativeDecoder": "specdecode.runtime.engine",
    "Stats": "specdecode.core.types",
    "load_model": "specdecode.models.loading",
}

__all__ = [
    "Draft",
    "GenerationRequest",
    "GenerationResult",
    "LoadedModel",
    "SamplingParams",
    "SpeculativeDecoder",
    "Stats",
    "load_model",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
