"""Small helpers shared across the package."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def cdiv(a: IntOrArray, b: int) -> IntOrArray:
    """``ceil(a / b)`` for non-negative integers (or an integer array): the blocks ``a`` tokens fill."""
    return -(-a // b)
