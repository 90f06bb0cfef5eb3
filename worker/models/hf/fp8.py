"""Fine-grained FP8 checkpoints (``quantization_config.quant_method: "fp8"``, as DeepSeek-V3 and
R1 and the Qwen3 FP8 models are published): each quantized weight is float8 (e4m3)
beside ``<name>_scale_inv``, one fp32 scale per ``weight_block_size`` block (128 x 128; the
grid rounds up, so an edge block is smaller). The weights are dequantized as they are read,
``w = float(q) * scale`` in fp32 (the library's dequantization), and trained and saved in full
precision: an export's config has no ``quantization_config``. Other quantized formats are
refused: they would read as missing tensors.
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def check(config) -> tuple[int, int] | None:
    """The block size of ``config``'s FP8 quantization; None if it is not quantized."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        raise ValueError(f"the checkpoint is quantized ({q.get('quant_method')!r}); only "
                         "fine-grained FP8 checkpoints are read (dequantize it first, e.g. "
                         "from_pretrained and save_pretrained in bf16)")
    block = q.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales (UE8M0 exponents, as bytes or float8_e8m0fnu, are 2 ** (e - 127))."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A quantized (out x in) weight in fp32: each ``block`` of it times its scale."""
    rows, cols = q.shape[-2:]
    s = scales(scale_inv)
    if s.shape[-2:] != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"a weight of shape {tuple(q.shape)} has block scales of shape "
                         f"{tuple(s.shape)}, not one per {block[0]} x {block[1]} block")
    s = s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    return q.to(torch.float32) * s[..., :cols]
