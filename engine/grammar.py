"""Output constraints (``StructuredSpec``) as llguidance grammars, compiled once and cached.

llguidance rather than xgrammar, measured on SmolLM2's 49k vocabulary with one core: both
compile a nested JSON Schema in 1-5 ms and fill a token mask in microseconds (xgrammar 1-3 µs,
llguidance 6-11 µs median), far under a decode step; but xgrammar imports transformers and
requires triton (a 150 MB download on a CPU machine), while llguidance is one abi3 wheel
with no dependencies. Its masks are applied by our own code (``engine.sampler``).

No torch here: the gateway validates a request's constraint with ``grammar_text`` (400 on a
bad schema or regex) before anything reaches a worker.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pdserve.protocol.messages import StructuredSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in llguidance's stub only, not at run time

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar larger than this is refused
MAX_CHOICES = 256
KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}

# JSON without free whitespace: a model (a random one above all) cannot fill its budget with
# blanks. The separators are json.dumps' defaults, what models are used to writing.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for ``spec``; ``ValueError`` with the reason when it is bad."""
    if len(spec.spec) > MAX_SPEC_CHARS:
        raise ValueError(f"the {spec.kind} constraint is longer than {MAX_SPEC_CHARS} characters")
    if spec.kind == "json":
        grammar = _json_grammar(spec.spec)
    elif spec.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.spec)
    elif spec.kind == "choice":
        grammar = llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec.spec))
    elif spec.kind == "grammar":
        try:
            lark = any_to_lark(spec.spec)
        except Exception as e:  # the converter raises whatever its parser meets
            raise ValueError(f"the grammar does not parse: {e}") from e
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:
        raise ValueError(f"unknown constraint kind {spec.kind!r}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {KIND_NAMES[spec.kind]}: {error}")
    return grammar


def _json_grammar(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict | bool):
        raise ValueError("the JSON schema must be an object")
    try:
        # the ignore: llguidance's stub omits the boolean schemas (true / false) it takes
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema,  # type: ignore[arg-type]
            defaults=JSON_OPTIONS,
        )
    except ValueError as e:
        raise ValueError(f"invalid JSON schema: {e}") from e


def _choice_lark(choices_text: str) -> str:
    try:
        choices = json.loads(choices_text)
    except ValueError as e:
        raise ValueError(f"choice must be a JSON list of strings: {e}") from e
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices")
    # Lark string literals take JSON's escapes
    return "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))


class GrammarCache:
    """Matchers for one engine's tokenizer: a grammar is compiled once (an ``LLMatcher`` in its
    initial state, kept in an LRU) and each sequence gets a copy of it."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_entries: int = 256,
    ) -> None:
        # the model's vocabulary may be larger than the tokenizer's: ids past it are never
        # allowed; EOS is what a finished grammar allows
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._compiled: OrderedDict[StructuredSpec, llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled (not found in the cache)

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; ``ValueError`` when ``spec`` does not compile."""
        initial = self._compiled.get(spec)
        if initial is None:
            initial = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if initial.is_error():
                raise ValueError(f"invalid {KIND_NAMES[spec.kind]}: {initial.get_error()}")
            self.compiles += 1
            self._compiled[spec] = initial
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return initial.deep_copy()


def advance(matcher: llguidance.LLMatcher, token_ids: Sequence[int]) -> None:
    """Feed tokens produced elsewhere (token 0 from a prefill worker, a migrated stream's
    tokens) through a fresh matcher; ``ValueError`` if they break the constraint."""
    for token in token_ids:
        if not matcher.consume_token(token):
            raise ValueError(
                f"generated token {token} does not satisfy the output constraint: "
                f"{matcher.get_error()}"
            )
