"""engine/embed/ on the pulled all-MiniLM-L6-v2 against sentence-transformers on the same
directory: the same ids, the same vectors (1 - cos < 1e-4, max abs difference < 1e-5; measured
2e-7), and a text's vector independent of its batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.embed.model import EmbeddingModel
from pdserve.engine.embed.tokenize import InputTooLongError

TEXTS = [
    "Hello world",
    "A",
    "",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Ünïcödé CAFÉ, 東京 and emoji 🙂 — mixed case",
    "pdserve serves embeddings " * 120,  # 962 tokens: cut to max_seq_length (256)
]
LENGTHS = [4, 3, 2, 42, 15, 256]  # tokens, [CLS] and [SEP] included


@pytest.fixture(scope="module")
def minilm(embed_dir: Path) -> EmbeddingModel:
    return EmbeddingModel.from_dir(embed_dir)


@pytest.fixture(scope="module")
def reference(embed_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embed_dir), device="cpu")


@pytest.fixture(scope="module")
def theirs(reference) -> torch.Tensor:
    """sentence-transformers' embeddings of TEXTS: [6, 384]."""
    return torch.from_numpy(reference.encode(TEXTS))


def test_the_model_says_what_it_is(minilm: EmbeddingModel) -> None:
    assert (minilm.name, minilm.kind, minilm.dim, minilm.max_seq_len) == (
        "all-minilm-l6-v2",
        "bert",
        384,
        256,  # sentence_bert_config.json's, not tokenizer.json's 128
    )
    assert minilm.sentence.pooling == ("mean",) and minilm.sentence.normalize


def test_ids_are_sentence_transformers_ids(minilm: EmbeddingModel, reference) -> None:
    ids = minilm.tokenize(TEXTS, truncate=True)
    assert [len(i) for i in ids] == LENGTHS
    assert ids[0] == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]: lower-cased
    assert ids[5][0] == 101 and ids[5][-1] == 102  # truncation keeps both special tokens
    features = reference.preprocess(TEXTS)
    theirs = [
        row[mask.bool()].tolist()
        for row, mask in zip(features["input_ids"], features["attention_mask"], strict=True)
    ]
    assert ids == theirs


def test_an_over_long_text_is_refused_unless_truncation_is_asked(minilm: EmbeddingModel) -> None:
    with pytest.raises(InputTooLongError, match="input 1 has 962 tokens, more than the 256"):
        minilm.tokenize(["short", TEXTS[5]])
    with pytest.raises(InputTooLongError, match="input 0 has 257 tokens"):
        minilm.embed([[101] * 257])
    with pytest.raises(ValueError, match="input 1 has no tokens"):
        minilm.embed([[101, 102], []])
    with pytest.raises(ValueError, match=r"input 0 has a token id outside the vocabulary"):
        minilm.embed([[101, 30522, 102]])
    assert minilm.embed([]).shape == (0, 384)


def test_embeddings_match_sentence_transformers(minilm: EmbeddingModel, theirs) -> None:
    ours = minilm.embed_texts(TEXTS, truncate=True)
    assert ours.dtype == torch.float32 and ours.shape == (6, 384)
    gap = 1 - torch.nn.functional.cosine_similarity(ours, theirs)
    diff = (ours - theirs).abs().max().item()
    print(f"max 1 - cos {gap.max().item():.2e}, max abs diff {diff:.2e}")
    assert gap.max().item() < 1e-4
    assert diff < 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(6), atol=1e-6)  # Normalize ran
    # the texts are not alike: a mix-up of rows would show
    assert ((ours @ theirs.T).argmax(dim=1) == torch.arange(6)).all()


def test_linear_layers_through_torch_match_too(embed_dir: Path, theirs) -> None:
    model = EmbeddingModel.from_dir(embed_dir, linear="torch")
    assert model.linear == "torch"
    assert (model.embed_texts(TEXTS, truncate=True) - theirs).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="linear must be one of auto, onednn, torch"):
        EmbeddingModel.from_dir(embed_dir, linear="mkl")


def test_a_text_embeds_the_same_in_any_batch(minilm: EmbeddingModel) -> None:
    ids = minilm.tokenize(TEXTS, truncate=True)
    batched = minilm.embed(ids)
    alone = torch.cat([minilm.embed([one]) for one in ids])
    reversed_ = minilm.embed(ids[::-1]).flip(0)
    # bit for bit through oneDNN here; within 1e-6 is the promise: MKL's matmul over 2 or 3
    # rows takes another kernel than over many (2.6e-7 apart, measured)
    print(f"{minilm.linear}: bit for bit {torch.equal(batched, alone)}")
    assert (batched - alone).abs().max().item() < 1e-6
    assert (batched - reversed_).abs().max().item() < 1e-6
    minilm.max_batch_tokens = 50  # several forward passes: [4, 3, 2], [42], [15], [256]
    try:
        assert (minilm.embed(ids) - batched).abs().max().item() < 1e-6
    finally:
        minilm.max_batch_tokens = 8192
