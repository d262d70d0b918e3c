"""The number formats of quantized weights, below both sides that use them: `model.quant` (reading,
writing and emulating quantized checkpoints) and `judge.quant_weights` (judging a quantized weight
within its format's rounding). Their largest values, e2m1's grid, and a scale grid over its blocks
(the last block of a dimension cut to what is left, as a `weight_block_size` that does not divide a
dimension covers it)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest value
INT8_MAX = 127.0
E2M1_MAX = 6.0
MX_GROUP = 32  # MXFP4: values per shared exponent
# e2m1 values by nibble (OCP MX), as transformers' and GPT-OSS's own dequantization index them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expand_blocks(grid: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """A scale grid over its weight's `shape`: each block's scale on its block, the last block of a
    dimension cut to what is left."""
    b0, b1 = block
    rows, cols = shape[-2], shape[-1]
    return grid.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]


def per_block(x: torch.Tensor, grid: tuple[int, ...], block: tuple[int, int], how: str = "sum") -> torch.Tensor:
    """`x` ([..., rows, cols]) reduced over each block (sum or amax; short last blocks padded with
    zeros): a tensor of the grid's shape."""
    b0, b1 = block
    rows, cols = x.shape[-2:]
    r, c = grid[-2], grid[-1]
    padded = torch.nn.functional.pad(x, (0, c * b1 - cols, 0, r * b0 - rows))
    blocks = padded.reshape(*x.shape[:-2], r, b0, c, b1)
    return blocks.sum(dim=(-3, -1)) if how == "sum" else blocks.amax(dim=(-3, -1))


def nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Each value's nearest e2m1 magnitude, as its index in `FP4_VALUES` (0..7; ties to the lower,
    past 6 to 6)."""
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    return (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - grid).abs().argmin(dim=-1)
