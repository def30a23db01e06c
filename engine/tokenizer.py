"""Text <-> token ids for a Hugging Face model directory, without torch.

Reads the files transformers reads (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json``, ``config.json``) and renders chat templates
the way ``PreTrainedTokenizerBase.apply_chat_template`` does, so a prompt built here is the same
string, and the same ids, as one built by transformers. The gateway imports this module, so it
must never import torch.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from pdserve.engine.jinja_templates import compile_template, read_chat_templates

Message = dict[str, Any]
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat templates of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_templates: dict[str, str] | None = None,
        model_bos_token_id: int | None = None,
        model_eos_token_ids: Sequence[int] = (),
        generation_eos_token_ids: Sequence[int] = (),
    ) -> None:
        """``model_*`` ids (config.json's) stand in where no token string names the bos/eos.
        Special token strings missing from the vocabulary are added, as transformers does."""
        self._backend = backend
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self._add_special([t for t in self._named_tokens() if t is not None])
        self._chat_templates = dict(chat_templates or {})
        model_eos = model_eos_token_ids[0] if model_eos_token_ids else None
        self.bos_token_id = self._id_or(bos_token, model_bos_token_id)
        self.eos_token_id = self._id_or(eos_token, model_eos)
        self.pad_token_id = self._id_or(pad_token, None)
        ordered = [*generation_eos_token_ids, self.eos_token_id, *model_eos_token_ids]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in ordered if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in model directory {path}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        # as transformers does per call: a tokenizer.json may carry padding and truncation
        # (all-MiniLM-L6-v2's pads and cuts to 128), which would change a prompt silently
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        _add_missing_tokens(backend, config.get("added_tokens_decoder") or {})
        # An explicit null bos_token (Qwen) means "no bos"; only an absent key falls back.
        model_bos = None if "bos_token" in config else _ids(model_config.get("bos_token_id"))
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_templates=read_chat_templates(path, config.get("chat_template")),
            model_bos_token_id=model_bos[0] if model_bos else None,
            model_eos_token_ids=_ids(model_config.get("eos_token_id")),
            generation_eos_token_ids=_ids(generation.get("eos_token_id")),
        )

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy whose only chat template is ``template`` (``--chat-template``: it replaces a
        tool-use template too, as in vLLM)."""
        out = copy.copy(self)
        out._chat_templates = {"default": template}
        return out

    def to_json(self) -> str:
        """tokenizer.json with the added special tokens (what llguidance reads)."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        """bos/eos/pad and every added token marked special: what ``decode`` skips. A superset of
        transformers' ``all_special_ids``, which leaves out e.g. ``<|im_start|>``."""
        named = {self.bos_token_id, self.eos_token_id, self.pad_token_id}
        added = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return {i for i in named if i is not None} | added

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode`` prepends the bos. Set by tokenizer.json's post-processor alone:
        transformers 5 ignores tokenizer_config.json's ``add_bos_token`` when tokenizer.json
        exists, and so do we."""
        return self.bos_token_id is not None and self.encode("")[:1] == [self.bos_token_id]

    @property
    def chat_template(self) -> str | None:
        templates = self._chat_templates
        return templates.get("default") or next(iter(templates.values()), None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt tokenized on a
        # gateway thread does not stall the event loop serving every other stream
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens = []
        for i in ids:
            token = self._backend.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` to a prompt string exactly as transformers does (tokenize=False).

        Extra keyword arguments become template variables (e.g. ``enable_thinking``)."""
        template = self._select_template(tools)
        # What transformers passes: its special-tokens map, documents=None, then the extras.
        named = zip(("bos_token", "eos_token", "pad_token"), self._named_tokens(), strict=True)
        variables: dict[str, Any] = {k: v for k, v in named if v is not None}
        variables["documents"] = None
        variables.update(extra)
        try:
            return compile_template(template).render(
                messages=list(messages),
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        # The template already writes the bos, so the post-processor must not add another.
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **extra)
        return self.encode(text, add_special_tokens=False)

    def template_for(self, tools: Sequence[dict[str, Any]] | None) -> str:
        """The template ``apply_chat_template`` renders with these ``tools``: the model's
        ``tool_use`` template when tools are given and it has one (as transformers picks)."""
        return self._select_template(tools)

    def _select_template(self, tools: Sequence[dict[str, Any]] | None) -> str:
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        template = self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json and "
                "no chat_template.jinja); send a plain completion request instead"
            )
        return template

    def _named_tokens(self) -> tuple[str | None, str | None, str | None]:
        return self.bos_token, self.eos_token, self.pad_token

    def _id_or(self, token: str | None, default: int | None) -> int | None:
        return default if token is None else self._backend.token_to_id(token)

    def _add_special(self, tokens: list[str]) -> None:
        missing = [t for t in tokens if self._backend.token_to_id(t) is None]
        if missing:
            self._backend.add_special_tokens(
                [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
            )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)  # tokenizer and generation configs: JSON objects
    return data


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    return value["content"] if isinstance(value, dict) else value


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _add_missing_tokens(backend: tokenizers.Tokenizer, decoder: dict[str, dict[str, Any]]) -> None:
    """Add ``added_tokens_decoder`` entries that tokenizer.json lacks, in id order, like HF."""
    for _, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
        if backend.token_to_id(entry["content"]) is not None:
            continue
        flags = {k: entry[k] for k in _ADDED_TOKEN_FLAGS if k in entry}
        token = tokenizers.AddedToken(entry["content"], **flags)
        if entry.get("special", False):
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
