"""What a sentence-transformers directory asks of its embeddings, read without torch.

    modules.json                  the pipeline: Transformer → Pooling → (Normalize)
    1_Pooling/config.json         pooling modes (``pooling_mode`` or the ``pooling_mode_*`` keys)
    sentence_bert_config.json     ``max_seq_length``, ``do_lower_case``
    tokenizer_config.json         ``model_max_length`` (a cap where max_seq_length is absent)

Defaults where a file is absent, as sentence-transformers takes them: no modules.json means
Transformer → Pooling, no Normalize, pooling ``mean`` for an encoder and ``lasttoken`` for a
decoder (a decoder directory without modules.json is refused: it is a chat model, not an
embedding model); no pooling config means ``mean``; no sentence_bert_config.json means
``max_seq_length`` = min(config's ``max_position_embeddings``, ``model_max_length``) and no
extra lower-casing. A module this code does not run (Dense, LayerNorm, ...) is refused rather
than left out, so an embedding is never silently different from sentence-transformers'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# sentence-transformers' legacy keys, in the order it concatenates several modes
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = tuple(LEGACY_POOLING_KEYS.values())
# a module by the last part of its type name: sentence_transformers.models.Pooling (v2-v5) and
# sentence_transformers.sentence_transformer.modules.Pooling (v6) alike
RUN_MODULES = ("Transformer", "Pooling", "Normalize")


class EmbeddingConfigError(ValueError):
    """A directory whose sentence-transformers files this code cannot follow exactly."""


@dataclass(frozen=True)
class SentenceConfig:
    """The pooling, normalisation and length limit of one embedding model."""

    pooling: tuple[str, ...]  # modes, concatenated in this order (usually one)
    normalize: bool  # L2 after pooling (a Normalize module)
    max_seq_len: int  # tokens, special tokens included
    do_lower_case: bool  # lower-case text before the tokenizer's own normalizer


def read_sentence_config(path: Path, max_positions: int, decoder: bool) -> SentenceConfig:
    """``path``'s sentence-transformers configuration; ``max_positions``: the longest input the
    network itself takes (a cap on any ``max_seq_length``)."""
    modules = _read_json(path / "modules.json")
    if modules is None:
        if decoder:
            raise EmbeddingConfigError(
                f"{path} has no modules.json: a decoder model is served for embeddings only "
                "where sentence-transformers' modules.json asks for pooling"
            )
        modules = [{"type": "Transformer", "path": ""}, {"type": "Pooling", "path": "1_Pooling"}]
    if not isinstance(modules, list):
        raise EmbeddingConfigError(f"{path / 'modules.json'}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in RUN_MODULES]
    if unknown or kinds[:1] != ["Transformer"] or "Pooling" not in kinds:
        raise EmbeddingConfigError(
            f"{path / 'modules.json'}: modules {kinds}; supported: Transformer, Pooling and "
            "an optional Normalize, in that order"
        )
    pooling_dir = modules[kinds.index("Pooling")].get("path") or "1_Pooling"
    pooling = pooling_modes(_read_json(path / pooling_dir / "config.json") or {}, decoder)
    sbert = _read_json(path / "sentence_bert_config.json") or {}
    limit = sbert.get("max_seq_length")
    if limit is None:
        limit = (_read_json(path / "tokenizer_config.json") or {}).get("model_max_length")
    max_len = max_positions if limit is None else min(int(limit), max_positions)
    return SentenceConfig(
        pooling=pooling,
        normalize="Normalize" in kinds,
        max_seq_len=max_len,
        do_lower_case=bool(sbert.get("do_lower_case", False)),
    )


def pooling_modes(config: dict[str, Any], decoder: bool = False) -> tuple[str, ...]:
    """The modes of a pooling config: ``pooling_mode`` (a name or a list, sentence-transformers
    v6) or the legacy ``pooling_mode_*`` flags; none set: ``mean`` (``lasttoken`` for a decoder
    with no config at all)."""
    if not config:
        return ("lasttoken",) if decoder else ("mean",)
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in LEGACY_POOLING_KEYS.items() if config.get(key))
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise EmbeddingConfigError(f"unknown pooling mode(s) {bad}; known: {POOLING_MODES}")
    return modes or ("mean",)


def _read_json(path: Path) -> Any:
    """The file's JSON, or None where the file does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise EmbeddingConfigError(f"{path}: not valid JSON ({e})") from e
