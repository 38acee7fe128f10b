"""Loading models: hub ids, local folders, GGUF files and offline presets."""

from specdecode.models.loading import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
