"""`vllm` engine: a thin adapter of `vllm.LLM` to the `Engine` protocol (extra `rl-rollout[vllm]`).

Tested with vLLM 0.26.0 by the opt-in `vllm` test session (generate with log-probs, scoring,
sleep/wake, weight pushes, and the apps' colocated rollouts).

- Sampling: `vllm.SamplingParams(n, temperature, top_p, top_k (-1 = off), max_tokens, stop,
  seed, logprobs=0)`; the engine is built with `logprobs_mode="processed_logprobs"`, so
  log-probs include the temperature like `Generation` promises. With top-k/top-p on, vLLM
  renormalizes over the kept tokens (unlike `hf`), so there the two engines differ.
- Memory: `enable_sleep_mode=True`; `sleep()` is `LLM.sleep(level=1)` (weights offloaded to
  CPU, KV cache discarded), `wake()` is `LLM.wake_up()`. Prefix caching is on.
- Weights: `load_weights(named_tensors, version=...)` runs `model.load_weights(...)` inside each
  worker through `LLM.collective_rpc`; vLLM's Qwen/Qwen-VL `load_weights` take the Hugging Face
  checkpoint names (its `hf_to_vllm_mapper` renames them and stacks q/k/v, gate/up). Sent while
  asleep, only the weights wake (`wake_up(tags=["weights"])`, the RL pattern of verl/TRL), so a
  trainer can push after every optimizer step without re-allocating the KV cache; `wake()` then
  brings the KV cache back. Colocated with the trainer, set `VLLM_ENABLE_V1_MULTIPROCESSING=0` so
  the worker runs in process and tensors pass by reference (with V1 multiprocessing, sending a
  function needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` and copies every tensor). An engine core
  in a process of its own (a rollout GPU of its own: the engine's Python loop then does not share
  this process's interpreter lock) is built with `ipc_weights=True` and takes pushes as CUDA IPC
  handles (`rl_rollout.vllm_ipc`): the tensors must be on the engine's GPU.
- FP8: `VLLMEngine(model, quantization="fp8")` samples with vLLM's online FP8 (weights quantized
  when they load). A push then runs vLLM's layerwise reload (`initialize_layerwise_reload`, the
  model's `load_weights`, `finalize_layerwise_reload`): the bf16 weights are quantized again, with
  fresh scales, instead of being copied into the FP8 parameters (which fails: other shapes).
- Images/videos: chat messages holding PIL images / frame arrays are rendered with the model's
  processor chat template and passed as `multi_modal_data`; vLLM expands the placeholders with
  the same Hugging Face processor, so the prompt ids match the `hf` engine's.
- Scoring (`score_next_tokens(_batch)`): one request per `prefix + suffix`, decoding one token
  with sampling restricted to the candidates (`allowed_token_ids`) and their log-probs returned
  (`logprobs=len(candidates)`), so the prefix cache computes each shared prefix once and there
  is one forward position per suffix, not a prompt per candidate. The returned log-probs are
  **renormalized over the candidates** (vLLM masks the other tokens before its processed
  log-probs): they differ from `hf`'s full-vocabulary log-probs by a constant per row, so any
  comparison among candidates (softmax over options, as caption QA's `exact` does) is the same,
  but the candidates' total probability mass reads 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
from transformers import AutoConfig, AutoProcessor

from rl_rollout.prompts import encode_prompt
from rl_rollout.protocol import (
    Continuation,
    Generation,
    Prompt,
    SamplingParams,
    is_chat_messages,
    is_token_ids,
)

try:
    import vllm
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('VLLMEngine needs vLLM: pip install "rl-rollout[vllm]"; in a clone of the repository: uv sync --all-packages --extra vllm') from exc


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]], requantize: bool = False) -> None:
    """Runs inside each vLLM worker process (via `collective_rpc`)."""
    from rl_rollout.vllm_ipc import load_into_model

    load_into_model(worker.model_runner, weights, requantize=requantize)


def _media(messages: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """`{"image": [...], "video": [...]}` from the content parts of chat messages (empty kinds left out)."""
    found: dict[str, list[Any]] = {}
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") in ("image", "video") and part.get(part["type"]) is not None:
                found.setdefault(part["type"], []).append(part[part["type"]])
    return found


class VLLMEngine:
    """`Engine` over `vllm.LLM(model, enable_sleep_mode=True, enable_prefix_caching=True, ...)`.

    Extra keyword arguments go to `vllm.LLM` (e.g. `gpu_memory_utilization`, `dtype`).
    `ipc_weights`: where the engine core runs in a process of its own (`VLLM_ENABLE_V1_MULTIPROCESSING=1`
    when it is built; `in_process` says which), `load_weights` sends CUDA IPC handles
    (`rl_rollout.vllm_ipc`) instead of the tensors, which would otherwise be copied through a
    socket (and need `VLLM_ALLOW_INSECURE_SERIALIZATION=1`); in process it changes nothing.
    """

    # partial rollouts' rounds (`rl_rollout.partial`): each request its own budget and seed
    row_budgets = "seeded"

    def __init__(self, model: str, *, ipc_weights: bool = False, **llm_kwargs: Any) -> None:
        llm_kwargs = {"enable_sleep_mode": True, "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs"} | llm_kwargs
        if ipc_weights:
            from rl_rollout.vllm_ipc import EXTENSION

            llm_kwargs["worker_extension_cls"] = EXTENSION
        ids = cast("list[int] | None", llm_kwargs.get("device_ids")) or [torch.cuda.current_device() if torch.cuda.is_available() else 0]
        self.ipc_device = torch.device("cuda", int(ids[0]))  # where IPC pushes must sit: the engine's GPU
        self.llm = vllm.LLM(model=model, **llm_kwargs)
        from vllm.v1.engine.core_client import InprocClient

        self.in_process = isinstance(self.llm.llm_engine.engine_core, InprocClient)  # as vLLM built it
        self.ipc_weights = ipc_weights and not self.in_process  # in process, tensors pass by reference
        self.tokenizer = self.llm.get_tokenizer()
        is_vl = "vision_config" in AutoConfig.from_pretrained(model).to_dict()
        self.processor = AutoProcessor.from_pretrained(model) if is_vl else None  # chat template with media parts
        self._state = "awake"  # "awake" | "asleep" | "weights" (asleep but for the weights) | "closed"
        self.weight_version = 0  # bumped by every load_weights
        self.requantize = llm_kwargs.get("quantization") == "fp8"  # online FP8: a push quantizes again
        self.lora: Any = None  # `load_adapter`'s request, passed with every generate
        self._adapter_ids = 0

    @property
    def state(self) -> str:
        """"awake" | "asleep" | "closed" (asleep but for freshly pushed weights counts as asleep)."""
        return "asleep" if self._state == "weights" else self._state

    @property
    def weights_only_awake(self) -> bool:
        """Asleep, but the weights were woken to take a `load_weights` (the KV cache is not back)."""
        return self._state == "weights"

    @property
    def is_asleep(self) -> bool:
        return self.state == "asleep"

    def _sampling(self, params: SamplingParams) -> vllm.SamplingParams:
        return vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None, seed=params.seed, logprobs=0,
        )

    def _prompt(self, prompt: Prompt | Continuation, index: int) -> Any:
        if isinstance(prompt, Continuation):  # token ids with the media: vLLM expands the placeholders
            base = self._prompt(prompt.prompt, index)
            ids = base.get("prompt_token_ids") or self.tokenizer(base["prompt"], add_special_tokens=False)["input_ids"]
            return {**{k: v for k, v in base.items() if k != "prompt"}, "prompt_token_ids": [*ids, *prompt.prefix]}
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if prompt and is_token_ids(prompt):
            return {"prompt_token_ids": list(prompt)}
        if prompt and is_chat_messages(prompt):
            media = _media(prompt)
            if not media:  # the hf engine's encoding (transformers 5 returns a BatchEncoding, not ids)
                return {"prompt_token_ids": encode_prompt(prompt, self.tokenizer, None, index).ids}
            if self.processor is None:
                raise ValueError(f"request {index}: holds images/videos but the model has no vision_config")
            text = self.processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return {"prompt": text, "multi_modal_data": media}
        raise ValueError(f"request {index}: a prompt is token ids, a string, or chat messages")

    def generate(self, requests: Sequence[Prompt | Continuation], params: SamplingParams, *,
                 max_new_tokens: Sequence[int] | None = None, seeds: Sequence[int] | None = None) -> list[Generation]:
        """`params.n` completions per request, request-major (see `Engine`). `max_new_tokens`,
        `seeds`: each request's own budget (at most `params.max_new_tokens`) and seed, as
        partial rollouts give their rounds."""
        if len(requests) == 0:
            return []
        prompts = [self._prompt(p, i) for i, p in enumerate(requests)]
        sampling: Any = self._sampling(params)
        if max_new_tokens is not None or seeds is not None:
            budgets = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(requests)
            own = list(seeds) if seeds is not None else [params.seed] * len(requests)
            if len(budgets) != len(requests) or len(own) != len(requests):
                raise ValueError(f"got {len(budgets)} budgets and {len(own)} seeds for {len(requests)} requests")
            sampling = [self._sampling(msgspec.structs.replace(params, max_new_tokens=min(b, params.max_new_tokens), seed=s))
                        for b, s in zip(budgets, own, strict=True)]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=self.lora)
        gens = []
        for index, out in enumerate(outputs):
            for sample in out.outputs:
                ids = list(sample.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(sample.logprobs or [], ids, strict=False)]
                gens.append(Generation(
                    request_index=index, prompt_ids=list(out.prompt_token_ids), completion_ids=ids,
                    text=sample.text, logprobs=logprobs,
                    finish_reason="length" if sample.finish_reason == "length" else "stop",
                ))
        return gens

    def score_next_tokens(
        self, shared_prefix: list[int], suffixes: Sequence[list[int]], candidates: Sequence[int], *, temperature: float = 1.0
    ) -> torch.Tensor:
        """`[len(suffixes), len(candidates)]` candidate log-probs after `shared_prefix + suffix`,
        renormalized over the candidates (see the module docstring)."""
        return self.score_next_tokens_batch([(shared_prefix, suffixes)], candidates, temperature=temperature)[0]

    def score_next_tokens_batch(
        self, items: Sequence[tuple[list[int], Sequence[list[int]]]], candidates: Sequence[int], *,
        temperature: float = 1.0,
    ) -> list[torch.Tensor]:
        """Every `(prefix, suffixes)` item in one `LLM.generate` call (the prefix cache shares
        each prefix across its suffixes): one `[len(suffixes), len(candidates)]` table per item."""
        if temperature <= 0:
            raise ValueError(f"scoring needs temperature > 0, got {temperature}")
        candidates = list(candidates)
        if len(set(candidates)) != len(candidates) or not candidates:
            raise ValueError(f"candidates must be distinct token ids, got {candidates}")
        prompts = [{"prompt_token_ids": [*prefix, *s]} for prefix, suffixes in items for s in suffixes]
        if not prompts:
            return [torch.empty(0, len(candidates)) for _ in items]
        params = vllm.SamplingParams(max_tokens=1, temperature=temperature, allowed_token_ids=candidates,
                                     logprobs=len(candidates), seed=0)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for index, out in enumerate(outputs):
            step = out.outputs[0].logprobs[0]  # {token id: Logprob}, the candidates (and the sampled one)
            missing = [c for c in candidates if c not in step]
            if missing:
                raise RuntimeError(f"scoring request {index}: vLLM returned no log-prob for candidates {missing}")
            rows.append([step[c].logprob for c in candidates])
        table = torch.tensor(rows, dtype=torch.float32)  # [sum of suffixes, C]
        return list(table.split([len(s) for _, s in items]))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Copy `(hf_name, tensor)` pairs into the running model in place; `version` (default:
        the previous one + 1) is kept in `weight_version` so callers can check what is served."""
        if self._state == "asleep":
            self.llm.wake_up(tags=["weights"])
            self._state = "weights"
        if self.ipc_weights:
            from rl_rollout.vllm_ipc import METHOD, ipc_payload

            # tensors elsewhere are copied to the engine's GPU first, and kept alive until it has loaded them
            shared = [(name, t.to(self.ipc_device)) for name, t in named_tensors]
            self.llm.collective_rpc(METHOD, args=(ipc_payload(shared), self.requantize))
        else:
            self.llm.collective_rpc(_load_weights_on_worker, args=(list(named_tensors), self.requantize))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weight_version = self.weight_version + 1 if version is None else version

    def load_adapter(self, folder: str | Path, *, version: int | None = None) -> None:
        """Sample with the PEFT adapter in `folder` over the base weights from now on (an engine
        built with `enable_lora=True`): a LoRA policy's push of its adapter alone. vLLM reads the
        folder at the next generate; each call takes a new adapter id, so it never serves a stale copy."""
        from vllm.lora.request import LoRARequest

        self.weight_version = self.weight_version + 1 if version is None else version
        self._adapter_ids += 1
        self.lora = LoRARequest(f"policy-{self._adapter_ids}", self._adapter_ids, str(folder))

    def sleep(self) -> None:
        if self._state != "asleep":
            self.llm.sleep(level=1)
        self._state = "asleep"

    def wake(self) -> None:
        if self._state == "weights":
            self.llm.wake_up(tags=["kv_cache"])
        elif self._state == "asleep":
            self.llm.wake_up()
        self._state = "awake"
        if self.lora is not None:  # re-read after a sleep: its GPU buffers are not kept
            self.load_adapter(self.lora.lora_path, version=self.weight_version)

    def close(self) -> None:
        self._state = "closed"
        del self.llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
