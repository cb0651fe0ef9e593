"""`hf` engine: batched generation and shared-prefix scoring on plain transformers models.

Generation runs its own decode loop over a `StaticCache` instead of wrapping `generate()`, so
every sampled token comes with its exact log-prob (see `rl_rollout.sampling`) at no extra cost,
and the decode step has static shapes. On CUDA the decode step is compiled with
`torch.compile` (text decoder + LM head only; `compile_mode="reduce-overhead"` adds CUDA graphs),
which removes the per-layer launch overhead that dominates decode at batch sizes below ~128.
Pick `compile=False` for short one-off generations where compile time does not pay back.
Decode attention reads each KV head once for its query-head group (`rl_rollout.attention`),
instead of transformers' sdpa copy of the KV heads whenever rows are padded, which makes the
compiled decode several times faster (benchmarks/RESULTS.md, "rl-rollout engines: generation, ...:
decode attention variants").

Requests are left-padded; positions count real tokens only, so a padded row computes exactly
what it would alone. Qwen-VL requests (chat messages with images/videos) go through the
processor; the pixel tensors are passed on the prefill step only, and 3-D M-RoPE positions come
from the model's own `get_rope_index`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    StaticCache,
)
from transformers.cache_utils import CacheLayerMixin

from rl_models.compiled import decoder_layers
from rl_models.vl import VL_MODEL_TYPES
from rl_rollout.attention import (
    FLEX_BLOCK,
    GROUPED_DECODE,
    PACKED_FLEX,
    PackedBlockMasks,
    attention_implementation,
)
from rl_rollout.prompts import EncodedPrompt, PromptBatch, encode_prompt, pad_batch
from rl_rollout.protocol import Continuation, Generation, Prompt, SamplingParams
from rl_rollout.sampling import compute_logprobs, sample_next_tokens

_CACHE_ROUND = 64  # round static-cache lengths up so repeated calls reuse one cache (and graph)
_SYNC_EVERY = 16  # decode steps between host checks for "all rows finished"
_MASKED_ATTENTION = frozenset({"sdpa", "eager"})  # attention implementations that take a custom 4-D mask


@dataclass
class _Decoded:
    """Host copies of a finished decode loop. tokens/logprobs: [B, N]; lengths, stopped: [B]."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    lengths: list[int]
    stopped: list[bool]


@dataclass(frozen=True)
class PackedRow:
    """One packed scoring sequence: item `item`'s prefix followed by its suffixes `suffixes`
    (indices into the item's suffix list); `length` tokens in all."""

    item: int
    suffixes: tuple[int, ...]
    length: int


def compute_packing_plan(
    prefix_lens: Sequence[int], suffix_lens: Sequence[Sequence[int]], token_budget: int
) -> list[list[PackedRow]]:
    """Group scoring items into forwards of packed rows.

    Each item's suffixes are packed, in order, behind its prefix into rows of at most
    `token_budget` tokens (a row always takes at least one suffix, so one prefix + suffix longer
    than the budget gets a row of its own; an item without suffixes gets no row). Rows are then
    sorted longest first (little padding) and batched while rows x the batch's widest row stays
    within `token_budget`. Returns the forwards, each a list of rows.
    """
    rows: list[PackedRow] = []
    for item, (plen, lens) in enumerate(zip(prefix_lens, suffix_lens, strict=True)):
        taken: list[int] = []
        length = plen
        for j, n in enumerate(lens):
            if taken and length + n > token_budget:
                rows.append(PackedRow(item, tuple(taken), length))
                taken, length = [], plen
            taken.append(j)
            length += n
        if taken:
            rows.append(PackedRow(item, tuple(taken), length))
    rows.sort(key=lambda row: -row.length)
    forwards: list[list[PackedRow]] = []
    for row in rows:
        if forwards and (len(forwards[-1]) + 1) * forwards[-1][0].length <= token_budget:
            forwards[-1].append(row)
        else:
            forwards.append([row])
    return forwards


def pack_rows_flat(rows: Sequence[PackedRow], token_budget: int) -> list[list[PackedRow]]:
    """Group rows into forwards whose rows, laid end to end in one sequence, take at most
    `token_budget` tokens (first fit, longest row first; a row longer than the budget gets a
    forward of its own). For the flex path, where rows share one sequence and pad only its end."""
    forwards: list[list[PackedRow]] = []
    used: list[int] = []
    for row in sorted(rows, key=lambda r: -r.length):
        slot = next((i for i, n in enumerate(used) if n + row.length <= token_budget), None)
        if slot is None:
            forwards.append([row])
            used.append(row.length)
        else:
            forwards[slot].append(row)
            used[slot] += row.length
    return forwards


def shared_prefix_len(prefixes: Sequence[Sequence[int]]) -> int:
    """Tokens every prefix starts with, leaving each prefix at least one token of its own (a
    suffix that is empty reads its item's last prefix token)."""
    if not prefixes:
        return 0
    limit = min(len(p) for p in prefixes) - 1
    low, high = min(map(list, prefixes)), max(map(list, prefixes))  # all share what the extremes share
    n = 0
    while n < limit and low[n] == high[n]:
        n += 1
    return n


def _flex_length(tokens: int, token_budget: int) -> int:
    """Padded length of a flex forward: a power of two from 128 up to the budget rounded to 128
    (each length is one compiled kernel, so few lengths), or the next multiple of 128 for a row
    longer than that."""
    budget = -(-token_budget // FLEX_BLOCK) * FLEX_BLOCK
    length = FLEX_BLOCK
    while length < tokens and length < budget:
        length *= 2
    return max(min(length, budget), -(-tokens // FLEX_BLOCK) * FLEX_BLOCK)


@contextmanager
def swapped_forwards(modules: Sequence[torch.nn.Module], forwards: Sequence[Any]) -> Iterator[None]:
    """Run with `modules[i].forward = forwards[i]`, then give each module back the forward it
    had: its class's, or one set on the instance before (e.g. compiled layers)."""
    saved = [module.__dict__.get("forward") for module in modules]
    for module, forward in zip(modules, forwards, strict=True):
        module.forward = forward
    try:
        yield
    finally:
        for module, own in zip(modules, saved, strict=True):
            if own is None:
                del module.forward
            else:
                module.forward = own


class EngineAsleepError(RuntimeError):
    """Raised when a sleeping or closed engine is asked to compute."""


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, Any]:
    """A checkpoint folder's (or hub id's) model on the CPU, with its tokenizer (a text LM) or
    processor (a VL model: a config with a `vision_config`)."""
    if "vision_config" in AutoConfig.from_pretrained(path).to_dict():
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype), AutoProcessor.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


class HFEngine:
    """Generation engine over a transformers causal LM or Qwen-VL model (`Engine` protocol).

    model: a loaded `PreTrainedModel` (moved to `device` if given).
    tokenizer_or_processor: its tokenizer, or for VL models its `AutoProcessor`.
    max_batch_size: rows (requests x n) decoded together; more are processed in chunks.
    compile: compile the decode step, and on CUDA the decoder layers of flex scoring forwards
        (default: on CUDA only).
    compile_mode: `torch.compile` mode of the decode step. `"reduce-overhead"` (CUDA graphs)
        is fastest when the KV cache stays allocated between calls; pick `"default"` (fused
        kernels, no graphs) when the caller frees the cache between calls (`release_cache`),
        since a graph is tied to the cache's addresses.
    stop_token_ids: tokens that end a completion (default: the generation config's EOS ids).
    score_token_budget: tokens (rows x padded width) per scoring forward; bounds the activation
        and attention-mask memory of `score_next_tokens(_batch)`. ~16k saturates a large GPU on a
        4B model; lower it for small devices.
    score_attention: how `score_next_tokens(_batch)` packs. `"flex"`: every item's rows laid end
        to end in one sequence behind the tokens all prefixes share (a system prompt runs once
        per forward), attention by `flex_attention` with a block mask, so masked blocks cost
        nothing; the fast choice on CUDA. `"mask"`: the tokens all prefixes share run once per
        call into a KV cache, then rows of the rest padded side by side with a dense 4-D mask
        through the model's sdpa/eager attention; for devices where flex_attention is not
        compiled. `"auto"` (default): flex on CUDA.
    """

    # partial rollouts' rounds (`rl_rollout.partial`): each request its own budget, one generator for the batch
    row_budgets = "batch"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer_or_processor: PreTrainedTokenizerBase | ProcessorMixin,
        *,
        device: str | torch.device | None = None,
        max_batch_size: int = 64,
        compile: bool | None = None,
        compile_mode: str = "reduce-overhead",
        stop_token_ids: Sequence[int] | None = None,
        score_token_budget: int = 16384,
        score_attention: str = "auto",
    ) -> None:
        if max_batch_size < 1 or score_token_budget < 1:
            raise ValueError("max_batch_size and score_token_budget must be >= 1")
        self.device = torch.device(device) if device is not None else model.device
        # PreTrainedModel.to is wrapped by a decorator whose signature mypy reads as (model, ...)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        if isinstance(tokenizer_or_processor, ProcessorMixin):
            self.processor: ProcessorMixin | None = tokenizer_or_processor
            self.tokenizer = tokenizer_or_processor.tokenizer
        else:
            self.processor, self.tokenizer = None, tokenizer_or_processor
        self.max_batch_size = max_batch_size
        self.score_token_budget = score_token_budget
        if score_attention not in ("auto", "flex", "mask"):
            raise ValueError(f"score_attention must be 'auto', 'flex' or 'mask', got {score_attention!r}")
        self.score_attention = ("flex" if self.device.type == "cuda" else "mask") if score_attention == "auto" else score_attention
        self.max_context = int(model.config.get_text_config(decoder=True).max_position_embeddings)
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else self._default_stop_ids()
        self.pad_id = self._pad_id()
        self.weight_version = 0  # counts load_weights calls (or the version the caller gives)
        self.compile = self.device.type == "cuda" if compile is None else compile
        inner = self.model.model  # the decoder of a causal LM, or the multimodal model of a VL one
        self._text_decoder = inner.language_model if model.config.model_type in VL_MODEL_TYPES else inner
        self._head = self.model.get_output_embeddings()
        self.compile_mode = compile_mode
        # decode attention without repeated KV heads where the model's kernel takes 4-D masks
        self._grouped_decode = self._text_decoder.config._attn_implementation in _MASKED_ATTENTION
        step = self._decode_step
        self._step = torch.compile(step, mode=compile_mode) if self.compile else step
        self._cache: StaticCache | None = None
        self._cache_key: tuple[int, int] = (0, 0)
        self._cache_released = False  # storage freed by release_cache, tensors kept
        self._flex_masks: dict[int, PackedBlockMasks] = {}  # per packed length: one mask function, one kernel
        self._scoring_layers: list[Any] | None = None  # compiled decoder layers of flex scoring (CUDA)
        self._scoring_compile_failed = False
        self.state = "awake"  # "awake" | "asleep" | "closed"

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> HFEngine:
        """Load a checkpoint folder (or hub id): a text LM with its tokenizer, or a VL model
        (config with a `vision_config`) with its processor.

        `device` defaults to CUDA when available, else the CPU (`from_pretrained` itself loads
        onto the CPU; a judge left there would run far slower on a GPU machine)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(*load_checkpoint(path, dtype), device=device, **kwargs)

    # ------------------------------------------------------------------ setup helpers
    def _default_stop_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def _pad_id(self) -> int:
        if self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        return self.stop_token_ids[0] if self.stop_token_ids else 0

    @property
    def is_asleep(self) -> bool:
        return self.state == "asleep"

    def _check_awake(self) -> None:
        if self.state != "awake":
            raise EngineAsleepError(f"HFEngine is {self.state}; call wake() first" if self.is_asleep else "HFEngine is closed")

    # ------------------------------------------------------------------ generate
    def _encode(self, prompt: Prompt | Continuation, index: int) -> EncodedPrompt:
        if isinstance(prompt, Continuation):  # the prompt, then the tokens sampled so far
            base = encode_prompt(prompt.prompt, self.tokenizer, self.processor, index)
            extra = len(prompt.prefix)  # per-token media tensors ([1, T] token types) get text (0) entries for it
            media = {k: torch.nn.functional.pad(v, (0, extra)) if k.endswith("token_type_ids") else v
                     for k, v in base.media.items()}
            encoded = EncodedPrompt(ids=[*base.ids, *prompt.prefix], media=media)
        else:
            encoded = encode_prompt(prompt, self.tokenizer, self.processor, index)
        if len(encoded.ids) >= self.max_context:
            raise ValueError(
                f"request {index}: prompt has {len(encoded.ids)} tokens, which leaves no room to generate "
                f"within the model context of {self.max_context} tokens"
            )
        return encoded

    def _generator(self, seed: int | None) -> torch.Generator:
        """A generator on the engine device; unseeded calls draw a seed from torch's global RNG
        (so `torch.manual_seed` still makes them reproducible)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return generator

    @torch.inference_mode()
    def generate(self, requests: Sequence[Prompt | Continuation], params: SamplingParams, *,
                 max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """Sample `params.n` completions per request, request-major (see `Engine`); a
        `Continuation` resumes a sample after its prefix. `max_new_tokens`: each request's own
        budget (at most `params.max_new_tokens`), as partial rollouts give their rounds."""
        self._check_awake()
        if len(requests) == 0:
            return []
        if max_new_tokens is not None and len(max_new_tokens) != len(requests):
            raise ValueError(f"got {len(max_new_tokens)} budgets for {len(requests)} requests")
        encoded = [self._encode(prompt, i) for i, prompt in enumerate(requests)]
        rows = [(i, enc) for i, enc in enumerate(encoded) for _ in range(params.n)]
        generator = self._generator(params.seed)
        out: list[Generation] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            batch = pad_batch([enc for _, enc in chunk], self.pad_id)
            own = None if max_new_tokens is None else [min(params.max_new_tokens, max_new_tokens[i]) for i, _ in chunk]
            decoded = self._decode(batch, params, generator, own)
            out += [self._to_generation(index, enc, decoded, row, params) for row, (index, enc) in enumerate(chunk)]
        return out

    def _to_generation(
        self, index: int, enc: EncodedPrompt, decoded: _Decoded, row: int, params: SamplingParams
    ) -> Generation:
        length = decoded.lengths[row]
        ids = decoded.tokens[row][:length]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = [pos for pos in (text.find(stop) for stop in params.stop) if pos >= 0]
        if cut:
            text = text[: min(cut)]
        return Generation(
            request_index=index,
            prompt_ids=list(enc.ids),
            completion_ids=ids,
            text=text,
            logprobs=decoded.logprobs[row][:length],
            finish_reason="stop" if decoded.stopped[row] else "length",
        )

    def _static_cache(self, batch_size: int, length: int) -> StaticCache:
        """One reusable `StaticCache` per (batch, rounded length): a compiled decode step keeps
        its CUDA graph when the cache tensors keep their addresses."""
        length = -(-length // _CACHE_ROUND) * _CACHE_ROUND
        if self._cache is not None and self._cache_key == (batch_size, length):
            if self._cache_released:  # storage freed by release_cache: take it again
                for tensor in self._cache_tensors():
                    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
                self._cache_released = False
            self._cache.reset()
        else:
            self._cache = None  # free the old one before allocating
            self._cache = StaticCache(config=self.model.config, max_cache_len=length)
            self._cache_key = (batch_size, length)
            self._cache_released = False
        return self._cache

    def _prefill_positions(self, batch: PromptBatch, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions for the prefill step and the next position of each row.

        Text models: real-token positions (left padding does not shift them). Qwen-VL with
        media: 3-D M-RoPE positions `[3, B, T]` from the model's `get_rope_index`, whose per-row
        delta also shifts every later text position.
        """
        lengths = batch.lengths.to(self.device)  # [B]
        if "image_grid_thw" in batch.media or "video_grid_thw" in batch.media:
            media = {k: v.to(self.device) for k, v in batch.media.items() if not k.startswith("pixel_values")}
            positions, deltas = self.model.model.get_rope_index(input_ids, attention_mask=mask, **media)  # [3, B, T], [B, 1]
            return positions, lengths + deltas[:, 0].to(lengths.dtype)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        return positions, lengths

    def _decode_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     cache: StaticCache) -> torch.Tensor:
        """Logits `[B, V]` of the next token after one new token per row: the text decoder and
        the LM head only. For Qwen-VL this skips the multimodal wrapper, which has nothing to do
        once the media are in the cache and whose graph breaks and cached state (`rope_deltas`)
        cost recompiles; text positions continue from `position_ids` (M-RoPE deltas included).

        input_ids, position_ids: [B, 1]; attention_mask: [B, L] over the whole cache, or with
        grouped decode attention a boolean `[B, 1, 1, L]` of the slots each row may read."""
        hidden = self._text_decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True,
        ).last_hidden_state  # [B, 1, H]
        return self._head(hidden[:, -1])  # [B, V]

    def _decode(self, batch: PromptBatch, params: SamplingParams, generator: torch.Generator,
                row_budgets: Sequence[int] | None = None) -> _Decoded:
        """Prefill the batch, then sample token by token until every row hit a stop token, a
        stop string, `max_new_tokens`, or the model context."""
        dev = self.device
        input_ids, prompt_mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)  # [B, T]
        bsz, width = input_ids.shape
        budgets = (self.max_context - batch.lengths).clamp(max=params.max_new_tokens)  # [B]
        if row_budgets is not None:
            budgets = torch.minimum(budgets, torch.tensor(row_budgets, dtype=budgets.dtype))
        budgets = budgets.to(dev)
        steps = int(budgets.max())
        cache = self._static_cache(bsz, width + steps)
        future = torch.ones(bsz, cache.get_max_length() - width, dtype=prompt_mask.dtype, device=dev)
        mask = torch.cat([prompt_mask, future], dim=1)  # [B, L]; later slots are hidden by causality
        step_mask: torch.Tensor = mask
        if self._grouped_decode:  # boolean key mask [B, 1, 1, L]; each step opens its own slot
            step_mask = torch.cat([prompt_mask.bool(), torch.zeros_like(future, dtype=torch.bool)], dim=1)[:, None, None]
        positions, next_pos = self._prefill_positions(batch, input_ids, prompt_mask)
        media = {k: v.to(dev) for k, v in batch.media.items()}
        logits = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, logits_to_keep=1, **media,
        ).logits[:, -1]  # [B, V]
        stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)
        tokens = torch.full((bsz, steps), self.pad_id, dtype=torch.long, device=dev)  # [B, N]
        logprobs = torch.zeros(bsz, steps, dtype=torch.float32, device=dev)  # [B, N]
        lengths = budgets.clone()  # [B]
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)  # [B]
        stopped = torch.zeros(bsz, dtype=torch.bool, device=dev)  # [B]
        watcher = _StopStringWatcher(self.tokenizer, params.stop, bsz) if params.stop else None
        attention = (attention_implementation(self._text_decoder.config, GROUPED_DECODE)
                     if self._grouped_decode else nullcontext())
        with attention:
            for t in range(steps):
                tok, lp = sample_next_tokens(
                    logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, generator=generator
                )  # [B], [B]
                tok = torch.where(done, self.pad_id, tok)  # [B]
                tokens[:, t], logprobs[:, t] = tok, lp
                hit = torch.isin(tok, stop_ids)  # [B]
                if watcher is not None:
                    hit |= watcher.update(tok.tolist(), done.tolist()).to(dev)
                newly = ~done & (hit | (t + 1 >= budgets))  # [B]
                lengths = torch.where(newly, t + 1, lengths)
                stopped |= newly & hit
                done |= newly
                if t + 1 == steps or ((t + 1) % _SYNC_EVERY == 0 and bool(done.all())):
                    break
                if self._grouped_decode:
                    step_mask[:, 0, 0, width + t] = True  # the slot this step's token is written to
                logits = self._step(tok[:, None], step_mask, (next_pos + t)[:, None], cache)  # [B, V]
        return _Decoded(tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist())

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def score_next_tokens(
        self,
        shared_prefix: list[int],
        suffixes: Sequence[list[int]],
        candidates: Sequence[int],
        *,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Log-probs `[len(suffixes), len(candidates)]` (float32, CPU) of each candidate right
        after `shared_prefix + suffixes[i]`: `score_next_tokens_batch` with one item."""
        return self.score_next_tokens_batch([(shared_prefix, suffixes)], candidates, temperature=temperature)[0]

    @torch.inference_mode()
    def score_next_tokens_batch(
        self,
        items: Sequence[tuple[list[int], Sequence[list[int]]]],
        candidates: Sequence[int],
        *,
        temperature: float = 1.0,
    ) -> list[torch.Tensor]:
        """For each `(prefix, suffixes)` item, log-probs `[len(suffixes), len(candidates)]`
        (float32, CPU) of each candidate right after `prefix + suffixes[j]`.

        Packed shared-prefix scoring (the "shared-prefix packing" of tree/prefix attention, e.g.
        Hydragen, Juravsky et al. 2024; here with a dense 4-D mask): every item becomes one row
        `prefix + s_1 + ... + s_k` whose attention mask lets each suffix see the prefix and itself
        only, and whose positions restart at `len(prefix)` for each suffix, so the prefix runs
        once and no KV cache is copied. Rows of many items are batched into forwards of at most
        `score_token_budget` tokens (rows x padded width); an item too long for the budget is
        split over several rows, each repeating the prefix. Only the hidden states at suffix ends
        go through the output head. The tokens all items' prefixes start with (a judge's system
        prompt and few-shot examples) run once per call (`mask`: into a KV cache the rows read;
        `flex`: once per forward), not once per item: that, more than filling the device, is
        what a batch saves on a CPU: there a call whose rows each repeat their prefix costs about
        as much a sample as one call per sample (benchmarks/RESULTS.md, "Reward server: Ray Serve
        dynamic batching of a judge", tiny:qwen3 on the CPU). Pass many items per call: one call
        per item leaves the GPU mostly idle on short rows.
        """
        self._check_awake()
        self._check_score_input(items, candidates, temperature)
        cand = torch.tensor(list(candidates), dtype=torch.long, device=self.device)  # [C]
        out = [torch.empty(len(suffixes), len(cand)) for _, suffixes in items]
        suffix_lens = [[len(s) for s in suffixes] for _, suffixes in items]
        shared = shared_prefix_len([prefix for prefix, suffixes in items if suffixes])  # of the rows' items
        head: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.score_attention == "flex":
            budget = max(1, self.score_token_budget - shared)
            plan = compute_packing_plan([len(prefix) - shared for prefix, _ in items], suffix_lens, budget)
            forwards = pack_rows_flat([row for rows in plan for row in rows], budget)
        else:
            forwards = compute_packing_plan([len(prefix) - shared for prefix, _ in items], suffix_lens,
                                            self.score_token_budget)
            if shared:
                head = self._prefix_cache(next(prefix for prefix, suffixes in items if suffixes)[:shared])
        tables: list[torch.Tensor] = []  # [n, C] per forward, kept on the device: one sync at the end, so
        keys: list[tuple[int, int]] = []  # the host packs the next forward while the GPU runs this one
        for rows in forwards:
            logits, forward_keys = (self._score_flex(items, rows, shared) if self.score_attention == "flex"
                                    else self._score_packed(items, rows, head))  # [n, V], n (item, suffix) pairs
            tables.append(compute_logprobs(logits, temperature)[:, cand])  # [n, C]
            keys += forward_keys
        if tables:
            for (item, suffix), row in zip(keys, torch.cat(tables).cpu(), strict=True):
                out[item][suffix] = row
        return out

    def _check_score_input(
        self, items: Sequence[tuple[list[int], Sequence[list[int]]]], candidates: Sequence[int], temperature: float
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for scoring, got {temperature}")
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        bad = [c for c in candidates if not 0 <= c < vocab]
        if bad:
            raise ValueError(f"candidate token ids {bad} are outside the vocabulary [0, {vocab})")
        if items and self.score_attention == "mask" and self.model.config._attn_implementation not in _MASKED_ATTENTION:
            raise ValueError(
                f"scoring packs suffixes with a custom 4-D attention mask, which attn_implementation "
                f"{self.model.config._attn_implementation!r} does not take; load the model with one of {sorted(_MASKED_ATTENTION)}"
            )
        for index, (prefix, suffixes) in enumerate(items):
            if not prefix:
                raise ValueError(f"item {index}: shared prefix is empty; scoring needs at least one prefix token")
            for i, suffix in enumerate(suffixes):
                if len(prefix) + len(suffix) > self.max_context:
                    raise ValueError(
                        f"item {index}, suffix {i}: prefix ({len(prefix)}) + suffix ({len(suffix)}) tokens exceed "
                        f"the model context of {self.max_context} tokens"
                    )

    def _prefix_cache(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values `[1, KV heads, S, D]` per layer of the S tokens every item's prefix
        starts with (a system prompt and few-shot examples: most of a judge prompt), computed once
        per call; `_score_packed`'s rows attend to them instead of each repeating them, so a
        batch of N items runs them once, not N times."""
        cache = DynamicCache(config=self.model.config)
        self.model.get_decoder()(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                                 past_key_values=cache, use_cache=True)
        return [(keys, values) for keys, values, _ in cache]

    def _score_packed(
        self, items: Sequence[tuple[list[int], Sequence[list[int]]]], rows: Sequence[PackedRow],
        head: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One forward over packed rows behind `head` (`_prefix_cache` of the S tokens all prefixes
        share, or [] for none): next-token logits `[n, V]` at every suffix end, and the
        `(item, suffix)` each of the n logit rows belongs to."""
        shared = head[0][0].shape[-2] if head else 0
        width = max(row.length for row in rows)
        ids, segments, positions = [], [], []
        ends: list[int] = []  # flat index b * width + t of each suffix's last token
        keys: list[tuple[int, int]] = []
        for b, row in enumerate(rows):
            prefix, suffixes = items[row.item]
            plen = len(prefix)
            ids_b, seg_b, pos_b = list(prefix[shared:]), [0] * (plen - shared), list(range(shared, plen))
            for k, j in enumerate(row.suffixes, start=1):
                suffix = suffixes[j]
                ids_b += suffix
                seg_b += [k] * len(suffix)
                pos_b += range(plen, plen + len(suffix))
                last = len(ids_b) - 1 if suffix else plen - shared - 1  # an empty suffix reads the prefix's last token
                ends.append(b * width + last)
                keys.append((row.item, j))
            pad = width - len(ids_b)
            ids.append(ids_b + [self.pad_id] * pad)
            segments.append(seg_b + [-1] * pad)
            positions.append(pos_b + [0] * pad)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)  # [B, T]
        position_ids = torch.tensor(positions, dtype=torch.long, device=dev)  # [B, T]
        mask = self._packed_mask(torch.tensor(segments, dtype=torch.long, device=dev), shared)  # [B, 1, T, S + T]
        cache = None
        if head:  # every row reads the same cached keys/values: expanded, not copied
            rows_n = len(rows)
            cache = DynamicCache([(k.expand(rows_n, -1, -1, -1), v.expand(rows_n, -1, -1, -1)) for k, v in head],
                                 config=self.model.config)
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
            use_cache=cache is not None,
        ).last_hidden_state  # [B, T, H]
        picked = hidden.flatten(0, 1)[torch.tensor(ends, dtype=torch.long, device=dev)]  # [n, H]
        return self.model.get_output_embeddings()(picked), keys  # [n, V]

    def _score_flex(
        self, items: Sequence[tuple[list[int], Sequence[list[int]]]], rows: Sequence[PackedRow], shared: int
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One flex_attention forward over rows laid end to end in one sequence behind the
        `shared` tokens every item's prefix starts with (those run once per forward): next-token
        logits `[n, V]` at every suffix end, and the `(item, suffix)` of each logit row.

        Token roles (see `PackedBlockMasks`): the shared tokens are seen by every later token;
        row d's own prefix and suffixes are document d, segment 0 for the prefix and k for its
        k-th suffix. Positions: shared and prefix continue, each suffix restarts at
        `len(prefix)`. End padding sees only shared tokens and padding."""
        first = items[rows[0].item][0]
        ids, pos, doc, seg = list(first[:shared]), list(range(shared)), [-1] * shared, [0] * shared
        ends: list[int] = []  # index of each suffix's last token in the sequence
        keys: list[tuple[int, int]] = []
        for d, row in enumerate(rows):
            prefix, suffixes = items[row.item]
            plen = len(prefix)
            ids += prefix[shared:]
            pos += range(shared, plen)
            doc += [d] * (plen - shared)
            seg += [0] * (plen - shared)
            prefix_end = len(ids) - 1
            for k, j in enumerate(row.suffixes, start=1):
                suffix = suffixes[j]
                ids += suffix
                pos += range(plen, plen + len(suffix))
                doc += [d] * len(suffix)
                seg += [k] * len(suffix)
                ends.append(len(ids) - 1 if suffix else prefix_end)  # an empty suffix reads the prefix's last token
                keys.append((row.item, j))
        length = _flex_length(len(ids), self.score_token_budget)
        pad = length - len(ids)
        dev = self.device
        input_ids = torch.tensor(ids + [self.pad_id] * pad, dtype=torch.long, device=dev)[None]  # [1, N]
        position_ids = torch.tensor(pos + [0] * pad, dtype=torch.long, device=dev)[None]  # [1, N]
        masks = self._flex_masks.get(length)
        if masks is None:
            masks = self._flex_masks[length] = PackedBlockMasks(length, dev)
        block_mask = masks.build(torch.tensor(doc + [len(rows)] * pad, dtype=torch.long, device=dev),
                                 torch.tensor(seg + [-1] * pad, dtype=torch.long, device=dev), shared)  # doc, seg: [N]
        with attention_implementation(self._text_decoder.config, PACKED_FLEX):
            hidden = self._scoring_forward(input_ids, block_mask, position_ids)  # [1, N, H]
        picked = hidden[0, torch.tensor(ends, dtype=torch.long, device=dev)]  # [n, H]
        return self._head(picked), keys  # [n, V]

    def _scoring_forward(self, input_ids: torch.Tensor, block_mask: Any, position_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states `[1, N, H]` of one packed flex forward; with compiled layers where they
        apply. A compiler failure costs no rewards: it is reported once and the layers run eagerly."""

        def run() -> torch.Tensor:
            return self._text_decoder(
                input_ids=input_ids, attention_mask=block_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state

        if not (self.compile and self.device.type == "cuda") or self._scoring_compile_failed:
            return run()
        try:
            with self._compiled_layers():
                return run()
        except Exception as error:  # torch.compile raises many types; the eager run below re-raises real errors
            self._scoring_compile_failed = True
            warnings.warn(f"HFEngine: compiled scoring layers failed ({type(error).__name__}: {str(error)[:300]}); "
                          "scoring with eager layers from now on (pass compile=False to skip compiling)", RuntimeWarning,
                          stacklevel=2)
            return run()

    @contextmanager
    def _compiled_layers(self) -> Iterator[None]:
        """Run the decoder layers `torch.compile`d for this block (fused norms, rotary,
        activations: a third of an eager scoring forward's GPU time at 16k tokens), then restore
        them; `_scoring_forward` enters it only with `compile` on a GPU. One compiled wrapper per
        layer, made once per engine from the layer class's own `forward`; a model that brings its
        own compiled layers (`rl_models.compile_decoder_layers`) gets them back afterwards."""
        layers = decoder_layers(self.model)
        if self._scoring_layers is None:
            self._scoring_layers = [torch.compile(MethodType(type(layer).forward, layer), dynamic=False) for layer in layers]
        with swapped_forwards(list(layers), self._scoring_layers):
            yield

    def _packed_mask(self, segments: torch.Tensor, shared: int = 0) -> torch.Tensor:
        """Attention mask `[B, 1, T, S + T]` for packed rows from segment ids `[B, T]` (0 prefix,
        k suffix k, -1 padding) behind `shared` (S) cached tokens every query sees: causal, and a
        key is visible if it is in the prefix or in the query's own segment. Boolean (True =
        attend) for sdpa; additive float for eager."""
        width = segments.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()  # [T, T]
        query, key = segments[:, :, None], segments[:, None, :]  # [B, T, 1], [B, 1, T]
        mask = (((key == 0) | (key == query)) & causal)[:, None]  # [B, 1, T, T]
        if shared:
            seen = torch.ones(*mask.shape[:3], shared, dtype=torch.bool, device=mask.device)  # [B, 1, T, S]
            mask = torch.cat([seen, mask], dim=-1)  # [B, 1, T, S + T]
        if self.model.config._attn_implementation == "sdpa":
            return mask
        dtype = self.model.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)

    # ------------------------------------------------------------------ weights and memory
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Copy new values into the model's parameters/buffers in place (names as in
        `model.state_dict()`; tied weights may appear under either name); `version` (default:
        the previous one + 1) is kept in `weight_version`."""
        if self.state == "closed":
            raise EngineAsleepError("HFEngine is closed")
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name not in targets:
                sample = ", ".join(sorted(targets)[:5])
                raise KeyError(f"load_weights: the model has no parameter {name!r} (names look like: {sample}, ...)")
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.weight_version = self.weight_version + 1 if version is None else version

    def release_cache(self) -> None:
        """Give the KV cache's memory back now; the next `generate` takes it again. A trainer
        that decodes with the model it trains calls this before its update, so the cache (batch
        x length x layers x KV heads: ~9 GiB for 256 rows of 300 tokens at Qwen3-VL-2B) does not
        sit next to gradients and optimizer state.

        The cache tensors keep their identity and shapes (only their storage is freed and later
        re-allocated), so a compiled decode step is not recompiled; their addresses do change,
        which CUDA graphs cannot follow: with `compile_mode="reduce-overhead"` the cache object
        is dropped instead and the next call records a new graph."""
        if self._cache is None:
            return
        if self.compile and self.compile_mode == "reduce-overhead":
            self._cache, self._cache_key = None, (0, 0)
            return
        for tensor in self._cache_tensors():
            tensor.untyped_storage().resize_(0)
        self._cache_released = True

    def _cache_tensors(self) -> list[torch.Tensor]:
        """The key and value tensors of every initialised layer of the KV cache."""
        if self._cache is None:
            raise RuntimeError("the engine holds no KV cache (none allocated yet, or dropped)")
        tensors: list[torch.Tensor] = []
        for layer in self._cache.layers:
            if not isinstance(layer, CacheLayerMixin):  # linear attention: conv/recurrent states
                raise TypeError(f"{type(layer).__name__}: only key/value cache layers can be released")
            if layer.is_initialized and layer.keys is not None and layer.values is not None:
                tensors += [layer.keys, layer.values]
        return tensors

    def sleep(self) -> None:
        """Release accelerator memory: weights go to CPU, the KV cache is dropped, and the CUDA
        caching allocator is emptied. On a CPU engine only the cache is freed."""
        self._check_awake()
        self._cache, self._cache_key = None, (0, 0)
        if self.device.type != "cpu":
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.state = "asleep"

    def wake(self) -> None:
        """Move the weights back to the engine device."""
        if self.state == "closed":
            raise EngineAsleepError("HFEngine is closed")
        if self.is_asleep:
            self.model.to(self.device)
            self.state = "awake"

    def close(self) -> None:
        """Drop the KV cache and refuse further calls (the model object is left to its owner)."""
        self._cache, self._cache_key = None, (0, 0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.state = "closed"


class _StopStringWatcher:
    """Host-side check of stop strings on the decoded tail of each row (one sync per step)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str], batch_size: int) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.window = 4 * max(len(s) for s in stops) + 8  # tokens; each adds >= 1 byte
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]

    def update(self, tokens: list[int], done: list[bool]) -> torch.Tensor:
        """Append this step's tokens; return `[B]` True where a stop string just appeared."""
        hits = []
        for row, tok, finished in zip(self.rows, tokens, done, strict=True):
            if finished:
                hits.append(False)
                continue
            row.append(tok)
            tail = self.tokenizer.decode(row[-self.window :], skip_special_tokens=True)
            hits.append(any(stop in tail for stop in self.stops))
        return torch.tensor(hits, dtype=torch.bool)
