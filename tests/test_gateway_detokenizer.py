"""Incremental detokenization: deltas concatenate to ``decode(all_ids)``, never a partial char."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.choices import IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "Café crème brûlée, naïve façade — déjà vu",
    "今天天气很好。こんにちは、世界。안녕하세요",
    "emoji 😀👍🏳️‍🌈🇯🇵 and ✈️",
    "  multiple   spaces\n\n\ttabs\r\nand CRLF",
    "unseen: ᚠᚢᚦ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_dir(model_dirs[request.param])


def deltas(tokenizer: Tokenizer, ids: list[int], skip: bool = True, **kw: object) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, **kw)  # type: ignore[arg-type]
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_token_by_token(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = deltas(tokenizer, ids)
    assert "".join(out) == text
    assert out[-1] == ""  # nothing was left unfinished
    assert all("\ufffd" not in d for d in out)


def test_multibyte_char_waits_for_its_last_byte(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in "".join(pieces)  # the emoji is split across byte tokens
    out = deltas(tokenizer, ids)
    assert out == ["a"] + [""] * (len(ids) - 2) + ["😀", ""]


def test_random_ids_concatenate_to_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    specials = sorted(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            out = deltas(tokenizer, ids, skip)
            assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=skip), ids
            assert all(not d.endswith("\ufffd") for d in out[:-1])


def test_special_tokens_skipped_or_shown(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("hi", add_special_tokens=False), tokenizer.eos_token_ids[0]]
    assert "".join(deltas(tokenizer, ids)) == "hi"
    assert "".join(deltas(tokenizer, ids, skip=False)) == "hi<|im_end|>"


def test_prompt_context_is_never_emitted(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The answer:", add_special_tokens=False)
    out_ids = tokenizer.encode(" forty-two 😀", add_special_tokens=False)
    out = deltas(tokenizer, out_ids, context_ids=prompt)
    assert "".join(out) == " forty-two 😀"


def test_unfinished_sequence_is_flushed_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in ids) == "x"
    assert detok.flush() == tokenizer.decode(ids)[1:]
    assert detok.flush() == ""


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    """A sentencepiece-style tokenizer (▁ for spaces): its decoder drops the leading space of
    the first token only, which window decoding must not repeat in mid-text."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["hello world, the café says hello", "a cat and a dog"] * 20, trainer)
    return Tokenizer(tok, eos_token="</s>")


def test_metaspace_spaces_survive_windows(metaspace: Tokenizer) -> None:
    text = "hello  world and café cat"
    ids = metaspace.encode(text)
    assert metaspace.decode(ids) == text
    assert "".join(deltas(metaspace, ids)) == text
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(metaspace.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert "".join(deltas(metaspace, ids)) == metaspace.decode(ids), ids


def test_metaspace_first_output_token_keeps_its_space(metaspace: Tokenizer) -> None:
    prompt, out = metaspace.encode("hello"), metaspace.encode("world")
    assert metaspace.decode(out) == "world"  # alone, the leading ▁ is stripped
    assert "".join(deltas(metaspace, out, context_ids=prompt)) == " world"
