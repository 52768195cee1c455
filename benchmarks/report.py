"""Benchmark results: the machine and versions they came from, a JSON file, a Markdown table,
and PNG plots when matplotlib is importable.

    save(result, results_dir) -> {"json": path, "markdown": path, "plots": [paths], "notes": [...]}

Files: <results_dir>/<suite>-<UTC timestamp>.json, the same stem .md, and -throughput.png /
-scaling.png beside them. `python -m benchmarks report RESULT.json` re-renders the table and
plots of a saved result.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOADED_CORES = 0.25   # other processes using more cores than this on average: a loaded machine
ABLATION_NAME = "jobrunner --no-plan --no-prefix-cache"


# ------------------------------------------------------------------------------ where it ran

def machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), None)
        flags = next((ln for ln in cpuinfo if ln.startswith("flags")), "").split()
        info["cpu_flags"] = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        mem = next((ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), None)
        if mem:
            info["memory_gb"] = round(int(mem.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    info["loadavg"] = list(os.getloadavg())
    try:
        import torch
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "tokenizers", "numpy", "pyarrow", "triton", "llama_cpp"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:        # not installed, or broken: either way, no version to report
            out[mod] = None
    return out


def code_repo() -> Path:
    """The checkout whose jobrunner is measured (the installed package's), else this one."""
    try:
        import jobrunner
        return Path(jobrunner.__file__).resolve().parent.parent
    except ImportError:
        return REPO


def git() -> dict:
    repo = code_repo()

    def cmd(*args):
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10,
                                  check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = cmd("rev-parse", "HEAD")
    status = cmd("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit or None, "dirty": bool(status), "branch": cmd("rev-parse", "--abbrev-ref", "HEAD") or None,
            "repo": str(repo)}


def loaded(result: dict) -> tuple[bool, str]:
    """Whether other work competed for the CPUs during the runs, and a line saying how much."""
    others = [r.get("other_load_cores") for c in result.get("cases", []) for r in c.get("runs", [])
              if r.get("other_load_cores") is not None]
    if not others:
        return False, "no load measurement"
    mean, worst = sum(others) / len(others), max(others)
    busy = mean > LOADED_CORES
    return busy, (f"{'LOADED' if busy else 'quiet'} machine: other processes used {mean:.2f} cores on average "
                  f"during the runs (worst run {worst:.2f}) of {os.cpu_count()}; figures from a loaded machine "
                  f"are slower than a quiet one's" if busy else
                  f"quiet machine: other processes used {mean:.2f} cores on average (worst {worst:.2f})")


# ------------------------------------------------------------------------------ tables

def _f(x, nd=1, unit=""):
    if x is None:
        return "-"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}{unit}"
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def _md_header(result: dict) -> list[str]:
    """Suite, command, machine and versions, threads and load."""
    lines = [f"## Suite `{result['suite']}`: {result.get('started', '')}", ""]
    lines.append(f"Command: `{result.get('command', '')}`  ")
    m, g = result.get("machine", {}), result.get("git", {})
    lines.append(f"Machine: {m.get('cpu_model', m.get('machine', '?'))}, {m.get('cpus_usable', m.get('cpu_count'))} "
                 f"cores, {m.get('memory_gb', '?')} GB; torch {result.get('versions', {}).get('torch')}, "
                 f"transformers {result.get('versions', {}).get('transformers')}; commit "
                 f"{(g.get('commit') or '?')[:10]}{' (dirty tree)' if g.get('dirty') else ''}  ")
    lines.append(f"Compute threads per system: {result.get('threads', 'default')}  ")
    lines.append(f"Load: {result.get('load_note', '')}")
    lines.append("")
    return lines


def _md_run_row(case: dict, r: dict) -> str:
    """One run's row of the main table (skipped and failed runs: the reason, then empty cells)."""
    name = r.get("label", r.get("system"))
    if r.get("skipped"):
        return f"| {case['name']} | {name} | skipped: {r['skipped']} |" + " |" * 11
    if r.get("error"):
        first = r["error"].splitlines()[0]
        return f"| {case['name']} | {name} | FAILED: {first} |" + " |" * 11
    cache = "-"
    if r.get("cache_hit_rate") is not None:
        opt = r.get("optimum_cache_hit_rate")
        reached = r["cache_hit_rate"] / opt if opt else None
        cache = f"{_pct(r['cache_hit_rate'])} of {_pct(opt)} ({_pct(reached)})"
    split = f"{_f(r.get('prefill_s'))} / {_f(r.get('decode_s'))}" if r.get("prefill_s") is not None else "-"
    ratio = case.get("speedups", {}).get(name)
    return (f"| {case['name']} | {name} | {_f(r.get('wall_s'), 2)} | {_f(r.get('model_load_s'))} | "
            f"{_f(r.get('rows'))} | {_f(r.get('prompt_tokens'))} | {_f(r.get('completion_tokens'))} | "
            f"{_f(r.get('prompt_tokens_per_s'))} | {_f(r.get('output_tokens_per_s'))} | {split} | {cache} | "
            f"{_f(r.get('peak_rss_mb'), 0)} | {_f(r.get('other_load_cores'), 2)} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} |")


def _md_runs_table(result: dict) -> list[str]:
    lines = ["| case | system | wall s | load s | rows | prompt tok | output tok | prompt tok/s | output tok/s "
             "| prefill s / decode s | cache hit of optimum (reached) | peak RSS MB | other load | "
             "jobrunner speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in result.get("cases", []):
        for r in case.get("runs", []):
            lines.append(_md_run_row(case, r))
    return lines


def _md_comparisons(result: dict) -> list[str]:
    extra = list(result.get("comparisons", []))
    if not extra:
        return []
    lines = []
    if result.get("load_loaded"):
        lines += ["", "**From a loaded machine**: the issues' targets assume a quiet one; compare ratios "
                      "measured side by side, not absolute times."]
    lines += ["", "| comparison | figure |", "|---|---|"]
    for c in extra:
        lines.append(f"| {c['name']} | {c['text']} |")
    return lines


def _md_metrics(result: dict) -> list[str]:
    metrics = [(c["name"], r.get("label", r["system"]), r["metrics"]) for c in result.get("cases", [])
               for r in c.get("runs", []) if r.get("metrics")]
    if not metrics:
        return []
    lines = ["", "| case | system | job metrics |", "|---|---|---|"]
    for case, sysname, mt in metrics:
        shown = {k: v for k, v in mt.items() if not isinstance(v, (dict, list))}
        lines.append(f"| {case} | {sysname} | "
                     f"{', '.join(f'{k} {_f(v, 3)}' for k, v in shown.items())} |")
    return lines


def _md_checks(result: dict) -> list[str]:
    """The checks' verdict, then each problem, note and plot."""
    problems = result.get("problems", [])
    lines = ["", f"Checks: {'all figures present and consistent with the workloads' if not problems else ''}"]
    for p in problems:
        lines.append(f"- PROBLEM: {p}")
    for n in result.get("notes", []):
        lines.append(f"- note: {n}")
    for p in result.get("plots", []):
        lines.append(f"- plot: {p}")
    return lines


_MD_COLUMNS = ("Columns: wall excludes model load (load s). Tokens/s are over that wall. Prefill/decode: "
               "jobrunner, time with at least one prompt in prefill vs the rest; transformers, time to each batch's "
               "first logits vs the rest. Cache hit: share of prompt tokens served from the prefix cache, against "
               "the best any cache could do for this dataset (every repeated prefix token cached), and the share "
               "of that optimum reached. Other load: "
               "cores used by other processes during the run (0 = quiet). Speed-up: this system's wall / "
               "jobrunner's wall on the same case.")


def markdown(result: dict) -> str:
    lines = (_md_header(result) + _md_runs_table(result) + _md_comparisons(result) + _md_metrics(result)
             + _md_checks(result) + ["", _MD_COLUMNS, ""])
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots

def plots(result: dict, stem: Path) -> tuple[list[str], list[str]]:
    """PNG plots beside `stem`; ([paths], [notes]). Without matplotlib: no plots, one note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ["plots skipped: matplotlib is not installed (pip install -e '.[plots]')"]
    paths = []
    cases = [c for c in result.get("cases", []) if not c.get("scaling")]
    systems = {}      # system -> legend label (transformers' batch size may differ between cases)
    for c in cases:
        for r in c.get("runs", []):
            if r.get("wall_s") and r.get("system") not in systems:
                systems[r["system"]] = ABLATION_NAME if r["system"] == "ablation" else r["system"]
    if cases and systems:
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(cases) + 4), 4.5))
        width = 0.8 / len(systems)
        for metric, ax, title in (("total_tokens_per_s", axes[0], "prompt + output tokens/s"),
                                  ("wall_s", axes[1], "wall seconds (model load excluded)")):
            for k, (system, label) in enumerate(systems.items()):
                vals = []
                for c in cases:
                    run = next((r for r in c["runs"] if r.get("system") == system), {})
                    vals.append(run.get(metric) or 0)
                ax.bar([i + k * width for i in range(len(cases))], vals, width, label=label)
            ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(cases))])
            ax.set_xticklabels([c["name"] for c in cases], rotation=20, ha="right", fontsize=8)
            ax.set_title(title)
            ax.set_yscale("log")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"suite {result['suite']}, {result.get('threads', 'default')} thread(s): "
                     f"{result.get('load_note', '').split(';')[0]}", fontsize=8)
        fig.tight_layout()
        path = f"{stem}-throughput.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    scaling = [c for c in result.get("cases", []) if c.get("scaling")]
    axes_names = sorted({c["scaling"]["axis"] for c in scaling})
    if axes_names:
        fig, axes = plt.subplots(1, len(axes_names), figsize=(4 * len(axes_names), 3.6), squeeze=False)
        for ax, axis in zip(axes[0], axes_names):
            pts = sorted((c["scaling"]["value"], r["wall_s"]) for c in scaling if c["scaling"]["axis"] == axis
                         for r in c["runs"] if r.get("system") == "jobrunner" and r.get("wall_s"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
            ax.set_xlabel(axis)
            ax.set_ylabel("wall s (jobrunner)")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        fig.suptitle("how jobrunner's cost grows with the work", fontsize=9)
        fig.tight_layout()
        path = f"{stem}-scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, []


# ------------------------------------------------------------------------------ saving

def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def save(result: dict, results_dir: str | Path) -> dict:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_dir / f"{result['suite']}-{result.get('stamp') or timestamp()}"
    result["load_loaded"], result["load_note"] = loaded(result)
    pngs, notes = plots(result, stem)
    result.setdefault("notes", []).extend(n for n in notes if n not in result["notes"])
    result["plots"] = [os.path.basename(p) for p in pngs]
    json_path = Path(f"{stem}.json")
    json_path.write_text(json.dumps(result, indent=1, default=str))
    md_path = Path(f"{stem}.md")
    md_path.write_text(markdown(result))
    return {"json": str(json_path), "markdown": str(md_path), "plots": pngs, "notes": notes}


def rerender(path: str | Path) -> dict:
    """Table and plots of a saved result again (e.g. once matplotlib is installed); updates its JSON."""
    result = json.loads(Path(path).read_text())
    stem = Path(str(path)).with_suffix("")
    pngs, notes = plots(result, stem)
    result["plots"] = [os.path.basename(p) for p in pngs]
    result["notes"] = [n for n in result.get("notes", []) if not n.startswith("plots skipped")] + notes
    Path(path).write_text(json.dumps(result, indent=1, default=str))
    md = Path(f"{stem}.md")
    md.write_text(markdown(result))
    sys.stdout.write(markdown(result) + "\n")
    return {"markdown": str(md), "plots": pngs, "notes": notes}
