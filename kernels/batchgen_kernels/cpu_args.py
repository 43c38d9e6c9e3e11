"""What the compiled CPU kernels are handed, checked once on the Python side before the call.

The C entry points take raw pointers and sizes; a tensor of the wrong dtype, shape or device, or
with a layout the kernel does not walk, would be read as something else. Each wrapper checks its
arguments here and raises ``KernelArgumentError`` naming the kernel, the argument and what was
expected. Builds with ``BATCHGEN_KERNEL_DEBUG=1`` also check the preconditions on the C++ side
(``BG_EXPECT`` in ``cpu_simd.h``), and abort with the failed condition."""

from __future__ import annotations

import torch


class KernelArgumentError(ValueError):
    """A compiled kernel was handed a tensor it cannot take; the message names kernel and argument."""


def expect(
    kernel: str,
    name: str,
    t: torch.Tensor,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = False,
) -> None:
    """``t`` (argument ``name`` of ``kernel``) is a CPU tensor of ``dtype`` (one of them), of
    ``shape`` (None: any size on that axis) and, where ``contiguous``, contiguous."""
    # The common case first, in as few operations as can tell (a call per kernel argument, every
    # layer of every step); the messages below only where something is wrong.
    if (
        isinstance(t, torch.Tensor)
        and t.is_cpu
        and (dtype is None or t.dtype is dtype or (isinstance(dtype, tuple) and t.dtype in dtype))
        and (shape is None or _fits(t.shape, shape))
        and (not contiguous or t.is_contiguous())
    ):
        return
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{kernel}: {name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise KernelArgumentError(f"{kernel}: {name} must be on the CPU, got {t.device}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            raise KernelArgumentError(f"{kernel}: {name} must be {want}, got {str(t.dtype).removeprefix('torch.')}")
    if shape is not None and not _fits(t.shape, shape):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise KernelArgumentError(f"{kernel}: {name} must have shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KernelArgumentError(f"{kernel}: {name} must be contiguous (strides {t.stride()})")


def _fits(got: tuple[int, ...], shape: tuple[int | None, ...]) -> bool:
    """Whether sizes ``got`` match ``shape`` (None: any size on that axis)."""
    if len(got) != len(shape):
        return False
    for want, n in zip(shape, got, strict=True):
        if want is not None and want != n:
            return False
    return True

