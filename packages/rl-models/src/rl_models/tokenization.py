"""Tiny real tokenizers trained on the fly, for the offline checkpoints of `rl_models.tiny`.

Each builder trains a small tokenizer with HuggingFace `tokenizers` on a fixed built-in corpus
(deterministic: same corpus, same trainer settings, same vocabulary) and wraps it in the
`transformers` class the real checkpoint uses (`Qwen2Tokenizer`, `CLIPTokenizer`,
`BertTokenizer`, `T5Tokenizer`), so `AutoTokenizer.from_pretrained` takes the same code path as
for a hub checkpoint. The Qwen tokenizer uses Qwen's own pre-tokenizer regex and byte-level
alphabet, Qwen's special tokens, and a Qwen-style chat template with vision placeholders.
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import BertTokenizer, CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

OPTION_LETTERS = "ABCDEFGHI"

# Qwen2/2.5/3 pre-tokenizer regex (the one `transformers.Qwen2Tokenizer` rebuilds on load).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added (not special) tokens of Qwen3: kept in decoded text, like the real tokenizer.
QWEN_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# Qwen-style ChatML template: string or list content, image/video placeholders the Qwen-VL
# processors expand, `add_generation_prompt`, and Qwen3's `enable_thinking=False` empty block.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_LETTER_LINES = [
    " ".join(OPTION_LETTERS),
    " ".join(f"{letter})" for letter in OPTION_LETTERS),
    " ".join(f"{letter}." for letter in OPTION_LETTERS),
    "".join(OPTION_LETTERS),
]
_TEXT = """\
The answer is A. The answer is B. The answer is C. The answer is D. The answer is E.
Caption: <Caption Start> a red circle above a blue square on a white background <Caption End>
Question: What color is the circle? Options: A) red B) blue C) green D) yellow
Can not answer based on the caption. Please describe this image in detail.
Describe the video chronologically with timestamps like [00:05] or [01:10 - 01:25].
[00:00] a man walks in. [00:12 - 00:18] he opens the door. [01:03] the dog barks.
0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024 3.14 (1) [2] {3} <4> "quoted text" 'single'
A photo of a cat sitting on a mat. A photo of a dog playing in the park with a ball.
A sign that says "hello world". A poster with the text "OPEN" written in bold letters.
The quick brown fox jumps over the lazy dog. The video shows a car driving down a road.
You are a helpful assistant. Answer strictly from the caption. Think step by step.
{"factuality": 0.8, "temporal_alignment": 0.5, "coverage": 0.9, "reason": "good"}
"""
BUILTIN_CORPUS: tuple[str, ...] = tuple(_LETTER_LINES * 40 + _TEXT.splitlines() * 8)


def _bpe_vocab_merges(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return dict(state["vocab"]), merges


def train_qwen_bpe(vocab_size: int = 768) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE with Qwen's normalizer and pre-tokenizer on `BUILTIN_CORPUS`.

    Returns (vocab, merges) without the special tokens; deterministic for a given vocab size.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(BUILTIN_CORPUS, trainer=trainer)
    return _bpe_vocab_merges(tok)


def build_qwen_tokenizer(vocab_size: int = 768, *, model_max_length: int = 32768) -> Qwen2Tokenizer:
    """A tiny `Qwen2Tokenizer` with Qwen's special tokens and chat template.

    Every option letter "A".."I" and " A".." I" is a single token (checked), so a caption-QA
    judge can read next-token letter probabilities.
    """
    vocab, merges = train_qwen_bpe(vocab_size)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=model_max_length,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.add_tokens(list(QWEN_ADDED_TOKENS))
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    _check_single_token_letters(tokenizer)
    return tokenizer


def _check_single_token_letters(tokenizer: Qwen2Tokenizer) -> None:
    for letter in OPTION_LETTERS:
        for text in (letter, " " + letter):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise RuntimeError(f"tiny tokenizer splits {text!r} into {ids}; grow the corpus")


def build_clip_tokenizer(vocab_size: int = 512, *, model_max_length: int = 77) -> CLIPTokenizer:
    """A tiny `CLIPTokenizer` (lower-cased BPE with the `</w>` end-of-word suffix)."""
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                behavior="removed",
                invert=True,
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
    )
    tok.train_from_iterator(BUILTIN_CORPUS, trainer=trainer)
    vocab, merges = _bpe_vocab_merges(tok)
    return CLIPTokenizer(
        vocab=vocab, merges=merges, model_max_length=model_max_length, pad_token="<|endoftext|>"
    )


def build_bert_tokenizer(vocab_size: int = 512, *, model_max_length: int = 512) -> BertTokenizer:
    """A tiny lower-cased WordPiece `BertTokenizer` (BGE-style sentence encoders use it)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    )
    tok.train_from_iterator(BUILTIN_CORPUS, trainer=trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    return BertTokenizer(vocab=vocab, model_max_length=model_max_length)


def build_t5_tokenizer(vocab_size: int = 512, *, model_max_length: int = 256) -> T5Tokenizer:
    """A tiny Unigram `T5Tokenizer` with T5's `<pad>`, `</s>`, `<unk>` ids 0, 1, 2."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
    )
    tok.train_from_iterator(BUILTIN_CORPUS, trainer=trainer)
    vocab = [tuple(item) for item in json.loads(tok.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
