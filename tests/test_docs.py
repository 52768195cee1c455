"""The docs stay true: their runnable blocks run, every option they name exists, the site builds.

Runnable blocks: a fenced shell block (```bash) whose opening fence comes right after a line
`<!-- runnable -->` in a page under docs/. A page's runnable blocks run in order, in one fresh
temporary directory that holds a copy of examples/ and of benchmarks/configs/ (so a later block may
use what an earlier one wrote, as a reader following the page would), under `bash -euo pipefail`
with this interpreter's bin directory first on PATH. Keep them to seconds: tiny inputs and the tiny
random model `-m dummy:benchmarks/configs/tiny-llama.json`.

Options: every `--option` in the README and in docs/*.md must be an option of some jobrunner command
(the click tree, hidden options included); a `jobrunner CMD ...` line in a code block must use only
CMD's own options. Options of other tools that the pages name are listed in OTHER_TOOLS.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from jobrunner.cli.main import main as cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w-]*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
SHELL = {"bash", "sh", "shell", "console", "cron"}
# named in the pages, not jobrunner's: the tool that owns each
OTHER_TOOLS = {
    "--include_path": "lm_eval", "--model_args": "lm_eval", "--batch_size": "lm_eval", "--use_cache": "lm_eval",
    "--tasks": "lm_eval", "--output_path": "lm_eval", "--apply_chat_template": "lm_eval", "--num_fewshot": "lm_eval",
    "--fewshot_as_multiturn": "lm_eval", "--max-restarts": "torchrun", "--nproc-per-node": "torchrun",
    "--nnodes": "torchrun", "--rdzv-backend": "torchrun", "--rdzv-endpoint": "torchrun", "--index-url": "pip",
    "--strict": "mkdocs build", "--suite": "python -m benchmarks", "--make": "python -m benchmarks.vision_caption",
    "--part": "python -m benchmarks.cpu_int4_bench / cpu_int8_bench", "--w4a8": "python -m benchmarks.shipped_quant",
}


def _blocks(text: str):
    """(language, code, runnable) of each fenced block of a Markdown text, and the text outside them."""
    blocks, prose, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        runnable = i > 0 and lines[i - 1].strip() == RUNNABLE
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        blocks.append((lang, "\n".join(lines[i + 1:j]), runnable))
        i = j + 1
    return blocks, "\n".join(prose)


def _commands(group: click.Group, path=()):
    """(path, command) of every command of the tree, the group itself first."""
    yield path, group
    for name, cmd in getattr(group, "commands", {}).items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path + (name,))
        else:
            yield path + (name,), cmd


def _options(cmd: click.Command) -> set[str]:
    names = set()
    for p in cmd.get_params(click.Context(cmd)):
        names.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    return names


COMMANDS = dict(_commands(cli))
ALL_OPTIONS = set().union(*(_options(c) for c in COMMANDS.values()))


def _jobrunner_calls(code: str):
    """(command path, [--options]) of each `jobrunner ...` call in a shell block."""
    code = code.replace("\\\n", " ")
    for line in code.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lex.whitespace_split, lex.commenters = True, "#"
        try:
            tokens = list(lex)
        except ValueError:      # an unbalanced quote in an illustrative line: the option scan below covers it
            continue
        for i, tok in enumerate(tokens):
            before = tokens[i - 1] if i else ""
            # a command, not an option's value (`lm_eval --model jobrunner`); `ray job submit -- jobrunner` is one
            if (tok == "jobrunner" and (before == "--" or not before.startswith("-"))) \
                    or (tok == "jobrunner.cli.main" and before == "-m"):
                yield _one_call(tokens[i + 1:])


def _one_call(tokens: list[str]):
    path, group = (), cli
    while tokens and isinstance(group, click.Group) and tokens[0] in group.commands:
        path, group = path + (tokens[0],), group.commands[tokens[0]]
        tokens = tokens[1:]
    opts = []
    for tok in tokens:
        if tok and set(tok) <= set(";&|<>()"):
            break
        if tok.startswith("--") and len(tok) > 2:
            opts.append(tok.split("=", 1)[0])
    return path, opts


def _sources():
    return [ROOT / "README.md", *PAGES]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_option_named_exists(path):
    blocks, prose = _blocks(path.read_text())
    unknown = {o for o in OPTION.findall(prose) if o not in ALL_OPTIONS and o not in OTHER_TOOLS}
    for lang, code, _ in blocks:
        if lang in SHELL:
            for cmd_path, opts in _jobrunner_calls(code):
                own = _options(COMMANDS[cmd_path])
                unknown.update(f"{o} (jobrunner {' '.join(cmd_path)})" for o in opts if o not in own)
    assert not unknown, f"{path.name} names options no jobrunner command has: {sorted(unknown)}"


def test_the_option_check_catches_a_missing_option():
    blocks, prose = _blocks("Use `--max-tokenz 8`.\n\n```bash\njobrunner stats out/ --max-tokens 8\n```\n")
    assert [o for o in OPTION.findall(prose) if o not in ALL_OPTIONS] == ["--max-tokenz"]
    assert list(_jobrunner_calls(blocks[0][1])) == [(("stats",), ["--max-tokens"])]
    assert "--max-tokens" not in _options(COMMANDS[("stats",)])


def test_every_command_states_its_exit_codes():
    """Each command that does something states its exit codes in its --help (and so in the CLI reference)."""
    missing = [" ".join(("jobrunner", *p)) for p, c in COMMANDS.items()
               if (not isinstance(c, click.Group) or c.invoke_without_command) and "Exit codes" not in (c.help or "")]
    assert not missing, f"no 'Exit codes' in the help of: {missing}"


def _runnable_pages():
    return [p for p in PAGES if any(r for _, _, r in _blocks(p.read_text())[0])]


def test_runnable_blocks_are_marked_in_some_page():
    assert _runnable_pages(), "no page has a <!-- runnable --> block"


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_blocks_run(page, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.copytree(ROOT / "benchmarks" / "configs", tmp_path / "benchmarks" / "configs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for lang, code, runnable in _blocks(page.read_text())[0]:
        if not runnable:
            continue
        assert lang in SHELL, f"{page.name}: a runnable block must be a shell block, not {lang!r}"
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{page.name}: this block exited {p.returncode}:\n{code}\n{p.stdout}\n{p.stderr}"


def test_docs_site_builds_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocs_click") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[docs]')")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").read_text().count("jobrunner submit") > 0
