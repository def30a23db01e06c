"""Request fields that constrain the output: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (and its older ``guided_*`` fields, which ``gateway.structured`` maps
to the same thing)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# a schema, regex or grammar larger than this is refused before it is parsed (engine.grammar
# checks it again in characters)
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256

Choice = Annotated[str, Field(min_length=1, max_length=1024)]
Text = Annotated[str, Field(max_length=MAX_SPEC_CHARS)]


class _Strict(BaseModel):
    # a misspelled constraint field must not pass as "no constraint"
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=256)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | bool | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # always so here (compact JSON)
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: None = None  # not supported: only null accepted


class StructuredFields(BaseModel):
    """Mixed into both request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs
    guided_json: dict[str, Any] | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)] | None = (
        None
    )
    guided_grammar: Text | None = None
    guided_decoding_backend: str | None = None  # accepted; the backend is llguidance
    guided_whitespace_pattern: None = None  # not supported: only null accepted
