"""What a request asks to be constrained to, as every edge carries it: a kind and its text.

Nothing here imports the grammar engine, so the router's validation, the worker
API's conversions and the sampler's callers share these types at no cost.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from ..requests import InvalidField

# The bound at every edge: the router may lower it for its clients (--max-constraint-chars),
# a worker refuses anything longer whoever sends it.
MAX_CONSTRAINT_CHARS = 1 << 20
MAX_CHOICES = 1024


class ConstraintKind(enum.IntEnum):
    # Values equal the worker proto's ConstraintKind.
    NONE = 0
    JSON_OBJECT = 1  # any JSON object (OpenAI's response_format json_object); text unused
    JSON_SCHEMA = 2  # text: the schema, JSON
    REGEX = 3  # text: the regex (Rust regex syntax, as llguidance takes it), matched whole
    CHOICE = 4  # text: a JSON array of the strings to choose among
    GRAMMAR = 5  # text: a Lark grammar (llguidance's dialect) or GBNF (llama.cpp's, with ::=)


FIELDS = {
    ConstraintKind.JSON_OBJECT: "json_object",
    ConstraintKind.JSON_SCHEMA: "json_schema",
    ConstraintKind.REGEX: "regex",
    ConstraintKind.CHOICE: "choice",
    ConstraintKind.GRAMMAR: "grammar",
}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint. `text` identifies it: compiled grammars are cached by (kind, text)."""

    kind: ConstraintKind
    text: str = ""

    @property
    def field(self) -> str:
        """The public gRPC API's name of the field that carries it (refusals name it)."""
        return f"constraint.{FIELDS[self.kind]}"

    def check(self, max_chars: int = MAX_CONSTRAINT_CHARS) -> None:
        """Raises InvalidField for what can be refused without compiling: the size, the JSON
        of a schema or a choice list, an empty regex or grammar."""
        if self.kind not in FIELDS:
            raise InvalidField("constraint", f"has an unknown kind {int(self.kind)}")
        if len(self.text) > max_chars:
            raise InvalidField(self.field, f"has {len(self.text)} characters; at most {max_chars} are allowed")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            schema = _json(self.field, self.text)
            if not isinstance(schema, (dict, bool)):
                raise InvalidField(self.field, "must be a JSON object (a JSON schema)")
        elif self.kind is ConstraintKind.CHOICE:
            choices = _json(self.field, self.text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidField(self.field, "must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise InvalidField(self.field, f"has {len(choices)} strings; at most {MAX_CHOICES} are allowed")
        elif self.kind in (ConstraintKind.REGEX, ConstraintKind.GRAMMAR) and not self.text:
            raise InvalidField(self.field, "is empty")

    def choices(self) -> list[str]:
        return json.loads(self.text)


def choice(strings: list[str]) -> Constraint:
    return Constraint(ConstraintKind.CHOICE, json.dumps(list(strings), ensure_ascii=False))


def json_schema(schema) -> Constraint:
    """From a schema as a dict (canonical text, so equal schemas share a cache entry) or as text."""
    text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True, ensure_ascii=False)
    return Constraint(ConstraintKind.JSON_SCHEMA, text)


def _json(field: str, text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidField(field, f"is not valid JSON: {exc}") from None
