"""llguidance against xgrammar on this project's tokenizers: the measurement behind the choice of
grammar engine (engine/sample/constraints.py uses llguidance).

    python -m benchmarks.grammar_libs [--tokenizer PATH/tokenizer.json] [--steps 40]

For each vocabulary (the default model's, 49152 tokens; and a Qwen-size one of 151,646 tokens made
offline by adding 102,494 merges of the default model's tokens, since no Qwen tokenizer is
reachable here) it reports:
  compile: seconds to compile each extraction-style schema (a fresh compiler each time, no cache);
  mask:    milliseconds per step to fill the token bitmask of a batch of 64 and of 256 matchers that
           walk a valid instance token by token (the library's batch call, all cores).
Both libraries get the vocabulary as raw token bytes, so they see the same tokens. Needs
`pip install llguidance xgrammar` (xgrammar is not a dependency of the project).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from benchmarks.grammar_schemas import EXTRACTION_SCHEMAS


def default_tokenizer_json() -> str:
    from jobrunner.engine.config.engine_config import cache_root
    for p in (cache_root() / "test-reference").glob("smollm2-135m-instruct-tokenizer-*/tokenizer.json"):
        return str(p)
    raise SystemExit("no default-model tokenizer.json in the cache; run the default_model tests once")


def token_bytes(tokenizer_json: str) -> tuple[list[bytes], list[int], int, object]:
    """(bytes of each token, special ids, eos id, the tokenizers.Tokenizer) of a byte-level BPE."""
    import tokenizers

    from jobrunner.engine.load.tokenizer import bytes_to_unicode
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    back = {c: b for b, c in bytes_to_unicode().items()}
    vocab = tok.get_vocab(with_added_tokens=True)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    tokens = [b""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text.encode() if text in added else bytes(back[c] for c in text)
    special = [vocab[t] for t in added]
    return tokens, special, vocab.get("<|im_end|>", vocab.get("<|endoftext|>", 0)), tok


def qwen_size(tokens: list[bytes], size: int = 151_646, seed: int = 0) -> list[bytes]:
    """The vocabulary grown to `size` by adding concatenations of two existing non-special tokens,
    the way BPE merges grow one (ids of the original tokens unchanged)."""
    rng = random.Random(seed)
    seen, out = set(tokens), list(tokens)
    pool = [t for t in tokens[300:] if t and not t.startswith(b"<|")]
    while len(out) < size:
        t = rng.choice(pool) + rng.choice(pool)
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


class LLG:
    name = "llguidance"

    def __init__(self, tokens, special, eos):
        import llguidance
        self.llg = llguidance

        class Raw:
            eos_token_id, bos_token_id, special_token_ids = eos, None, special

            def __init__(self):
                self.tokens = tokens

            def __call__(self, s):   # only used for tokenizing grammar literals; our schemas have none
                return []

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Raw()))
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return grammar

    def matchers(self, grammar, n):
        return [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n):
        import llguidance.torch as lt
        return lt.allocate_token_bitmask(n, self.tok.vocab_size)

    def fill(self, matchers, mask):
        import llguidance.torch as lt
        lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def advance(self, matchers, tokens):
        for m, t in zip(matchers, tokens):
            assert m.consume_token(t), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, tokens, special, eos):
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=len(tokens),
                                           stop_token_ids=[eos])
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count(), cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, grammar, n):
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.info.vocab_size)

    def fill(self, matchers, mask):
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def advance(self, matchers, tokens):
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t)


def measure(lib, tok, batches: tuple[int, ...], steps: int) -> dict:
    compile_s = {}
    for name, schema in EXTRACTION_SCHEMAS.items():
        t0 = time.perf_counter()
        lib.compile(schema)
        compile_s[name] = time.perf_counter() - t0
    grammar = lib.compile(EXTRACTION_SCHEMAS["person"])
    instance = json.dumps(EXAMPLE_PERSON, separators=(",", ":"))
    ids = tok.encode(instance, add_special_tokens=False).ids[:steps]
    mask_ms = {}
    for b in batches:
        matchers, mask = lib.matchers(grammar, b), lib.bitmask(b)
        lib.fill(matchers, mask)                     # warm-up
        t = 0.0
        for token in ids:
            t0 = time.perf_counter()
            lib.fill(matchers, mask)
            t += time.perf_counter() - t0
            lib.advance(matchers, [token] * b)
        mask_ms[b] = 1000 * t / len(ids)
    return {"compile_s": compile_s, "mask_ms_per_step": mask_ms}


EXAMPLE_PERSON = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "employed": False,
                  "address": {"street": "12 St James's Square", "city": "London", "country": "UK"},
                  "skills": ["mathematics", "poetry"], "role": "engineer"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="a byte-level BPE tokenizer.json (default: the default model's)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    tokens, special, eos, tok = token_bytes(args.tokenizer or default_tokenizer_json())
    print(f"cpu cores: {os.cpu_count()}")
    for label, vocab in (("smollm2 (49152)", tokens), ("qwen-size (151646)", qwen_size(tokens))):
        for cls in (LLG, XGR):
            t0 = time.perf_counter()
            lib = cls(vocab, special, eos)
            setup = time.perf_counter() - t0
            r = measure(lib, tok, (64, 256), args.steps)
            comp = " ".join(f"{k}={v * 1000:.1f}ms" for k, v in r["compile_s"].items())
            masks = " ".join(f"batch{b}={v:.2f}ms" for b, v in r["mask_ms_per_step"].items())
            print(f"{label:20s} {cls.name:11s} tokenizer {setup:.2f}s | compile {comp} | mask/step {masks}")


if __name__ == "__main__":
    main()
