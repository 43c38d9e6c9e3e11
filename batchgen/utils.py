"""Small helpers shared across the package."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers: the blocks that ``a`` tokens fill."""
    return -(-a // b)
