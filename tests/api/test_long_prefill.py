"""A long prefill's attention runs its queries in blocks (``attention.PREFILL_SCORES`` bounds the
scores held at once): the blocked path must give what the whole chunk gives, with plain causal
attention, with windows and soft-capping (Gemma 2) and with sinks (gpt-oss)."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
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
        attention.TorchAttention, "_prefill_rows", lambda self, q, *a: calls.append(q.shape[0]) or rows(self, q, *a)
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
