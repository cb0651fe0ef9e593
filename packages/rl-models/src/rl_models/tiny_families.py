"""Builders of the tiny checkpoints registered in `rl_models.tiny` (one function per family).

Each builder writes a complete `save_pretrained` folder into an existing empty directory; the
caller seeds torch. Sizes are tiny (hidden 32-64, 2 layers) so a family builds in seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from rl_models.tokenization import build_qwen_tokenizer


def _vocab_size(n_tokens: int, multiple: int = 64) -> int:
    """Round the tokenizer length up, as real checkpoints pad their embedding tables."""
    return (n_tokens + multiple - 1) // multiple * multiple


def _qwen_generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )


def build_qwen3(out: Path) -> None:
    """Qwen3 text model (tied embeddings, q/k norms, GQA), `Qwen2Tokenizer` + chat template."""
    tokenizer = build_qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=_vocab_size(len(tokenizer)),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = _qwen_generation_config(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
