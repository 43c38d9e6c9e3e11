"""Small helpers shared across the package."""

from __future__ import annotations

from functools import cache
from typing import TypeVar

import numpy as np
import torch

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def cdiv(a: IntOrArray, b: int) -> IntOrArray:
    """``ceil(a / b)`` for non-negative integers (or an integer array): the blocks ``a`` tokens fill."""
    return -(-a // b)


@cache
def has_amx() -> bool:
    """Whether this CPU runs AMX tile instructions (Intel Sapphire Rapids and later), which torch's
    oneDNN GEMMs and its CPU flash-attention kernel use for bfloat16."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())
