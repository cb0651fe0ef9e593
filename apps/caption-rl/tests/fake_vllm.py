"""A stand-in for the `vllm` module (vLLM needs CUDA; this machine has none): `FakeLLM` plays
`vllm.LLM` with a Hugging Face copy of the checkpoint. It samples with full forwards (no KV
cache), answers `collective_rpc(load_weights)` by copying the named tensors into that copy, and
records every call, so tests can check what a trainer pushes and when."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[Completion]


@dataclass
class Push:
    names: list[str]
    shapes: list[tuple[int, ...]]
    state: str  # the fake's sleep state when the weights arrived


@dataclass
class FakeLLM:
    """`vllm.LLM(model=..., **kwargs)` over a float32 HF copy of `model`."""

    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # generate / sleep / wake_up[tags] / load_weights, in order
    pushes: list[Push] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hf = AutoModelForImageTextToText.from_pretrained(self.model, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(self.model)
        self.state = "awake"
        eos = self.hf.generation_config.eos_token_id
        self.stop_ids = set([eos] if isinstance(eos, int) else eos or [])
        self.generator = torch.Generator().manual_seed(0)

    def get_tokenizer(self) -> Any:
        return self.processor.tokenizer

    @torch.no_grad()
    def generate(self, prompts: list[dict[str, Any]], params: SamplingParams, use_tqdm: bool = False) -> list[RequestOutput]:
        assert self.state == "awake", f"generate while {self.state}"
        self.calls.append("generate")
        return [self._request(prompt, params) for prompt in prompts]

    def _request(self, prompt: dict[str, Any], params: SamplingParams) -> RequestOutput:
        media = prompt.get("multi_modal_data", {})
        inputs = self.processor(text=[prompt["prompt"]], images=media.get("image"), videos=media.get("video"),
                                return_tensors="pt")
        ids = inputs.pop("input_ids")  # [1, P]
        inputs.pop("attention_mask")
        outputs = []
        for _ in range(params.n):
            tokens: list[int] = []
            logprobs: list[dict[int, Logprob]] = []
            while len(tokens) < params.max_tokens:
                new = torch.tensor([tokens], dtype=torch.long)  # [1, t]
                seq = torch.cat([ids, new], dim=1)  # [1, P + t]
                per_token = {k: torch.cat([v, torch.zeros_like(new)], dim=1) for k, v in inputs.items()
                             if v.shape[:2] == ids.shape}  # e.g. mm_token_type_ids [1, P + t]
                logits = self.hf(input_ids=seq, **{**inputs, **per_token}).logits[0, -1] / params.temperature  # [V]
                logp = torch.log_softmax(logits.float(), -1)  # [V]
                tok = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                tokens.append(tok)
                logprobs.append({tok: Logprob(float(logp[tok]))})
                if tok in self.stop_ids:
                    break
            finish = "stop" if tokens[-1] in self.stop_ids else "length"
            outputs.append(Completion(tokens, self.processor.tokenizer.decode(tokens, skip_special_tokens=True),
                                      logprobs, finish))
        return RequestOutput(ids[0].tolist(), outputs)

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(
            model=types.SimpleNamespace(load_weights=self._load_weights)))
        return [method(worker, *args)]

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's Qwen-VL `load_weights` takes checkpoint names; an unknown one is an error there too."""
        assert self.state in ("awake", "weights"), f"load_weights while {self.state}"
        self.calls.append("load_weights")
        params = dict(self.hf.named_parameters())
        for name, tensor in weights:
            assert name in params, f"{name} is not a parameter of the checkpoint"
            assert params[name].shape == tensor.shape, name
            params[name].data.copy_(tensor)
        self.pushes.append(Push([n for n, _ in weights], [tuple(t.shape) for _, t in weights], self.state))

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep{level}")
        self.state = "asleep"

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up{tags or ''}")
        self.state = "weights" if tags == ["weights"] else "awake"


def module() -> types.ModuleType:
    """A `vllm` module holding the fakes; every `LLM(...)` built is appended to `module.built`."""
    fake = types.ModuleType("vllm")
    fake.built = []

    def llm(model: str, **kwargs: Any) -> FakeLLM:
        instance = FakeLLM(model, kwargs)
        fake.built.append(instance)
        return instance

    fake.LLM = llm
    fake.SamplingParams = SamplingParams
    return fake
