"""`janus` engine: autoregressive image-token sampling with classifier-free guidance for Janus /
Janus-Pro, returning per-token log-probs and decoded images, for token-level GRPO on images.

Sampling is what transformers' `generate(generation_mode="image")` and the Janus-Pro repository
do: the prompt gets the chat template and `<begin_of_image>`; the conditional and the
unconditional rows (prompt tokens but BOS and `<begin_of_image>` replaced by pad) run as one
batch of 2B rows; each of the N image tokens is drawn from `softmax((u + s * (c - u)) / T)`
(`rl_models.janus`) and fed back through the generation embedding and aligner; the VQ decoder
turns the N codes into pixels. The engine runs its own decode loop over a `StaticCache`, with
the one-token decode step (language model + generation head + CFG mix) compiled on CUDA.

Decode attention (`rl_rollout.attention.grouped_decode_attention`) reads the cache only up to
the filled length rounded up to `kv_block` slots, not to its preallocated length: at Janus-Pro-7B
shape the KV cache of a 64-image call (128 rows) is ~4 GB per 64 slots, more than the weights
over a 576-token image, and a full-length read costs ~1.9x the mean context. Each rounded
length is one shape of the compiled step (its length dimension is marked dynamic, so it
compiles once; CUDA graphs record one graph per length).

Seeds: each sample draws its N uniforms from its own `torch.Generator` seeded with its seed, and
a token is the inverse-CDF draw at that uniform (no other randomness), so a sample's tokens
depend on its seed and its logits only, never on the other rows of the batch or on the batch
size (up to the last bits of batched matmuls): a rollout is replayed by sampling again with the
same seeds.

Log-probs (`logprobs=`):
- `"rescore"` (default): after sampling, one teacher-forced forward over `[prompt | tokens]`
  (`rl_models.janus.image_token_logprobs`, the trainer's own function) gives the log-probs.
  The trainer's first replay of the same rows in the same batch then has an importance ratio of
  exactly 1 (bit-identical in float32, as the SD3 path), at the cost of one forward over the
  batch (no KV cache; small next to N decode steps).
- `"decode"`: the log-probs of the draws themselves, from the sampling forward (no extra
  forward); they differ from a teacher-forced recomputation in the last bits (float32) or ~1e-2
  (bf16): KV-cached one-token matmuls round differently, and a compiled step fuses differently.
  Pick it when the trainer tolerates that mismatch (a ratio tolerance, or a rollout correction).

`precision="fp8"` decodes (and rescores) with the language model's linear layers as FP8 GEMMs
(`rl_rollout.fp8`: weights quantized again when they change, activations per token; CUDA needs
compute capability 9.0 and bf16 weights, the CPU emulates it). The log-probs are then the FP8
sampler's: a trainer rescores them in the weights' dtype and corrects the gap (diffusion-grpo's
`rollout.precision`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import JanusForConditionalGeneration, JanusProcessor, StaticCache

from rl_models.janus import (
    ImageTokenBatch,
    guided_features,
    image_token_logprobs,
    janus_causal_lm,
    load_janus,
    num_image_tokens,
    unconditional_prompt_ids,
)
from rl_rollout.attention import GROUPED_DECODE, attention_implementation
from rl_rollout.fp8 import Fp8Sampling, Precision

__all__ = ["ImageRollout", "JanusEngine"]

_CACHE_ROUND = 64  # static-cache lengths are rounded up so calls with similar prompts share one cache
LogprobMode = Literal["rescore", "decode"]


@dataclass(frozen=True)
class ImageRollout:
    """B sampled images and what a token-level GRPO trainer replays.

    - `tokens`: prompts `[B, P]` (left-padded, mask, unconditional rows) and image tokens `[B, N]`.
    - `log_probs` `[B, N]` float32: log-prob of each image token under the distribution it was
      drawn from (`softmax((u + s (c - u)) / T)`).
    - `images` `[B, 3, H, W]` float32 in [0, 1].
    - `seeds`: one per sample; sampling again with them redraws the same tokens.
    - `window`: the image-token positions [start, stop) a trainer replays and trains (None: all);
      the engine samples every token either way, a trainer sets it (diffusion-grpo's windows).
    """

    prompts: tuple[str, ...]
    tokens: ImageTokenBatch
    log_probs: Tensor
    images: Tensor
    seeds: tuple[int, ...]
    guidance_scale: float
    temperature: float
    window: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def to(self, device: str | torch.device) -> ImageRollout:
        """The per-sample tensors on `device`."""
        return replace(self, tokens=self.tokens.to(device), log_probs=self.log_probs.to(device),
                       images=self.images.to(device))


def sample_to_cpu(engine: JanusEngine, batch: Any, *, guidance_scale: float, temperature: float) -> ImageRollout:
    """`engine.sample` of one sampling batch (a `SampleBatch`: its prompts, seeds and window of
    trained positions) with its tensors on CPU: the sampling call of a Ray worker
    (`rl_rollout.ray_pool.RolloutPool.map`), whose caller moves them to its device."""
    rollout = engine.sample(list(batch.prompts), guidance_scale=guidance_scale, temperature=temperature, seeds=batch.seeds)
    return replace(rollout, window=batch.sde_window).to("cpu")


class JanusEngine(Fp8Sampling):
    """Janus image-token sampling with per-token log-probs, and the replay the trainer shares.

    model: a loaded `JanusForConditionalGeneration` (LoRA may be added in place later: the engine
        samples with whatever adapters are active).
    max_batch_size: images decoded together (2x rows with CFG); more are sampled in chunks. The
        KV cache holds 2 x max_batch_size x (P + N) tokens: ~0.47 MiB per token at Janus-Pro-7B.
    compile: compile the decode step (default: on CUDA only); `compile_mode` as `torch.compile`
        (`"reduce-overhead"` adds CUDA graphs; the cache is kept between calls so they replay).
    logprobs: `"rescore"` or `"decode"` (module docstring).
    kv_block: decode attention reads the cache up to the filled length rounded up to a multiple
        of this many slots. Smaller reads fewer empty slots but gives the compiled step more
        shapes (one CUDA graph each); 64 wastes ~3% of a 7B step's traffic with ~11 graphs.
    """

    def __init__(
        self,
        model: JanusForConditionalGeneration,
        processor: JanusProcessor,
        *,
        device: str | torch.device | None = None,
        max_batch_size: int = 64,
        compile: bool | None = None,
        compile_mode: str = "reduce-overhead",
        logprobs: LogprobMode = "rescore",
        chunk_size: int = 1024,
        kv_block: int = 64,
        precision: Precision = "bf16",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if kv_block < 1:
            raise ValueError(f"kv_block must be >= 1, got {kv_block}")
        if logprobs not in ("rescore", "decode"):
            raise ValueError(f"logprobs must be 'rescore' or 'decode', got {logprobs!r}")
        self.device = torch.device(device) if device is not None else model.device
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # see HFEngine
        self.processor = processor
        self.max_batch_size, self.logprobs, self.chunk_size = max_batch_size, logprobs, chunk_size
        self.kv_block = kv_block
        self.num_tokens = num_image_tokens(model)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.compile_mode = compile_mode
        self._step = torch.compile(self._decode_step, mode=compile_mode) if self.compile else self._decode_step
        self._cache: StaticCache | None = None
        self._cache_key: tuple[int, int] = (0, 0)
        self._asleep = False
        self.precision = precision  # sampling in FP8: the language model's linear layers (`Fp8Sampling`)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> JanusEngine:
        """Load a transformers-format Janus checkpoint (`deepseek-community/Janus-Pro-7B`) through
        `rl_models.janus.load_janus`. `device` defaults to CUDA when available."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model, processor = load_janus(path, dtype=dtype, attn_implementation=attn_implementation)
        return cls(model, processor, device=device, **kwargs)

    def over(self, model: JanusForConditionalGeneration) -> JanusEngine:
        """An engine decoding with `model` (a copy of this one's, e.g. an asynchronous rollout's
        weights), with the same options and a processor and KV cache of its own. Its decode step
        compiles without CUDA graphs: captured from a rollout thread, which runs on a CUDA stream
        of its own, the graphs of "reduce-overhead" come out empty (torch 2.11)."""
        mode = "default" if self.compile_mode == "reduce-overhead" else self.compile_mode
        return JanusEngine(model, copy.deepcopy(self.processor), device=self.device, max_batch_size=self.max_batch_size,
                           compile=self.compile, compile_mode=mode, logprobs=self.logprobs,
                           chunk_size=self.chunk_size, kv_block=self.kv_block, precision=self.precision)

    # -- prompts -------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> ImageTokenBatch:
        """Chat template + `<begin_of_image>`, left-padded, with the unconditional rows; the image
        tokens are an empty `[B, 0]` placeholder."""
        texts = [
            self.processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": p}]}],  # type: ignore[arg-type]  # typed parts, as the template takes them
                add_generation_prompt=True)
            for p in prompts
        ]
        inputs = self.processor(text=texts, generation_mode="image", return_tensors="pt", padding=True)
        ids, mask = inputs["input_ids"].to(self.device), inputs["attention_mask"].to(self.device)  # [B, P]
        empty = torch.zeros(len(prompts), 0, dtype=torch.long, device=self.device)  # [B, 0]
        return ImageTokenBatch(ids, mask, empty, unconditional_prompt_ids(self.model, ids))

    # -- sampling ------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[str],
        *,
        guidance_scale: float = 5.0,
        temperature: float = 1.0,
        seeds: Sequence[int] | None = None,
    ) -> ImageRollout:
        """Sample one image per prompt (repeat a prompt n times for a group). `seeds` (default
        0, 1, ...) gives each sample its own random stream (module docstring). Guidance 1 means
        no CFG (the conditional rows only); Janus-Pro uses 5."""
        if not prompts:
            raise ValueError("sample() needs at least one prompt")
        if self._asleep:
            raise RuntimeError("JanusEngine is asleep; call wake() first")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 = no guidance), got {guidance_scale}")
        seeds = list(range(len(prompts))) if seeds is None else [int(s) for s in seeds]
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        with self._sampling_precision(janus_causal_lm(self.model).model.language_model):  # FP8: the decode's and the rescore's log-probs are the sampler's
            encoded = self.encode(prompts)
            uniforms = torch.stack([
                torch.rand(self.num_tokens, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds
            ]).to(self.device)  # [B, N]
            tokens, logprobs = [], []
            for start in range(0, len(prompts), self.max_batch_size):
                rows = slice(start, start + self.max_batch_size)
                tok, lp = self._decode(encoded.index(rows), uniforms[rows], guidance_scale, temperature)  # [b, N] x2
                tokens.append(tok)
                logprobs.append(lp)
            batch = ImageTokenBatch(encoded.prompt_ids, encoded.prompt_mask, torch.cat(tokens), encoded.uncond_ids)
            log_probs = torch.cat(logprobs)  # [B, N]
            if self.logprobs == "rescore":  # in the decode chunks: a trainer replays the same row groups
                log_probs = torch.cat([
                    self.replay(batch.index(slice(start, start + self.max_batch_size)), guidance_scale=guidance_scale,
                                temperature=temperature)
                    for start in range(0, len(prompts), self.max_batch_size)
                ])  # [B, N]
        return ImageRollout(
            prompts=tuple(prompts), tokens=batch, log_probs=log_probs.float(), images=self.decode(batch.image_ids),
            seeds=tuple(seeds), guidance_scale=guidance_scale, temperature=temperature,
        )

    def replay(
        self,
        batch: ImageTokenBatch,
        *,
        guidance_scale: float,
        temperature: float,
        model: torch.nn.Module | None = None,
        use_cfg: bool = True,
    ) -> Tensor:
        """Teacher-forced log-probs `[B, N]` of `batch`'s image tokens (`image_token_logprobs`)
        under `model` (default: the engine's model; pass the trainer's wrapper to get gradients).
        Equal to a `"rescore"` rollout's `log_probs` at unchanged weights for the same rows in
        the same batch."""
        return image_token_logprobs(model or self.model, batch, guidance_scale=guidance_scale,
                                    temperature=temperature, use_cfg=guidance_scale > 1 and use_cfg,
                                    chunk_size=self.chunk_size)  # [B, N]

    def _static_cache(self, rows: int, length: int) -> StaticCache:
        """One reusable cache per (rows, rounded length): a compiled step keeps its CUDA graph."""
        length = -(-length // _CACHE_ROUND) * _CACHE_ROUND
        if self._cache is not None and self._cache_key == (rows, length):
            self._cache.reset()
        else:
            self._cache = None  # free the old one before allocating
            self._cache = StaticCache(config=self.model.config, max_cache_len=length)
            self._cache_key = (rows, length)
        return self._cache

    def _decode_step(self, tokens: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: StaticCache,
                     guidance_scale: float, use_cfg: bool) -> Tensor:
        """CFG logits `[B, V]` (float32) of the next image token after feeding `tokens` `[B]`
        (both rows with CFG). attention_mask: boolean `[R, 1, 1, Lk]` of the slots each row
        reads (Lk bounds the read, `grouped_decode_attention`); position_ids `[R, 1]`."""
        step = torch.cat([tokens, tokens]) if use_cfg else tokens  # [R]
        embeds = self.model.prepare_embeddings_for_image_generation(step[:, None])  # [R, 1, H]
        hidden = self.model.model.language_model(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True,
        ).last_hidden_state  # [R, 1, H]
        return self._logits(hidden[:, -1], guidance_scale, use_cfg)  # [B, V]

    def _logits(self, hidden: Tensor, guidance_scale: float, use_cfg: bool) -> Tensor:
        features = guided_features(self.model, hidden, guidance_scale=guidance_scale, use_cfg=use_cfg)  # [B, D]
        head = self.model.model.generation_head.vision_head
        return F.linear(features, head.weight, head.bias).float()  # [B, V]

    def _decode(self, batch: ImageTokenBatch, uniforms: Tensor, guidance_scale: float,
                temperature: float) -> tuple[Tensor, Tensor]:
        """Prefill `[cond; uncond]`, then N decode steps: tokens `[B, N]`, log-probs `[B, N]`
        (those of the draws, the sampling forward's own)."""
        use_cfg = guidance_scale > 1
        ids = torch.cat([batch.prompt_ids, batch.uncond_ids]) if use_cfg else batch.prompt_ids  # [R, P]
        mask = batch.prompt_mask.repeat(2, 1) if use_cfg else batch.prompt_mask  # [R, P]
        rows, width = ids.shape
        cache = self._static_cache(rows, width + self.num_tokens)
        length = cache.get_max_length()
        future = torch.ones(rows, length - width, dtype=mask.dtype, device=self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)  # [R, P]
        next_pos = mask.long().sum(-1)  # [R]
        hidden = self.model.model.language_model(
            inputs_embeds=self.model.get_input_embeddings()(ids),
            attention_mask=torch.cat([mask, future], dim=1),  # [R, L]; later slots are hidden by causality
            position_ids=positions, past_key_values=cache, use_cache=True,
        ).last_hidden_state  # [R, P, H]
        logits = self._logits(hidden[:, -1], guidance_scale, use_cfg)  # [B, V]
        # decode: boolean key mask [R, 1, 1, L]; step t opens slot width + t (its own token)
        keys = torch.cat([mask.bool(), torch.zeros_like(future, dtype=torch.bool)], dim=1)[:, None, None]
        batch_size = len(batch.prompt_ids)
        tokens = torch.zeros(batch_size, self.num_tokens, dtype=torch.long, device=self.device)  # [B, N]
        logprobs = torch.zeros(batch_size, self.num_tokens, dtype=torch.float32, device=self.device)  # [B, N]
        with attention_implementation(self.model.model.language_model.config, GROUPED_DECODE):
            for t in range(self.num_tokens):
                tokens[:, t], logprobs[:, t] = draw(logits, uniforms[:, t], temperature)
                if t + 1 == self.num_tokens:
                    break
                keys[..., width + t] = True
                # slots filled (width + t + 1 <= L - 1: the last token is never fed back), rounded
                # up; below L, since a slice to L would be contiguous and compile a second graph
                read = min(length - 1, -(-(width + t + 1) // self.kv_block) * self.kv_block)
                step_mask = keys[..., :read].clone()  # [R, 1, 1, read]; contiguous, as every length's
                torch._dynamo.maybe_mark_dynamic(step_mask, 3)  # one compile for every length
                logits = self._step(tokens[:, t], step_mask, (next_pos + t)[:, None], cache, guidance_scale, use_cfg)
        return tokens, logprobs

    @torch.no_grad()
    def decode(self, image_ids: Tensor) -> Tensor:
        """VQ-decode image tokens `[B, N]` to images `[B, 3, H, W]` float32 in [0, 1]."""
        pixels = self.model.decode_image_tokens(image_ids)  # [B, H, W, 3] in [-1, 1]
        return ((pixels.float().clamp(-1, 1) + 1) / 2).permute(0, 3, 1, 2).contiguous()  # [B, 3, H, W]

    # -- memory --------------------------------------------------------------------------------

    def release_cache(self) -> None:
        """Drop the KV cache (before a training step on the same device); the next `sample`
        allocates it again (and, with CUDA graphs, records a new graph)."""
        self._cache, self._cache_key = None, (0, 0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sleep(self) -> None:
        """Weights to CPU and the cache dropped (no-op for the weights on a CPU engine)."""
        self.release_cache()
        self._drop_fp8()
        if self.device.type != "cpu":
            janus_causal_lm(self.model).to("cpu")  # type: ignore[arg-type]  # see HFEngine
        self._asleep = True

    def wake(self) -> None:
        janus_causal_lm(self.model).to(self.device)  # type: ignore[arg-type]  # see HFEngine
        self._asleep = False

    @property
    def is_asleep(self) -> bool:
        return self._asleep


def draw(logits: Tensor, uniforms: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Inverse-CDF draw of one token per row: `(tokens [B], logprobs [B])` from float32 logits
    `[B, V]` and uniforms `[B]` in [0, 1). The token is the first whose cumulative probability
    exceeds `u` times the total (a token of probability 0 is never drawn); its log-prob is taken
    under `softmax(logits / temperature)`."""
    logp = torch.log_softmax(logits / temperature, dim=-1)  # [B, V]
    cdf = logp.exp().cumsum(dim=-1)  # [B, V]
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]  # [B, 1]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_max(logits.shape[-1] - 1)  # [B, 1]
    return tokens[:, 0], logp.gather(-1, tokens)[:, 0]  # [B], [B]
