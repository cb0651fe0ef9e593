"""caption-rl's setup pieces: the `Run` every phase takes, the policy (LoRA, compiled layers, shared media), the reward
backend, the sharding check, the engine's turn on the accelerator, the KL reference and the
export."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from caption_config import Config, ModelConfig
from caption_parts import Dataset, LocalReward, RemoteReward, resolve_model
from peft import PeftModel
from transformers import PreTrainedModel

from rl_core.train import (
    FullWeights,
    NonFiniteGuard,
    OptimizerOffload,
    PhaseTimer,
    SampleLog,
    UserError,
    gathered,
)
from rl_data import GroupSampler, ReadStats
from rl_models.compiled import compile_decoder_layers
from rl_models.lora import add_lora, disabled_adapter, export_lora, merge_and_export
from rl_models.shared_media import share_identical_media
from rl_models.vl import load_vl_model


def check_sharding(acc: Accelerator) -> None:
    """Refuse DeepSpeed ZeRO-3, whose sharded weights the rollout engine and the log-prob replay
    cannot read. Sharded weights go through FSDP2 instead (`train.sharding = "fsdp2"`, or an
    accelerate FSDP config with fsdp_version: 2): the engine decodes from gathered full weights
    and the replay runs through the sharded policy's forward (`rl_core.train.sharding`)."""
    if acc.distributed_type == DistributedType.DEEPSPEED and acc.state.deepspeed_plugin.zero_stage == 3:
        raise UserError("caption-rl does not run with DeepSpeed ZeRO-3: the rollout engine and the log-prob replay "
                        "read the full weights outside the wrapped forward. Use FSDP2 (train.sharding=\"fsdp2\" or "
                        "examples/caption-rl/accelerate/fsdp2_1node.yaml), DDP or ZeRO-1/2.")


def load_policy(cfg: ModelConfig, *, trainable: bool = True) -> tuple[torch.nn.Module, Any, str]:
    """The captioner with LoRA / gradient checkpointing / compiled layers as configured; with
    `trainable=False` a frozen copy of the initial policy (the full fine-tuning KL reference)."""
    path = resolve_model(cfg.path)
    model: PreTrainedModel | PeftModel
    model, processor = load_vl_model(path, dtype=cfg.dtype)
    if cfg.share_media:
        share_identical_media(model)
    if not trainable:
        return model.eval().requires_grad_(False), processor, path
    if cfg.lora_rank > 0:
        model = add_lora(model, r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_targets)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.compile_layers == "on" or (cfg.compile_layers == "auto" and torch.cuda.is_available()):
        compile_decoder_layers(model)
    return model, processor, path


class _LengthReward(TypedDict):
    """The length-reward keywords LocalReward and RemoteReward share."""

    length_tokenizer: str
    length_l1: int
    length_l2: int
    length_weight: float


def build_reward_backend(cfg: Config, policy_path: str) -> LocalReward | RemoteReward:
    r = cfg.reward
    url = r.url or (f"http://{r.host}:{r.port}/get_reward" if r.host else None)
    length: _LengthReward = {"length_tokenizer": r.length_tokenizer or policy_path, "length_l1": r.length_l1,
                             "length_l2": r.length_l2, "length_weight": r.length_weight}
    if url is not None:
        return RemoteReward(url, retries=r.retries, timeout=r.timeout, **length)
    judge = None if r.spec is not None else resolve_model(r.judge, "reward.judge")
    return LocalReward(judge=judge, spec=r.spec, qa_estimator=r.qa_estimator, qa_num=r.qa_num,
                       format_weight=r.format_weight, seed=cfg.train.seed, format_variant=r.format_variant,
                       format_min_brackets=r.format_min_brackets, answer_parser=r.answer_parser,
                       qa_prompt_file=r.qa_prompt_file, **length)


@contextmanager
def awake_engine(run: Any) -> Iterator[Any]:
    """The rollout engine, ready to sample: the `hf` engine's model in eval mode, with the Adam
    moments on the host while it decodes and its KV cache freed afterwards (`rollout.
    offload_optimizer`, `rollout.release_cache`), so decoding and training take turns with the
    same memory; a colocated vLLM engine woken for the rollout and put back to sleep (weights to
    CPU, KV cache freed) so the trainer has the GPU memory."""
    if run.engine_kind == "hf":
        run.engine.model.eval()
        if run.optimizer_offload is not None:
            run.optimizer_offload.to_host()
        try:
            with gathered(run.full, run.engine.model):  # a sharded policy's full weights, this rollout only
                yield run.engine
        finally:
            if run.cfg.rollout.release_cache:
                run.engine.release_cache()
            if run.optimizer_offload is not None:
                run.optimizer_offload.to_device()
        return
    run.engine.wake()
    try:
        yield run.engine
    finally:
        run.engine.sleep()


@contextmanager
def reference_model(run: Any) -> Iterator[torch.nn.Module]:
    """The KL reference: the trained `Policy` with its LoRA adapter disabled (no second copy of
    the weights; sharded or not), or a frozen copy of the initial policy for full fine-tuning."""
    if run.reference is not None:
        yield run.reference
        return
    with disabled_adapter(run.model):
        yield run.acc.unwrap_model(run.policy)


def export(model: torch.nn.Module, processor: Any, out: Path) -> None:
    """The final model in Hugging Face format (LoRA: the adapter and the merged model)."""
    if isinstance(model, PeftModel):
        export_lora(model, out / "adapter")
        merge_and_export(model, out, processor=processor)
    else:
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"export needs the transformers model (or its PeftModel), got {type(model).__name__}")
        model.save_pretrained(out)
        processor.save_pretrained(out)


@dataclass
class Run:
    """Everything the loop touches, built once by `setup`."""

    cfg: Config
    acc: Accelerator
    run_dir: Path
    policy: torch.nn.Module  # `Policy` (model -> completion log-probs), prepared: DDP-wrapped
    processor: Any
    engine: Any  # rollout.engine: HFEngine over the training modules, or a colocated VLLMEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reward: LocalReward | RemoteReward
    sampler: GroupSampler
    data: Dataset
    prompts_per_rank: int
    total_steps: int
    start_step: int
    reference: torch.nn.Module | None  # frozen initial policy (full fine-tuning with a KL term)
    samples: SampleLog
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)
    bad_records: ReadStats = field(default_factory=ReadStats)  # records that failed to become model input
    placeholders: frozenset[int] = frozenset()
    pad_id: int = 0
    dropped_long: int = 0  # prompts over rollout.max_prompt_length, this process
    weight_version: int = 0  # optimizer steps pushed into a vllm engine
    engine_kind: str = "hf"  # rollout.engine resolved: "hf" | "vllm"
    optimizer_offload: OptimizerOffload | None = None
    full: FullWeights | None = None  # a sharded policy's full weights for the engine and export (train.sharding)

    @property
    def model(self) -> torch.nn.Module:
        return self.acc.unwrap_model(self.policy).model

    @property
    def on_policy(self) -> bool:
        """Each rollout batch makes exactly one optimizer step: old log-probs = the update's own."""
        t = self.cfg.train
        return self.cfg.algo.ppo_epochs == 1 and (t.mini_batch_size or t.batch_size) == t.batch_size
