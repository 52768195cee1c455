"""Benchmark workloads: deterministic, generated here, no downloads.

Every generator takes a seed (the defaults are the ones the issues' figures use) and returns
a `Workload`: the dataset rows as `jobrunner submit` reads them, the raw prompt texts the peers
get, and each row's prompt length counted with OUR tokenizer exactly as the job tokenizes it
(raw text with the tokenizer's special tokens; or, for chat rows, the rendered chat template),
so a run can be checked against the workload token for token.

    shared_prefix(tok, n=64)                   the issue-4 workload; prefixes=1 reproduces
                                               ../shared/peers/make_cls_workload.py row for row
    shared_prefix(tok, n=64, prefixes=4)       several instruction prefixes, shuffled together
    free_generation(tok, n=64)                 64..256-token prompts; reproduces make_gen_workload.py
    rag(tok, n=16, prompt_tokens=1024)         long retrieved-context prompts, short answers
    evaluation(tok, n=64)                      sentiment reviews with a reference label
    openai_batch(tok, base, max_tokens=(a,b))  any workload above as an OpenAI Batch API file
                                               (chat messages, per-row max_tokens uniform in a..b)
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------------- the type


@dataclass
class Workload:
    name: str
    description: str
    rows: list[dict]                     # written one JSON object a line
    prompts: list[str]                   # the raw prompt text of each row (what peers get)
    prompt_tokens: list[int]             # per row, our tokenizer, as the job tokenizes it
    format: str = "jsonl"                # jsonl | openai-batch
    chat: bool = False                   # the job renders the chat template (openai-batch rows)
    max_tokens: list[int] | None = None  # per-row max_tokens carried in the rows (openai-batch)
    labels: tuple[str, ...] = ()         # classification labels, when the workload has them
    reference_column: str | None = None  # column holding the expected answer
    params: dict = field(default_factory=dict)   # the generator's arguments, for the report

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for r in self.rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        return path

    def summary(self) -> dict:
        lens = self.prompt_tokens
        return {"name": self.name, "description": self.description, "rows": self.num_rows,
                "format": self.format, "chat": self.chat, "prompt_tokens": sum(lens),
                "prompt_tokens_min": min(lens) if lens else 0, "prompt_tokens_max": max(lens) if lens else 0,
                "max_tokens_total": sum(self.max_tokens) if self.max_tokens else None,
                "labels": list(self.labels), "params": self.params}


def count_tokens(tok, prompts: list[str], chat: bool = False) -> list[int]:
    """Prompt lengths as `jobrunner submit` computes them: raw text is encoded with the
    tokenizer's special tokens; a chat prompt is the rendered template, encoded without them."""
    if chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                 for p in prompts]
        return [len(ids) for ids in tok.encode_batch(texts, add_special_tokens=False)]
    return [len(ids) for ids in tok.encode_batch(prompts, add_special_tokens=True)]


def _plain(name: str, description: str, tok, rows: list[dict], **kw) -> Workload:
    prompts = [r["prompt"] for r in rows]
    return Workload(name, description, rows, prompts, count_tokens(tok, prompts), **kw)


# ------------------------------------------------------------------- shared-prefix (issue 4)

_CLS_WORDS = ("the a movie film plot acting great terrible boring wonderful story scene character music slow fast "
              "loved hated director script ending beautiful awful funny sad long short brilliant dull").split()
_CLS_LABELS = ("positive", "negative", "neutral")
_CLS_INSTRUCTIONS = (
    "You are a sentiment classifier. Read the review and answer with exactly one word: "
    "positive, negative or neutral. Examples:\n",
    "Classify the sentiment of the film review below as positive, negative or neutral. "
    "Reply with the label only. Here are some labelled reviews:\n",
    "Task: sentiment analysis of movie reviews. Possible answers: positive, negative, neutral. "
    "Study these examples first:\n",
    "Decide whether each review is positive, negative or neutral about the film. "
    "Answer with a single lowercase word. Worked examples:\n",
    "You label customer reviews of films. Labels: positive, negative, neutral. "
    "Some reviews that were labelled before:\n",
    "Read carefully. For the review at the end, output its sentiment: positive, negative or neutral. "
    "Reference examples:\n",
)


def shared_prefix(tok, n: int = 64, prefixes: int = 1, seed: int = 7, total: int = 256) -> Workload:
    """Rows sharing a ~290-token instruction with 8 few-shot examples, each ending in a unique
    10..40-word review, shuffled. prefixes=1, seed=7: the rows of make_cls_workload.py (it makes
    256 and the benchmarks take the first n). prefixes=k: k different instructions and example
    sets; each row picks one at random, so rows of different prefixes are interleaved."""
    rng = random.Random(seed)
    if prefixes == 1:
        # Same calls, same order as make_cls_workload.py, so the same rows come out.
        sysmsg = (_CLS_INSTRUCTIONS[0] + "\n".join(
            f"Review: {' '.join(rng.choices(_CLS_WORDS, k=25))}\nSentiment: {rng.choice(list(_CLS_LABELS))}"
            for _ in range(8)))
        rows = []
        for i in range(max(total, n)):
            rows.append({"id": f"r{i:04d}",
                         "prompt": sysmsg + f"\nReview: {' '.join(rng.choices(_CLS_WORDS, k=rng.randint(10, 40)))}"
                                            f"\nSentiment:"})
        rng.shuffle(rows)
    else:
        heads = []
        for k in range(prefixes):
            intro = _CLS_INSTRUCTIONS[k % len(_CLS_INSTRUCTIONS)]
            heads.append(intro + "\n".join(
                f"Review: {' '.join(rng.choices(_CLS_WORDS, k=25))}\nSentiment: {rng.choice(list(_CLS_LABELS))}"
                for _ in range(8)))
        rows = []
        for i in range(max(total, n)):
            k = rng.randrange(prefixes)
            body = ' '.join(rng.choices(_CLS_WORDS, k=rng.randint(10, 40)))
            rows.append({"id": f"r{i:04d}", "prefix": k, "prompt": heads[k] + f"\nReview: {body}\nSentiment:"})
        rng.shuffle(rows)
    rows = rows[:n]
    name = "shared-prefix" if prefixes == 1 else f"shared-prefix-{prefixes}"
    return _plain(name, f"{n} shuffled rows sharing {prefixes} few-shot instruction prefix(es) of ~290 tokens, "
                        f"unique 10-40-word review each", tok, rows, labels=_CLS_LABELS,
                  params={"n": n, "prefixes": prefixes, "seed": seed})


# -------------------------------------------------------------- free generation (issue 2)

_GEN_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point home "
    "water room mother area money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name president team minute "
    "idea kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education").split()


def free_generation(tok, n: int = 64, min_tokens: int = 64, max_tokens: int = 256, seed: int = 11) -> Workload:
    """n prompts "Write a story about ...", each grown word by word until it is at least a
    length drawn uniformly from min_tokens..max_tokens, counted with our tokenizer (with its
    special tokens, as make_gen_workload.py counts them). Defaults reproduce that script."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target, s = rng.randint(min_tokens, max_tokens), "Write a story about"
        while len(tok.encode(s, add_special_tokens=True)) < target:
            s += " " + rng.choice(_GEN_WORDS)
        rows.append({"id": f"g{i:02d}", "prompt": s})
    return _plain("free-generation", f"{n} prompts of {min_tokens}-{max_tokens} tokens", tok, rows,
                  params={"n": n, "min_tokens": min_tokens, "max_tokens": max_tokens, "seed": seed})


# ------------------------------------------------------------------------------ RAG-like

_RAG_SUBJECTS = ("harbor", "bridge", "library", "observatory", "railway", "reservoir", "museum", "lighthouse",
                 "market", "garden", "factory", "tunnel", "airport", "stadium", "school", "hospital")
_RAG_ATTRS = ("architect", "opening year", "code name", "chief engineer", "main supplier", "founding mayor")
_RAG_NAMES = ("Alder", "Birch", "Cedar", "Dune", "Ember", "Fjord", "Garnet", "Heron", "Iris", "Juniper",
              "Kestrel", "Linden", "Marlow", "Nettle", "Onyx", "Pike", "Quill", "Rowan", "Sable", "Tamsin")


def rag(tok, n: int = 16, prompt_tokens: int = 1024, docs_per_prompt: int = 4, pool: int = 12,
        seed: int = 13) -> Workload:
    """Retrieval-augmented prompts: `docs_per_prompt` passages picked from a pool of `pool`
    synthetic documents (each holding a few facts in filler text), in retrieval order, then a
    question about one fact. Each passage is about prompt_tokens / docs_per_prompt tokens long,
    so prompts are about prompt_tokens long; the answer is one or two words (`answer` column)."""
    rng = random.Random(seed)
    per_doc = max(16, prompt_tokens // docs_per_prompt - 24)   # header and question fill the rest
    docs = []
    for d in range(pool):
        subject = f"the {rng.choice(_RAG_NAMES)} {_RAG_SUBJECTS[d % len(_RAG_SUBJECTS)]}"
        facts = {a: (str(rng.randint(1850, 2020)) if a == "opening year" else rng.choice(_RAG_NAMES))
                 for a in rng.sample(_RAG_ATTRS, 3)}
        sentences = [f"The {a} of {subject} is {v}." for a, v in facts.items()]
        text = f"{subject.capitalize()}. " + " ".join(sentences)
        while len(tok.encode(text)) < per_doc:
            filler = " ".join(rng.choices(_GEN_WORDS, k=rng.randint(6, 14)))
            text += f" Records of {subject} mention {filler}."
        docs.append((subject, facts, text))
    rows = []
    for i in range(n):
        picked = rng.sample(range(pool), docs_per_prompt)
        subject, facts, _ = docs[rng.choice(picked)]
        attr = rng.choice(sorted(facts))
        context = "\n\n".join(f"Document {j + 1}: {docs[d][2]}" for j, d in enumerate(picked))
        prompt = ("Answer the question using only the documents below. Reply with the answer alone.\n\n"
                  f"{context}\n\nQuestion: What is the {attr} of {subject}?\nAnswer:")
        rows.append({"id": f"q{i:03d}", "prompt": prompt, "answer": facts[attr]})
    return _plain("rag", f"{n} prompts of ~{prompt_tokens} tokens ({docs_per_prompt} retrieved passages each), "
                         f"short answers", tok, rows, reference_column="answer",
                  params={"n": n, "prompt_tokens": prompt_tokens, "docs_per_prompt": docs_per_prompt,
                          "pool": pool, "seed": seed})


# ------------------------------------------------------------------------------ evaluation

_POS = "wonderful brilliant moving delightful superb charming gripping beautiful funny memorable".split()
_NEG = "boring awful dull tedious clumsy lifeless predictable ugly annoying forgettable".split()
_NEUTRAL = "the film plot acting story scene character music director script ending camera".split()


def evaluation(tok, n: int = 64, seed: int = 17) -> Workload:
    """Sentiment rows with a known answer: each review mixes neutral words with positive and
    negative ones, and its `answer` is the side with more words (ties never occur). For
    `--kind classify --labels positive,negative --reference-column answer`, or generation
    with `--reference-column answer`."""
    rng = random.Random(seed)
    head = ("Is the following movie review positive or negative? Answer with one word.\n\n")
    rows = []
    for i in range(n):
        pos = rng.randint(0, 6)
        neg = rng.choice([k for k in range(7) if k != pos])
        words = rng.choices(_POS, k=pos) + rng.choices(_NEG, k=neg) + rng.choices(_NEUTRAL, k=rng.randint(6, 20))
        rng.shuffle(words)
        rows.append({"id": f"e{i:03d}", "prompt": head + f"Review: {' '.join(words)}\nSentiment:",
                     "answer": "positive" if pos > neg else "negative"})
    return _plain("evaluation", f"{n} labelled sentiment reviews (reference column `answer`)", tok, rows,
                  labels=("positive", "negative"), reference_column="answer", params={"n": n, "seed": seed})


# ------------------------------------------------------------------------------ OpenAI batch

def openai_batch(tok, base: Workload, max_tokens: tuple[int, int] = (16, 128), seed: int = 19,
                 model: str = "smollm2-135m-instruct") -> Workload:
    """`base` as an OpenAI Batch API input file: one /v1/chat/completions request per row
    (custom_id = the row id, the prompt as the user message), each with its own max_tokens drawn
    uniformly from max_tokens (output lengths uniform in a range, as nano-vllm's benchmark).
    The job renders the chat template, so prompt lengths are counted through it."""
    rng = random.Random(seed)
    rows, budgets = [], []
    for r, p in zip(base.rows, base.prompts):
        k = rng.randint(*max_tokens)
        budgets.append(k)
        rows.append({"custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": k}})
    return Workload(f"{base.name}-openai-batch", f"{base.description}; OpenAI batch file, chat messages, "
                                                  f"max_tokens uniform in {max_tokens[0]}..{max_tokens[1]}",
                    rows, list(base.prompts), count_tokens(tok, base.prompts, chat=True), format="openai-batch",
                    chat=True, max_tokens=budgets,
                    params={"base": base.name, "max_tokens": list(max_tokens), "seed": seed})


def our_tokenizer(model: str = "smollm2-135m-instruct"):
    """The tokenizer `jobrunner submit -m model` uses (reads metadata only, no weights)."""
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.models.known import resolve_model
    return load_model_bundle(resolve_model(model)).tokenizer
