"""The per-choice state machine: in-order chunks, eos hiding, stop strings, logprobs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.backend import BackendError
from pdserve.gateway.choices import ChoiceState, ChoiceUpdate
from pdserve.gateway.logprobs import LogprobEntry, TokenTexts
from pdserve.protocol.messages import TokenChunk, TokenLogprob

HELLO = [39, 327, 302, 891, 372, 0, 342, 948, 13]  # H|el|lo| wor|ld|!| The| end|.
EMOJI = [573, 322, 246, 222]  # é + 😀 in three byte tokens
EOS = 2046  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Tokenizer:
    tok = Tokenizer.from_dir(model_dirs["llama"])
    assert tok.decode(HELLO) == "Hello world! The end." and tok.decode(EMOJI) == "é😀"
    assert tok.eos_token_ids[0] == EOS
    return tok


def ev(
    index: int, ids: list[int], finish: str | None = None, logprobs: list | None = None
) -> TokenChunk:
    return TokenChunk(
        request_id="r",
        choice=0,
        index=index,
        token_ids=ids,
        logprobs=logprobs,
        finished=finish is not None,
        finish_reason=finish,
        num_prompt_tokens=3,
        num_cached_tokens=0,
    )


def test_chunks_are_consumed_as_they_come(tokenizer: Tokenizer) -> None:
    c = ChoiceState(3, tokenizer)
    assert c.add(ev(0, HELLO[:1])) == ChoiceUpdate(3, "H", 1, first=True)
    assert c.add(ev(1, HELLO[1:5])) == ChoiceUpdate(3, "ello world", 4)
    assert c.add(ev(5, [*HELLO[5:], EOS], "stop")) == ChoiceUpdate(
        3, "! The end.", 5, False, "stop"
    )
    assert (c.finished, c.num_tokens, c.backend_finished, c.stopped_by_stop_string) == (
        True, 10, True, False,
    )  # fmt: skip


def test_a_finish_reason_without_finished_is_not_the_end(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer)
    unfinished = dataclasses.replace(ev(0, [39, EOS], "stop"), finished=False)
    assert c.add(unfinished) == ChoiceUpdate(0, "H", 2, first=True)
    assert not c.finished and not c.backend_finished


def test_eos_counts_but_is_not_shown_even_unskipped(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer, skip_special_tokens=False)
    assert c.add(ev(0, [39, EOS], "stop")) == ChoiceUpdate(0, "H", 2, True, "stop")


def test_length_finish_shows_the_last_token(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer)
    assert c.add(ev(0, [39, 327], "length")) == ChoiceUpdate(0, "Hel", 2, True, "length")


def test_partial_character_waits_then_appears(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer)
    updates = [c.add(ev(i, [t])) for i, t in enumerate(EMOJI)]
    assert [u.text for u in updates if u] == ["é", "", "", "😀"]
    assert [u.first for u in updates if u] == [True, False, False, False]


def test_stop_string_ends_the_choice(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer, stops=["d!"])
    assert c.add(ev(0, HELLO[:4])) == ChoiceUpdate(0, "Hello wor", 4, True)
    assert c.add(ev(4, HELLO[4:6])) == ChoiceUpdate(0, "l", 2, False, "stop")
    assert (c.finished, c.stopped_by_stop_string, c.backend_finished) == (True, True, False)
    assert c.add(ev(6, HELLO[6:], "length")) is None  # a straggler
    assert c.backend_finished and c.num_tokens == 6


def test_held_text_is_flushed_on_finish(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer, stops=[" world peace"])
    assert c.add(ev(0, HELLO[:4])) == ChoiceUpdate(0, "Hello", 4, True)  # " wor" is held
    assert c.add(ev(4, [], "length")) == ChoiceUpdate(0, " wor", 0, False, "length")


@pytest.mark.parametrize("index", [0, 2])  # a repeat, a gap: the backend reorders, never here
def test_a_chunk_out_of_order_is_a_backend_error(tokenizer: Tokenizer, index: int) -> None:
    c = ChoiceState(0, tokenizer)
    c.add(ev(0, [39]))
    with pytest.raises(BackendError, match=f"choice 0: token index {index} came, 1 expected"):
        c.add(ev(index, [72]))


def test_logprobs_with_text_offsets(tokenizer: Tokenizer) -> None:
    c = ChoiceState(0, tokenizer, token_texts=TokenTexts(tokenizer))
    lps = [
        TokenLogprob(token_id=573, logprob=-0.5, rank=1, top=[(573, -0.5), (39, -2.0)]),
        TokenLogprob(token_id=322, logprob=-0.25, rank=1, top=[]),
        TokenLogprob(token_id=246, logprob=-1.0, rank=1, top=[]),
    ]
    update = c.add(ev(0, EMOJI[:3], logprobs=lps))
    assert update is not None and update.text == "é"
    partial = b"\xf0\x9f"  # what token 322 holds of 😀 (f0 9f 98 80)
    assert update.logprobs == [
        LogprobEntry("é", "é".encode(), -0.5, (("é", "é".encode(), -0.5), ("H", b"H", -2.0)), 0),
        LogprobEntry("\ufffd", partial, -0.25, (), 1),
        LogprobEntry("\ufffd", b"\x98", -1.0, (), 1),
    ]
