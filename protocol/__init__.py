"""The l2l wire protocol: the only package both the EPS and the workers import (see SPEC.md)."""

from .codec import DecodeError, decode, encode
from .messages import PROTOCOL_VERSION, REGISTRY
from .tensors import LayerPlan, LayerSpec, Layout, Manifest, TensorSpec, plan_layout

__all__ = [
    "PROTOCOL_VERSION", "REGISTRY", "DecodeError", "decode", "encode", "Layout", "LayerPlan",
    "LayerSpec", "Manifest", "TensorSpec", "plan_layout",
]
