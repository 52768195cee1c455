"""Benchmark suites: our runner against its peers on the same workloads, side by side.

    python -m benchmarks run --suite smoke      # tiny sizes, a minute or few; every figure checked
    python -m benchmarks run --suite cpu        # the issues' workloads at their real sizes (~15+ min on 2 cores)
    python -m benchmarks run --suite scaling    # how jobrunner's wall grows with rows, lengths, batch size
    python -m benchmarks report benchmarks/results/cpu-<stamp>.json     # re-render table and plots

Each case runs `jobrunner submit` (what users run) and, where the suite says so, the ablation
(the same command with --no-plan --no-prefix-cache), HF transformers batched generate (float32)
and llama.cpp (only when llama-cpp-python imports; else the result says it was skipped). The
JSON result (figures, machine, versions, commit, whether the machine was loaded), a Markdown
table and PNG plots (with matplotlib) go to benchmarks/results/; job outputs and logs to
benchmarks/results/tmp/ (not committed). Exit status 1 when a run failed or a figure is missing
or inconsistent with its workload (token counts, rows); speeds are reported, never checked.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import report
from benchmarks import workloads as W
from benchmarks.peers import run_jobrunner, run_llamacpp, run_transformers

RESULTS = Path(__file__).resolve().parent / "results"
ABLATION = ("--no-plan", "--no-prefix-cache")
ABLATION_LABEL = "jobrunner --no-plan --no-prefix-cache"


@dataclass
class Case:
    name: str
    workload: W.Workload
    kind: str = "generate"                  # generate | classify
    max_tokens: int = 16                    # generate: new tokens a row (ignore_eos); openai rows carry their own
    systems: tuple[str, ...] = ("jobrunner",)   # jobrunner, ablation, transformers, llamacpp
    hf_batch: int = 16
    reference: bool = False                 # pass the workload's reference column (evaluation)
    compare_with: str | None = None         # classify: the generate case whose rows/s it is compared with
    scaling: dict | None = None             # {"axis": ..., "value": ...} for the scaling plots
    extra_args: tuple[str, ...] = ()
    targets: dict = field(default_factory=dict)   # issue targets, reported (never checked)

    def expected_completion_tokens(self) -> int:
        if self.kind == "classify":
            return 0
        if self.workload.max_tokens:
            return sum(self.workload.max_tokens)
        return self.workload.num_rows * self.max_tokens


# ------------------------------------------------------------------------------ suites

def suite_cases(suite: str, tok) -> list[Case]:
    if suite == "smoke":
        cls = W.shared_prefix(tok, n=4)
        gen = W.free_generation(tok, n=4, min_tokens=16, max_tokens=32)
        return [
            Case("shared-prefix/generate", cls, max_tokens=4, systems=("jobrunner", "ablation", "transformers",
                                                                       "llamacpp"), hf_batch=4),
            Case("shared-prefix/classify", cls, kind="classify", systems=("jobrunner", "transformers"),
                 hf_batch=4, compare_with="shared-prefix/generate"),
            Case("free-generation", gen, max_tokens=4),
            Case("rag", W.rag(tok, n=2, prompt_tokens=128, docs_per_prompt=2, pool=3), max_tokens=4),
            Case("evaluation/classify", W.evaluation(tok, n=4), kind="classify", reference=True),
            Case("openai-batch", W.openai_batch(tok, gen, max_tokens=(2, 4))),
        ]
    if suite == "cpu":
        cls = W.shared_prefix(tok, n=64)
        gen = W.free_generation(tok, n=64)
        return [
            Case("shared-prefix/generate", cls, max_tokens=16,
                 systems=("jobrunner", "ablation", "transformers", "llamacpp"), hf_batch=16,
                 targets={"wall_s": 9.5, "transformers": 5.0, ABLATION_LABEL: 4.0, "llama.cpp": 1.6}),
            Case("shared-prefix/classify", cls, kind="classify", systems=("jobrunner", "ablation", "transformers"),
                 hf_batch=16, compare_with="shared-prefix/generate"),
            Case("free-generation", gen, max_tokens=128,
                 systems=("jobrunner", "ablation", "transformers", "llamacpp"), hf_batch=64,
                 targets={"wall_s": 44.0, "transformers": 2.0, "llama.cpp": 2.0}),
            Case("shared-prefix-4/generate", W.shared_prefix(tok, n=64, prefixes=4), max_tokens=16,
                 systems=("jobrunner", "ablation")),
            Case("rag", W.rag(tok, n=16), max_tokens=16, systems=("jobrunner", "transformers"), hf_batch=16),
            Case("evaluation/classify", W.evaluation(tok, n=64), kind="classify", reference=True),
            Case("openai-batch", W.openai_batch(tok, W.free_generation(tok, n=16), max_tokens=(16, 128))),
        ]
    if suite == "scaling":
        cases = []
        for rows in (8, 16, 32, 64):
            cases.append(Case(f"rows={rows}", W.free_generation(tok, n=rows), max_tokens=32,
                              scaling={"axis": "rows", "value": rows}))
        for out in (16, 32, 64, 128):
            cases.append(Case(f"output={out}", W.free_generation(tok, n=16), max_tokens=out,
                              scaling={"axis": "output tokens", "value": out}))
        for plen in (64, 256, 1024):
            cases.append(Case(f"prompt={plen}", W.free_generation(tok, n=16, min_tokens=plen, max_tokens=plen),
                              max_tokens=16, scaling={"axis": "prompt tokens", "value": plen}))
        for seqs in (1, 4, 16, 64):
            cases.append(Case(f"max-num-seqs={seqs}", W.free_generation(tok, n=64), max_tokens=16,
                              extra_args=("--max-num-seqs", str(seqs)),
                              scaling={"axis": "batch size (max-num-seqs)", "value": seqs}))
        return cases
    raise SystemExit(f"unknown suite {suite!r}: smoke, cpu or scaling")


# ------------------------------------------------------------------------------ running

def jobrunner_args(case: Case, model: str) -> list[str]:
    w = case.workload
    args = ["-m", model]
    if w.format == "openai-batch":
        args += ["--format", "openai-batch"]
    args += ["--chat"] if w.chat else ["--no-chat"]
    if case.kind == "classify":
        args += ["--kind", "classify", "--labels", ",".join(w.labels)]
    else:
        args += ["--max-tokens", str(case.max_tokens), "--ignore-eos"]
    if case.reference and w.reference_column:
        args += ["--reference-column", w.reference_column]
    return args + list(case.extra_args)


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind `model`, for the peers that read one (None: not a GGUF model)."""
    if model.endswith(".gguf"):
        return Path(model)
    from jobrunner.models import known as models
    if model in models.KNOWN_MODELS:
        return Path(models.pull(model))
    return None


def thread_env(threads: int | None) -> dict:
    """Environment that caps every system's compute threads alike (torch reads OMP_NUM_THREADS)."""
    if not threads:
        return {}
    return {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def _run_transformers_peer(case: Case, args, data: Path, workdir: Path, slug: str, env: dict) -> dict:
    w = case.workload
    gguf = gguf_path(args.model)
    if args.no_transformers:
        return {"system": "transformers", "skipped": "--no-transformers"}
    if w.format != "jsonl" or gguf is None:
        return {"system": "transformers", "skipped": "needs a plain-prompt workload and a GGUF model"}
    r = run_transformers(data, gguf, workdir / f"{slug}.transformers.json",
                         new_tokens=case.max_tokens, batch=case.hf_batch,
                         labels=w.labels if case.kind == "classify" else (), timeout=args.timeout,
                         env=env)
    r["label"] = f"transformers (batch {case.hf_batch})"
    return r


def _run_llamacpp_peer(case: Case, args, data: Path, workdir: Path, slug: str, env: dict) -> dict:
    gguf = gguf_path(args.model)
    if args.no_llamacpp:
        return {"system": "llama.cpp", "skipped": "--no-llamacpp"}
    if gguf is None:
        return {"system": "llama.cpp", "skipped": "needs a GGUF model"}
    return run_llamacpp(data, gguf, workdir / f"{slug}.llamacpp.log", rows=case.workload.num_rows,
                        new_tokens=case.max_tokens, python=args.llamacpp_python, timeout=args.timeout,
                        threads=args.threads, env=env)


def run_system(case: Case, system: str, args, data: Path, workdir: Path, slug: str, env: dict) -> dict | None:
    """One system's run of a case (None: the system is switched off and left out of the result)."""
    if system == "jobrunner":
        return run_jobrunner(data, workdir / f"{slug}.jobrunner", jobrunner_args(case, args.model) + args.extra,
                             timeout=args.timeout, env=env)
    if system == "ablation":
        if args.no_ablation:
            return None
        r = run_jobrunner(data, workdir / f"{slug}.ablation",
                          jobrunner_args(case, args.model) + args.extra + list(ABLATION),
                          system="ablation", timeout=args.timeout, env=env)
        r["label"] = ABLATION_LABEL
        return r
    if system == "transformers":
        return _run_transformers_peer(case, args, data, workdir, slug, env)
    if system == "llamacpp":
        return _run_llamacpp_peer(case, args, data, workdir, slug, env)
    raise ValueError(system)


def run_status(r: dict) -> str:
    """One line on how a run went: skipped, its error's first line, or its wall and load."""
    return r.get("skipped") and f"skipped ({r['skipped']})" or r.get("error", "").split("\n")[0] or \
        f"wall {r.get('wall_s', 0):.2f}s (process {r.get('process_wall_s', 0):.0f}s, other load " \
        f"{r.get('other_load_cores') or 0:.2f} cores)"


def case_result(case: Case, runs: list[dict]) -> dict:
    """A case's entry in the suite result: its workload figures, runs, problems and speedups."""
    w = case.workload
    out = {"name": case.name, "workload": w.name, "kind": case.kind, "rows": w.num_rows,
           "max_tokens": case.max_tokens if case.kind == "generate" else 0,
           "expected_prompt_tokens": w.total_prompt_tokens,
           "expected_completion_tokens": case.expected_completion_tokens(), "runs": runs,
           "scaling": case.scaling, "targets": case.targets, "compare_with": case.compare_with}
    out["problems"] = [f"{case.name} / {r['label']}: {p}" for r in runs for p in check_run(case, r)]
    ours = next((r for r in runs if r["system"] == "jobrunner" and r.get("wall_s")), None)
    out["speedups"] = {r["label"]: r["wall_s"] / ours["wall_s"] for r in runs
                       if ours and r is not ours and r.get("wall_s")}
    for r in runs:   # per-row lists were for the checks; the result keeps the figures
        r.pop("row_completion_tokens", None)
        r.pop("row_finish_reasons", None)
    return out


def run_case(case: Case, args, workdir: Path) -> dict:
    slug = case.name.replace("/", "-").replace("=", "")
    data = case.workload.write(workdir / f"{slug}.jsonl")
    env = thread_env(args.threads)
    runs = []
    for system in case.systems:
        t0 = time.time()
        r = run_system(case, system, args, data, workdir, slug, env)
        if r is None:
            continue
        r.setdefault("label", r["system"])
        print(f"[{case.name}] {r['label']}: {run_status(r)}  [{time.time() - t0:.0f}s]", flush=True)
        runs.append(r)
    return case_result(case, runs)


def check_run(case: Case, r: dict) -> list[str]:
    """What is wrong with a run's figures (empty: all present and consistent). Never speeds."""
    if r.get("skipped"):
        return []
    if r.get("error"):
        return [r["error"].splitlines()[0]]
    p = []
    w = case.workload

    def positive(*keys):
        for k in keys:
            v = r.get(k)
            if not isinstance(v, (int, float)) or not v > 0:
                p.append(f"{k} is {v!r}, expected > 0")

    positive("wall_s", "process_wall_s", "peak_rss_mb", "cpu_s", "model_load_s", "prompt_tokens",
             "prompt_tokens_per_s", "rows_per_s")
    if r.get("rows") != w.num_rows:
        p.append(f"rows {r.get('rows')} != workload rows {w.num_rows}")
    want_out = case.expected_completion_tokens()
    if r["system"] == "llama.cpp":     # its own tokenizer and BOS handling: counts are its own
        return p
    if r.get("prompt_tokens") != w.total_prompt_tokens:
        p.append(f"prompt tokens {r.get('prompt_tokens')} != workload's {w.total_prompt_tokens} (our tokenizer)")
    if r.get("completion_tokens") != want_out:
        p.append(f"completion tokens {r.get('completion_tokens')} != expected {want_out}")
    if want_out:
        positive("output_tokens_per_s")
    for k in ("prefill_s", "decode_s"):
        if not isinstance(r.get(k), (int, float)) or r[k] < 0 or r[k] > r.get("wall_s", 0) * 1.01 + 1e-6:
            p.append(f"{k} {r.get(k)!r} not within [0, wall]")
    if r["system"] in ("jobrunner", "ablation"):
        if r.get("rows_ok") != w.num_rows:
            p.append(f"rows_ok {r.get('rows_ok')} of {w.num_rows}")
        for k in ("cache_hit_rate", "optimum_cache_hit_rate"):
            if not isinstance(r.get(k), (int, float)) or not 0 <= r[k] <= 1:
                p.append(f"{k} {r.get(k)!r} not in [0, 1]")
        if r.get("cache_hit_rate", 0) > (r.get("optimum_cache_hit_rate") or 0) + 1e-9:
            p.append("cache hit rate above its optimum")
        if r["system"] == "ablation" and r.get("cached_tokens"):
            p.append(f"ablation served {r['cached_tokens']} tokens from a prefix cache it should not have")
        computed = r.get("prompt_tokens_computed")
        if computed is None or computed < r.get("prompt_tokens", 0) - r.get("cached_tokens", 0):
            p.append(f"engine computed {computed} prompt tokens, fewer than the uncached "
                     f"{r.get('prompt_tokens', 0) - r.get('cached_tokens', 0)}")
        rows_out = r.get("row_completion_tokens")
        if case.kind == "generate" and rows_out is not None:
            want = w.max_tokens or [case.max_tokens] * w.num_rows
            if sorted(rows_out) != sorted(want):
                p.append("per-row completion tokens differ from the rows' max_tokens (ignore_eos)")
        if case.reference and not (r.get("metrics") or {}).get("accuracy") is not None:
            p.append("no accuracy in the job metrics")
    return p


def comparisons(cases: list[dict]) -> list[dict]:
    out = []
    by_name = {c["name"]: c for c in cases}
    for c in cases:
        ours = next((r for r in c["runs"] if r["system"] == "jobrunner" and r.get("wall_s")), None)
        gen_case = by_name.get(c.get("compare_with") or "")
        if gen_case and ours:
            gen = next((r for r in gen_case["runs"] if r["system"] == "jobrunner" and r.get("wall_s")), None)
            if gen:
                ratio = ours["rows_per_s"] / gen["rows_per_s"]
                out.append({"name": f"{c['name']} vs generation (--max-tokens {gen_case['max_tokens']})",
                            "ratio": ratio, "text": f"classify {ours['rows_per_s']:.2f} rows/s, generate "
                                                    f"{gen['rows_per_s']:.2f} rows/s: {ratio:.2f}x"})
        t = c.get("targets") or {}
        if ours and t:
            parts = []
            if "wall_s" in t:
                parts.append(f"wall {ours['wall_s']:.1f} s (target <= {t['wall_s']} s: "
                             f"{'met' if ours['wall_s'] <= t['wall_s'] else 'not met'})")
            for peer, want in t.items():
                if peer == "wall_s":
                    continue
                got = next((v for k, v in c["speedups"].items() if k.startswith(peer)), None)
                parts.append(f"{want}x {peer}: " + ("not measured" if got is None else
                                                    f"{got:.2f}x ({'met' if got >= want else 'not met'})"))
            out.append({"name": f"{c['name']}: issue targets", "text": "; ".join(parts)})
    return out


def run_suite(args) -> int:
    started = datetime.now(timezone.utc)
    stamp = report.timestamp()
    results_dir = Path(args.results_dir)
    workdir = Path(args.workdir) if args.workdir else results_dir / "tmp" / f"{args.suite}-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"suite {args.suite}: model {args.model}, work files in {workdir}", flush=True)
    t0 = time.perf_counter()
    tok = W.our_tokenizer(args.model)
    cases = suite_cases(args.suite, tok)
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c.name in wanted]
        if not cases:
            raise SystemExit(f"--only {args.only}: no such case")
    print(f"workloads built in {time.perf_counter() - t0:.1f}s", flush=True)
    result = {"suite": args.suite, "stamp": stamp, "started": started.isoformat(timespec="seconds"),
              "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in args.argv),
              "model": args.model, "threads": args.threads or "default", "machine": report.machine(),
              "versions": report.versions(), "git": report.git(),
              "workloads": {}, "cases": [], "notes": []}
    for case in cases:
        result["workloads"][case.workload.name] = case.workload.summary()
        result["cases"].append(run_case(case, args, workdir))
    result["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result["comparisons"] = comparisons(result["cases"])
    result["problems"] = [p for c in result["cases"] for p in c["problems"]]
    saved = report.save(result, results_dir)
    print(report.markdown(result))
    print(f"result: {saved['json']}\ntable:  {saved['markdown']}")
    for p in saved["plots"]:
        print(f"plot:   {p}")
    for n in saved["notes"]:
        print(f"note:   {n}")
    return 1 if result["problems"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a suite")
    r.add_argument("--suite", default="smoke", choices=("smoke", "cpu", "scaling"))
    r.add_argument("-m", "--model", default="smollm2-135m-instruct")
    r.add_argument("--only", help="comma-separated case names")
    r.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    r.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    r.add_argument("--no-ablation", action="store_true", help="skip jobrunner --no-plan --no-prefix-cache")
    r.add_argument("--llamacpp-python", help="a Python that imports llama_cpp (e.g. a separate venv's)")
    r.add_argument("--jobrunner-args", dest="extra", type=shlex.split, default=[],
                   help='extra options for every jobrunner run, e.g. "--max-batched-tokens 4096"')
    r.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    r.add_argument("--threads", type=int, help="compute threads for every system (OMP_NUM_THREADS; llama.cpp "
                                               "--threads); default: each system's own (torch: one per core). On a "
                                               "machine other work is loading, 1 thread avoids the thread-barrier "
                                               "stalls that make 2-thread torch several times slower")
    r.add_argument("--results-dir", default=str(RESULTS))
    r.add_argument("--workdir", help="job outputs and logs (default: <results-dir>/tmp/<suite>-<stamp>)")
    rep = sub.add_parser("report", help="re-render a saved result's table and plots")
    rep.add_argument("result")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.cmd == "report":
        out = report.rerender(args.result)
        for n in out["notes"]:
            print(f"note: {n}")
        return 0
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
