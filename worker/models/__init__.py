"""Layered model definitions (pre / blocks / post): the built-in ones and your own."""

from __future__ import annotations

import importlib
import os
import sys

from .base import AssembledModel, Batch, LayeredModel
from .bert import BertModel
from .gpt import GptModel

MODELS: dict[str, type[LayeredModel]] = {"bert": BertModel, "gpt": GptModel}


def model_class(name: str) -> type[LayeredModel]:
    """A built-in model by name, ``hf:PATH`` (a Hugging Face directory), or
    ``package.module:Class`` (a LayeredModel subclass)."""
    if name in MODELS:
        return MODELS[name]
    if name.startswith("hf:"):
        from .hf import HfModel

        return HfModel
    module_name, _, attr = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # (as under python -m, whatever
        sys.path.append(os.getcwd())  # program imports it: l2l-launch's children, l2l-export)
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model {name!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, LayeredModel)):
        raise ValueError(f"{name} is not a worker.models.LayeredModel subclass")
    return cls


def build_model(cfg) -> LayeredModel:
    """The layered model ``cfg.model`` names (cfg: a worker.config.ModelConfig)."""
    return model_class(cfg.model)(cfg)


__all__ = ["AssembledModel", "Batch", "LayeredModel", "BertModel", "GptModel", "build_model",
           "model_class"]
