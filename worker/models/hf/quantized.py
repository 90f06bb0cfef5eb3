"""Quantized checkpoints as models are published, read dequantized (fp32, as the library
dequantizes them), trained and saved in full precision (an export's config has no
``quantization_config``):

- fine-grained FP8 (``quant_method: "fp8"``: DeepSeek-V3 and R1, the Qwen3 FP8 models): each
  quantized weight is float8 (e4m3) beside ``<name>_scale_inv``, one fp32 scale per
  ``weight_block_size`` block (128 x 128; the grid rounds up, so an edge block is smaller):
  ``w = float(q) * scale``;
- MXFP4 (``quant_method: "mxfp4"``: gpt-oss): an expert stack ``<name>`` is stored as
  ``<name>_blocks`` (experts x out x in/32 x 16 bytes, two e2m1 values a byte, the low nibble
  first) and ``<name>_scales`` (one exponent byte per 32 values, 2 ** (byte - 127)), out x in
  where the library keeps in x out.

Other quantized formats are refused: they would read as missing tensors.
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def method(config) -> str | None:
    """``config``'s quantization ("fp8", "mxfp4"); None if it is not quantized."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") not in ("fp8", "mxfp4"):
        raise ValueError(f"the checkpoint is quantized ({q.get('quant_method')!r}); only "
                         "fine-grained FP8 and MXFP4 checkpoints are read (dequantize it "
                         "first, e.g. from_pretrained and save_pretrained in bf16)")
    return q["quant_method"]


def fp8_block(config) -> tuple[int, int]:
    """The block size of ``config``'s FP8 quantization."""
    q = config.quantization_config
    q = q if isinstance(q, dict) else q.to_dict()
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
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if s.shape[-2:] != grid:
        raise ValueError(f"a weight of shape {tuple(q.shape)} has block scales of shape "
                         f"{tuple(s.shape)}, not one per {block[0]} x {block[1]} block")
    w = q.to(torch.float32)
    if rows % block[0] == 0 and cols % block[1] == 0:  # in place, block by block
        w.view(*q.shape[:-2], grid[0], block[0], grid[1], block[1]).mul_(
            s.unsqueeze(-1).unsqueeze(-3))
        return w
    s = s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    return w.mul_(s[..., :cols])


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An MXFP4 expert stack (experts x out x in/32 x 16 bytes, its exponents experts x out x
    in/32) in fp32, as the library keeps it: experts x in x out (a transposed view: its reader
    copies it once, into the layer's buffer)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match their "
                         f"scales' {tuple(scales.shape)}")
    pairs = _E2M1_PAIRS  # a byte's two values, its low nibble first
    values = pairs.index_select(0, blocks.reshape(-1).to(torch.int32)).view(*blocks.shape, 2)
    values = values.flatten(-2).mul_(torch.exp2(scales.to(torch.float32) - 127.0).unsqueeze(-1))
    return values.flatten(-2).transpose(1, 2)


_LUT = torch.tensor(E2M1, dtype=torch.float32)
_E2M1_PAIRS = torch.stack((_LUT.repeat(16), _LUT.repeat_interleave(16)), -1)
