"""engine/embed/'s small parts with exact values: sentence-transformers' config files read,
pooling of a packed batch, the tokenizer's own padding and truncation set aside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers, processors

from pdserve.engine.embed.pooling import normalize, pool
from pdserve.engine.embed.sentence_config import (
    EmbeddingConfigError,
    SentenceConfig,
    pooling_modes,
    read_sentence_config,
)
from pdserve.engine.embed.tokenize import EmbedTokenizer, InputTooLongError


def test_pooling_modes_from_either_form_of_the_config() -> None:
    assert pooling_modes({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}) == (
        "mean",
    )
    # several: concatenated in sentence-transformers' order, whatever the file's order
    both = {"pooling_mode_lasttoken": True, "pooling_mode_cls_token": True}
    assert pooling_modes(both) == ("cls", "lasttoken")
    assert pooling_modes({"pooling_mode": "lasttoken"}) == ("lasttoken",)
    assert pooling_modes({"pooling_mode": ["max", "cls"]}) == ("max", "cls")
    assert pooling_modes({"pooling_mode_max_tokens": False}) == ("mean",)  # none set
    assert pooling_modes({}) == ("mean",)
    assert pooling_modes({}, decoder=True) == ("lasttoken",)
    with pytest.raises(EmbeddingConfigError, match=r"unknown pooling mode\(s\) \['median'\]"):
        pooling_modes({"pooling_mode": "median"})


def write(path: Path, name: str, data: object) -> None:
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(data))


def test_sentence_config_files_and_their_defaults(tmp_path: Path) -> None:
    # no file at all: Transformer -> Pooling(mean), no Normalize, the network's own limit
    assert read_sentence_config(tmp_path, 512, decoder=False) == SentenceConfig(
        pooling=("mean",), normalize=False, max_seq_len=512, do_lower_case=False
    )
    write(tmp_path, "tokenizer_config.json", {"model_max_length": 128})
    assert read_sentence_config(tmp_path, 512, decoder=False).max_seq_len == 128
    modules = [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "pool", "type": "sentence_transformers.sentence_transformer.modules.Pooling"},
        {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    write(tmp_path, "modules.json", modules)
    write(tmp_path, "pool/config.json", {"pooling_mode_cls_token": True})
    write(tmp_path, "sentence_bert_config.json", {"max_seq_length": 1000, "do_lower_case": True})
    assert read_sentence_config(tmp_path, 512, decoder=True) == SentenceConfig(
        pooling=("cls",), normalize=True, max_seq_len=512, do_lower_case=True
    )
    write(tmp_path, "modules.json", [*modules[:2], {"path": "2_Dense", "type": "x.Dense"}])
    with pytest.raises(
        EmbeddingConfigError, match=r"modules \['Transformer', 'Pooling', 'Dense'\]"
    ):
        read_sentence_config(tmp_path, 512, decoder=False)


def test_pooling_a_packed_batch() -> None:
    hidden = torch.tensor([[1.0, 2.0], [3.0, 6.0], [0.0, 0.0], [2.0, -4.0], [4.0, 1.0]])
    lengths = [2, 3]  # rows 0-1, then rows 2-4
    assert pool(hidden, lengths, ["mean"]).tolist() == [[2.0, 4.0], [2.0, -1.0]]
    assert pool(hidden, lengths, ["cls", "lasttoken"]).tolist() == [
        [1.0, 2.0, 3.0, 6.0],
        [0.0, 0.0, 4.0, 1.0],
    ]
    assert pool(hidden, lengths, ["max"]).tolist() == [[3.0, 6.0], [4.0, 1.0]]
    # weights 1, 2 and 1, 2, 3; each quotient rounded once to float32
    expected = torch.tensor([[7 / 3, 14 / 3], [16 / 6, -5 / 6]])
    assert pool(hidden, lengths, ["weightedmean"]).tolist() == expected.tolist()
    assert pool(hidden, [4], ["mean_sqrt_len_tokens"]).tolist() == [[3.0, 2.0]]
    assert pool(hidden, [], ["mean", "cls"]).shape == (0, 4)
    assert normalize(torch.tensor([[3.0, 4.0]])).tolist() == torch.tensor([[0.6, 0.8]]).tolist()


def bert_like_tokenizer() -> tokenizers.Tokenizer:
    """[CLS] $A [SEP] over a word-level vocabulary, padding and truncation to 4 saved in it."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, "a": 4, "b": 5, "c": 6, "A": 7}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tok.enable_padding(pad_id=3, pad_token="[PAD]", length=6)
    tok.enable_truncation(4)
    return tok


def test_the_tokenizer_neither_pads_nor_truncates_unless_asked() -> None:
    tok = EmbedTokenizer(bert_like_tokenizer(), max_seq_len=5)
    assert tok.encode(["a b", "A"]) == [[1, 4, 5, 2], [1, 7, 2]]
    with pytest.raises(InputTooLongError, match="input 0 has 7 tokens, more than the 5") as e:
        tok.encode(["a b c a b"])
    assert (e.value.index, e.value.tokens, e.value.limit) == (0, 7, 5)
    assert tok.encode(["a b c a b"], truncate=True) == [[1, 4, 5, 6, 2]]  # [SEP] kept
    lower = EmbedTokenizer(bert_like_tokenizer(), max_seq_len=5, do_lower_case=True)
    assert lower.encode(["A"]) == [[1, 4, 2]]


def test_the_gateway_side_modules_do_not_import_torch() -> None:
    code = (
        "import sys, pdserve.engine.embed.tokenize, pdserve.engine.embed.sentence_config; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
