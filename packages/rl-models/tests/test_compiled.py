"""compile_decoder_layers: every text decoder layer goes through torch.compile, with the same
log-probs and gradients, and unchanged parameter names (backend aot_eager: dynamo + AOTAutograd,
no C++ build, so it runs in seconds on a CPU)."""

from __future__ import annotations

import pytest
import torch

from rl_models.compiled import compile_decoder_layers, decoder_layers
from rl_models.logprobs import TokenBatch, completion_logprobs
from rl_models.lora import add_lora
from rl_models.text import load_causal_lm
from rl_models.vl import load_vl_model

# dynamo reads `.grad` of its fake tensors while tracing a training forward (a torch-internal warning)
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")


def _text_batch(tokenizer) -> TokenBatch:
    prompt = tokenizer(["Hello there", "Hi"], return_tensors="pt", padding=True, padding_side="left")
    completion = tokenizer([" a b c", " d"], return_tensors="pt", padding=True, padding_side="right")
    return TokenBatch.from_prompt_completion(prompt.input_ids, prompt.attention_mask, completion.input_ids,
                                             completion.attention_mask)


def _logprobs_and_grads(model, batch):
    model.train()
    logp = completion_logprobs(model, batch)  # [B, C]
    (logp * torch.arange(1, logp.shape[0] + 1)[:, None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


@pytest.mark.parametrize("lora", [False, True])
def test_compiled_layers_give_the_same_logprobs_and_gradients(qwen3_path, lora):
    torch._dynamo.reset()
    plain, tokenizer = load_causal_lm(qwen3_path, dtype="float32")
    compiled, _ = load_causal_lm(qwen3_path, dtype="float32")
    if lora:
        plain = add_lora(plain, r=4, alpha=8)
        compiled = add_lora(compiled, r=4, alpha=8)
        compiled.load_state_dict(plain.state_dict())
    names = [n for n, _ in compiled.named_parameters()]
    calls = []
    compile_decoder_layers(compiled, backend=lambda gm, inputs: calls.append(gm) or gm.forward)
    assert [n for n, _ in compiled.named_parameters()] == names  # checkpoints and adapters keep their keys
    batch = _text_batch(tokenizer)
    want_logp, want_grads = _logprobs_and_grads(plain, batch)
    got_logp, got_grads = _logprobs_and_grads(compiled, batch)
    assert calls, "no layer went through torch.compile"
    torch.testing.assert_close(got_logp, want_logp)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)


def test_vl_model_compiles_its_language_model_layers_for_forwards_without_a_cache(vl_paths):
    torch._dynamo.reset()
    model, processor = load_vl_model(vl_paths["qwen3_vl"], dtype="float32")
    traced = []
    compile_decoder_layers(model, backend=lambda gm, inputs: traced.append(gm) or gm.forward)
    assert decoder_layers(model) is model.model.language_model.layers
    assert all(type(block.forward).__name__ == "method" for block in model.model.visual.blocks)  # vision stays eager
    ids = processor.tokenizer(["a b c"], return_tensors="pt").input_ids
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)  # generation-style forward: a DynamicCache is passed
        assert not traced
        model(input_ids=ids, use_cache=False)
        assert traced


def test_a_model_without_decoder_layers_is_refused():
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return self

    with pytest.raises(ValueError, match="no `layers` list"):
        decoder_layers(NoLayers())


@pytest.mark.parametrize("dynamic, graphs", [(True, 2), (None, 4)])
def test_rows_of_new_lengths_with_and_without_padding_build_two_graphs_not_four(qwen3_path, dynamic, graphs):
    """Micro-batches without padding reach the layers with no attention mask, padded ones with a
    mask: dynamic from the start (the default) that is one graph each, built at their first
    micro-batch; dynamo's automatic dynamic shapes (`dynamic=None`) built each twice, the second
    at its variant's first new length, mid-run (caption-rl's step-3 recompile)."""
    torch._dynamo.reset()
    model, _ = load_causal_lm(qwen3_path, dtype="float32")
    built = []
    compile_decoder_layers(model, backend=lambda gm, inputs: built.append(gm) or gm.forward, dynamic=dynamic)
    with torch.no_grad():
        for rows, length, padded in [(2, 5, False), (2, 7, False), (2, 5, True), (2, 9, True), (2, 6, False)]:
            mask = torch.ones(rows, length, dtype=torch.long)
            if padded:
                mask[0, 0] = 0  # a left-padded row: the layers get a mask
            model(input_ids=torch.randint(5, 100, (rows, length)), attention_mask=mask, use_cache=False)
    assert len(built) == graphs
