"""The endpoints beside generation, as vLLM and OpenAI shape them, and the served models they
share with it::

    POST /tokenize     {model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
                        chat_template_kwargs?, tools?, return_token_strs?}
                       -> {count, max_model_len, tokens, token_strs}
    POST /detokenize   {model?, tokens} -> {prompt}
    GET  /v1/models, /v1/models/{id}    model cards; an alias (--model-alias) is a card of its own
    GET  /version      {version}

A request names a model by its served name or an alias; the alias resolves to the served name,
which responses report (vLLM's first ``--served-model-name``). ``model`` may be left out while
the gateway serves one model. Each served model's tokenizer is loaded from its root on first use
(``LazyTokenizers``). Inputs are bounded as generation's are: the body limit and timeout
(``gateway.admission``), the prompt guard (``gateway.jobs``), at most ``max_model_len`` tokens
to decode.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError, invalid_request, model_not_found
from pdserve.gateway.jobs import check_prompt_size, too_long
from pdserve.gateway.openai_models import INT64_MAX, ChatCompletionRequest, ChatMessage
from pdserve.gateway.tools.models import MAX_TOOLS, Tool
from pdserve.gateway.tools.request import template_tools
from pdserve.protocol import messages as m

log = logging.getLogger(__name__)


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def system_fingerprint(model: m.ServedModel) -> str:
    """``pdserve-<version>-<hash8>``, the hash of what the model is served from (vLLM's shape):
    it changes when the server or the model's weights or context length do."""
    digest = hashlib.sha256(f"{model.root}\0{model.max_model_len}".encode()).hexdigest()
    return f"pdserve-{pdserve_version()}-{digest[:8]}"


def resolve_model(name: str | None, aliases: Mapping[str, str], served: Collection[str]) -> str:
    """The served name ``name`` stands for; None is the only model served. Unknown names pass
    through (the caller answers 404)."""
    if name is None:
        if len(served) != 1:
            raise invalid_request("model is required: this server serves several models", "model")
        return next(iter(served))
    return aliases.get(name, name)


class LazyTokenizers(Mapping[str, Tokenizer]):
    """The tokenizer of every model ``roots()`` names, loaded from its root on first use.

    A tokenizer that cannot be loaded is logged and answered with a 503 ``OpenAIError`` from
    ``[]`` and ``get`` (only a ``KeyError`` means "no such model"); it is tried again after
    ``retry_s`` or when the model's root changes. ``in`` is False for it."""

    def __init__(
        self,
        roots: Callable[[], Mapping[str, str]],
        load: Callable[[str], Tokenizer] = Tokenizer.from_dir,
        *,
        retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._roots = roots
        self._load = load
        self._retry_s = retry_s
        self._clock = clock
        self._loaded: dict[str, tuple[str, Tokenizer]] = {}  # name -> (root, tokenizer)
        self._failed: dict[str, tuple[str, float, str]] = {}  # name -> (root, when, message)

    def __getitem__(self, name: str) -> Tokenizer:
        root = self._roots().get(name)
        if root is None:
            raise KeyError(name)
        loaded = self._loaded.get(name)
        if loaded is not None and loaded[0] == root:
            return loaded[1]
        failed = self._failed.get(name)
        if failed is not None and failed[0] == root and self._clock() - failed[1] < self._retry_s:
            raise OpenAIError(503, failed[2], param="model")
        try:
            tokenizer = self._load(root)
        except Exception as e:
            message = f"model `{name}` is unavailable: no tokenizer in {root}: {e}"
            log.error("%s", message)
            self._failed[name] = (root, self._clock(), message)
            raise OpenAIError(503, message, param="model") from e
        self._loaded[name] = (root, tokenizer)
        self._failed.pop(name, None)
        log.info("loaded the tokenizer of %s from %s", name, root)
        return tokenizer

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except (KeyError, OpenAIError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._roots())

    def __len__(self) -> int:
        return len(self._roots())


def model_card(info: m.ServedModel, name: str | None = None) -> dict[str, Any]:
    """``name``: the alias the card is for (its ``root`` is the model's). ``created`` is 0:
    nothing records when a model came to be served."""
    return {
        "id": name or info.name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "root": info.root,
        "parent": None,
        "max_model_len": info.max_model_len,
    }


def model_cards(
    models: list[m.ServedModel], served: Mapping[str, Tokenizer], aliases: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Every model with workers and a tokenizer, then each alias of one of them."""
    available = [model for model in models if model.name in served]
    data = [model_card(model) for model in available]
    by_id = {model.name: model for model in available}
    data += [
        model_card(by_id[target], alias) for alias, target in aliases.items() if target in by_id
    ]
    return data


def model_list(
    models: list[m.ServedModel], served: Mapping[str, Tokenizer], aliases: Mapping[str, str]
) -> dict[str, Any]:
    """``GET /v1/models``: ``model_cards`` as a list object."""
    return {"object": "list", "data": model_cards(models, served, aliases)}


def retrieve_model(
    name: str,
    models: list[m.ServedModel],
    served: Mapping[str, Tokenizer],
    aliases: Mapping[str, str],
) -> dict[str, Any]:
    """``GET /v1/models/{name}``; 404 ``model_not_found`` for a name ``model_cards`` lacks."""
    card = next((c for c in model_cards(models, served, aliases) if c["id"] == name), None)
    if card is None:
        raise model_not_found(name)
    return card


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TokenizeRequest(_Body):
    """vLLM's two tokenize bodies in one: ``prompt`` (text) or ``messages`` (a chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(default=False, json_schema_extra={"enum": [False]})
    chat_template: str | None = Field(default=None, json_schema_extra={"enum": [None]})
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


def tokenize(req: TokenizeRequest, tokenizer: Tokenizer, model: m.ServedModel) -> dict[str, Any]:
    """``POST /tokenize``: the ids the generation endpoints would give the model for this
    prompt or chat (what ``vllm bench serve`` checks its prompt lengths against)."""
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        text, param, special = _render_chat(req, tokenizer), "messages", False
    else:
        text, param, special = req.prompt or "", "prompt", True
    _check_unicode(text, param)
    check_prompt_size(text, tokenizer, model.max_model_len, param)
    add_special = special if req.add_special_tokens is None else req.add_special_tokens
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    if len(ids) > model.max_model_len:  # an answer as bounded as a request's prompt
        raise too_long(model.max_model_len, param)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


def detokenize(
    req: DetokenizeRequest, tokenizer: Tokenizer, model: m.ServedModel
) -> dict[str, Any]:
    """``POST /detokenize``: the text of ``tokens``, special tokens included (as vLLM)."""
    if len(req.tokens) > model.max_model_len:
        message = (
            f"at most {model.max_model_len} tokens (the model's context length) can be "
            f"detokenized, got {len(req.tokens)}"
        )
        raise invalid_request(message, "tokens")
    bad = next((t for t in req.tokens if t >= tokenizer.vocab_size), None)
    if bad is not None:
        message = f"token id {bad} is outside the vocabulary (size {tokenizer.vocab_size})"
        raise invalid_request(message, "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _render_chat(req: TokenizeRequest, tokenizer: Tokenizer) -> str:
    if req.continue_final_message:
        raise invalid_request("continue_final_message is not supported", "continue_final_message")
    if req.chat_template is not None:
        message = "a chat template per request is not supported: the server's template applies"
        raise invalid_request(message, "chat_template")
    # The chat endpoint's own conversion of messages and tools for the template.
    chat = ChatCompletionRequest(
        model=req.model or "", messages=req.messages or [], tools=req.tools
    )
    try:
        return tokenizer.apply_chat_template(
            chat.template_messages(),
            add_generation_prompt=req.add_generation_prompt,
            tools=template_tools(chat),
            **(req.chat_template_kwargs or {}),
        )
    except (ValueError, TypeError) as e:
        raise invalid_request(str(e), "messages") from e


def _check_unicode(text: str, param: str) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        message = f"{param} is not valid Unicode: it holds a lone surrogate"
        raise invalid_request(message, param) from None
