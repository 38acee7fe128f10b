"""specdecode: lossless speculative decoding for Hugging Face causal language models."""

from specdecode.engine import SpeculativeDecoder
from specdecode.models.loading import LoadedModel, load_model
from specdecode.sampling import SamplingParams
from specdecode.types import Draft, GenerationResult, Stats

__all__ = [
    "Draft",
    "GenerationResult",
    "LoadedModel",
    "SamplingParams",
    "SpeculativeDecoder",
    "Stats",
    "load_model",
]
__version__ = "0.1.0"
