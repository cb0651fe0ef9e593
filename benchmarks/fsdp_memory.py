"""Peak GPU memory of one FSDP2 policy update at a shape that does not fit one GPU unsharded,
and the time to gather the full weights for the rollout.

Qwen3-8B shape (`rl_models.shapes.qwen3_config("8b")`, 8.2B parameters, random bf16 weights),
trained with fp32 master weights and AdamW (`train.fsdp_mixed_precision="bf16"`): unsharded that
is ~16 bytes/parameter = ~131 GB before activations, past an 80 GB GPU. Here the policy is
sharded with `rl_core.train.prepare_policy` (FSDP2) with the shards and optimizer state offloaded
to host memory, one optimizer step on a random token batch runs through
`rl_policy.training.Policy` and `rl_core.train.optimizer_step`, and `FullWeights` gathers the
bf16 weights as the rollout would.

    uv run torchrun --nproc_per_node 1 benchmarks/fsdp_memory.py          # one GPU (appends RESULTS.md)
    uv run torchrun --nproc_per_node 1 benchmarks/fsdp_memory.py --mixed-precision none   # host < ~130 GiB
    uv run torchrun --nproc_per_node 2 benchmarks/fsdp_memory.py          # per GPU, 2 GPUs
    uv run torchrun --nproc_per_node 1 benchmarks/fsdp_memory.py --tiny   # CPU check (gloo), no RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from accelerate import Accelerator
from transformers import Qwen3Config, Qwen3ForCausalLM

from rl_core.train import (
    FullWeights,
    NonFiniteGuard,
    UpdateStats,
    accelerator_kwargs,
    end_training,
    optimizer_step,
    prepare_policy,
    resolve_sharding,
)
from rl_models.logprobs import TokenBatch
from rl_models.shapes import qwen3_config
from rl_policy.training import Policy


def build(config: Qwen3Config, device: torch.device) -> torch.nn.Module:
    """Random bf16 weights (the shape is what matters), no download. Drawn on `device`: the
    host's normal_ is one serial generator (~45 s for 8.2B values), a GPU's takes well under a
    second; with offload, sharding moves the weights to the host."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    torch.manual_seed(0)  # the same weights on every process
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.model.rotary_emb.inv_freq.copy_(model.model.rotary_emb.original_inv_freq)
    return model


# weights + gradients + 2 Adam moments, fp32 with bf16 mixed precision, else bf16
BYTES_PER_PARAM = {"bf16": 16, "none": 8}


def check_host_memory(config: Qwen3Config, mixed_precision: str) -> None:
    """With offload the host holds every process's shards, gradients and Adam moments: stop
    before loading when they cannot fit (an 8B policy with fp32 master weights needs ~130 GB)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    need = params * BYTES_PER_PARAM[mixed_precision]
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > 0.95 * available:
        raise SystemExit(f"offload needs ~{need / 2**30:.0f} GiB of host memory for {params / 1e9:.1f}B parameters "
                         f"with --mixed-precision {mixed_precision}; this host has {available / 2**30:.0f} GiB "
                         "available. --mixed-precision none needs half that.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks the script runs")
    parser.add_argument("--no-offload", action="store_true", help="keep the shards on the GPU")
    parser.add_argument("--mixed-precision", choices=("bf16", "none"), default="bf16",
                        help="bf16: fp32 master weights + fp32 Adam (16 B/param; ~130 GB of host memory with "
                             "offload); none: bf16 weights, gradients and Adam moments (8 B/param)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt 256 + completion)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    offload = not args.no_offload  # on a CPU (--tiny) the same code path, with nothing to pin
    if args.tiny:
        config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        args.seq = 64
    else:
        config = qwen3_config("8b")
    acc = Accelerator(cpu=not cuda, **accelerator_kwargs(sharding="fsdp2", cpu_offload=offload))
    if offload and not args.tiny:
        check_host_memory(config, args.mixed_precision)
    plan = resolve_sharding(acc, "fsdp2", mixed_precision=args.mixed_precision, cpu_offload=offload, activation_checkpointing=True)
    began = time.perf_counter()
    model = build(config, acc.device)
    params = sum(p.numel() for p in model.parameters())
    full = FullWeights(model, device=acc.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    policy, optimizer, _ = prepare_policy(acc, Policy(model), optimizer, None, plan)  # offload: fused host AdamW
    acc.print(f"built and sharded in {time.perf_counter() - began:.0f} s ({params / 1e9:.2f}B parameters, "
              f"{acc.num_processes} process(es), offload {offload})")
    prompt = 256 if not args.tiny else 16
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=acc.device)  # [B, T]
    mask = torch.ones_like(ids)
    batch = TokenBatch.from_prompt_completion(ids[:, :prompt], mask[:, :prompt], ids[:, prompt:], mask[:, prompt:])

    def loss_fn(micro: TokenBatch, num_valid: torch.Tensor):
        logp, _ = policy(micro, 1.0)  # [B, C]
        loss = -logp.sum() / num_valid
        return loss, {"loss/policy": float(loss.detach())}

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(2):  # the first step allocates the optimizer state
        began = time.perf_counter()
        optimizer_step(acc, policy, optimizer, [batch], loss_fn, units=lambda m: float(m.completion_mask.sum()),
                       grad_clip=1.0, guard=NonFiniteGuard(), stats=UpdateStats())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        acc.print(f"optimizer step {len(times)}: {times[-1]:.1f} s")
    peak_update = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    with full.gathered() as copy:
        gather = full.pop_metrics()["time/weight_gather"]
        peak_gather = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        held = sum(p.numel() * p.element_size() for p in copy.parameters()) / 2**30
    world = acc.num_processes
    per_param = BYTES_PER_PARAM[args.mixed_precision]
    row = [f"Qwen3-{'tiny' if args.tiny else '8B'} ({params / 1e9:.2f}B)", world,
           "shards+Adam on host" if offload else "on the GPU", f"{params * per_param / 2**30:.0f}",
           f"{peak_update:.1f}", f"{times[-1]:.2f}", f"{gather:.2f}", f"{held:.1f}", f"{peak_gather:.1f}"]
    header = ["policy", "GPUs", "FSDP2 shards", "unsharded need, GiB (weights+grads+Adam)", "peak GPU GiB, update",
              "step s", "gather s", "gathered GiB", "peak GPU GiB, gather"]
    if acc.is_main_process:
        if args.tiny:
            print(header, row, sep="\n")
        else:
            from results import append_results

            append_results("FSDP2 memory per GPU (benchmarks/fsdp_memory.py)", header, [row],
                           notes=f"mixed precision {args.mixed_precision} ({per_param} B/param unsharded) + AdamW, activation checkpointing, batch "
                                 f"{args.batch} x {args.seq} tokens, one optimizer step (the second, with "
                                 "optimizer state); gather = FullWeights.gathered() of the bf16 weights for the "
                                 "rollout engine.")
    end_training(acc)


if __name__ == "__main__":
    main()
