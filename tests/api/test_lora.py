"""LoRA adapters equal transformers + peft on the same weights: greedy tokens, beam sequences and
scores, sampled log-probabilities; in mixed batches with evictions and preemption; with the prefix
cache kept apart per adapter; on Llama, Qwen3, Gemma 2 and Phi-3 (fused q/k/v and gate/up); over
quantized checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, BeamSearchParams, LoRARequest, SamplingParams
from batchgen.tiny import make_model
from scripts.fixtures.models import make_adapter

peft = pytest.importorskip("peft")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 40, 50], [7, 100, 200, 300, 17, 18]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
_HF: dict[tuple[str, str | None], object] = {}


def peft_model(model_dir: str, adapter: str | None):
    """transformers in float32, with the adapter loaded by peft (None: the base model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    key = (model_dir, adapter)
    if key not in _HF:
        capped = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None) is not None
        kwargs = {"attn_implementation": "eager"} if capped else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter)
        _HF[key] = model.eval()
    return _HF[key]


@torch.no_grad()
def oracle_greedy(model_dir: str, adapter: str | None, prompt: list[int], max_new: int = 8) -> list[int]:
    model = peft_model(model_dir, adapter)
    ids = list(prompt)
    for _ in range(max_new):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def oracle_logprob(model_dir: str, adapter: str | None, prompt: list[int], completion: list[int]) -> float:
    model = peft_model(model_dir, adapter)
    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
    return float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(completion)))


@torch.no_grad()
def oracle_beam(model_dir: str, adapter: str | None, prompt: list[int], width: int, max_new: int = 6):
    g = peft_model(model_dir, adapter).generate(
        input_ids=torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    return g.sequences[:, len(prompt) :].tolist(), g.sequences_scores.tolist()


def requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(sorted(adapters.items()), start=1)}


def test_each_adapter_equals_peft_greedy_beam_and_sampled_logprobs(llama_dir, adapters):
    llm = LLM(llama_dir, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    for name, req in requests(adapters).items():
        path = adapters[name]
        outs = llm.generate(PROMPTS, GREEDY, lora_request=req)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == [oracle_greedy(llama_dir, path, p) for p in PROMPTS], name
        assert got != base, f"{name}: the adapter changed nothing"
        assert all(o.lora_request == req for o in outs)

        beams = llm.beam_search(
            PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True), lora_request=req
        )
        for prompt, out in zip(PROMPTS[:2], beams):
            seqs, scores = oracle_beam(llama_dir, path, prompt, 3)
            assert [s.tokens[len(prompt) :] for s in out.sequences] == seqs, name
            for s, want in zip(out.sequences, scores):
                assert abs(s.score - want) < 1e-4, (name, s.score, want)

        sampled = llm.generate(
            PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True), lora_request=req
        )
        for prompt, out in zip(PROMPTS, sampled):
            for c in out.outputs:
                want = oracle_logprob(llama_dir, path, prompt, c.token_ids)
                assert abs(c.cumulative_logprob - want) < 2e-3, (name, c.cumulative_logprob, want)
    assert llm.stats()["lora_disk_loads"] == 3


@pytest.mark.parametrize(
    "fmt,opts,tol", [("gptq", dict(bits=4, group=32), 5e-3), ("ct-int8", dict(group=-1), 2e-3)], ids=["gptq-int4", "ct-int8"]
)
def test_adapters_over_a_quantized_model_equal_peft_over_its_dequantized_weights(llama_dir, adapters, tmp_path, fmt, opts, tol):
    """Adapters over a quantized checkpoint (as vLLM serves them over GPTQ / AWQ / compressed-tensors
    models): the projections stay quantized, each row adds its adapter's float delta. The oracle is
    peft over transformers on the dequantized weights; rows of two adapters and the base share a batch."""
    from scripts.fixtures.quant import quantize_model

    quantized, oracle = tmp_path / "q", str(tmp_path / "oracle")
    quantize_model(llama_dir, quantized, fmt, oracle=oracle, **opts)
    llm = LLM(str(quantized), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    st = llm.stats()
    assert st["quantization"] != "none" and "reference" not in st["quantized_paths"], st["quantized_paths"]
    reqs = requests(adapters)
    rows = [reqs["r4"], reqs["r16"], None]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=rows)
    for prompt, req, out in zip(PROMPTS, rows, outs):
        adapter = None if req is None else req.lora_path
        assert out.outputs[0].token_ids == oracle_greedy(oracle, adapter, prompt), req
    sampled = llm.generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True), lora_request=rows
    )
    for prompt, req, out in zip(PROMPTS, rows, sampled):
        adapter = None if req is None else req.lora_path
        for c in out.outputs:
            want = oracle_logprob(oracle, adapter, prompt, c.token_ids)
            assert abs(c.cumulative_logprob - want) < tol, (req, c.cumulative_logprob, want)


@pytest.mark.parametrize("pool,seqs", [(None, 2), (7, 4)], ids=["roomy", "tiny-pool-preempts"])
def test_a_mixed_batch_over_more_adapters_than_slots_equals_each_row_alone(llama_dir, adapters, pool, seqs):
    reqs = list(requests(adapters).values())
    choices = [None, *reqs]  # the base model and three adapters, round-robin over the rows
    prompts = [PROMPTS[i % 3] + [20 + i] for i in range(12)]
    loras = [choices[i % 4] for i in range(12)]
    kwargs = {"num_kv_blocks": pool, "block_size": 8} if pool else {}
    # a few rows at a time: the adapters come and go, so some are evicted and loaded again
    llm = LLM(llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=seqs, **kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        path = None if lora is None else lora.lora_path
        assert out.outputs[0].token_ids == oracle_greedy(llama_dir, path, prompt, 16), lora
    stats = llm.stats()
    assert stats["lora_disk_loads"] == 3  # read once each, however often evicted
    assert stats["lora_evictions"] >= 2 and stats["lora_activations"] > 3  # some loaded twice
    if pool:
        assert stats["num_preemptions"] > 0


def test_no_cached_block_crosses_from_one_adapter_to_another(llama_dir, adapters):
    reqs = requests(adapters)
    prompt = list(range(3, 40))  # 4 full blocks of 8
    llm = LLM(llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=8)
    first = llm.generate([prompt], GREEDY, lora_request=reqs["r4"])[0]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    other = llm.generate([prompt], GREEDY, lora_request=reqs["r8"])[0]
    assert other.num_cached_tokens == 0 and llm.stats()["prefix_cache_hit_tokens"] == hits
    base = llm.generate([prompt], GREEDY)[0]
    assert base.num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, lora_request=reqs["r4"])[0]
    assert again.num_cached_tokens == 32 and llm.stats()["prefix_cache_hit_tokens"] == hits + 32
    for out, adapter in ((first, adapters["r4"]), (other, adapters["r8"]), (base, None), (again, adapters["r4"])):
        assert out.outputs[0].token_ids == oracle_greedy(llama_dir, adapter, prompt), adapter


@pytest.mark.parametrize(
    "arch,targets",
    [
        ("qwen3", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ("gemma2", ("q_proj", "v_proj", "down_proj")),
        ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    ],
)
def test_other_families_equal_peft(model_dirs, tmp_path, arch, targets):
    model_dir = model_dirs[arch] if arch in model_dirs else str(make_model(tmp_path / arch, arch, seed=4))
    path = str(make_adapter(tmp_path / "a", model_dir, rank=8, alpha=16, seed=7, scale=0.15, targets=targets))
    llm = LLM(model_dir, dtype="float32", enable_lora=True)
    req = LoRARequest("a", 1, path)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[req, None, req])
    for prompt, out, adapter in zip(PROMPTS, outs, (path, None, path)):
        assert out.outputs[0].token_ids == oracle_greedy(model_dir, adapter, prompt), arch


def _copy_with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_bad_adapters_are_refused_before_anything_runs(llama_dir, adapters, model_dirs, tmp_path):
    llm = LLM(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)

    def refused(path: str, match: str, lora_id: int = 1) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("bad", lora_id, path))

    refused(str(tmp_path / "nowhere"), "does not exist")
    refused(adapters["r16"], "rank 16, above max_lora_rank=8")
    refused(_copy_with_config(adapters["r4"], tmp_path / "dora", use_dora=True), "DoRA")
    refused(_copy_with_config(adapters["r4"], tmp_path / "mts", modules_to_save=["lm_head"]), "modules_to_save")
    refused(_copy_with_config(adapters["r4"], tmp_path / "gpt2", target_modules=["c_attn"]), "'c_attn' is not a module")
    emb = make_adapter(tmp_path / "emb", llama_dir, rank=4, targets=["embed_tokens"])
    refused(str(emb), "embedding")
    other = make_model(tmp_path / "wide", "llama", seed=9, hidden_size=96)
    refused(str(make_adapter(tmp_path / "wide_a", other, rank=4)), "another base model")
    corrupt = _copy_with_config(adapters["r4"], tmp_path / "corrupt")
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    refused(corrupt, "cannot read adapter_model.safetensors")
    # one id, two adapters
    llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("r4", 3, adapters["r4"]))
    refused(adapters["r8"], "lora_int_id 3 is adapter 'r4'", lora_id=3)
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(llama_dir, dtype="float32").generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, adapters["r4"]))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, adapters["r4"])
    moe_dir = model_dirs["mixtral"] if "mixtral" in model_dirs else make_model(tmp_path / "mx", "mixtral", seed=2)
    # an adapter on an expert's projection, as PEFT names it on a per-expert checkpoint
    moe_adapter = make_adapter(tmp_path / "moe", moe_dir, rank=4, targets=["q_proj"])
    weights = load_file(str(moe_adapter / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1.lora_A.weight"
    weights[name] = torch.ones(4, 64)
    save_file(weights, str(moe_adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="MoE experts"):
        LLM(str(moe_dir), dtype="float32", enable_lora=True).generate(
            PROMPTS, GREEDY, lora_request=LoRARequest("m", 1, str(moe_adapter))
        )


def test_vllm_lora_example_runs_with_only_its_import_changed(llama_dir, adapters):
    """vLLM's offline LoRA example: engine keywords, ``LoRARequest`` positional, ``lora_request=``."""
    llm = LLM(model=llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2, max_num_seqs=16,
              dtype="float32")
    sampling_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(["cat dog the", "a fox sat"], sampling_params,
                           lora_request=LoRARequest("sql_adapter", 1, adapters["r4"]))
    chat = llm.chat([{"role": "user", "content": "hi"}], sampling_params,
                    lora_request=LoRARequest("sql_adapter", 1, adapters["r4"]))
    tok = llm.get_tokenizer()
    for out in outputs + chat:
        assert out.outputs[0].token_ids == oracle_greedy(llama_dir, adapters["r4"], out.prompt_token_ids, 8)
    assert [o.lora_request.lora_name for o in outputs] == ["sql_adapter"] * 2 and tok is not None
