"""Builders of the tiny checkpoints registered in `rl_models.tiny` (one function per family).

Each builder writes a complete `save_pretrained` folder into an existing empty directory; the
caller seeds torch. Sizes are tiny (hidden 32-64, 2 layers) so a family builds in seconds on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import (
    BertConfig,
    BertModel,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    GenerationConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rl_models.tokenization import (
    build_bert_tokenizer,
    build_clip_tokenizer,
    build_qwen_tokenizer,
    token_id,
)


def round_vocab(n_tokens: int, multiple: int = 64) -> int:
    """Round the tokenizer length up, as real checkpoints pad their embedding tables."""
    return (n_tokens + multiple - 1) // multiple * multiple


def qwen_generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )


def build_qwen3(out: Path, *, head_dim: int = 8) -> None:
    """Qwen3 text model (tied embeddings, q/k norms, GQA), `Qwen2Tokenizer` + chat template."""
    tokenizer = build_qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=round_vocab(len(tokenizer)),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=token_id(tokenizer, "<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = qwen_generation_config(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_qwen3_vllm(out: Path) -> None:
    """`build_qwen3` with 64-wide attention heads, a size vLLM's attention kernels take (its
    FlashAttention and flex-attention backends refuse or hang on the 8-wide heads of `qwen3`)."""
    build_qwen3(out, head_dim=64)


def build_embedding(out: Path) -> None:
    """BGE-style sentence encoder: `BertModel` + WordPiece `BertTokenizer`, CLS pooling.

    Also writes the sentence-transformers module files (CLS pooling, then normalize), so the
    folder loads with `sentence_transformers.SentenceTransformer` as well as plain transformers.
    """
    tokenizer = build_bert_tokenizer()
    config = BertConfig(
        vocab_size=round_vocab(len(tokenizer)),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        # Wider than BERT's 0.02 so different sentences get visibly different embeddings.
        initializer_range=0.5,
    )
    BertModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_json(out / "modules.json", SENTENCE_TRANSFORMERS_MODULES)
    _write_json(
        out / "1_Pooling" / "config.json",
        {"word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": True},
    )


def build_clip(out: Path) -> None:
    """`CLIPModel` (32x32 images, patch 8) + `CLIPProcessor` (BPE tokenizer, image processor)."""
    tokenizer = build_clip_tokenizer()
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = CLIPConfig(
        text_config={
            "vocab_size": round_vocab(len(tokenizer)),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": tokenizer.model_max_length,
            **special,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=32,
    )
    CLIPModel(config).save_pretrained(out)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)


SENTENCE_TRANSFORMERS_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")
