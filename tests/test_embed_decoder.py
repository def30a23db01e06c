"""Pooled embeddings from the repository's decoder (engine/embed/decoder.py) against
transformers' ``AutoModel`` last hidden states pooled the same way (within 1e-5), on the tiny
random checkpoints with sentence-transformers' files written beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.embed.model import EmbeddingModel
from pdserve.engine.embed.sentence_config import EmbeddingConfigError
from pdserve.engine.embed.tokenize import InputTooLongError
from pdserve.engine.tokenizer import Tokenizer

IDS = [[2043, 5, 9, 200, 3], [7, 8], [2043, *range(10, 60)], [11]]
LEGACY_KEY = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}


def embedding_dir(src: Path, dest: Path, mode: str, normalize: bool, **sbert: object) -> Path:
    """A copy of ``src`` with modules.json, 1_Pooling/config.json (the legacy keys, as
    Qwen3-Embedding writes them) and, given ``sbert``, sentence_bert_config.json."""
    shutil.copytree(src, dest)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 64,
        **{k: k == LEGACY_KEY[mode] for k in LEGACY_KEY.values()},
    }
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if sbert:
        (dest / "sentence_bert_config.json").write_text(json.dumps(sbert))
    return dest


def transformers_pooled(path: Path, mode: str, normalize: bool) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in IDS:
            states = model(torch.tensor([ids])).last_hidden_state[0]  # [L, E], after the norm
            rows.append(states[-1] if mode == "lasttoken" else states.mean(0))
    out = torch.stack(rows)
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(("mode", "normalize"), [("lasttoken", True), ("mean", False)])
def test_pooled_states_match_transformers(
    model_dirs: dict[str, Path], tmp_path: Path, arch: str, mode: str, normalize: bool
) -> None:
    path = embedding_dir(model_dirs[arch], tmp_path / arch, mode, normalize)
    model = EmbeddingModel.from_dir(path)
    assert (model.kind, model.dim, model.sentence.pooling) == ("decoder", 64, (mode,))
    ours = model.embed(IDS)
    theirs = transformers_pooled(path, mode, normalize)
    assert ours.shape == (4, 64) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 1e-5
    norms = ours.norm(dim=1)
    assert torch.allclose(norms, torch.ones(4), atol=1e-6) == normalize
    # each input over its own tokens alone: the same alone as in the batch
    alone = torch.cat([model.embed([ids]) for ids in IDS])
    assert (alone - ours).abs().max().item() < 1e-6


def test_a_headless_checkpoint_without_the_model_prefix_loads(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen3-Embedding's form: ``layers.0...`` names, no lm_head, a bare ``...Model``."""
    path = embedding_dir(model_dirs["qwen3"], tmp_path / "prefixed", "lasttoken", True)
    bare = embedding_dir(model_dirs["qwen3"], tmp_path / "bare", "lasttoken", True)
    weights = load_file(bare / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items()}, bare / "model.safetensors")
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    assert all(not k.startswith("model.") for k in load_file(bare / "model.safetensors"))
    assert torch.equal(
        EmbeddingModel.from_dir(bare).embed(IDS), EmbeddingModel.from_dir(path).embed(IDS)
    )


def test_text_goes_through_the_model_tokenizer_and_its_limit(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    path = embedding_dir(model_dirs["llama"], tmp_path / "m", "lasttoken", True, max_seq_length=8)
    model = EmbeddingModel.from_dir(path)
    assert model.max_seq_len == 8
    text = "hello world"
    ids = model.tokenize([text])[0]
    assert ids == Tokenizer.from_dir(path).encode(text) and ids[0] == 2043  # the bos, as served
    long = "the quick brown fox jumps over the lazy dog " * 3
    with pytest.raises(InputTooLongError, match="more than the 8 this model takes"):
        model.tokenize([text, long])
    cut = model.tokenize([long], truncate=True)[0]
    assert cut == Tokenizer.from_dir(path).encode(long)[:8]
    assert torch.equal(model.embed_texts([long], truncate=True), model.embed([cut]))


def test_a_decoder_without_sentence_transformers_files_is_refused(
    model_dirs: dict[str, Path],
) -> None:
    with pytest.raises(EmbeddingConfigError, match=r"has no modules\.json"):
        EmbeddingModel.from_dir(model_dirs["llama"])
