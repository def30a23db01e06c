"""A prompt's own logprobs in a response: completions' ``echo`` (the legacy OpenAI shape, the
prompt's tokens listed before the output's) and vLLM's ``prompt_logprobs`` field.

The worker that ran the prompt scores every prompt token after the first and sends the
scores with token 0 (``TokenChunk.prompt_logprobs``); token 0 of the prompt has no score
(``null``), as in OpenAI's and vLLM's answers::

    echo:   text  "<prompt><output>"
            logprobs.tokens          [p0, p1, ..., o0, ...]
                     token_logprobs  [null, lp(p1), ..., lp(o0), ...]
                     top_logprobs    [null, {p1: .., alt: ..}, ..., {o0: ..}, ...]
                     text_offset     [0, len(p0), ..., len(prompt), ...]
    vLLM:   prompt_logprobs [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.choices import ChoiceUpdate, IncrementalDetokenizer
from pdserve.gateway.jobs import Job
from pdserve.gateway.logprobs import LogprobEntry, TokenTexts, completion_logprobs, resolve
from pdserve.protocol.messages import TokenLogprob


@dataclass(frozen=True)
class PromptEcho:
    """A prompt as ``echo`` shows it: its text and, scored, its tokens' logprob entries."""

    text: str
    first_token: str  # token 0's text: listed, with no logprob
    entries: list[LogprobEntry]  # tokens 1.., their offsets into ``text``


class PromptScores:
    """Turns one job's prompts and their scores into what the response shows."""

    def __init__(self, tokenizer: Tokenizer, texts: TokenTexts | None = None) -> None:
        self._tokenizer = tokenizer
        self._texts = texts or TokenTexts(tokenizer)

    def echo(self, prompt: list[int], scores: list[TokenLogprob] | None) -> PromptEcho:
        """The prompt's text as its tokens decode in order, each token's offset where its
        text starts. Special tokens (a bos the tokenizer added) are listed as tokens but show
        no text, as the output's do."""
        detok = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=True)
        offsets, text = [], ""
        for token_id in prompt:
            offsets.append(len(text))
            text += detok.add(token_id)
        text += detok.flush()
        entries = []
        for i, lp in enumerate(scores or []):
            entries.append(resolve(self._texts, prompt[i + 1], lp, offsets[i + 1]))
        return PromptEcho(text, self._texts.get(prompt[0])[0], entries)

    def vllm(self, prompt: list[int], scores: list[TokenLogprob]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: null for token 0, then for each token a map of token id
        to its logprob, rank and text, the prompt's own token first, then the alternatives."""
        out: list[dict[str, Any] | None] = [None]
        for token_id, lp in zip(prompt[1:], scores, strict=True):
            entry = {str(token_id): self._entry(token_id, lp.logprob, lp.rank)}
            for rank, (alt, alt_lp) in enumerate(lp.top, start=1):
                entry.setdefault(str(alt), self._entry(alt, alt_lp, rank))
            out.append(entry)
        return out

    def _entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._texts.get(token_id)[0]}


def echo_logprobs(echo: PromptEcho, output: list[LogprobEntry]) -> dict[str, Any]:
    """The legacy ``logprobs`` of an echoed choice: the prompt's tokens, then the output's
    (their offsets moved past the prompt's text)."""
    shift = len(echo.text)
    moved = [
        LogprobEntry(e.token, e.token_bytes, e.logprob, e.top, e.text_offset + shift)
        for e in output
    ]
    body = completion_logprobs(echo.entries + moved)
    body["tokens"].insert(0, echo.first_token)
    body["token_logprobs"].insert(0, None)
    body["top_logprobs"].insert(0, None)
    body["text_offset"].insert(0, 0)
    return body


class PromptStream:
    """A stream's prompt parts: an echoed choice's first chunk starts with the prompt (its
    logprobs before the output's, whose text offsets move past it); vLLM's
    ``prompt_logprobs`` come in each choice's first chunk."""

    def __init__(self, job: Job, tokenizer: Tokenizer) -> None:
        self.job = job
        self.scores = PromptScores(tokenizer)
        self.shift: dict[int, int] = {}  # an echoed choice's prompt text length

    def apply(
        self,
        choice: dict[str, Any],
        update: ChoiceUpdate,
        logprobs: list[LogprobEntry],
        first: bool,
    ) -> None:
        """Add to ``choice`` (a chunk's, built from ``update``, with ``logprobs``; ``first``:
        the choice's first chunk) what its prompt shows."""
        job, index = self.job, update.index
        prompt = job.requests[index // job.n].prompt_token_ids
        if first and job.prompt_logprobs and update.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.scores.vllm(prompt, update.prompt_logprobs)
        if not job.echo:
            return
        if first:
            echo = self.scores.echo(prompt, update.prompt_logprobs)
            self.shift[index] = len(echo.text)
            choice["text"] = echo.text + choice.get("text", "")
            if job.logprobs:
                choice["logprobs"] = echo_logprobs(echo, logprobs)
        elif job.logprobs and logprobs:
            shift = self.shift.get(index, 0)
            choice["logprobs"]["text_offset"] = [e.text_offset + shift for e in logprobs]
