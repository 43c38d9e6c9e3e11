"""A long prefill's attention runs its queries in blocks (``attention.PREFILL_SCORES`` bounds the
scores held at once): the blocked path must give what the whole chunk gives, with plain causal
attention, with windows and soft-capping (Gemma 2) and with sinks (gpt-oss). A chunk after cached
positions runs, where torch's CPU flash kernel takes the layer, as two unmasked calls merged by
their log-sum-exps: that must give what one masked call gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams, utils
from batchgen.model import attention
from batchgen.tiny import make_model

PROMPT = [1] + [(i * 37) % 300 + 3 for i in range(95)]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_blocked_prefill_equals_whole_chunks(tmp_path, monkeypatch, arch):
    path = str(make_model(tmp_path / arch, arch, seed=3))
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True, prompt_logprobs=2)

    def run():
        llm = LLM(path, max_num_batched_tokens=48, max_num_seqs=4, attention_backend="torch")
        return llm.generate([PROMPT], params)[0]

    whole = run()
    calls = []
    rows = attention.TorchAttention._prefill_rows
    monkeypatch.setattr(attention, "PREFILL_SCORES", 40 * 8)  # blocks of 3..8 queries
    monkeypatch.setattr(
        attention.TorchAttention,
        "_prefill_rows",
        lambda self, q, *a: calls.append(q.shape[0]) or rows(self, q, *a),
    )
    blocked = run()
    assert calls and max(calls) <= 8, "the blocked path did not run"
    assert blocked.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(blocked.outputs[0].logprobs, whole.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)
    for a, b in zip(blocked.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        for t in b:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)


@pytest.mark.parametrize("repeat", [False, True], ids=["kernel-gqa", "repeated-kv"])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, ctx", [(1, 2), (1, 300), (7, 40), (64, 64 + 16), (300, 1000)])
def test_chunk_after_context_equals_one_masked_call(monkeypatch, dtype, n, ctx, amx, repeat):
    """Without AMX (or in float32) both calls run in float32 and the merge is rounded once; with
    AMX bfloat16 runs in bfloat16 (the kernel's products on AMX tiles), as transformers' one masked
    bfloat16 call does, and its error is held to that call's. Four query heads per kv head: on the
    kernel's own grouped-query heads where this torch has them, and with the keys and values
    repeated to the query heads (the path of releases whose kernel reads past the key heads)."""
    if not repeat and not attention._cpu_flash_takes_gqa():
        pytest.skip("this torch's CPU flash kernel does not take fewer kv heads than query heads")
    monkeypatch.setattr(attention, "_cpu_flash_takes_gqa", lambda: not repeat)
    monkeypatch.setattr(utils, "has_amx", lambda: amx)
    gen = torch.Generator().manual_seed(n * ctx)
    q = torch.randn(n, 8, 32, generator=gen).to(dtype)
    keys, values = (torch.randn(2, ctx, 32, generator=gen).to(dtype) for _ in range(2))
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    exact = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        keys.double(),
        values.double(),
        attn_mask=visible,
        scale=0.3,
        enable_gqa=True,
    ).transpose(0, 1)
    got = attention._prefill_after_context(q, keys, values, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    elif amx:  # each call's weights and output in bf16: no worse than one masked bf16 call
        # the keys repeated to the query heads: torch's flash kernel in every release (with
        # enable_gqa, torch 2.6 takes another path)
        k4, v4 = keys.repeat_interleave(4, 0), values.repeat_interleave(4, 0)
        one_call = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k4[None], v4[None], attn_mask=visible, scale=0.3
        )[0].transpose(0, 1)
        ours, theirs = (got.double() - exact).abs(), (one_call.double() - exact).abs()
        assert ours.mean() <= 1.5 * theirs.mean() + 1e-6
        assert ours.max() <= 2**-7 * exact.abs().max()
    else:  # rounded once, after the merge: within half a bf16 step of the exact value
        step = 2.0 ** (torch.frexp(exact).exponent.double() - 8)
        assert bool(((got.double() - exact).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunks_after_context_in_the_engine(tmp_path, monkeypatch, arch):
    """Chunked prefill and a cached prefix, with the two-call path and with the masked call."""
    path = str(make_model(tmp_path / arch, arch, seed=4))
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True, prompt_logprobs=2)
    prompts = [PROMPT, PROMPT[:80] + [7, 8, 9]]  # the second starts with the first's cached blocks
    calls = []
    split = attention._prefill_after_context

    def run():
        llm = LLM(path, max_num_batched_tokens=32, max_num_seqs=4, block_size=8, dtype="float32")
        return llm.generate(prompts, params)

    monkeypatch.setattr(
        attention, "_prefill_after_context", lambda *a: calls.append(a[0].shape[0]) or split(*a)
    )
    fast = run()
    assert calls, "the two-call path did not run"
    monkeypatch.setattr(attention, "_cpu_flash_takes", lambda q, layer: False)
    masked = run()
    for a, b in zip(fast, masked, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(
            a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]
        ):
            assert x.keys() == y.keys()
            for t in x:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)
