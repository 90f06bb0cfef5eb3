"""Layered model definitions (pre / blocks / post)."""

from .base import AssembledModel, Batch, LayeredModel
from .bert import BertModel
from .gpt import GptModel

MODELS: dict[str, type[LayeredModel]] = {"bert": BertModel, "gpt": GptModel}


def build_model(cfg) -> LayeredModel:
    """The layered model named by ``cfg.model`` (a worker.config.ModelConfig)."""
    return MODELS[cfg.model](cfg)


__all__ = ["AssembledModel", "Batch", "LayeredModel", "BertModel", "GptModel", "build_model"]
