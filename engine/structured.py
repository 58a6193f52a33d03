"""Structured outputs: a request's tokens constrained to a grammar (a JSON schema, or a Lark
grammar that may embed JSON schemas), by llguidance.

A request carries its grammar as text (``SamplingParams.grammar``, built by ``json_grammar`` or
``lark_grammar`` and checked by ``check_grammar`` where the request arrives, so a bad schema is a
400 there, not a failed step). The engine gives each of its sequences a ``Guide``; the sampler
masks that sequence's logits with it at every step. Once the grammar is complete, the end of
sequence is the only token left, so the request stops there.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("mmserve.engine")

# JSON in the shape chat templates write it ({"a": 1, "b": [2, 3]}), with no free whitespace:
# given a choice of whitespace, small models can emit newlines until max_tokens.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (or the JSON schema it came from) that cannot be compiled."""


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def _composes(schema: Any) -> bool:
    """Whether objects of ``schema`` are put together from parts (``allOf``, or a ``$ref`` with
    properties beside it): closing a part would forbid the other parts' properties."""
    if isinstance(schema, list):
        return any(_composes(sub) for sub in schema)
    if not isinstance(schema, dict):
        return False
    return "allOf" in schema or ("$ref" in schema and "properties" in schema) or _composes(list(schema.values()))


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    ``properties`` and says nothing of others (as vLLM's xgrammar backend and OpenAI's strict
    mode read a schema): else a small model pads its object with made-up keys until max_tokens.
    A schema that composes objects (``_composes``) is left as it is."""
    return schema if _composes(schema) else _closed(schema)


def _closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text valid under ``closed(schema)`` (``{"type": "object"}``: any
    JSON object)."""
    return llguidance.LLMatcher.grammar_from_json_schema(closed(schema), overrides=COMPACT_JSON)  # type: ignore[arg-type]


def lark_json(schema: dict[str, Any]) -> str:
    """``closed(schema)`` as a Lark rule body (``%json {...}``), compact as ``json_grammar``'s."""
    return "%json " + json.dumps({**closed(schema), "x-guidance": COMPACT_JSON})


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: ``%json {schema}`` embeds a JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def regex_grammar(regex: str) -> str:
    """The grammar of text that matches ``regex`` whole."""
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: list[str]) -> str:
    """The grammar of exactly one of ``choices``."""
    return lark_grammar("start: " + " | ".join(json.dumps(c) for c in choices))


def cfg_grammar(text: str) -> str:
    """The grammar of a context-free grammar in Lark (llguidance's dialect) or GBNF (llama.cpp's);
    ``GrammarError`` when a GBNF text does not convert."""
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def check_grammar(grammar: str) -> None:
    """Raise ``GrammarError`` with llguidance's message if ``grammar`` does not compile."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip())


class Guide:
    """One sequence's progress through its grammar. ``error``: why the grammar cannot go on
    (llguidance's limits: e.g. a schema with no finite instance, which compiles); the sequence
    then ends at once, its output cut short (the engine reports it as ``length``)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_id: int) -> None:
        self._matcher = matcher
        self._eos_id = eos_id
        self._seen = 0  # output tokens consumed
        self.error: str | None = None

    def constrain_(self, row: torch.Tensor, output_ids: list[int]) -> None:
        """Set, in place, the logits of every token the grammar forbids next to -inf. First
        consumes the output tokens it has not seen: the engine appends tokens without telling
        guides, and a step that is rerun samples again from the same place."""
        import numpy as np
        import torch  # (here: the API process imports this module for its grammars alone)

        for token in output_ids[self._seen :]:
            self._matcher.consume_token(token)
        self._seen = len(output_ids)
        if self._matcher.is_error():
            if self.error is None:
                self.error = self._matcher.get_error()
                logger.warning("a grammar cannot go on (%s): the sequence ends", self.error)
            row[torch.arange(row.numel()) != self._eos_id] = float("-inf")
            return
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: row.numel()].view(np.bool_))
        row.masked_fill_(~allowed.to(row.device), float("-inf"))


class Guides:
    """Makes a ``Guide`` per sequence for one engine's tokenizer (its llguidance view is built
    at the first structured request: ~0.4-1 s). Thread-safe, one compile at a time:
    ``AsyncEngine`` compiles a request's grammar on a worker thread (llguidance releases the
    GIL), so the engine thread never waits on a compile."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def new(self, grammar: str, n: int = 1) -> list[Guide]:
        """``n`` guides at the grammar's start (compiled once); ``ValueError`` when this engine
        cannot guide."""
        with self._lock:  # one compile at a time: they share the cores with the engine's steps
            matcher = llguidance.LLMatcher(self._view(), grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return [Guide(matcher if k == 0 else matcher.deep_copy(), self._eos_ids[0]) for k in range(n)]

    def _view(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            if self._tokenizer is None or not self._eos_ids:
                raise ValueError("structured outputs need a model with a tokenizer and an end-of-sequence token")
            from llguidance.hf import from_tokenizer

            self._ll = from_tokenizer(self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids)
        return self._ll
