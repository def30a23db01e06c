"""The built-in models' tokenizer: a byte-level BPE trained on ``models/data/corpus.txt``
(deterministic), dressed as each architecture's own, and the files transformers reads it
from (``tokenizer.json``, ``tokenizer_config.json`` with a chat template,
``special_tokens_map.json``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).parent / "data"
BOS, END_OF_TEXT, IM_START, IM_END, PAD = SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
)
VOCAB_SIZE = 2048
# chat templates: plain ChatML, or ChatML turns with tools in a family's style (both render a
# conversation without tools exactly as plain ChatML does)
TEMPLATES = {
    "chatml": "chatml.jinja",
    "hermes": "chatml_tools.jinja",
    "llama3": "llama3_tools.jinja",
}
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE on the bundled corpus (deterministic), specials at the top ids."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (DATA_DIR / "corpus.txt").read_text(encoding="utf-8")
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    specials = [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    tok.add_special_tokens(specials)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tok


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    return train_tokenizer().to_str()


def build_tokenizer(arch: str) -> tokenizers.Tokenizer:
    """The trained tokenizer dressed as the arch's own: Llama 3 prepends the bos; Qwen adds
    none, and gets Qwen's NFC + digit-splitting pre-tokenizer, which transformers 5 imposes
    on model_type qwen2 whatever tokenizer.json says."""
    tok = tokenizers.Tokenizer.from_str(_trained_tokenizer_json())
    byte_level = processors.ByteLevel(trim_offsets=False)
    if arch == "llama":
        bos = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, tok.token_to_id(BOS))],
        )
        tok.post_processor = processors.Sequence([byte_level, bos])
        return tok
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = byte_level
    return tok


def special_token_ids(tok: tokenizers.Tokenizer) -> dict[str, int]:
    """The id of each of ``SPECIAL_TOKENS`` in ``tok`` (``build_tokenizer`` adds them all)."""
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"the tokenizer lacks the special token {t!r}")
        ids[t] = token_id
    return ids


def write_tokenizer_config(
    out: Path, arch: str, max_len: int, ids: dict[str, int], template: str
) -> None:
    bos = BOS if arch == "llama" else None
    chatml = (DATA_DIR / TEMPLATES[template]).read_text(encoding="utf-8").strip()
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": arch == "llama",
            "add_eos_token": False,
            "added_tokens_decoder": {
                str(ids[t]): {"content": t, **flags, "special": True} for t in SPECIAL_TOKENS
            },
            "bos_token": bos,
            "chat_template": ("{{ bos_token }}" if bos else "") + chatml,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": max_len,
            "pad_token": PAD,
            "tokenizer_class": "PreTrainedTokenizerFast",
            # Qwen2Tokenizer would otherwise add "<|endoftext|>" as its default unk token.
            "unk_token": None,
        },
    )
    named = {"bos_token": bos, "eos_token": IM_END, "pad_token": PAD}
    special_map = {k: {"content": v, **flags} for k, v in named.items() if v is not None}
    write_json(out / "special_tokens_map.json", special_map)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
