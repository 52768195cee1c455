"""The systems a benchmark runs on one workload, each in its own child process.

    run_jobrunner(...)      `jobrunner submit` as users run it; figures from its _stats.json
                            (wall_s excludes model load, model_load_s is load alone) and its
                            part files (the prefill/decode split); --no-plan --no-prefix-cache
                            gives the ablation
    run_transformers(...)   HF transformers batched greedy `generate` (float32 on CPU), the
                            same settings as ../shared/peers/hf_generate.py, plus a prefill/decode
                            split and a classify mode (every label scored by a forward pass over
                            prompt + label); load timed apart from generation
    run_llamacpp(...)       ../shared/peers/llamacpp_batched.py when llama-cpp-python imports,
                            else a result that says it was skipped and why

Every child is waited for with os.wait4, so peak memory (ru_maxrss) and CPU seconds are that
child's own. CPU seconds over wall seconds ("cpu_util") shows how much of the machine a run
got; "other_load_cores" is the CPU time everything else on the machine used meanwhile (from
/proc/stat, less this child and this process), in cores: about 0 on a quiet machine. Figures
taken with other_load_cores well above 0 come from a loaded machine and run slow.

The transformers child is this module run as a script:
    python -m benchmarks.peers transformers --model M.gguf|HF_DIR --prompts P.jsonl --new 16 --batch 16 --out R.json
    python -m benchmarks.peers transformers ... --labels positive,negative,neutral    (classify)
"""
from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(os.environ.get("JOBRUNNER_PEERS_DIR", REPO.parent / "shared" / "peers"))


# ------------------------------------------------------------------------------ child processes

def run_child(cmd: list[str], log: Path, timeout: float | None = None, env: dict | None = None) -> dict:
    """Runs cmd with stdout and stderr to `log`; returns rc, wall, peak RSS and CPU seconds of the
    child (os.wait4: its own rusage, not the sum over every child this process ever had)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    busy0, self0 = machine_busy_s(), _self_cpu_s()
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)
        timed_out = False
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if timeout is not None and time.perf_counter() - start > timeout:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.05)
        except BaseException:            # interrupted: don't leave the child (its own session) running
            os.killpg(proc.pid, signal.SIGKILL)
            os.wait4(proc.pid, 0)
            raise
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here; keep Popen from waiting again
    cpu = usage.ru_utime + usage.ru_stime
    busy1, self1 = machine_busy_s(), _self_cpu_s()
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - cpu - (self1 - self0))
    return {"command": " ".join(shlex.quote(c) for c in cmd), "rc": proc.returncode, "timed_out": timed_out,
            "process_wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "cpu_s": cpu,
            "cpu_util": cpu / wall if wall > 0 else None,
            "other_load_cores": others / wall if others is not None and wall > 0 else None,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0], "log": str(log)}


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)        # idle + iowait
    busy = sum(fields[:8]) - idle                                    # guest time is inside user already
    return busy / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tail(path: str | Path, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------ jobrunner

def jobrunner_cmd() -> list[str]:
    """The `jobrunner` console script of this interpreter's environment (what users run)."""
    script = Path(sys.executable).parent / "jobrunner"
    return [str(script)] if script.exists() else [sys.executable, "-m", "jobrunner.cli.main"]


def run_jobrunner(dataset: Path, out_dir: Path, args: list[str], *, system: str = "jobrunner",
                  timeout: float | None = None, env: dict | None = None) -> dict:
    """`jobrunner submit dataset -o out_dir --overwrite *args`, then its _stats.json and part files."""
    cmd = jobrunner_cmd() + ["submit", str(dataset), "-o", str(out_dir), "--overwrite", *args]
    res = {"system": system, **run_child(cmd, out_dir.with_name(out_dir.name + ".log"), timeout, env)}
    if res["rc"] != 0:
        res["error"] = f"exit code {res['rc']}" + (" (timed out)" if res["timed_out"] else "") + \
                       f"; log tail:\n{_tail(res['log'])}"
        return res
    try:
        stats = json.loads((out_dir / "_stats.json").read_text())
    except (OSError, ValueError) as e:
        res["error"] = f"no readable _stats.json: {e}"
        return res
    wall = stats["wall_s"]
    res.update(
        wall_s=wall, model_load_s=stats.get("model_load_s"), rows=stats["rows"], rows_ok=stats["rows_ok"],
        rows_failed=stats["rows_failed"], prompt_tokens=stats["prompt_tokens"],
        cached_tokens=stats["cached_tokens"], completion_tokens=stats["completion_tokens"],
        prompt_tokens_per_s=stats["prompt_tokens"] / wall, output_tokens_per_s=stats["completion_tokens"] / wall,
        total_tokens_per_s=(stats["prompt_tokens"] + stats["completion_tokens"]) / wall,
        rows_per_s=stats["rows"] / wall, cache_hit_rate=stats.get("cache_hit_rate"),
        optimum_cache_hit_rate=stats.get("optimum_cache_hit_rate"),
        cache_hit_of_block_optimum=stats.get("cache_hit_of_block_optimum"),
        cache_hit_of_optimum=(stats["cached_tokens"] / stats["optimum_cached_tokens"]
                              if stats.get("optimum_cached_tokens") else None),
        row_queue_s_p50=stats.get("queue_s_p50"), row_prefill_s_p50=stats.get("prefill_s_p50"),
        row_decode_s_p50=stats.get("decode_s_p50"), engine=stats.get("engine"), metrics=stats.get("metrics"))
    engine = stats.get("engine") or {}
    res["prompt_tokens_computed"] = engine.get("prompt_tokens_computed")
    res.update(_phase_split(out_dir, wall))
    return res


def _phase_split(out_dir: Path, wall: float) -> dict:
    """Prefill and decode split of the wall time, from the rows' queue/prefill/decode seconds.

    Every row of a job of up to 2 x max_num_seqs rows is added to the engine at its start, so a
    row's prefill runs over [queue_s, queue_s + prefill_s] from the start: `prefill_s` is the
    time during which at least one prompt was being prefilled (the union of those intervals),
    `decode_s` the rest of the wall time (steps that only decode). Decodes also run inside
    mixed steps in the prefill time; this is the phase split, not a per-token cost split.
    Also returned: the per-row lists the smoke checks use (completion tokens, finish reasons)."""
    files = sorted(glob.glob(str(out_dir / "part-*.parquet")))
    if not files:
        return {}
    import pyarrow.parquet as pq
    cols = ["queue_s", "prefill_s", "decode_s", "completion_tokens", "finish_reason"]
    table = pq.ParquetDataset(files).read(columns=cols).to_pydict()
    spans = sorted((q, q + p) for q, p in zip(table["queue_s"], table["prefill_s"]) if q is not None and p is not None)
    busy, end = 0.0, 0.0
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    busy = min(busy, wall)
    return {"prefill_s": busy, "decode_s": max(wall - busy, 0.0),
            "row_completion_tokens": table["completion_tokens"], "row_finish_reasons": table["finish_reason"]}


# ------------------------------------------------------------------------------ transformers

def hf_source(gguf: Path) -> tuple[str, dict]:
    """Where transformers loads the default model from: the float32 copy the test suite caches
    (tests/conftest.py: transformers' own conversion of this GGUF, saved as safetensors; it loads
    in about a second instead of about 45 s of GGUF dequantization), else the GGUF itself.
    Returns (model source, {"tokenizer": source}) as paths."""
    try:
        import transformers

        from jobrunner.models.known import cache_root
    except ImportError:
        return str(gguf), {}
    ref = cache_root() / "test-reference"
    model = ref / f"smollm2-135m-instruct-model-transformers-{transformers.__version__}"
    tok = ref / f"smollm2-135m-instruct-tokenizer-transformers-{transformers.__version__}"
    if gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and (model / "done").is_file() and (tok / "done").is_file():
        return str(model), {"tokenizer": str(tok)}
    return str(gguf), {}


def transformers_available() -> str | None:
    """None when transformers can run, else why not."""
    for mod in ("transformers", "torch"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed"
    return None


def run_transformers(prompts_path: Path, gguf: Path, out_json: Path, *, new_tokens: int, batch: int,
                     labels: tuple[str, ...] = (), timeout: float | None = None, env: dict | None = None) -> dict:
    why = transformers_available()
    if why:
        return {"system": "transformers", "skipped": why}
    model, extra = hf_source(gguf)
    cmd = [sys.executable, "-m", "benchmarks.peers", "transformers", "--model", model, "--prompts", str(prompts_path),
           "--new", str(new_tokens), "--batch", str(batch), "--out", str(out_json)]
    if extra.get("tokenizer"):
        cmd += ["--tokenizer", extra["tokenizer"]]
    if labels:
        cmd += ["--labels", ",".join(labels)]
    res = {"system": "transformers", **run_child(cmd, out_json.with_suffix(".log"), timeout,
                                                 env={**(env or {}), "PYTHONPATH": _pythonpath()})}
    if res["rc"] != 0:
        res["error"] = f"exit code {res['rc']}" + (" (timed out)" if res["timed_out"] else "") + \
                       f"; log tail:\n{_tail(res['log'])}"
        return res
    figures = json.loads(out_json.read_text())
    res.update(figures)
    wall = figures["wall_s"]
    res.update(prompt_tokens_per_s=figures["prompt_tokens"] / wall,
               output_tokens_per_s=figures["completion_tokens"] / wall,
               total_tokens_per_s=(figures["prompt_tokens"] + figures["completion_tokens"]) / wall,
               rows_per_s=figures["rows"] / wall)
    return res


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _child_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers transformers")
    ap.add_argument("--model", required=True, help="a .gguf file or an HF model directory")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: from --model)")
    ap.add_argument("--prompts", required=True, help="JSONL with a prompt field")
    ap.add_argument("--new", type=int, default=16, help="new tokens a row (EOS suppressed until then)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--labels", help="classify: score these labels after each prompt instead of generating")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def _pretrained_source(path: str) -> tuple[str, dict]:
    """from_pretrained's path and keywords for a .gguf file or an HF directory."""
    if path.endswith(".gguf"):
        d, f = os.path.split(path)
        return d, {"gguf_file": f}
    return path, {}


def _load_hf(model_path: str, tokenizer_path: str | None):
    """(tokenizer padding on the left, float32 model in eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tsrc, tkw = _pretrained_source(tokenizer_path or model_path)
    msrc, mkw = _pretrained_source(model_path)
    tok = AutoTokenizer.from_pretrained(tsrc, **tkw)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(msrc, dtype=torch.float32, **mkw).eval()
    return tok, model


def _read_prompts(path: str, limit: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:limit] if limit else prompts


@functools.cache
def _first_logits_class():
    from transformers import LogitsProcessor

    class FirstLogits(LogitsProcessor):
        """Notes when generate first asks for logits: the batch's prefill is done."""
        t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    return FirstLogits


@dataclass
class _HFTally:
    """Token counts and prefill/decode times summed over a transformers child's batches."""
    n_in: int = 0
    n_out: int = 0
    n_computed: int = 0
    prefill: float = 0.0
    row_prefill: list = field(default_factory=list)
    row_decode: list = field(default_factory=list)

    def add_times(self, rows: int, prefill_s: float, decode_s: float) -> None:
        self.prefill += prefill_s
        self.row_prefill += [prefill_s] * rows
        self.row_decode += [decode_s] * rows


def _hf_batch(model, tok, prompts: list[str], a: argparse.Namespace, tally: _HFTally) -> None:
    """One batch: score the labels (classify: all prefill) or generate a.new tokens a row."""
    from transformers import LogitsProcessorList

    b0 = time.perf_counter()
    enc = tok(prompts, return_tensors="pt", padding=True)
    tally.n_in += int(enc["attention_mask"].sum())
    rows = enc["input_ids"].shape[0]
    if a.labels:
        tally.n_computed += _score_labels(model, tok, enc, a.labels.split(","))
        tally.add_times(rows, time.perf_counter() - b0, 0.0)
        return
    first = _first_logits_class()()
    out = model.generate(**enc, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                         pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([first]))
    b1 = time.perf_counter()
    tally.n_out += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    tally.n_computed += int(enc["input_ids"].numel())
    tally.add_times(rows, first.t - b0, b1 - first.t)


def _hf_figures(a: argparse.Namespace, rows: int, tally: _HFTally, wall: float, load: float) -> dict:
    import torch
    import transformers

    row_prefill, row_decode = sorted(tally.row_prefill), sorted(tally.row_decode)
    return {
        "wall_s": wall, "model_load_s": load, "rows": rows, "prompt_tokens": tally.n_in,
        "completion_tokens": tally.n_out, "prompt_tokens_computed": tally.n_computed, "prefill_s": tally.prefill,
        "decode_s": wall - tally.prefill,
        "row_prefill_s_p50": row_prefill[len(row_prefill) // 2] if row_prefill else None,
        "row_decode_s_p50": row_decode[len(row_decode) // 2] if row_decode else None,
        "batch": a.batch, "dtype": "float32", "threads": torch.get_num_threads(),
        "transformers": transformers.__version__, "model_source": a.model,
        "mode": "classify" if a.labels else "generate",
    }


def transformers_child(argv: list[str]) -> None:
    """Runs in the child: load (timed), then generate or score over the prompts (timed)."""
    a = _child_args(argv)
    t0 = time.perf_counter()
    tok, model = _load_hf(a.model, a.tokenizer)
    load = time.perf_counter() - t0
    prompts = _read_prompts(a.prompts, a.limit)
    import torch

    tally = _HFTally()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), a.batch):
            _hf_batch(model, tok, prompts[i:i + a.batch], a, tally)
    wall = time.perf_counter() - start
    figures = _hf_figures(a, len(prompts), tally, wall, load)
    Path(a.out).write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


def _score_labels(model, tok, enc, labels: list[str]) -> int:
    """Each label's summed logprob after each prompt, one forward pass over prompt + label per
    label (labels encoded alone, as jobrunner's classify does); returns the tokens computed."""
    import torch

    computed = 0
    ids, mask = enc["input_ids"], enc["attention_mask"]
    for label in labels:
        lab = tok(label, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        x = torch.cat([ids, lab.expand(ids.shape[0], -1)], dim=1)
        m = torch.cat([mask, torch.ones(ids.shape[0], len(lab), dtype=mask.dtype)], dim=1)
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=x, attention_mask=m, position_ids=pos).logits[:, -len(lab) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, lab.expand(ids.shape[0], -1)[..., None])
        logp.sum((1, 2))
        computed += x.numel()
    return computed


# ------------------------------------------------------------------------------ llama.cpp

_LLAMA_LINE = re.compile(
    r"\[N=(?P<n>\d+) mode=(?P<mode>\w+)[^\]]*\] prompts=(?P<rows>\d+) prompt_tokens=(?P<prompt>\d+) "
    r"\(prefilled=(?P<prefilled>\d+), shared_prefix=(?P<shared>\d+)\) generated=(?P<gen>\d+) "
    r"wall=(?P<wall>[\d.]+)s \(tokenize [\d.]+s, prefill (?P<prefill>[\d.]+)s, decode (?P<decode>[\d.]+)s\)")
_LLAMA_LOAD = re.compile(r"model load (?P<load>[\d.]+)s")


def llamacpp_python(python: str | None = None) -> tuple[str | None, str | None]:
    """(the interpreter that can import llama_cpp, None) or (None, why not)."""
    if python:
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, check=False).returncode == 0
        return (python, None) if ok else (None, f"llama-cpp-python not importable by {python}")
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python not installed"
    return sys.executable, None


def parse_llamacpp(text: str) -> list[dict]:
    """The result lines of llamacpp_batched.py, one dict per (N, mode)."""
    load = _LLAMA_LOAD.search(text)
    runs = []
    for m in _LLAMA_LINE.finditer(text):
        g = m.groupdict()
        wall = float(g["wall"])
        runs.append({"n_parallel": int(g["n"]), "mode": g["mode"], "rows": int(g["rows"]),
                     "prompt_tokens": int(g["prompt"]), "prompt_tokens_computed": int(g["prefilled"]),
                     "shared_prefix": int(g["shared"]), "completion_tokens": int(g["gen"]), "wall_s": wall,
                     "prefill_s": float(g["prefill"]), "decode_s": float(g["decode"]),
                     "model_load_s": float(load["load"]) if load else None})
    return runs


def run_llamacpp(prompts_path: Path, gguf: Path, log: Path, *, rows: int, new_tokens: int,
                 python: str | None = None, modes: str = "parallel,prefix", timeout: float | None = None,
                 threads: int | None = None, env: dict | None = None) -> dict:
    """llama.cpp (Q4_1, 2 threads) with all rows as parallel sequences, each mode; the best one
    is the figure. Skipped, with the reason, when llama-cpp-python or the script is missing."""
    script = PEERS_DIR / "llamacpp_batched.py"
    py, why = llamacpp_python(python)
    if why:
        return {"system": "llama.cpp", "skipped": why}
    if not script.is_file():
        return {"system": "llama.cpp", "skipped": f"peer script {script} not found"}
    cmd = [py, str(script), "--model", str(gguf), "--data", str(prompts_path), "--ns", str(rows), "--modes", modes,
           "--n-prompts", str(rows), "--gen", str(new_tokens), "--threads", str(threads or os.cpu_count() or 2)]
    res = {"system": "llama.cpp", **run_child(cmd, log, timeout, env)}
    runs = parse_llamacpp(Path(log).read_text(errors="replace"))
    if res["rc"] != 0 or not runs:
        res["error"] = f"exit code {res['rc']}, {len(runs)} result lines; log tail:\n{_tail(log)}"
        return res
    best = min(runs, key=lambda r: r["wall_s"])
    res.update(best, runs=runs)
    wall = best["wall_s"]
    res.update(prompt_tokens_per_s=best["prompt_tokens"] / wall, output_tokens_per_s=best["completion_tokens"] / wall,
               total_tokens_per_s=(best["prompt_tokens"] + best["completion_tokens"]) / wall,
               rows_per_s=best["rows"] / wall)
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "transformers":
        transformers_child(sys.argv[2:])
    else:
        sys.exit("usage: python -m benchmarks.peers transformers --model M --prompts P.jsonl --new N --batch B "
                 "--out R.json [--labels a,b,c]")
