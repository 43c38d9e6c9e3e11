"""The structured-output mask kernels against their torch reference and xgrammar's own CPU
application of the same bitmask: the GPU's (``batchgen_kernels/token_mask.py``) under Triton's
interpreter, and the compiled CPU kernel (``cpu_sampling.token_mask``) the engine runs on float32
scores on the CPU."""

from __future__ import annotations

import pytest
import torch

from batchgen_kernels.reference import token_mask_ref

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab", [100, 384, 1000])
def test_the_kernel_masks_what_the_bits_forbid(vocab):
    pytest.importorskip("triton")
    from batchgen_kernels.token_mask import token_mask

    g = torch.Generator().manual_seed(vocab)
    scores = torch.randn(5, vocab, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    mask[3] = -1  # every token allowed
    rows = [0, 2, 3]
    got, want, theirs = scores.clone(), scores.clone(), scores.clone()
    token_mask(got, mask, rows, block=128)
    token_mask_ref(want, mask, rows)
    xgr.apply_token_bitmask_inplace(theirs, mask, vocab_size=vocab, indices=rows, backend="torch_native")
    assert torch.equal(got, want) and torch.equal(got, theirs)
    assert torch.equal(got[1], scores[1]) and torch.equal(got[3], scores[3])  # rows not given, or all allowed
    assert bool(torch.isneginf(got[0]).any()) and bool(torch.isfinite(got[0]).any())
    with pytest.raises(ValueError, match="int32"):
        token_mask(got, mask.to(torch.int64), rows)


@pytest.mark.parametrize("vocab", [31, 32, 100, 1000, 32000])
def test_the_cpu_kernel_masks_what_the_bits_forbid(vocab):
    from batchgen_kernels import cpu, cpu_sampling
    from batchgen_kernels.cpu_args import KernelArgumentError

    if not cpu.available():
        pytest.skip("the compiled kernels do not build here")
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    scores = torch.randn(7, vocab + 5, generator=g)[:, :vocab]  # strided rows, as a slice of wider logits
    mask = torch.randint(-(2**31), 2**31 - 1, (7, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[2] = -1  # every token allowed
    mask[3] = 0  # none
    mask[4, ::2] = -1  # whole words allowed between random ones
    mask[5] = mask[5] & 0x00FF00FF  # whole bytes forbidden, whole bytes random
    rows = [0, 2, 3, 4, 5, 6]
    got, want, theirs = scores.clone(), scores.clone(), scores.clone()
    cpu_sampling.token_mask(got, mask, rows, vocab)
    token_mask_ref(want, mask, rows)
    xgr.apply_token_bitmask_inplace(theirs, mask, vocab_size=vocab, indices=rows)
    assert torch.equal(got, want) and torch.equal(got, theirs)
    assert torch.equal(got[1], scores[1]) and torch.equal(got[2], scores[2])  # a row not given; all allowed
    assert bool(torch.isneginf(got[3]).all())
    assert bool(torch.isneginf(got[0]).any()) and bool(torch.isfinite(got[0]).any())
    with pytest.raises(KernelArgumentError, match="token_mask: bitmask must be int32"):
        cpu_sampling.token_mask(got, mask.to(torch.int64), rows, vocab)
    with pytest.raises(KernelArgumentError, match="token_mask: rows must index"):
        cpu_sampling.token_mask(got, mask, [7], vocab)
    with pytest.raises(KernelArgumentError, match="token_mask: vocab"):
        cpu_sampling.token_mask(got, mask, rows, words * 32 + 1)
