"""The options of `submit` and `validate`, in the sections their help shows.

Defaults come from JobConfig's sections (jobrunner/config/sections.py); `--config job.toml` supplies any option, and the command line wins.
"""
from __future__ import annotations

from types import SimpleNamespace

import click

from jobrunner.engine import SPECULATIVE_MODES
from jobrunner.config.job import CACHE_MODES, FORMATS, KINDS, KV_CACHE_DTYPES, MATCH_MODES, NORMALIZE_MODES, OUTPUT_FORMATS, JOB_QUANTIZATIONS, POOLINGS, option_defaults
from jobrunner.config.ray import RayOptions
from jobrunner.jobs.reasoning import REASONING_PARSERS
from jobrunner.jobs.schema_check import SCHEMA_MODES
from jobrunner.jobs.tool_parsers import TOOL_PARSERS
from jobrunner.jobs.truncation import TRUNCATE_MODES

D = SimpleNamespace(**option_defaults())    # the defaults, read from the config's sections
R = RayOptions()                            # --ray-*'s defaults

# Section title -> its options, in the order `--help` lists them; "Other" takes any option not here.
OPTION_GROUPS: dict[str, list] = {
    "Input": [
        click.option("--format", "format", type=click.Choice(FORMATS), default=D.format, show_default=True,
                     help="Input format; auto: from the file extension (a JSONL of OpenAI batch requests is "
                          "openai-batch)."),
        click.option("--id-column", default=D.id_column, show_default=True, help="Row id column; else the row number."),
        click.option("--prompt-column", default=D.prompt_column, show_default=True,
                     help="Column holding each row's prompt text."),
        click.option("--messages-column", help="Column holding a chat messages list [{role, content}, ...] "
                                               "(always rendered through the chat template)."),
        click.option("--image-column", help="Column holding each row's images, put in its user message before the "
                                            "prompt (or in a --messages-column's {\"type\": \"image\"} parts): "
                                            "Hugging Face image structs {bytes, path}, bytes, paths (relative to "
                                            "the dataset's folder) or URLs (http(s), data:, any fsspec URL), or "
                                            "a list of them."),
        click.option("--max-image-pixels", type=int, default=D.max_image_pixels, show_default=True,
                     help="An image of more pixels fails its row (decompression bombs)."),
        click.option("--max-image-bytes", type=int, default=D.max_image_bytes, show_default=True,
                     help="An encoded image (a file, a download) of more bytes fails its row."),
        click.option("--image-timeout", type=float, default=D.image_timeout, show_default=True,
                     help="Seconds one download of an http(s) image may take, all of it (connect, redirects, "
                          "body: a server trickling bytes is cut there); tried 3 times."),
        click.option("--image-hosts", multiple=True,
                     help="Only these hosts serve http(s) images (repeatable; a name, an address or a pattern "
                          "such as *.example.com); default: any public host."),
        click.option("--image-allow-private", is_flag=True, default=None,
                     help="Fetch http(s) images from private hosts too (loopback, 10/8, 172.16/12, 192.168/16, "
                          "100.64/10, link-local, fc00::/7); cloud metadata addresses never."),
        click.option("--image-root", multiple=True,
                     help="A folder or store prefix (s3://bucket/prefix) image paths may be read from, past the "
                          "dataset's own folder (repeatable); other paths fail their row."),
        click.option("--served-model-name", multiple=True,
                     help="OpenAI batch: another name a line's body.model may give the model (repeatable); a "
                          "line naming none of the model's names is an error line."),
        click.option("--any-model", is_flag=True, default=None,
                     help="OpenAI batch: serve every line whatever model its body names (a file written for "
                          "another provider)."),
        click.option("--limit", type=int, help="Only the first N rows."),
        click.option("--max-row-bytes", type=int, default=D.max_row_bytes, show_default=True,
                     help="A dataset line (JSONL), record (CSV) or row (Parquet) of more bytes is an error row, "
                          "read through without being held; the job goes on."),
        click.option("--csv-max-lines", type=int, default=D.csv_max_lines, show_default=True,
                     help="CSV: a record over more lines than this is an unclosed quote (exit 2, naming its line)."),
        click.option("--csv-delimiter",
                     help="CSV: the field delimiter (one character, e.g. ';'); default: a tab for .tsv, else "
                          "sniffed from the header line (, ; tab |)."),
        click.option("--config", "config_file", type=click.Path(dir_okay=False),
                     help="TOML job file; any option by name (e.g. max_tokens = 64); the command line wins."),
    ],
    "Prompt": [
        click.option("--template", help="Prompt template filled from columns: {column}; {{ and }} are braces; "
                                        "\\n, \\t and \\\\ are a newline, a tab and a backslash, here as in TOML. "
                                        'E.g. "Review: {text}\\nSentiment:".'),
        click.option("--system", help="System prompt for every row (same escapes as --template); without the chat "
                                      "template it goes before the prompt and a blank line."),
        click.option("--chat/--no-chat", default=None,
                     help="Render plain prompts through the model's chat template. Default by kind: generate "
                          "does when the model has one; classify and score use raw text (as lm-eval and vLLM's "
                          "prompt logprobs do). Messages always use it."),
        click.option("--chat-template-kwargs", help='Extra chat template variables, a JSON object, e.g. '
                                                    '\'{"enable_thinking": false}\' for Qwen3.'),
        click.option("--truncate-prompt", type=click.Choice(TRUNCATE_MODES), default=D.truncate_prompt,
                     show_default=True, help="A prompt that leaves no room for --max-tokens in the context: cut "
                                             "its start (left) or its end (right), counted in `truncated_tokens`; "
                                             "none: a prompt longer than the context fails its row."),
        click.option("--show-prompt", is_flag=True, default=False,
                     help="submit: log the first row's rendered prompt (the text the tokenizer gets)."),
    ],
    "Generation": [
        click.option("--max-tokens", type=int, default=D.max_tokens, show_default=True,
                     help="Tokens to generate at most per sample."),
        click.option("--temperature", type=float,
                     help="Sampling temperature; 0 is greedy. Default, for this and the next three: the model's "
                          "generation_config.json value, else 0 (top-p 1, top-k 0, min-p 0); the manifest says "
                          "which."),
        click.option("--top-p", type=float,
                     help="Nucleus sampling: keep the smallest set of tokens with this much probability."),
        click.option("--top-k", type=int, help="Keep the k most likely tokens; 0 keeps all."),
        click.option("--min-p", type=float, help="Drop tokens less likely than this fraction of the most likely one."),
        click.option("--seed", type=int, help="Sampling seed (per row, so outputs don't depend on batching)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=False, help="Generate max-tokens even past end-of-sequence."),
        click.option("--n", type=int, default=D.n, show_default=True, help="Samples per prompt (rows get sample_index)."),
        click.option("--presence-penalty", type=float, default=D.presence_penalty, show_default=True,
                     help="OpenAI's: lower the logit of every token already generated by this (-2..2)."),
        click.option("--frequency-penalty", type=float, default=D.frequency_penalty, show_default=True,
                     help="OpenAI's: lower a token's logit by this times its count in the output (-2..2)."),
        click.option("--repetition-penalty", type=float, default=D.repetition_penalty, show_default=True,
                     help="transformers': divide (multiply, if negative) the logits of tokens in the prompt or "
                          "output by this; 1 is off."),
        click.option("--min-tokens", type=int, default=D.min_tokens, show_default=True,
                     help="Generate at least this many tokens before end-of-sequence or a stop may end a sample."),
        click.option("--logprobs", is_flag=True, default=False,
                     help="A `logprobs` column: each generated token with its logprob and bytes."),
        click.option("--top-logprobs", type=int, default=D.top_logprobs, show_default=True,
                     help="And each token's k most likely alternatives (0..20; implies --logprobs)."),
        click.option("--reasoning-parser", type=click.Choice(tuple(REASONING_PARSERS)),
                     help="A reasoning model's <think>...</think>: `reasoning` and `reasoning_tokens` columns, "
                          "the answer alone in `output`."),
    ],
    "Job kind": [
        click.option("--kind", type=click.Choice(tuple(KINDS)), default=D.kind, show_default=True,
                     help="generate text, classify by label scoring, score a completion's log-likelihood, "
                          "embed each prompt as a vector, or run rows of token ids (tokens: context_ids and "
                          "continuation_ids, as the lm-eval backend sends them)."),
        click.option("--labels", help="classify: comma-separated labels, e.g. positive,negative,neutral."),
        click.option("--labels-column", help="classify: column with each row's list of labels."),
        click.option("--normalize", type=click.Choice(NORMALIZE_MODES), default=D.normalize, show_default=True,
                     help="classify: sum or per-token mean of a label's logprobs."),
        click.option("--label-delimiter", default=D.label_delimiter, show_default=True,
                     help="classify: text between the prompt and each label, as lm-eval's target_delimiter; "
                          "left out when the prompt already ends in whitespace, or under the chat template "
                          "(the label is the assistant's reply). \"\" scores labels right after the prompt."),
        click.option("--reference-column", help="Evaluate against this column: per-row `correct`, summary accuracy."),
        click.option("--match", type=click.Choice(MATCH_MODES), default=D.match,
                     show_default=True, help="How an output is compared with --reference-column."),
        click.option("--score-column", help="score: the column whose log-likelihood after the prompt is measured."),
        click.option("--pooling", type=click.Choice(POOLINGS),
                     help="embed: the last token's, the mean or the first (cls) token's final hidden state "
                          "(default: the checkpoint's sentence-transformers pooling, else last)."),
        click.option("--normalize-embeddings/--no-normalize-embeddings", default=None,
                     help="embed: scale vectors to unit L2 norm (default: as the checkpoint says, else yes)."),
        click.option("--dimensions", type=int,
                     help="embed: keep the first N values (Matryoshka models), then normalize."),
    ],
    "Structured output": [
        click.option("--json-schema", help="Every output is JSON valid under this schema: the schema's JSON text, "
                                           "or a file (path or URL)."),
        click.option("--json", is_flag=True, default=False, help="Every output is a JSON object."),
        click.option("--regex", help="Every output fully matches this regular expression."),
        click.option("--choice", help="Every output is exactly one of these comma-separated strings (generated; "
                                      "--kind classify scores labels instead)."),
        click.option("--grammar", help="Every output follows this grammar file (Lark, or GBNF-style EBNF)."),
        click.option("--schema-column", help="Column holding each row's JSON schema (text or object)."),
        click.option("--json-schema-mode", type=click.Choice(SCHEMA_MODES), default=D.json_schema_mode,
                     show_default=True, help="strict: a schema with keywords the grammar cannot enforce is refused; "
                                             "validate: enforce what it can, then check each output against the "
                                             "whole schema (`schema_valid` column)."),
        click.option("--grammar-timeout", type=float, default=D.grammar_timeout, show_default=True,
                     help="Seconds a constraint may take to compile; a row's that takes longer is an error row."),
    ],
    "Tool calls": [
        click.option("--tools", help="Function tools offered to every row through the chat template: a JSON list "
                                     '[{"type": "function", "function": {"name", "parameters"}}], or a file of one '
                                     "(an OpenAI line's own `tools` win)."),
        click.option("--tool-choice", help="none | auto (default: the model decides; its calls parsed into "
                                           "`tool_calls`) | required | a function's name (both enforced by a "
                                           "grammar: the arguments validate)."),
        click.option("--tool-call-parser", type=click.Choice(tuple(TOOL_PARSERS)),
                     help="How the model writes tool calls (default: from its chat template: <tool_call> is "
                          "hermes, [TOOL_CALLS] mistral, Llama 3's JSON llama3_json)."),
    ],
    "Output": [
        click.option("-o", "--output", help="Output directory URL (default: the dataset's path + .results, "
                                            "e.g. x.csv -> x.csv.results). Rows come in completion order, "
                                            "not input order: join on id."),
        click.option("--output-format", type=click.Choice(OUTPUT_FORMATS), default=D.output_format,
                     show_default=True, help="openai-batch also writes an OpenAI Batch API output file."),
        click.option("--part-rows", type=int, default=D.part_rows, show_default=True, help="Rows per output part."),
        click.option("--flush-seconds", type=float, default=D.flush_seconds, show_default=True,
                     help="Write a part at least this often, so a kill loses at most this much finished work."),
        click.option("--overwrite", is_flag=True, default=False,
                     help="Replace an existing jobrunner output (never a directory that is not one)."),
        click.option("--max-error-rate", type=float, help="Fail (exit 3) when more than this fraction of rows failed."),
        click.option("--fail-on-empty", is_flag=True, default=False,
                     help="Exit 2 when the dataset has no rows (else 0, with a warning)."),
        click.option("--allow-all-failed", is_flag=True, default=False,
                     help="Exit 0 when every row failed (else 3: a job in which no row succeeded is a failure)."),
        click.option("--device-hourly-cost", type=float, help="USD per device-hour, for cost figures."),
        click.option("--lease-optional", is_flag=True, default=False,
                     help="Run without the output's lease when the store refuses it for a reason other than "
                          "another job holding it (else exit 4); a second job on the output is then not stopped."),
    ],
    "Model and engine": [
        click.option("-m", "--model", default=D.model, show_default=True,
                     help="Known model name, Hugging Face Hub name (org/name[@revision]; HF_TOKEN, "
                          "HF_HUB_OFFLINE and the HF cache apply), local HF directory, .gguf file, fsspec URL, "
                          "or dummy:<config>."),
        click.option("--device", default=D.device, show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option("--dtype", default=D.dtype, show_default=True, help="auto, float32, float16, bfloat16."),
        click.option("--quantization", type=click.Choice(JOB_QUANTIZATIONS),
                     default=D.quantization, show_default=True,
                     help="Weight quantization (w8a8, w4a8: CPU speed modes, int8 activations; fp8: sm_89+ GPUs; auto: the fastest mode "
                          "within 1% of float32's perplexity on this machine, e.g. bfloat16 on AMX CPUs; a GPU keeps "
                          "the model's 16-bit dtype)."),
        click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default=D.kv_cache_dtype,
                     show_default=True, help="KV cache storage; int8 and fp8 store it in 8 bits, so more rows fit."),
        click.option("--kv-cache-memory", help="KV cache size, e.g. 64MB or 8GiB (default: 2GiB on CPU, "
                                               "a share of free GPU memory)."),
        click.option("--block-size", type=int, default=D.block_size, show_default=True,
                     help="Tokens per KV cache block."),
        click.option("--max-num-seqs", type=int, help="Sequences in flight at once (default: 256 on CPU, 1024 on a GPU)."),
        click.option("--max-batched-tokens", type=int,
                     help="Tokens a step computes at most (default: 2048 on CPU, 8192 on a GPU)."),
        click.option("--plan/--no-plan", default=D.plan, show_default=True,
                     help="Order rows so shared prefixes run back to back."),
        click.option("--prefix-cache/--no-prefix-cache", default=D.prefix_cache, show_default=True,
                     help="Reuse the KV cache of prompt prefixes already computed."),
        click.option("--cuda-graphs/--no-cuda-graphs", default=D.cuda_graphs, show_default=True,
                     help="On a GPU, replay captured CUDA graphs for decode steps."),
        click.option("--async-scheduling/--no-async-scheduling", default=D.async_scheduling, show_default=True,
                     help="Schedule and prepare each step while the one before runs on the device."),
        click.option("--packed-weights/--no-packed-weights", default=D.packed_weights, show_default=True,
                     help="On CPU, run float32 and bfloat16 linears on oneDNN over weights packed once at "
                          "load (float32: 1.6-1.7x a job's speed on an AVX-512 EPYC; its last bits differ "
                          "from F.linear's)."),
        click.option("--speculative", type=click.Choice(SPECULATIVE_MODES), default=D.speculative, show_default=True,
                     help="Speculative decoding: each row drafts tokens from its own prompt and output (n-gram "
                          "lookup) or, with draft, from --draft-model, and one step verifies them; the same "
                          "tokens as without. auto: only where the measured acceptance pays for the verify cost "
                          "at the batch size (the tail of a job, outputs that copy their prompt)."),
        click.option("--draft-model", help="With --speculative draft (or auto: where it pays): a smaller model with "
                                            "the same vocabulary that drafts each row's next tokens (named as "
                                            "--model names one)."),
        click.option("--speculative-tokens", type=int, default=D.speculative_tokens, show_default=True,
                     help="Drafted tokens a row verifies a step, at most (1-16)."),
        click.option("--deterministic/--no-deterministic", default=D.deterministic, show_default=True,
                     help="Batch-invariant results (CPU): a row's tokens, logprobs, scores and embeddings are "
                          "bit-identical whatever else is in its batch, however prompts are chunked or cached, "
                          "and at any --threads (costs speed: docs/guides/performance.md)."),
        click.option("--threads", type=int, help="CPU compute threads of an engine, shared by its --tensor-parallel "
                                                 "processes (default: the cores no other process is busy on at "
                                                 "start; a thread waiting for a busy core stalls all)."),
    ],
    "Reuse": [
        click.option("--dedup/--no-dedup", default=D.dedup, show_default=True,
                     help="Compute identical rows (same request, deterministic) once; copies get the result."),
        click.option("--cache", help="Result cache URL (a directory or any fsspec URL), shared across runs "
                                     "and jobs; default $JOBRUNNER_CACHE_URL. Rows sampled without a seed "
                                     "are never cached."),
        click.option("--cache-mode", type=click.Choice(CACHE_MODES), default=D.cache_mode, show_default=True,
                     help="read-only: never store; write-only: never serve; refresh: recompute and replace."),
    ],
    "LoRA": [
        click.option("--lora", multiple=True, metavar="NAME=PATH",
                     help="A LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors): a "
                          "directory, fsspec URL or Hub name (repeatable; TOML: lora = {name = \"path\"}). Rows "
                          "of every adapter and of the base model share each batch; the model loads once."),
        click.option("--lora-column", help="Column naming each row's adapter (null: the base model; another name: "
                                           "an error row). An OpenAI batch line names its adapter in body.model."),
        click.option("--max-loras", type=int,
                     help="Adapters resident on the device at once (default: all); rows of the others wait."),
    ],
    "Parallel": [
        click.option("--data-parallel", type=int,
                     help="Worker processes, each with its own engine (default: visible GPUs // "
                          "--tensor-parallel; 1 on CPU)."),
        click.option("--tensor-parallel", type=int, default=D.tensor_parallel, show_default=True,
                     help="Devices one engine spans, its model split across them (for a model larger than one "
                          "GPU); its processes share --threads on CPU. With --data-parallel M: M x N devices."),
    ],
    # the parallel section's one `ray` option, a RayOptions (jobrunner/config/ray.py): cli.build_config folds
    # these into it (ray_options.fold_cli), the value TOML `ray` and the API's `ray=` give; defaults: RayOptions'
    "Ray": [
        click.option("--ray", "ray", is_flag=False, flag_value="auto", metavar="[ADDRESS]",
                     help="Run the workers as Ray actors on a Ray cluster: auto (the default value) joins the "
                          "cluster this process runs in, ray://head:10001 connects as a client, host:port to "
                          "a head, local starts a private one-node cluster. --data-parallel is then the most "
                          "workers."),
        click.option("--ray-min-workers", type=int,
                     help=f"Exit 2 unless this many workers are placed within --ray-timeout (default {R.min_workers})."),
        click.option("--ray-max-workers", type=int,
                     help="Workers at most (default --data-parallel, else the cluster's GPUs // "
                          "--tensor-parallel, else 1); workers placed late join the job."),
        click.option("--ray-resources", metavar="JSON",
                     help='Each worker\'s resources, a JSON object: CPU, GPU, memory (bytes) and custom '
                          'resources, e.g. \'{"CPU": 4, "accelerator_type:A100": 0.001}\'. Default: '
                          '--tensor-parallel GPUs on a GPU cluster, --threads (else 1) CPUs.'),
        click.option("--ray-timeout", type=float,
                     help=f"Seconds to wait for the first workers to be placed and loaded (default {R.timeout_s:g})."),
        click.option("--ray-max-restarts", type=int,
                     help=f"Times Ray restarts a dead worker's actor (default {R.max_restarts}); its units go to the others "
                          "meanwhile."),
    ],
}


def _names(options: list) -> tuple[str, ...]:
    """The parameter names a list of click.option decorators declares."""
    def probe():
        pass
    for opt in options:
        opt(probe)
    return tuple(p.name for p in probe.__click_params__)


SECTIONS = {title: _names(opts) for title, opts in OPTION_GROUPS.items()}


def job_options(f):
    """Every job option, then --verbose."""
    return some_job_options()(f)


def some_job_options(only: frozenset[str] | None = None, hidden: frozenset[str] = frozenset()):
    """A decorator: the job options named in `only` (None: every one), then --verbose; those in `hidden` are
    accepted but left out of --help (a command that ignores them, given the submit command's options)."""
    def decorate(f):
        opts = [o for group in OPTION_GROUPS.values() for o in group
                if only is None or _names([o])[0] in only]
        opts.append(click.option("-v", "--verbose", is_flag=True, help="Debug logging."))
        for opt in reversed(opts):
            f = opt(f)
        for param in f.__click_params__:
            param.hidden = param.name in hidden
        return f
    return decorate


class GroupedCommand(click.Command):
    """A command whose help lists its options in the sections of OPTION_GROUPS."""

    def format_options(self, ctx, formatter):
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        left = {name: rec for name, rec in records.items() if rec}     # shrinks as sections take options
        for title, names in [*SECTIONS.items(), ("Other", tuple(left))]:
            rows = [left.pop(n) for n in names if n in left]
            if rows:
                with formatter.section(f"{title} options"):
                    formatter.write_dl(rows)


