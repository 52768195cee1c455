"""lm-evaluation-harness backend: lm-eval's tasks, prompts and metrics over our engine.

    lm_eval --model jobrunner --model_args pretrained=smollm2-135m-instruct,dtype=float32 --tasks hellaswag
    lm_eval.simple_evaluate(model="jobrunner", model_args="pretrained=PATH,cache=s3://bucket/cache", tasks=[...])

Model arguments are jobrunner's option names (`jobrunner submit --help`, with `_` for `-`): model
(or lm-eval's `pretrained`), dtype, quantization, device, kv_cache_memory, max_num_seqs, cache and
cache_mode (our result cache), data_parallel, tensor_parallel, threads, seed, ...; plus lm-eval's
own `max_length` (the window of loglikelihood requests and rolling perplexity; default: the model's
context less one, since the token a full window scores needs a position of its own here),
`max_gen_toks` (256) and `batch_size`, which is accepted and ignored: our engine batches by tokens
and KV memory (`max_num_seqs`, `max_batched_tokens`), as `auto` asks.

Scoring follows lm-eval's `hf` backend exactly: the token boundary between a context and its
continuation (TemplateLM: the whole text is tokenized and split at the context's length), the
prefix token before an empty context, left truncation to max_length + 1 tokens, rolling windows
(lm_eval.utils.get_rolling_token_windows), is_greedy as every continuation token being the argmax.
Each call runs as one jobrunner job of kind `tokens` (jobs/tokens.py: rows of token ids, tokenized
here as hf's backend does, so nothing is re-tokenized): the
continuations of one context are one row (the engine computes the context once and branches each
continuation off it) and the planner orders rows so that shared prefixes (few-shot examples, a
task's description) are computed once.

lm-eval 0.4 discovers no plugins: importing this module registers the name `jobrunner`, and the
`jobrunner-lm-eval.pth` file that `pip install jobrunner[eval]` puts in site-packages registers it
lazily (jobrunner_lm_eval_hook.py) whenever lm-eval's model registry loads.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections import defaultdict

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while empty)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

import jobrunner
from jobrunner.engine import load_model_bundle
from jobrunner.api.submit import build_config
from jobrunner.config.job import JobConfigError
from jobrunner.dataset import Row
from jobrunner.models.known import DEFAULT_MODEL, resolve_model
from jobrunner.output import EXTRA_JSON, read_results, stored_values

log = logging.getLogger("jobrunner.lm_eval")

DEFAULT_MAX_GEN_TOKS = 256          # as lm-eval's hf backend


@register_model("jobrunner")
class JobrunnerLM(TemplateLM):
    def __init__(self, pretrained: str | None = None, model: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, batch_size=None, max_batch_size=None,
                 device: str | None = None, add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 **options):
        super().__init__()
        name = model or pretrained or DEFAULT_MODEL
        try:
            self.jobs = _Jobs({**options, "model": name, "device": _device(device)})
        except JobConfigError:
            _one_line_if_uncaught()
            raise
        self.tok, context = self.jobs.tokenizer_and_context()
        self.pretrained = name
        self._max_length = int(max_length) if max_length else context - 1
        if self._max_length + 1 > context:
            raise ValueError(f"max_length {self._max_length} leaves no position for the scored token: the "
                             f"model's context is {context}; give max_length <= {context - 1}")
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        if batch_size not in (None, "auto") or max_batch_size is not None:
            log.info("batch_size %s ignored: the engine batches by tokens and KV memory (max_num_seqs, "
                     "max_batched_tokens)", batch_size)

    # --- what lm-eval asks of a model ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tok.special_tokens.get("eos_token") if hasattr(self.tok, "special_tokens") else None
        found = self.tok.token_to_id(eos) if eos and hasattr(self.tok, "token_to_id") else None
        return found if found is not None else self.tok.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """Before an empty context: as hf's, the BOS token, else the end-of-text token."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return "jobrunner:" + self.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """As hf's: without a generation prompt the last (assistant) message is continued, not closed."""
        text = self.tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt and chat_history:
            # transformers' continue_final_message: cut the rendering after the final message's content
            final = chat_history[-1]["content"].strip()
            if final and final in text:
                text = text[:text.rindex(final) + len(final)]
        return text

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As hf's: the tokenizer's special tokens unless told (add_bos_token), none before a BOS already there."""
        if add_special_tokens is None:
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            bos = self.tok.decode([self.prefix_token_id], skip_special_tokens=False)
            if bos and string.startswith(bos):
                add_special_tokens = False
        return self.tok.encode(string, add_special_tokens=add_special_tokens)

    # --- the three request types ----------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids). One row per distinct
        context (after truncation), all of them one job."""
        rows, where = {}, []
        for _, context, continuation in requests:
            context = _truncated(list(context), list(continuation), self._max_length)
            row = rows.setdefault(tuple(context), {"context_ids": context, "continuation_ids": []})
            where.append((tuple(context), len(row["continuation_ids"])))
            row["continuation_ids"].append(list(continuation))
        keys = list(rows)
        for i, key in enumerate(keys):
            rows[key]["id"] = str(i)
        results = dict(zip(keys, self.jobs.run([rows[k] for k in keys], kind="tokens")))
        out = []
        for key, j in where:
            res = results[key]
            if res.get("error"):
                raise RuntimeError(f"jobrunner could not score a request: {res['error']}")
            out.append((float(res["continuation_logprobs"][j]), bool(res["continuation_greedy"][j])))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood over lm-eval's disjoint rolling windows of max_length tokens."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, pred in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append(((None, None), context, pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One job per distinct gen_kwargs (a task's); contexts left-truncated to max_length - max_gen_toks,
        stops and max_gen_toks as hf's, then each output cut at its first stop string."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        eos = self.tok.decode([self.eot_token_id], skip_special_tokens=False)
        texts = [""] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            keep = self._max_length - int(kwargs["max_gen_toks"])
            if keep < 1:
                raise ValueError(f"max_gen_toks {kwargs['max_gen_toks']} leaves no room for a context in "
                                 f"max_length {self._max_length}")
            rows = [{"id": str(i),
                     "context_ids": (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-keep:]}
                    for i in indices]
            results = self.jobs.run(rows, **_sampling(kwargs, until))
            for i, res in zip(indices, results):
                if res.get("error"):
                    raise RuntimeError(f"jobrunner could not generate for request {i}: {res['error']}")
                text = res.get("output") or ""
                for term in until:
                    if term:
                        text = text.split(term)[0]
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def get_model_info(self) -> dict:
        return {"model_source": "jobrunner", "model_name": self.pretrained}


def _truncated(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The context hf's backend feeds: (context + continuation) keeps its last max_length + 1 tokens."""
    keep = max_length + 1 - len(continuation)
    if keep < 1:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length {max_length}")
    return context[-keep:]


def _sampling(kwargs: dict, until: list[str]) -> dict:
    """lm-eval's generation kwargs as our options; every sampling option set, so none comes from the
    checkpoint's generation_config.json (hf's backend passes its own, too)."""
    sampling = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0) or 0) > 0
    options = {"kind": "tokens", "max_tokens": int(kwargs["max_gen_toks"]), "stop": until,
               "temperature": float(kwargs.get("temperature", 1.0)) if sampling else 0.0,
               "top_p": float(kwargs.get("top_p") or 1.0) if sampling else 1.0,
               "top_k": int(kwargs.get("top_k") or 0) if sampling else 0}
    if kwargs.get("seed") is not None:
        options["seed"] = int(kwargs["seed"])
    return options


LM_EVAL_DEFAULT_DEVICE = "cuda:0"      # what lm-eval passes when no --device was given (EvaluatorConfig)


def _device(device: str | None) -> str | None:
    """lm-eval's --device as ours; a CUDA device on a machine without one: auto. lm-eval's own default
    (cuda:0, passed when the user named none) goes quietly: on a CPU machine a warning of it says nothing."""
    if device and device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            if device != LM_EVAL_DEFAULT_DEVICE:
                log.warning("device %s is not available here; jobrunner picks the device (auto)", device)
            return None
    return device


def _one_line_if_uncaught() -> None:
    """A bad --model_args value that nothing catches (the lm_eval command) ends the process with its one line,
    not a traceback around it; a caller that catches the JobConfigError sees no difference."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, JobConfigError):
            print(f"error: --model_args: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)
    sys.excepthook = hook


class _Jobs:
    """The one place this backend meets jobrunner: rows in, result rows (dicts of values, input order)
    out, through the public API (an engine session's run_rows, jobrunner.open_engine, opened at the
    first in-process job and held while the model object lives; or jobrunner.submit for data-parallel
    workers)."""

    def __init__(self, options: dict):
        self.options = {k: v for k, v in options.items() if v is not None}
        build_config("memory://lm-eval.jsonl", self.options)     # unknown or bad options: now (JobConfigError)
        self.session = None         # jobrunner.EngineSession: closed when collected with this object

    def tokenizer_and_context(self):
        """The model's tokenizer and context length, without loading its weights."""
        bundle = load_model_bundle(resolve_model(self.options["model"]))
        return bundle.tokenizer, bundle.config.max_position_embeddings

    def run(self, rows: list[dict], **job_options) -> list[dict]:
        """rows: the tokens kind's ({"id": a str, "context_ids": [...], ...}); their result rows in the
        same order, each value as the kind made it (continuation_logprobs a list of floats, output a str)."""
        options = {**self.options, **job_options}
        if not rows:
            return []
        if int(options.get("data_parallel") or 1) != 1:
            return _submit(rows, options)
        if self.session is None:
            self.session = jobrunner.open_engine(**self.options)
        # in this process the rows go to the job as Rows: no file, no text, nothing tokenized again
        given = [Row(index=i, id=row["id"], data=row, id_value=row["id"]) for i, row in enumerate(rows)]
        return self.session.run_rows(given, **job_options)


def _submit(rows: list[dict], options: dict) -> list[dict]:
    """A data-parallel job over files in a temporary directory: its worker processes each read the
    dataset, so these rows go to them as a JSONL file (the one round trip left), and their results are
    read back from the parts as values (stored_values: JSON cells decoded)."""
    with tempfile.TemporaryDirectory(prefix="jobrunner-lm-eval-") as tmp:
        dataset = os.path.join(tmp, "requests.jsonl")
        with open(dataset, "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
        result = jobrunner.submit(dataset, os.path.join(tmp, "out"), **options)
        if result.exit_code != 0:
            raise RuntimeError(f"jobrunner job failed (exit {result.exit_code}): {result.error}")
        by_id = {str(r["id"]): r for r in _stored_rows(read_results(result.output))}
    return [by_id[row["id"]] for row in rows]


def _stored_rows(table) -> list[dict]:
    """A results table's rows with their values as the kind made them (as EngineSession.run_rows gives)."""
    columns = {name: stored_values(table, name) for name in table.column_names if name != EXTRA_JSON}
    return [dict(zip(columns, values)) for values in zip(*columns.values())]
