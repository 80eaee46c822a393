"""A Constraint as an llguidance grammar (its serialized TopLevelGrammar)."""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from .spec import Constraint, ConstraintKind

# JSON as json.dumps writes it (", " and ": ", no other whitespace). llguidance's default allows any
# whitespace between tokens, and a sampled small model then spends its tokens on whitespace runs
# and never closes the object; one layout also makes a constrained output reproducible.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_grammar(constraint: Constraint) -> str:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if kind is ConstraintKind.CHOICE:
        # Lark string literals take JSON's escapes: each choice matched exactly, as written.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices()))
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(constraint.text))
    raise ValueError(f"no grammar for constraint kind {kind!r}")
