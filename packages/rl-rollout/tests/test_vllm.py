"""`vllm` engine on a real vLLM: opt-in (`-m vllm`, `nox -s vllm`), needs vLLM and a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from rl_rollout import SamplingParams

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vLLM is absent")
def test_import_without_vllm_names_the_extra() -> None:
    proc = subprocess.run([sys.executable, "-c", "import rl_rollout.vllm"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert 'pip install "rl-rollout[vllm]"' in proc.stderr


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM or not torch.cuda.is_available(), reason="needs vLLM and a GPU")
def test_vllm_engine_generate_score_sleep_and_load() -> None:
    from rl_models import tiny
    from rl_rollout.hf import HFEngine
    from rl_rollout.vllm import VLLMEngine

    # qwen3_vllm: 64-wide heads (vLLM 0.26's FlashAttention hung at start on tiny qwen3's 8-wide
    # ones, and its flex attention refuses them); enforce_eager: starts in seconds
    qwen3_path = tiny.build("qwen3_vllm")
    engine = VLLMEngine(str(qwen3_path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024,
                        enforce_eager=True)
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=8, seed=0)
    gens = engine.generate([[1, 2, 3], "hello"], params)
    assert [g.request_index for g in gens] == [0, 0, 1, 1]
    ref = HFEngine.from_pretrained(qwen3_path, dtype=torch.bfloat16, device="cuda")
    for g in gens:
        ids = torch.tensor([g.prompt_ids + g.completion_ids], device="cuda")
        with torch.no_grad():
            lps = torch.log_softmax(ref.model(ids).logits[0].float() / 0.7, -1)[len(g.prompt_ids) - 1 : -1]
        expected = lps.gather(-1, torch.tensor(g.completion_ids, device="cuda")[:, None])[:, 0].cpu()
        assert torch.allclose(torch.tensor(g.logprobs), expected.float(), atol=5e-2)  # bf16 kernels differ
    # scoring: candidate log-probs renormalized over the candidates, so compare distributions
    items = [([5, 6, 7], [[8], [9, 10], [9, 11, 12]]), ([20, 21], [[22]])]
    for temperature in (1.0, 0.6):
        tables = engine.score_next_tokens_batch(items, [11, 12, 13], temperature=temperature)
        assert [t.shape for t in tables] == [(3, 3), (1, 3)]
        for (prefix, suffixes), table in zip(items, tables, strict=True):
            expected = ref.score_next_tokens(prefix, suffixes, [11, 12, 13], temperature=temperature)
            assert torch.allclose(table.exp().sum(-1), torch.ones(len(suffixes)), atol=1e-4)
            assert torch.allclose(table.softmax(-1), expected.float().softmax(-1), atol=2e-2)
    single = engine.score_next_tokens([5, 6, 7], [[8], [9, 10]], [11, 12])
    assert torch.allclose(single.softmax(-1), ref.score_next_tokens([5, 6, 7], [[8], [9, 10]], [11, 12]).float().softmax(-1),
                          atol=2e-2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate([[1, 2, 3]], greedy)
    engine.sleep()
    engine.wake()
    assert engine.generate([[1, 2, 3]], greedy) == before
    engine.sleep()  # the RL pattern: push while asleep (only the weights wake), then wake the KV cache
    engine.load_weights(((name, torch.zeros_like(t)) for name, t in ref.model.state_dict().items()
                         if name.endswith("norm.weight")), version=7)
    assert engine.weights_only_awake and engine.state == "asleep" and engine.weight_version == 7
    engine.wake()
    after = engine.generate([[1, 2, 3]], greedy)[0]
    assert after.completion_ids != before[0].completion_ids
    vocab = ref.model.config.vocab_size  # zero final norm: every logit 0, a uniform distribution
    assert all(abs(lp + torch.log(torch.tensor(float(vocab))).item()) < 1e-3 for lp in after.logprobs), after.logprobs
    engine.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM or not torch.cuda.is_available(), reason="needs vLLM and a GPU")
def test_vllm_engine_in_a_process_of_its_own_takes_pushes_by_cuda_ipc() -> None:
    """An engine core in a process of its own (a rollout GPU of its own) gets weight pushes as
    CUDA IPC handles: host tensors are copied to its GPU first, GPU tensors shared as they are;
    the pushed weights are what it then samples with."""
    from rl_models import tiny
    from rl_rollout.colocated import vllm_engine_core
    from rl_rollout.hf import HFEngine
    from rl_rollout.vllm import VLLMEngine

    qwen3_path = tiny.build("qwen3_vllm")
    with vllm_engine_core(in_process=False):
        engine = VLLMEngine(str(qwen3_path), ipc_weights=True, dtype="bfloat16", gpu_memory_utilization=0.3,
                            max_model_len=1024, enforce_eager=True, enable_sleep_mode=False)
    assert not engine.in_process and engine.ipc_weights
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate([[1, 2, 3]], greedy)[0]
    ref = HFEngine.from_pretrained(qwen3_path, dtype=torch.bfloat16, device="cpu")
    norms = {name: t for name, t in ref.model.state_dict().items() if name.endswith("norm.weight")}
    engine.load_weights(((name, torch.zeros_like(t)) for name, t in norms.items()), version=3)  # host tensors
    assert engine.weight_version == 3
    zeroed = engine.generate([[1, 2, 3]], greedy)[0]
    vocab = ref.model.config.vocab_size  # zero final norm: every logit 0, a uniform distribution
    assert all(abs(lp + torch.log(torch.tensor(float(vocab))).item()) < 1e-3 for lp in zeroed.logprobs), zeroed.logprobs
    engine.load_weights([(name, t.cuda()) for name, t in norms.items()])  # on the engine's GPU: shared as is
    assert engine.generate([[1, 2, 3]], greedy)[0].completion_ids == before.completion_ids
    engine.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM or not torch.cuda.is_available(), reason="needs vLLM and a GPU")
def test_vllm_fp8_engine_quantizes_every_push_again() -> None:
    """`quantization="fp8"` (`rollout.precision = "fp8"`): vLLM's online FP8 serves log-probs near
    the bf16 model's. A push of another model's bf16 weights goes through vLLM's layerwise reload,
    quantized again: the engine then serves that model, not the one it loaded, and a second push
    brings the first back."""
    from rl_models import tiny
    from rl_rollout.hf import HFEngine
    from rl_rollout.vllm import VLLMEngine

    paths = [tiny.build("qwen3_vllm"), tiny.build("qwen3_vllm", seed=1)]
    engine = VLLMEngine(str(paths[0]), dtype="bfloat16", quantization="fp8", gpu_memory_utilization=0.3,
                        max_model_len=1024, enforce_eager=True)
    assert engine.requantize
    refs = [HFEngine.from_pretrained(p, dtype=torch.bfloat16, device="cuda") for p in paths]
    prompts = [[1, 2, 3, 4], [7, 8, 9], "hello there"]

    def gaps() -> list[float]:
        """Mean |engine log-prob - each bf16 model's| over the tokens the engine samples."""
        gens = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0))
        out = []
        for ref in refs:
            diffs = []
            for g in gens:
                ids = torch.tensor([g.prompt_ids + g.completion_ids], device="cuda")
                with torch.no_grad():
                    lps = torch.log_softmax(ref.model(ids).logits[0].float(), -1)[len(g.prompt_ids) - 1 : -1]
                expected = lps.gather(-1, torch.tensor(g.completion_ids, device="cuda")[:, None])[:, 0].cpu()
                diffs.append((torch.tensor(g.logprobs) - expected).abs())
            out.append(float(torch.cat(diffs).mean()))
        return out

    loaded = gaps()
    for version, source in ((1, 1), (2, 0)):
        engine.sleep()
        engine.load_weights(list(refs[source].model.state_dict().items()), version=version)
        engine.wake()
        served = gaps()
        print(f"push {version} (model {source}): mean |log-prob gap| to model 0, 1: {served}")
        assert served[source] < 0.5 * served[1 - source], served
    print(f"as loaded: {loaded}")
    assert loaded[0] < 0.5 * loaded[1]
    engine.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM or not torch.cuda.is_available(), reason="needs vLLM and a GPU")
def test_vllm_continues_samples_with_their_own_budgets_and_seeds() -> None:
    """Partial rollouts on vLLM: a greedy `Continuation` goes on as the uninterrupted sample; one
    call takes each request's budget and seed (the same prompt twice draws apart); a stream of
    rounds returns the first groups to finish with their versions."""
    from rl_models import tiny
    from rl_rollout import Continuation, PartialRollouts
    from rl_rollout.partial import round_generator
    from rl_rollout.vllm import VLLMEngine

    engine = VLLMEngine(str(tiny.build("qwen3_vllm")), dtype="bfloat16", gpu_memory_utilization=0.3,
                        max_model_len=1024, enforce_eager=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    for prompt in ([1, 2, 3], "hello there"):
        whole = engine.generate([prompt], greedy)[0]
        rest = engine.generate([Continuation(prompt, whole.completion_ids[:4])], greedy)[0]
        assert rest.prompt_ids == whole.prompt_ids + whole.completion_ids[:4]
        assert rest.completion_ids[:6] == whole.completion_ids[4:]
    gens = engine.generate([[5, 6, 7], [5, 6, 7]], SamplingParams(max_new_tokens=9), max_new_tokens=[3, 9], seeds=[1, 2])
    assert [len(g.completion_ids) for g in gens] == [3, 9] and gens[0].completion_ids != gens[1].completion_ids[:3]
    partial = PartialRollouts(4, 1, engine.tokenizer.decode)
    taken = [0]

    def draw(count: int):
        keys = list(range(taken[0], taken[0] + count))
        taken[0] += count
        return keys, [[10 + k, 11, 12] for k in keys], keys

    def budgets(key: int, j: int) -> int:
        return 3 if key % 2 == 0 else 11

    params = SamplingParams(n=2, max_new_tokens=11, seed=0)
    generate = round_generator(engine)
    assert partial.run(generate, draw, 2, params, version=0, budgets=budgets)[0] == [0, 2]
    keys, gens = partial.run(generate, draw, 2, params, version=1, budgets=budgets)
    assert keys == [1, 3] and all(g.token_versions == [0] * 4 + [1] * 7 for g in gens)
    engine.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM or not torch.cuda.is_available(), reason="needs vLLM and a GPU")
def test_an_adapter_push_samples_as_the_lora_policy_does(tmp_path) -> None:
    """rollout.weight_push=adapter: vLLM (enable_lora) samples with the pushed adapter over its base
    weights: the log-probs of the LoRA policy itself, after a sleep too, and a new version's
    adapter replaces the last."""
    from transformers import AutoModelForCausalLM

    from rl_models import tiny
    from rl_models.lora import add_lora
    from rl_rollout.colocated import push_adapter
    from rl_rollout.vllm import VLLMEngine

    path = tiny.build("qwen3_vllm")
    model = add_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda(), family="qwen3", r=8)
    engine = VLLMEngine(str(path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024, enforce_eager=True,
                        enable_lora=True, max_lora_rank=8, max_loras=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    def logprobs_match(gen) -> None:
        ids = torch.tensor([gen.prompt_ids + gen.completion_ids], device="cuda")
        with torch.no_grad():
            lps = torch.log_softmax(model(ids).logits[0].float(), -1)[len(gen.prompt_ids) - 1 : -1]
        expected = lps.gather(-1, torch.tensor(gen.completion_ids, device="cuda")[:, None])[:, 0].cpu()
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=5e-2), (gen.logprobs, expected.tolist())

    base = engine.generate([[1, 2, 3]], greedy)[0]
    for version in (1, 2):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1, generator=torch.Generator("cuda").manual_seed(version))
        folder = push_adapter(engine, model, version, tmp_path)
        gen = engine.generate([[1, 2, 3]], greedy)[0]
        assert gen.completion_ids != base.completion_ids and engine.weight_version == version
        logprobs_match(gen)
        assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # the last version's only
    engine.sleep()
    engine.wake()
    assert engine.generate([[1, 2, 3]], greedy)[0] == gen
    engine.close()
