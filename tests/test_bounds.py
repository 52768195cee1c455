"""Bounds on what a dataset or a model's chat template can make a job hold (issue 58, items 10 and 11): a
template past its time or size is its row's error; a line, CSV record or Parquet row over --max-row-bytes
is an error row read without being held; the job goes on, writes every other row, in bounded memory."""
from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.engine.load.chat_template import MAX_CHARS, TemplateBoundError, compile_template, render
from jobrunner.config.sections import InputOptions
from jobrunner.dataset import count_rows, read_rows
from jobrunner.dataset.files import DEFAULT_MAX_ROW_BYTES

JOB_PEAK_MB = 1536      # a tiny job's peak RSS stays under this (torch, the compiled kernels and the job: 500-1050 MB here;
                        # before the bounds these cases passed 4 GB)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 258}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# the row's text picks the bomb: a model's template applied to every row, hostile to some
BOMBS = ("{% set text = messages[-1]['content'] %}{% if text == 'mem' %}{{ 'A' * 10**9 }}"
         "{% elif text == 'loop' %}" + LOOP + "{% else %}" + CHATML + "{% endif %}")
NORMAL = [{"id": str(i), "prompt": f"row {i}"} for i in range(4)]


def _model(root: Path, template: str | None = None) -> str:
    """dummy: a tiny random Llama; with a template, a byte tokenizer that carries it."""
    folder = root / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    if template is not None:
        from jobrunner.engine.load.tokenizer import Tokenizer
        Tokenizer.bytes_fallback(259).inner.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
        (folder / "chat_template.jinja").write_text(template)
    return f"dummy:{folder}"


# The peak is this process image's own (VmHWM): getrusage's ru_maxrss survives exec, so a child of a large
# pytest process would report its parent's peak.
_RUN = """
import re, sys
from jobrunner.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
with open("/proc/self/status") as f:
    print("PEAK_MB", int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) >> 10, file=sys.stderr)
sys.exit(code)
"""


def _submit(root: Path, dataset: Path, model: str, *args: str, timeout: float = 240):
    """(exit code, the output's rows by id, the process's peak RSS in MB): `jobrunner submit` in a process
    of its own, so that its peak is the job's."""
    out = root / "out"
    cmd = [sys.executable, "-c", _RUN, "submit", str(dataset), "-o", str(out), "--model", model,
           "--max-tokens", "2", "--device", "cpu", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert "PEAK_MB" in p.stderr, f"the job died (exit {p.returncode}): {p.stderr[-2000:]}"
    peak = int(p.stderr.rsplit("PEAK_MB", 1)[1].split()[0])
    from jobrunner.output import read_results
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()} if (out / "_manifest.json").exists() else {}
    return p.returncode, rows, peak


# -- templates ---------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{{ 'A' * 10**9 }}",
    "{% set n = 10**9 %}{{ ['A'] * n }}",
    "{% set ns = namespace(s='A') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='A') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'a'|center(10**9) }}",
    "{{ 'a'.ljust(10**9) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '{:999999999}'.format(1) }}",
    "{% set s = 'a' * 100000 %}{{ s.replace('', s) }}",
    "{% set s = 'a' * 100000 %}{{ s|replace('', s) }}",
    "{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|join }}",
    "{% set s = 'a' * 1000000 %}{{ [s] * 1000 }}",
    "{% set s = '\n' * 1000000 %}{{ s|indent(1000) }}",
    "{{ {'a': [[1]]}|tojson(indent=10**6) }}",
    "{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
])
def test_a_template_past_the_size_bound_stops_before_making_it(source):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateBoundError):
            render(compile_template(source), messages=[])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_CHARS + (32 << 20)      # at most a value within the bound, never the bomb's


@pytest.mark.parametrize("source", [
    LOOP,
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
])
def test_a_template_past_the_time_bound_stops_in_time(source):
    start = time.monotonic()
    with pytest.raises(TemplateBoundError, match="more than 0.5 s"):
        render(compile_template(source), seconds=0.5, messages=[])
    assert time.monotonic() - start < 10       # bounded (unbounded, these run for hours); slack for a loaded machine


def test_bounded_renders_equal_transformers_renders():
    """The bounds change no render within them: the templates of two model families with tools, and
    one that uses every operator and filter the bounds wrap, render as transformers renders them."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from tests.tool_templates import LLAMA31, QWEN25
    wrapped = ("{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.role[0] %}"
               "{{ loop.index }}/{{ loop.length }}{{ '%s-%03d' % (m.role, loop.index) }}{{ '{:>6}'.format(m.role) }}"
               "{{ m.content|indent(2)|trim }}{{ m.content|replace('a', 'bb') }}{{ ' '.join([m.role, 'x']) }}"
               "{% endfor %}{{ ns.s * 3 }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}{{ tools|tojson(indent=2) }}"
               "{% for t in [[1, [2, 3]], [4]] recursive %}<{% if t is iterable %}{{ loop(t) }}{% else %}{{ t }}"
               "{% endif %}>{% endfor %}{{ messages|map(attribute='role')|join(',') }}")
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    chats = [[{"role": "user", "content": "Hi, what is 2+2?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nworld\ttab " * 500},
              {"role": "assistant", "content": "Hey."}, {"role": "user", "content": "a" * 5000}]]
    for source in (QWEN25, LLAMA31, CHATML, wrapped):
        ours, theirs = compile_template(source), _compile_jinja_template(source)
        for messages in chats:
            for offered in (None, tools):
                variables = dict(messages=messages, tools=offered, add_generation_prompt=True, bos_token="<s>",
                                 date_string="26 Jul 2024")
                assert render(ours, **variables) == theirs.render(**variables)


def test_bomb_templates_fail_their_rows_and_the_job_goes_on(tmp_path):
    """A model whose template takes all memory on one row and loops 10^10 times on another: both rows
    fail, saying why, the others are written; the job's peak memory is a tiny job's (before: over 4 GB
    for `'A' * 10**9`, the loop until killed)."""
    rows = NORMAL[:2] + [{"id": "mem", "prompt": "mem"}, {"id": "loop", "prompt": "loop"}] + NORMAL[2:]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.monotonic()
    code, out, peak = _submit(tmp_path, dataset, _model(tmp_path, BOMBS), "--chat")
    assert code == 0 and len(out) == 6
    assert "makes a repeated value over" in out["mem"]["error"]
    assert "ran for more than" in out["loop"]["error"]
    assert all(out[r["id"]]["error"] is None for r in NORMAL)
    assert peak < JOB_PEAK_MB
    assert time.monotonic() - start < 120


def test_sigterm_stops_a_job_held_by_a_looping_template(tmp_path):
    """SIGTERM while every row's template loops: the job exits 130 within one render's bound."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps({"id": str(i), "prompt": "loop"}) + "\n" for i in range(50)))
    cmd = [sys.executable, "-c", "import sys; from jobrunner.cli.main import main; main(sys.argv[1:])", "submit",
           str(dataset), "-o", str(tmp_path / "out"), "--model", _model(tmp_path, BOMBS), "--chat",
           "--max-tokens", "2", "--device", "cpu"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:       # the rows render (each for MAX_SECONDS) once the model has loaded
            if " loaded in " in line or time.monotonic() > deadline:
                break
        assert p.poll() is None, "the job ended before its rows rendered"
        time.sleep(1)               # inside the first rows' renders
        p.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = p.wait(timeout=60)
        assert code == 130
        assert time.monotonic() - sent < 30      # one render (5 s) and the exit; unbounded, the 50 rows take 250 s
    finally:
        if p.poll() is None:
            p.kill()


# -- rows over --max-row-bytes -------------------------------------------------------

def _huge_parquet(path: Path) -> None:
    rows = NORMAL[:2] + [{"id": "big", "prompt": "word " * (10 << 20)}] + NORMAL[2:]      # a 50 MiB cell
    pq.write_table(pa.Table.from_pylist(rows), path)


def _huge_jsonl(path: Path) -> None:
    """A gzip of a few hundred KB whose third line is 256 MiB long."""
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write("".join(json.dumps(r) + "\n" for r in NORMAL[:2]).encode())
        f.write(b'{"id": "big", "prompt": "')
        for _ in range(256):
            f.write(b"a" * (1 << 20))
        f.write(b'"}\n')
        f.write("".join(json.dumps(r) + "\n" for r in NORMAL[2:]).encode())


def _huge_csv(path: Path) -> None:
    """A 64 MiB quoted cell over two lines (a newline inside), then a record that spans lines."""
    with open(path, "w") as f:
        f.write("id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in NORMAL[:2]))
        f.write('big,"' + "b" * (32 << 20) + "\n" + "c" * (32 << 20) + '"\n')
        f.write('2,"row\n2"\n3,row 3\n')


@pytest.mark.parametrize("name, make", [("d.parquet", _huge_parquet), ("d.jsonl.gz", _huge_jsonl),
                                        ("d.csv", _huge_csv)])
def test_a_huge_row_is_an_error_row_and_the_job_goes_on(tmp_path, name, make):
    """Before: past 4 GB (the Parquet cell, the CSV cell) and still counting (the JSONL line)."""
    dataset = tmp_path / name
    make(dataset)
    code, out, peak = _submit(tmp_path, dataset, _model(tmp_path))
    assert code == 0
    big = [r for r in out.values() if r["error"] is not None]
    assert len(big) == 1 and "over --max-row-bytes 4194304" in big[0]["error"]
    assert len(out) == len(NORMAL) + 1 and all(out[r["id"]]["error"] is None for r in NORMAL)
    assert peak < JOB_PEAK_MB
    # Parquet keeps the id of a row not read (its id cell is small); a line not read has none
    assert big[0]["id"] == ("big" if name == "d.parquet" else "row-2")


def test_max_row_bytes_raised_reads_the_row(tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in [{"id": "a", "prompt": "x" * 5000}, NORMAL[0]]))
    small = [r for batch in read_rows(str(dataset), max_row_bytes=4096) for r in batch]
    assert "over --max-row-bytes 4096" in small[0].error and small[1].error is None
    large = [r for batch in read_rows(str(dataset), max_row_bytes=8192) for r in batch]
    assert [r.error for r in large] == [None, None] and large[0].data["prompt"] == "x" * 5000


def test_a_csv_record_over_the_bound_ends_where_it_did(tmp_path):
    """A quoted cell whose lines are each short but together over the bound: one error row, and the
    records after it read as they are."""
    dataset = tmp_path / "d.csv"
    dataset.write_text('id,prompt\nbig,"' + "x\n" * 3000 + '"\nnext,"two\nlines"\nlast,plain\n')
    rows = [r for batch in read_rows(str(dataset), max_row_bytes=1000) for r in batch]
    assert [r.id for r in rows][1:] == ["next", "last"]
    assert "over --max-row-bytes 1000" in rows[0].error
    assert rows[1].data == {"id": "next", "prompt": "two\nlines"} and rows[2].error is None
    assert count_rows(str(dataset)) == 3


def test_counting_one_huge_line_is_linear_and_holds_a_chunk(tmp_path):
    """count_rows over a gzip whose one line is 256 MiB: one pass, holding a read's chunk (before: each
    chunk joined to the line so far, the whole line held)."""
    dataset = tmp_path / "d.jsonl.gz"
    _huge_jsonl(dataset)
    tracemalloc.start()
    try:
        assert count_rows(str(dataset)) == len(NORMAL) + 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_max_row_bytes_is_an_input_option():
    from click.testing import CliRunner

    from jobrunner.cli.main import main
    assert InputOptions().max_row_bytes == DEFAULT_MAX_ROW_BYTES
    r = CliRunner().invoke(main, ["submit", "nothing.jsonl", "-o", "out", "--max-row-bytes", "0"])
    assert r.exit_code == 2 and "--max-row-bytes must be >= 1" in r.output
    from jobrunner.config.job import job_config
    assert "max_row_bytes" not in job_config("d.jsonl", max_row_bytes=1 << 20).fingerprint_fields()
