"""Small helpers shared across the package."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
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
    oneDNN GEMMs and its CPU flash-attention kernel use for bfloat16; False where
    ``ONEDNN_MAX_CPU_ISA`` keeps oneDNN below AMX (a CPU without it, emulated). Read once per process."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if isa != "ALL" and "AMX" not in isa:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's ``FlexibleArgumentParser``: long options may be written with underscores as well as
    dashes (``--max_model_len 512`` is ``--max-model-len 512``)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        fixed = []
        for arg in argv:
            if arg.startswith("--") and len(arg) > 2:
                name, eq, value = arg[2:].partition("=")
                arg = "--" + name.replace("_", "-") + eq + value
            fixed.append(arg)
        return super().parse_known_args(fixed, namespace)
