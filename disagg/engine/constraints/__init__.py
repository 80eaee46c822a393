"""Constrained decoding: the tokens a request may produce, as a grammar (JSON, a JSON
schema, a regex, a choice among strings, a Lark/GBNF grammar), through llguidance.

The room's parts, in the order a request meets them:
  spec.py      what a request asks for (Constraint), torch- and llguidance-free: the
               edges parse it and check its size with the same rules everywhere;
  grammars.py  a Constraint -> an llguidance grammar;
  compiler.py  compiles a Constraint against the model's tokenizer once (cached by its
               text, on threads of its own, bounded in time) and starts a row's matcher
               from the tokens the request generated before (a resumed request);
  rows.py      per step, the rows' matchers advanced by their input tokens and their
               masks filled: one int32 bitmask [n, ceil(vocab / 32)] that the sampler
               applies to the whole batch in one tensor op (sampler.apply_bitmask).

The router compiles a constraint to refuse a bad one before any prefill; each worker
compiles it again (cached by text) from the spec the worker API carries; the prefill
worker masks the first token, the decode worker every later one.
"""

from .spec import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind

__all__ = ["Constraint", "ConstraintKind", "MAX_CONSTRAINT_CHARS"]
