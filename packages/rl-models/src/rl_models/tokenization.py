"""Tiny real tokenizers trained on the fly, for the offline checkpoints of `rl_models.tiny`.

Each builder trains a small tokenizer with HuggingFace `tokenizers` on a fixed built-in corpus
(deterministic: same corpus, same trainer settings, same vocabulary) and wraps it in the
`transformers` class the real checkpoint uses (`Qwen2Tokenizer`, `CLIPTokenizer`,
`BertTokenizer`, `T5Tokenizer`), so `AutoTokenizer.from_pretrained` takes the same code path as
for a hub checkpoint. The Qwen tokenizer uses Qwen's own pre-tokenizer regex and byte-level
alphabet, Qwen's special tokens, and a Qwen-style chat template with vision placeholders.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import (
    BertTokenizer,
    CLIPTokenizer,
    PreTrainedTokenizerBase,
    Qwen2Tokenizer,
    T5Tokenizer,
)

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


def _pre_tokenize(tok: Tokenizer) -> Counter[str]:
    """Count the pre-tokens of `BUILTIN_CORPUS` under `tok`'s normalizer and pre-tokenizer."""
    counts: Counter[str] = Counter()
    for line in BUILTIN_CORPUS:
        text = tok.normalizer.normalize_str(line) if tok.normalizer else line
        counts.update(piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text))
    return counts


def train_bpe_merges(
    words: Counter[tuple[str, ...]], max_merges: int, *, min_frequency: int = 2
) -> list[tuple[str, str]]:
    """Plain BPE (Sennrich et al., 2016) over symbol tuples, with a deterministic tie-break.

    The `tokenizers` trainers break frequency ties in hash order, so their output changes from
    process to process; here ties go to the lexicographically smallest pair.
    """
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < min_frequency:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            merged[_merge_pair(word, best)] += count
        words = merged
    return merges


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _bpe_vocab(alphabet: list[str], merges: list[tuple[str, str]]) -> dict[str, int]:
    tokens = list(dict.fromkeys([*alphabet, *(a + b for a, b in merges)]))
    return {token: i for i, token in enumerate(tokens)}


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
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = Counter({tuple(piece): n for piece, n in _pre_tokenize(tok).items()})
    merges = train_bpe_merges(words, vocab_size - len(alphabet))
    return _bpe_vocab(alphabet, merges), merges


def build_qwen_tokenizer(vocab_size: int = 768, *, model_max_length: int = 32768) -> Qwen2Tokenizer:
    """A tiny `Qwen2Tokenizer` with Qwen's special tokens and chat template.

    Every option letter "A".."I" and " A".." I" is a single token (checked), so a caption-QA
    judge can read next-token letter probabilities.
    """
    vocab, merges = train_qwen_bpe(vocab_size)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        # transformers annotates merges `list[str]` and unk_token `str`; the BPE model takes the
        # (left, right) pairs as they are and Qwen has no unknown token
        merges=merges,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,  # type: ignore[arg-type]
        model_max_length=model_max_length,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.add_tokens(list(QWEN_ADDED_TOKENS))
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    _check_single_token_letters(tokenizer)
    return tokenizer


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of the single token `token` (`convert_tokens_to_ids` is typed `int | list[int]`)."""
    ids = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(ids, int):
        raise TypeError(f"{type(tokenizer).__name__} maps token {token!r} to {ids!r}, not one id")
    return ids


def _check_single_token_letters(tokenizer: Qwen2Tokenizer) -> None:
    for letter in OPTION_LETTERS:
        for text in (letter, " " + letter):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise RuntimeError(f"tiny tokenizer splits {text!r} into {ids}; grow the corpus")


def build_clip_tokenizer(vocab_size: int = 512, *, model_max_length: int = 77) -> CLIPTokenizer:
    """A tiny `CLIPTokenizer` (lower-cased byte-level BPE with the `</w>` end-of-word suffix)."""
    probe = CLIPTokenizer()  # CLIP's own normalizer and pre-tokenizer, with an empty vocabulary
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    alphabet += [char + "</w>" for char in alphabet]
    words: Counter[tuple[str, ...]] = Counter()
    for piece, n in _pre_tokenize(probe.backend_tokenizer).items():
        words[(*piece[:-1], piece[-1] + "</w>")] += n
    merges = train_bpe_merges(words, vocab_size - len(alphabet) - 2)
    vocab = _bpe_vocab(alphabet, merges)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # (left, right) pairs, as in build_qwen_tokenizer
        model_max_length=model_max_length,
        pad_token="<|endoftext|>",
    )


def _word_counts(tok: Tokenizer) -> list[tuple[str, int]]:
    """Pre-tokens of the corpus, most frequent first (ties alphabetical)."""
    return sorted(_pre_tokenize(tok).items(), key=lambda item: (-item[1], item[0]))


def build_bert_tokenizer(vocab_size: int = 512, *, model_max_length: int = 512) -> BertTokenizer:
    """A tiny lower-cased WordPiece `BertTokenizer` (BGE-style sentence encoders use it).

    Vocabulary: BERT's special tokens, every corpus character (plain and `##`-continued), then
    the most frequent whole words.
    """
    probe = BertTokenizer()  # BERT's own normalizer and pre-tokenizer
    words = _word_counts(probe.backend_tokenizer)
    chars = sorted({char for word, _ in words for char in word})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars)]
    tokens += [word for word, _ in words if len(word) > 1][: max(vocab_size - len(tokens), 0)]
    vocab = {token: i for i, token in enumerate(tokens)}
    return BertTokenizer(vocab=vocab, model_max_length=model_max_length)


def build_t5_tokenizer(vocab_size: int = 512, *, model_max_length: int = 256) -> T5Tokenizer:
    """A tiny Unigram `T5Tokenizer`: `<pad>`, `</s>`, `<unk>` at ids 0, 1, 2, then every corpus
    character and the most frequent words, scored by log relative frequency."""
    probe = T5Tokenizer()  # T5's own normalizer and Metaspace pre-tokenizer
    words = _word_counts(probe.backend_tokenizer)
    total = sum(n for _, n in words)
    chars = sorted({char for word, _ in words for char in word})
    pieces = [(word, math.log(n / total)) for word, n in words if len(word) > 1]
    pieces = pieces[: max(vocab_size - 3 - len(chars), 0)]
    floor = min((score for _, score in pieces), default=0.0) - 1.0
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces]
    vocab += [(char, floor) for char in chars if char not in dict(pieces)]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
