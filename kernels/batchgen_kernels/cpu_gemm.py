"""Linear layers on the compiled CPU kernel (``cpu_gemm.cpp``): weights packed once into 16-column
vectors, then ``y = x @ W^T + bias`` in one register-blocked loop, faster than oneDNN's packed
GEMM at the row counts of decode steps and of mixture-of-experts layers (``batchgen.model.linear``
uses it on the CPU where it builds; oneDNN and ``F.linear`` remain the fallbacks)."""

from __future__ import annotations

import torch

from batchgen_kernels.cpu import available, load
from batchgen_kernels.cpu_args import KernelArgumentError, expect
from batchgen_kernels.cpu_ops import DTYPE_SUFFIX


def amx(on: bool | None = None) -> bool:
    """Whether bfloat16 GEMMs run on AMX tiles (``cpu_gemm.cpp``'s ``amx_part``: where the tiles
    were compiled in, Linux grants them and K is a multiple of 32); ``on`` turns them on or off
    for the process first (tests and benchmarks time and check both paths). False where the
    library does not build."""
    if not available():
        return False
    return bool(load().gemm_amx(-1 if on is None else int(on)))


class PackedWeight:
    """``weight`` [n, k] packed for the kernel, with the bias in float32; calling it on ``x``
    [m, k] (rows may be strided) gives ``x @ weight.T + bias``, [m, n] in the weight's dtype, or
    with ``widened`` that result as float32 (``(x @ weight.T + bias).float()`` in one pass).
    ``gated``: the weight is [gate; up] of a SwiGLU MLP, packed so that ``silu_mul(x)`` gives
    ``silu(gate) * up`` [m, n / 2] in the same pass (calling it still gives [gate | up])."""

    def __init__(
        self,
        packed: torch.Tensor,
        n: int,
        k: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        gated: bool = False,
    ):
        self.packed, self.n, self.k, self.bias, self.dtype, self.gated = packed, n, k, bias, dtype, gated
        self._gemm = getattr(load(), "gemm_" + DTYPE_SUFFIX[dtype])
        self._gemm_widened = load().gemm_bf16_widened if dtype == torch.bfloat16 else self._gemm
        self._gemm_gated = getattr(load(), "gemm_gated_" + DTYPE_SUFFIX[dtype])
        self._bias_ptr = 0 if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor, widened: bool = False) -> torch.Tensor:
        out = self._run(self._gemm_widened if widened else self._gemm, x, self.n, widened)
        if self.gated:  # gate and up vectors alternate in the packed order
            return out.view(out.shape[0], self.n // 32, 2, 16).transpose(1, 2).reshape(out.shape)
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a gated weight's output, [m, n / 2] in the weight's dtype."""
        if not self.gated:
            raise KernelArgumentError("gemm: silu_mul needs a weight packed with gated=True")
        return self._run(self._gemm_gated, x, self.n // 2)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, [len(ids), k], gathered from the packed layout: an embedding
        lookup on a tied LM head's packed copy, so that the model keeps no other."""
        if self.gated:
            raise KernelArgumentError("gemm: rows of a weight packed with gated=True")
        vector, lane = ids // 16, ids % 16
        if self.dtype == torch.float32:  # [n / 16][k][16]
            return self.packed.view(-1, self.k, 16)[vector, :, lane]
        # bf16: [n / 16][k / 2][16] 32-bit pairs, the even input in the low half
        pairs = self.packed.view(torch.bfloat16).view(-1, self.k // 2, 16, 2)
        return pairs[vector, :, lane].reshape(-1, self.k)

    def _run(self, gemm, x: torch.Tensor, width: int, widened: bool = False) -> torch.Tensor:
        expect("gemm", "x", x, self.dtype, (None, self.k))
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, width), dtype=torch.float32 if widened else self.dtype)
        if m == 0:
            return out
        rc = gemm(
            x.data_ptr(),
            x.stride(0),
            m,
            self.k,
            self.packed.data_ptr(),
            self.n,
            self._bias_ptr,
            out.data_ptr(),
            width,
            torch.get_num_threads(),
        )
        if rc:  # pack() took the shapes, so only another build of the library gets here
            raise KernelArgumentError(f"gemm: the library has no kernel for {self.dtype} with k = {self.k}")
        return out


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> PackedWeight | None:
    """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
    without AVX-512 or AVX2 with FMA; another dtype or device; an odd ``k`` in bf16;
    ``gated`` [gate; up] rows whose halves are not whole 16-column vectors)."""
    dtype = weight.dtype
    if weight.dim() != 2 or dtype not in DTYPE_SUFFIX or weight.device.type != "cpu" or not available():
        return None
    n, k = weight.shape
    if k == 0 or n == 0 or (gated and n % 32):
        return None
    if gated:  # gate vector i, up vector i, gate vector i + 1, ...
        weight = weight.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)
        bias = None if bias is None else bias.view(2, n // 32, 16).transpose(0, 1).reshape(n)
    vectors = (n + 15) // 16
    w = weight.contiguous()
    if dtype == torch.float32:
        packed = torch.empty(vectors * k * 16, dtype=torch.float32)
        rc = load().gemm_pack_f32(w.data_ptr(), n, k, packed.data_ptr())
    else:
        packed = torch.empty(vectors * (k // 2) * 16, dtype=torch.int32)
        rc = load().gemm_pack_bf16(w.data_ptr(), n, k, packed.data_ptr())  # 1 for an odd k
    if rc:
        return None
    b = None
    if bias is not None:  # padded to whole vectors: the kernel loads the bias a vector at a time
        b = torch.zeros(vectors * 16, dtype=torch.float32)
        b[:n] = bias.detach().to(torch.float32)
    return PackedWeight(packed, n, k, b, dtype, gated)


class _Widened:
    """A quantized weight [n, k] packed for the kernel's widening paths, with its scales in the
    layout the kernel reads; calling it on ``x`` [m, k] in ``dtype`` (float32 or bfloat16) gives
    ``x @ weight.T + bias`` in that dtype, the weight widened in registers."""

    def __init__(self, kernel: str, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, group: int | None = None,
                 zeros: torch.Tensor | None = None, with_zeros: bool = False):
        """``group``: the inputs per scale, for the kernels that take it (block-wise FP8, int4);
        ``zeros``: int4's zero points, in the scales' layout (``with_zeros``: the kernel takes
        them, or null for none, after the scales)."""
        self.kernel, self.packed, self.scale, self.n, self.k, self.dtype = kernel, packed, scale, n, k, dtype
        self.zeros = zeros
        self._group = ((zeros.data_ptr() if zeros is not None else 0,) if with_zeros else ()) + (
            () if group is None else (group,))
        self.bias = None if bias is None else _padded(bias, n)
        self._gemm = getattr(load(), f"{kernel}_" + DTYPE_SUFFIX[dtype])
        self._bias_ptr = 0 if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        expect(self.kernel, "x", x, self.dtype, (None, self.k))
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, self.n), dtype=self.dtype)
        if m == 0:
            return out
        rc = self._gemm(x.data_ptr(), x.stride(0), m, self.k, self.packed.data_ptr(), self.n, self.scale.data_ptr(),
                        *self._group, self._bias_ptr, out.data_ptr(), self.n, torch.get_num_threads())
        if rc:  # of() packed it, so only another build of the library gets here
            raise KernelArgumentError(f"{self.kernel}: the library has no kernel for {self.dtype}")
        return out


def _padded(values: torch.Tensor, n: int) -> torch.Tensor:
    """float32 per column, zero past ``n`` to whole 16-column vectors (the kernel loads a vector at a time)."""
    out = torch.zeros((n + 15) // 16 * 16, dtype=torch.float32)
    out[:n] = values.detach().to(torch.float32).reshape(-1).expand(n)
    return out


def _pack_bytes(weight: torch.Tensor) -> torch.Tensor | None:
    """A weight of one byte a value [n, k] in the kernel's layout, [ceil(n/16)][k][16] (its dtype)."""
    n, k = weight.shape
    packed = torch.empty((n + 15) // 16 * k * 16, dtype=weight.dtype)
    if load().gemm_pack_bytes(weight.contiguous().view(torch.uint8).data_ptr(), n, k, packed.view(torch.uint8).data_ptr()):
        return None
    return packed


class PackedBytes(_Widened):
    """A weight of one byte a value, FP8 (E4M3) or int8, [n, k] with a float32 scale per output
    column (or one for all): ``x @ (weight * scale).T + bias``."""

    KINDS = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> PackedBytes | None:
        """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
        without AVX2, FMA and F16C; a weight neither FP8 nor int8; ``dtype`` other than float32 /
        bfloat16)."""
        kind = cls.KINDS.get(weight.dtype)
        if kind is None or weight.dim() != 2 or dtype not in DTYPE_SUFFIX or not available():
            return None
        n, k = weight.shape
        if n == 0 or k == 0 or scale.numel() not in (1, n):
            return None
        packed = _pack_bytes(weight)
        if packed is None:
            return None
        # FP8's widening gives 2^-8 times each weight: the epilogue's factor takes it back
        columns = _padded(scale.float() * (256.0 if kind == "fp8" else 1.0), n)
        return cls(f"gemm_{kind}", packed, columns, n, k, bias, dtype)


class PackedInt8Tiles(_Widened):
    """W8A8 on AMX-INT8 tiles: an int8 weight [n, k] with a float32 scale per output column (or
    one for all); calling it on ``x`` [m, k] rounds each row of ``x`` to int8 on its own grid
    (``cpu_ops.round_tokens_int8``'s values), multiplies the int8 values exactly (int32 sums) and
    scales each sum by its row's and column's scales: ``round_tokens_int8(x) @ (weight * scale).T +
    bias``, in ``x``'s dtype."""

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> PackedInt8Tiles | None:
        """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
        without AMX-INT8 or a process Linux refuses the tiles; a weight not int8; ``dtype`` other
        than float32 / bfloat16)."""
        if weight.dtype != torch.int8 or weight.dim() != 2 or dtype not in DTYPE_SUFFIX or not amx_int8():
            return None
        n, k = weight.shape
        if n == 0 or k == 0 or scale.numel() not in (1, n):
            return None
        packed = torch.empty((n + 15) // 16 * ((k + 63) // 64 * 64) * 16, dtype=torch.int8)
        load().gemm_pack_int8_tiles(weight.contiguous().data_ptr(), n, k, packed.data_ptr())
        return cls("gemm_w8a8_amx", packed, _padded(scale.float(), n), n, k, bias, dtype)


class PackedInt4Tiles(_Widened):
    """int4 weight-only in bfloat16 on AMX tiles: unsigned 4-bit codes [n, k] with a scale and a
    zero point per output column and group of ``group`` inputs, both kept in bf16 (as torch's int4
    GEMM keeps them); each weight ``(code - zero) * scale`` is rounded to bf16 inside the call (a
    pair of column vectors at a time, as a bf16 model's weights are rounded), then multiplied on
    the bf16 tiles: ``x @ w.T + bias``."""

    @classmethod
    def of(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
           bias: torch.Tensor | None, dtype: torch.dtype) -> PackedInt4Tiles | None:
        """``codes`` [n, k]: uint8 0-15, or int8 -8..7 (stored as code - 8: ``zero`` then counts
        from 0-15 all the same); ``scale`` and ``zero`` [n, k / group] (``zero`` None: 8 for every
        group, a symmetric checkpoint's, and nothing stored). None where the kernel does not run
        it: no AMX tiles here (``amx()``), ``dtype`` not bfloat16, k not a multiple of 32,
        ``group`` odd or not dividing k."""
        if dtype != torch.bfloat16 or codes.dim() != 2 or codes.dtype not in (torch.uint8, torch.int8) or not amx():
            return None
        n, k = codes.shape
        if n == 0 or k % 32 or group <= 0 or group % 2 or k % group or scale.shape != (n, k // group):
            return None
        vectors = (n + 15) // 16
        pairs = torch.empty(vectors * 16 * (k // 2), dtype=torch.uint8)  # packed in place: no copies of the codes
        offset = 8 if codes.dtype == torch.int8 else 0
        load().gemm_pack_int4(codes.contiguous().view(torch.uint8).data_ptr(), n, k, offset, pairs.data_ptr())

        def per_group(values: torch.Tensor) -> torch.Tensor:  # [n, groups] -> bf16 [vectors][groups][16]
            out = torch.zeros(vectors * 16, k // group, dtype=torch.bfloat16)
            out[:n] = values
            return out.view(vectors, 16, k // group).transpose(1, 2).contiguous()

        return cls("gemm_int4_amx", pairs, per_group(scale), n, k, bias, dtype, group,
                   None if zero is None else per_group(zero), with_zeros=True)


def amx_int8() -> bool:
    """Whether W8A8 runs on AMX-INT8 tiles (``PackedInt8Tiles``): the tiles compiled in (the ``amx``
    variant) and granted to the process by Linux."""
    return available() and bool(load().gemm_amx_int8())


class PackedFP8Blocks(_Widened):
    """A block-wise FP8 (E4M3) weight [n, k], one byte a weight, with a float32 scale per output
    column and group of ``group`` inputs (``scale`` [n, k / group]): ``x @ (weight * scale).T + bias``,
    each group's scale multiplying the widened weights before the FMAs."""

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None,
           dtype: torch.dtype) -> PackedFP8Blocks | None:
        """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
        without AVX2, FMA and F16C; ``dtype`` other than float32 / bfloat16; inputs not whole groups)."""
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or dtype not in DTYPE_SUFFIX or not available():
            return None
        n, k = weight.shape
        if n == 0 or group <= 0 or k % group or scale.shape != (n, k // group):
            return None
        packed = _pack_bytes(weight)
        if packed is None:
            return None
        vectors = (n + 15) // 16
        # [n, groups] -> [vectors][groups][16], zero past n; times 2^8, the widening's factor (PackedBytes)
        scales = torch.zeros(vectors * 16, k // group, dtype=torch.float32)
        scales[:n] = scale.float() * 256.0
        scales = scales.view(vectors, 16, k // group).transpose(1, 2).contiguous().view(-1)
        return cls("gemm_fp8_block", packed, scales, n, k, bias, dtype, group)


class PackedMXFP4(_Widened):
    """An MXFP4 weight [n, k] (``blocks`` [n, k / 2] uint8, two E2M1 codes a byte, and ``exponents``
    [n, k / 32] uint8, each group's biased power-of-two scale), half a byte a weight and a float32
    scale per 32."""

    @classmethod
    def of(cls, blocks: torch.Tensor, exponents: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> PackedMXFP4 | None:
        """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
        without AVX2, FMA and F16C; ``dtype`` other than float32 / bfloat16; a scale above 2^113)."""
        if blocks.dtype != torch.uint8 or exponents.dtype != torch.uint8 or blocks.dim() != 2:
            return None
        n, k = blocks.shape[0], blocks.shape[1] * 2
        if dtype not in DTYPE_SUFFIX or n == 0 or k % 32 or exponents.shape != (n, k // 32) or not available():
            return None
        vectors = (n + 15) // 16
        packed = torch.empty(vectors * (k // 2) * 16, dtype=torch.uint8)
        scales = torch.empty(vectors * (k // 32) * 16, dtype=torch.float32)
        if load().gemm_pack_mxfp4(blocks.contiguous().data_ptr(), exponents.contiguous().data_ptr(), n, k,
                                  packed.data_ptr(), scales.data_ptr()):
            return None
        return cls("gemm_mxfp4", packed, scales, n, k, bias, dtype)


class PackedExperts:
    """A mixture-of-experts layer's routed SwiGLU experts on the kernel, in one call a layer:
    ``gate_up`` packed gated (``silu(gate) * up`` in the GEMM's pass), ``down`` plain. Calling it
    on ``x`` [T, d] with the router's ``weights`` [T, top_k] and ``chosen`` experts [T, top_k]
    gives ``sum_s weights[t, s] * down_e(silu_mul(gate_up_e(x[t])))`` over each token's slots (e =
    ``chosen[t, s]``), summed in float32 and rounded once to the weights' dtype."""

    def __init__(self, gate_up: list[PackedWeight], down: list[PackedWeight]):
        self.d, self.inter, self.dtype = down[0].n, down[0].k, down[0].dtype
        self._keep = (gate_up, down)  # the packed tensors the addresses point into
        self._gate_up = torch.tensor([w.packed.data_ptr() for w in gate_up], dtype=torch.int64)
        self._down = torch.tensor([w.packed.data_ptr() for w in down], dtype=torch.int64)
        self._gate_up_bias = self._biases(gate_up)
        self._down_bias = self._biases(down)
        self._gate_up_bias_ptr = 0 if self._gate_up_bias is None else self._gate_up_bias.data_ptr()
        self._down_bias_ptr = 0 if self._down_bias is None else self._down_bias.data_ptr()
        self._run = getattr(load(), "moe_experts_" + DTYPE_SUFFIX[self.dtype])

    @staticmethod
    def _biases(weights: list[PackedWeight]) -> torch.Tensor | None:
        if all(w.bias is None for w in weights):
            return None
        return torch.tensor([0 if w.bias is None else w.bias.data_ptr() for w in weights], dtype=torch.int64)

    @classmethod
    def of(cls, gate_up: list[PackedWeight | None], down: list[PackedWeight | None]) -> PackedExperts | None:
        """The grouped experts, or None where some expert is not packed as the call needs (then the
        caller runs them one by one)."""
        if not gate_up or len(gate_up) != len(down):
            return None
        ups = [w for w in gate_up if w is not None and w.gated]
        downs = [w for w in down if w is not None and not w.gated]
        if len(ups) != len(gate_up) or len(downs) != len(down):
            return None
        d, inter, dtype = downs[0].n, downs[0].k, downs[0].dtype
        if inter % 16 or any(
            (u.n, u.k, u.dtype) != (2 * inter, d, dtype) or (w.n, w.k, w.dtype) != (d, inter, dtype)
            for u, w in zip(ups, downs, strict=True)
        ):
            return None
        return cls(ups, downs)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        expect("moe_experts", "x", x, self.dtype, (None, self.d))
        expect("moe_experts", "chosen", chosen, shape=(x.shape[0], None))
        expect("moe_experts", "weights", weights, shape=tuple(chosen.shape))
        x = x.contiguous()
        chosen = chosen.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        tokens, top_k = chosen.shape
        out = torch.empty_like(x)
        if tokens == 0:
            return out
        rc = self._run(
            x.data_ptr(),
            tokens,
            self.d,
            top_k,
            chosen.data_ptr(),
            weights.data_ptr(),
            len(self._gate_up),
            self._gate_up.data_ptr(),
            self._gate_up_bias_ptr,
            self._down.data_ptr(),
            self._down_bias_ptr,
            self.inter,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 2:
            raise KernelArgumentError(
                f"moe_experts: expert ids must lie in [0, {len(self._gate_up)}), got {chosen.tolist()}"
            )
        if rc:  # of() took the shapes, so only another build of the library gets here
            raise KernelArgumentError(f"moe_experts: the library has no kernel for {self.dtype}")
        return out
