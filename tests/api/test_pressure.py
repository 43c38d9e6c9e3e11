"""Randomized stress of the engine under KV-memory pressure.

The property: every request that completes alone in a pool completes in any mix with others in
that pool, under any ``max_num_seqs`` / ``max_num_batched_tokens``, prefix caching on or off,
recompute or swap preemption (host pools down to one block), chunked prefill, with the output it
has alone. Each configuration draws a mix of greedy, seeded n = 1..8 sampling and beam widths
1..8 over prompts that share prefixes, sizes the pool from "the largest request just fits alone"
upward, runs it with the block manager's invariants checked after every step, compares each
request with a run of it alone in a large pool, checks ``stats()``, and runs once more to show
the engine is usable afterwards. A failure prints the configuration and requests that reproduce it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams

NUM_CONFIGS = 200
VOCAB = 384  # the test models' vocabulary
PREFIXES = [[(7 * i + 11) % 370 + 3 for i in range(21)], [(13 * i + 5) % 370 + 3 for i in range(13)]]


@dataclass
class Trial:
    engine: dict
    prompts: list[list[int]]
    params: list[SamplingParams | BeamSearchParams]

    def repro(self) -> str:
        lines = [f"LLM(model, dtype='float32', device='cpu', debug_checks=True, **{self.engine!r})"]
        lines += [f"  prompt {p!r}\n    {q!r}" for p, q in zip(self.prompts, self.params)]
        return "\n".join(lines)


def draw_request(rng: random.Random) -> tuple[list[int], SamplingParams | BeamSearchParams]:
    prompt = []
    if rng.random() < 0.6:  # share a prefix with other requests (often a whole block or more)
        prefix = rng.choice(PREFIXES)
        prompt = prefix[: rng.randint(4, len(prefix))]
    prompt += [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
    kind = rng.choice(["greedy", "sample", "sample", "beam"])
    ignore_eos = rng.random() < 0.5
    if kind == "greedy":
        return prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=ignore_eos)
    if kind == "sample":
        return prompt, SamplingParams(
            n=rng.randint(1, 8),
            temperature=1.0,
            top_p=rng.choice([1.0, 0.9]),
            max_tokens=rng.randint(1, 16),
            seed=rng.randrange(10_000),
            ignore_eos=ignore_eos,
        )
    return prompt, BeamSearchParams(
        beam_width=rng.randint(1, 8),
        max_tokens=rng.randint(1, 10),
        length_penalty=rng.choice([1.0, 0.5, 2.0]),
        early_stopping=rng.choice([True, False, "never"]),
        ignore_eos=ignore_eos,
    )


def draw_trial(index: int, need_alone) -> Trial:
    rng = random.Random(1000 + index)
    block_size = rng.choice([8, 16])
    requests = [draw_request(rng) for _ in range(rng.randint(3, 8))]
    if rng.random() < 0.3:  # the same prompt twice: identical blocks from two requests
        requests.append((list(requests[0][0]), requests[-1][1]))
    largest = max(need_alone(block_size, len(p), q) for p, q in requests)
    engine = dict(
        block_size=block_size,
        num_kv_blocks=max(2, largest + rng.choice([0, 0, 0, 0, 1, 1, 2, 3, 6, 12])),
        max_num_seqs=rng.choice([1, 3, 8, 256, 256]),
        max_num_batched_tokens=rng.choice([3, 17, 64, 4096, 4096]),
        enable_prefix_caching=rng.random() < 0.6,
    )
    if rng.random() < 0.5:
        engine["preemption_mode"] = "swap"
        engine["swap_host_blocks"] = rng.choice([1, 2, 4, 16, 256])
    else:
        engine["preemption_mode"] = "recompute"
    return Trial(engine, [p for p, _ in requests], [q for _, q in requests])


class Oracle:
    """Each request run alone in a large pool, once per block size."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.llms: dict[int, LLM] = {}
        self.cache: dict[tuple, object] = {}

    def llm(self, block_size: int) -> LLM:
        if block_size not in self.llms:
            self.llms[block_size] = LLM(
                self.path, dtype="float32", device="cpu", block_size=block_size, num_kv_blocks=2048,
                enable_prefix_caching=False,
            )
        return self.llms[block_size]

    def need_alone(self, block_size: int, prompt_len: int, params) -> int:
        return self.llm(block_size).engine.blocks_needed_alone(prompt_len, params)

    def alone(self, block_size: int, prompt: list[int], params):
        key = (block_size, tuple(prompt), repr(params))
        if key not in self.cache:
            self.cache[key] = self.llm(block_size).generate([prompt], params, use_tqdm=False)[0]
        return self.cache[key]

    def bytes_per_block(self, block_size: int) -> int:
        return self.llm(block_size).engine.runner.bytes_per_block


@pytest.fixture(scope="module")
def oracle(llama_dir) -> Oracle:
    return Oracle(llama_dir)


def boundary_flip(got: list[int], want: list[int]) -> bool:
    """Whether two sampled completions part at one draw that fell on the boundary between two
    neighbouring tokens of the inverse CDF (ids one apart), the rest then not comparable. A request
    preempted by recompute has the keys and values of its generated tokens recomputed by a prefill,
    which rounds differently from the decode steps that first computed them (float32, last bits:
    the log-probabilities before the flip agree to ~1e-6); a uniform number within that distance
    of a CDF boundary then picks the neighbour. Anything else (a different token elsewhere, a
    different length) is a real difference."""
    if len(got) != len(want) or got == want:
        return False
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    return abs(got[first] - want[first]) == 1


def same_output(got, want, sampling: bool = False) -> str | None:
    """None if ``got`` (a request run in a mix) is what the request gives alone (``want``); with
    ``sampling`` (temperature > 0), a completion may part from its alone run at a boundary flip."""
    if got.error is not None:
        return f"failed: {got.error}"
    if len(got.outputs) != len(want.outputs):
        return f"{len(got.outputs)} completions, alone {len(want.outputs)}"
    for a, b in zip(got.outputs, want.outputs, strict=True):
        if sampling and boundary_flip(a.token_ids, b.token_ids):
            continue
        if a.token_ids != b.token_ids or a.finish_reason != b.finish_reason:
            return f"completion {a.index}: {a.token_ids} ({a.finish_reason}), alone {b.token_ids} ({b.finish_reason})"
        if abs(a.cumulative_logprob - b.cumulative_logprob) > 1e-3:
            return f"completion {a.index}: logprob {a.cumulative_logprob} alone {b.cumulative_logprob}"
        if (a.score is None) != (b.score is None) or (a.score is not None and abs(a.score - b.score) > 1e-4):
            return f"completion {a.index}: score {a.score} alone {b.score}"
    return None


def sampled(params) -> bool:
    return isinstance(params, SamplingParams) and params.temperature > 0


def check_idle(llm: LLM) -> None:
    """Everything is done: every block free, no request left anywhere, host pool empty."""
    eng, bm = llm.engine, llm.engine.bm
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs and not bm.swapped
    assert len(bm.host_free) + len(bm.host_pending_free) == bm.num_host_blocks
    assert not eng.has_unfinished() and not eng.kinds[BeamSearchParams].pending and not eng._groups


@pytest.mark.parametrize("index", range(NUM_CONFIGS))
def test_every_request_that_fits_alone_completes_in_any_mix(oracle, index):
    trial = draw_trial(index, oracle.need_alone)
    kwargs = dict(trial.engine)
    bs = kwargs["block_size"]
    host_blocks = kwargs.pop("swap_host_blocks", None)
    if host_blocks is not None:
        kwargs["swap_space_gb"] = (host_blocks + 0.5) * oracle.bytes_per_block(bs) / 2**30
    try:
        llm = LLM(oracle.path, dtype="float32", device="cpu", debug_checks=True, **kwargs)
        if host_blocks is not None:
            assert llm.engine.runner.num_host_blocks == host_blocks
        outs = llm.generate(trial.prompts, trial.params, use_tqdm=False)
        for i, (prompt, params, out) in enumerate(zip(trial.prompts, trial.params, outs, strict=True)):
            problem = same_output(out, oracle.alone(bs, prompt, params), sampled(params))
            assert problem is None, f"request {i}: {problem}"
            if not kwargs["enable_prefix_caching"]:
                assert out.num_cached_tokens == 0, f"request {i}: cached tokens with prefix caching off"
        st = llm.stats()
        assert st["peak_blocks_used"] <= st["num_blocks"] == kwargs["num_kv_blocks"]
        assert st["num_swap_outs"] <= st["num_preemptions"]
        assert st["swapped_blocks"] == 0 or host_blocks is not None
        assert st["peak_physical_kv_slots"] <= st["num_blocks"] * bs
        check_idle(llm)
        # still usable: the first request again, same output as alone
        again = llm.generate([trial.prompts[0]], trial.params[0], use_tqdm=False)[0]
        problem = same_output(again, oracle.alone(bs, trial.prompts[0], trial.params[0]), sampled(trial.params[0]))
        assert problem is None, f"rerun of request 0: {problem}"
        check_idle(llm)
    except Exception as e:
        raise AssertionError(f"configuration {index} failed: {e}\nreproduce with:\n{trial.repro()}") from e


def _ids(n: int, salt: int) -> list[int]:
    return [(7 * i + salt) % 300 + 3 for i in range(n)]


SIX = [_ids(n, i) for i, n in enumerate([3, 16, 17, 29, 50, 81])]
N4 = SamplingParams(n=4, temperature=1.0, max_tokens=18, seed=5, ignore_eos=True)
CASES = {
    # after a recompute preemption every sample matched the same free prompt blocks, and admission
    # counted them once per sample: the group never came back and the engine raised
    "six-prompts-n4": (dict(block_size=8, num_kv_blocks=40), SIX, [N4] * 6),
    "n1-and-n8": (
        dict(block_size=8, num_kv_blocks=21),
        [_ids(4, 1), _ids(36, 2)],
        [SamplingParams(temperature=0, max_tokens=6), SamplingParams(n=8, max_tokens=6, seed=3)],
    ),
    "beams-after-recompute": (
        dict(block_size=8, num_kv_blocks=19),
        [_ids(30, 4), _ids(9, 5), _ids(17, 6)],
        [BeamSearchParams(beam_width=8, max_tokens=6, ignore_eos=True)] * 3,
    ),
    # swapped out near its peak, the n=8 group waited for its blocks plus one per sample, which the
    # pool never had
    "swap-near-peak": (
        dict(block_size=8, num_kv_blocks=17, preemption_mode="swap", swap_space_gb=0.01),
        [_ids(4, 7), _ids(7, 8)],
        [
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
            SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=2, ignore_eos=True),
        ],
    ),
}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_the_reported_pressure_cases_complete_as_alone(oracle, case, caching):
    engine, prompts, params = CASES[case]
    llm = LLM(oracle.path, dtype="float32", device="cpu", debug_checks=True, enable_prefix_caching=caching, **engine)
    outs = llm.generate(prompts, params)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
        assert same_output(out, oracle.alone(engine["block_size"], prompt, p), sampled(p)) is None, f"request {i}"
    st = llm.stats()
    assert st["num_preemptions"] > 0
    if engine.get("preemption_mode") == "swap":  # came back by swap, not by a fallback to recompute
        assert st["num_swap_outs"] == st["num_preemptions"]
    check_idle(llm)
