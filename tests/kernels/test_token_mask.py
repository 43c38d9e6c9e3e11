"""The structured-output mask kernel (``batchgen_kernels/token_mask.py``) under Triton's interpreter,
against its torch reference and xgrammar's own CPU application of the same bitmask."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab", [100, 384, 1000])
def test_the_kernel_masks_what_the_bits_forbid(vocab):
    from batchgen_kernels.token_mask import token_mask, token_mask_ref

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
