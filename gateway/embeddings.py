"""``POST /v1/embeddings`` in OpenAI's shape: the request body, its inputs as token ids for the
embed worker (``protocol.embeddings``), and the response.

    input            a string, a list of strings, a list of token ids, or a list of such lists
                     (at most 2,048 inputs; each non-empty and within the model's length:
                     longer is a 400, as OpenAI answers, never cut silently)
    encoding_format  "float" (lists of numbers) or "base64" (float32 little-endian bytes, what
                     the openai SDK asks for by default and decodes)
    dimensions       refused (400): no served model here was trained to be cut shorter
    user             accepted, ignored

Text is tokenized here with the model's own tokenizer as sentence-transformers does it (its
[CLS]/[SEP], its lower-casing), so the worker gets ids only; token-id inputs go as given.
"""

from __future__ import annotations

import base64
import uuid
from array import array
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.embed.sentence_config import read_sentence_config
from pdserve.engine.embed.tokenize import EmbedTokenizer, InputTooLongError
from pdserve.gateway.errors import OpenAIError, invalid_request
from pdserve.protocol import messages as m
from pdserve.protocol.embeddings import MAX_EMBED_INPUTS

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def load_tokenizer(info: m.ServedModel) -> EmbedTokenizer:
    """The model's tokenizer as its workers run it: its length, its lower-casing."""
    root = Path(info.root)
    sentence = read_sentence_config(root, info.max_model_len, decoder=False)
    return EmbedTokenizer.from_dir(root, info.max_model_len, sentence.do_lower_case)


def prepare_embed(req: EmbeddingRequest, tokenizer: EmbedTokenizer, info: m.ServedModel) -> m.Embed:
    """The ``Embed`` for ``req`` (its ``stream_address`` the backend's, filled in there); a 400
    naming the field for what cannot be served."""
    if req.dimensions is not None:
        message = f"model `{info.name}` does not support `dimensions`: its embeddings are whole"
        raise invalid_request(message, "dimensions")
    inputs = _inputs(req.input)
    if not inputs:
        raise invalid_request("input must not be empty", "input")
    if len(inputs) > MAX_EMBED_INPUTS:
        message = f"at most {MAX_EMBED_INPUTS} inputs in one request, got {len(inputs)}"
        raise invalid_request(message, "input")
    ids: list[list[int]] = []
    for i, one in enumerate(inputs):
        if not one:
            raise invalid_request(f"input {i} is empty", "input")
        if isinstance(one, str):
            try:
                [tokens] = tokenizer.encode([one])
            except InputTooLongError as e:
                raise OpenAIError(400, str(e), param="input", code="context_length_exceeded") from e
        else:
            tokens = list(one)
            bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
            if bad:
                message = f"input {i}: token id {bad[0]} is outside the vocabulary"
                raise invalid_request(message, "input")
            if len(tokens) > info.max_model_len:
                error = InputTooLongError(i, len(tokens), info.max_model_len)
                raise OpenAIError(400, str(error), param="input", code="context_length_exceeded")
        ids.append(tokens)
    return m.Embed(
        request_id=f"embd-{uuid.uuid4().hex}",
        model=info.name,
        inputs=ids,
        stream_address="",
    )


def _inputs(value: EmbeddingInput) -> list[str | list[int]]:
    """One list of inputs, whichever of the four shapes ``value`` takes."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [cast("list[int]", value)]
    return list(cast("list[str] | list[list[int]]", value))


def embedding_body(result: m.EmbedResult, model: str, encoding: str) -> dict[str, Any]:
    """OpenAI's ``list`` of ``embedding`` objects, with the inputs' tokens as usage."""
    row = 4 * result.dim
    rows = [result.vectors[i : i + row] for i in range(0, len(result.vectors), row)]
    data = []
    for index, raw in enumerate(rows):
        vector: Any
        if encoding == "base64":
            vector = base64.b64encode(raw).decode("ascii")
        else:
            floats = array("f")
            floats.frombytes(raw)
            vector = floats.tolist()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
