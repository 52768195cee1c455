"""Structured output through llguidance: constraints compiled to matchers, and a step's token bitmask.

    grammars = Grammars(tokenizer, eos_token_ids, vocab_size, timeout_s)
    template = grammars.compile(constraint)      # once per distinct constraint (cached); ConstraintError
    seq.matcher = template.deep_copy()           # each constrained sequence holds its own
    bitmask = grammars.fill(matchers)            # [rows, words] int32, the whole batch in one call
    advance(seq.matcher, token) -> stopped?      # after each sampled token

Why llguidance (benchmarks/grammar_libs.py has the figures): no dependencies (xgrammar requires
torch, transformers, triton and pydantic at run time), schemas compile in about a millisecond
(xgrammar: 10-100 ms, more on a large vocabulary), Lark grammars and regexes natively, and
matchers copy (n > 1 forks).

The matcher's EOS is every id in the model's eos_token_ids: EOS is allowed exactly where the
grammar accepts. Tokens past the tokenizer's vocabulary (a model's padded rows) are never allowed.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from threading import Lock
from typing import TYPE_CHECKING

import torch

from jobrunner.engine.api.request import Constraint

if TYPE_CHECKING:
    import llguidance

# llguidance is imported on first use: an engine that serves no constraint never needs it
# (the GPU machine's image lacks it unless carried).

DEFAULT_TIMEOUT_S = 30.0
# JSON as models usually write it on one line ({"a": 1, "b": [2, 3]}), without free whitespace:
# a flexible-whitespace grammar lets a model pad with blanks until max_tokens. A schema may
# override these in its "x-guidance" key.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# JSON Schema's integer-valued keywords: 2.0 is a valid value (any number with a zero fractional
# part), which llguidance refuses ("expected positive integer"); they are made ints before compiling.
INTEGER_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                    "minContains", "maxContains")
# keywords whose values are instances, not schemas: never rewritten
_INSTANCE_KEYWORDS = ("const", "enum", "default", "examples")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar; or the timeout)."""


def grammar_text(c: Constraint) -> str:
    """The constraint as an llguidance grammar; raises ConstraintError when its spec is not even
    well-formed (a schema that is not JSON, choices that are not a list of strings). With
    `c.reasoning`, the answer's grammar after an optional reasoning block (after_reasoning)."""
    answer = _answer_grammar(c)
    return answer if c.reasoning is None else after_reasoning(answer, *c.reasoning)


def after_reasoning(answer: str, start: str, end: str) -> str:
    """An llguidance grammar (its JSON form) of an optional reasoning block, `start`, any text, `end`
    (lazy: the block ends at the first `end`, as the text's split does: jobs/reasoning.py), blanks, then
    a text of the grammar `answer` (another grammar_text), referenced as the subgrammar @answer."""
    try:
        top = json.loads(answer)            # JSON schemas and regexes come as a grammar list
    except json.JSONDecodeError:
        top = None
    if not (isinstance(top, dict) and "grammars" in top):
        top = {"grammars": [{"lark_grammar": answer}]}     # Lark text
    grammars = top["grammars"]
    lark = (f"start: thought? @answer\nthought: think BLANK\nthink[lazy]: THINK\n"
            f"THINK: {json.dumps(start)} /(?s:.*)/ {json.dumps(end)}\nBLANK: /[ \\t\\r\\n]*/\n")
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**grammars[0], "name": "answer"}, *grammars[1:]]})


def _answer_grammar(c: Constraint) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
    if c.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(integer_keywords_as_ints(schema), defaults=JSON_STYLE)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        try:
            choices = json.loads(c.spec)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(x, str) and x for x in choices):
            raise ConstraintError("choice needs a list of non-empty strings")
        # a Lark alternation of string literals; JSON string escapes are Lark's
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in choices))
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(c.spec))   # Lark, or GBNF-style EBNF


def integer_keywords_as_ints(schema, names: bool = False):
    """The schema with each integer keyword written as an integral float (maxItems: 2.0) made an
    int, at any depth; instances (const, enum, default, examples) are left as they are. `names`:
    schema is a map of names to schemas (properties, $defs, ...), whose keys are not keywords."""
    if isinstance(schema, list):
        return [integer_keywords_as_ints(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if names:
            out[k] = integer_keywords_as_ints(v)
        elif k in INTEGER_KEYWORDS and isinstance(v, float) and v.is_integer():
            out[k] = int(v)
        elif k in _INSTANCE_KEYWORDS:
            out[k] = v
        else:
            out[k] = integer_keywords_as_ints(v, names=k in _NAME_MAPS)
    return out


def check_constraint(c: Constraint) -> str | None:
    """Why the constraint cannot compile or can match no text (no tokenizer needed: a byte-level
    one), or None. For checks before a job runs."""
    import llguidance
    try:
        grammar = grammar_text(c)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if not error:
            error = dead_start(llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0))
    except ValueError as e:          # ConstraintError is one
        return str(e)
    return error or None


def dead_start(matcher: "llguidance.LLMatcher") -> str | None:
    """Why a fresh matcher's grammar can match no text (its first step allows neither a token nor EOS:
    llguidance then puts it in error), or None. The matcher is not changed."""
    if matcher.is_error():
        return matcher.get_error()
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        return f"can match no text ({_first_line(probe.get_error())}): nothing could be generated"
    return None


def grammar_error(matcher: "llguidance.LLMatcher") -> str:
    """A sequence's error when its matcher ended in error (no token could continue its output)."""
    return f"constraint: no token can continue the output to a match ({_first_line(matcher.get_error())})"


def _first_line(text: str | None) -> str:
    return (text or "").strip().split("\n", 1)[0] or "no reason given"


_BYTES = None


def _byte_tokenizer() -> "llguidance.LLTokenizer":
    """A tokenizer of the 256 bytes and an EOS: every text is some token sequence, so a grammar
    whose first step allows no token matches no text (llguidance's regexes simplify such a
    language to nothing; a grammar dead only further on fails its rows instead)."""
    global _BYTES
    if _BYTES is None:
        import llguidance

        class Bytes:
            eos_token_id, bos_token_id = 256, None
            tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
            special_token_ids = [256]

            def __call__(self, s):
                return list(s.encode("utf-8") if isinstance(s, str) else s)

        _BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
    return _BYTES


class Grammars:
    """The tokenizer as llguidance sees it, a cache of compiled constraints (template matchers,
    keyed by the constraint itself: frozen, hashed by its text) and the pool that compiles them."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 2):
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._source, self._eos = tokenizer, list(eos_token_ids)
        self._llg_tokenizer = self._executor = None             # built on the first constraint
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._cache: dict[Constraint, Future] = {}
        self._lock = Lock()

    def compile(self, c: Constraint) -> "llguidance.LLMatcher":
        """The constraint's template matcher (copy it per sequence). Compiles in the pool, once per
        distinct constraint; raises ConstraintError on a bad constraint or after timeout_s."""
        with self._lock:
            future = self._cache.get(c)
            if future is None:
                future = self._cache[c] = self._pool.submit(self._build, c)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise ConstraintError(f"{c.kind} constraint did not compile within {self.timeout_s:g} s "
                                  f"(--grammar-timeout)") from None

    def _tokenizer(self) -> "llguidance.LLTokenizer":
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance
                if self._source is None:
                    raise ConstraintError("constraints need the model's tokenizer; this model has none")
                self._llg_tokenizer = llguidance.LLTokenizer(self._source.inner.to_str(), n_vocab=self.vocab_size,
                                                             eos_token=self._eos)
                self._executor = llguidance.LLExecutor()
            return self._llg_tokenizer

    def _build(self, c: Constraint) -> "llguidance.LLMatcher":
        import llguidance
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_text(c), log_level=0)
        error = dead_start(matcher)
        if error:
            raise ConstraintError(f"{c.kind} constraint: {error}")
        return matcher

    def fill(self, matchers: list["llguidance.LLMatcher | None"]) -> torch.Tensor:
        """[rows, words] int32 bitmask on the host, one row per matcher (None: every token allowed),
        filled by llguidance's threads for the whole batch at once."""
        import llguidance.torch as llg_torch
        mask = llg_torch.allocate_token_bitmask(len(matchers), self.vocab_size)     # all ones: every token
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if rows:
            llg_torch.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask


def advance(matcher: "llguidance.LLMatcher", token: int) -> bool:
    """Feeds the matcher a sampled token; True when the grammar has ended (nothing but EOS may follow,
    or EOS was just taken)."""
    matcher.consume_token(token)
    return matcher.is_stopped()
