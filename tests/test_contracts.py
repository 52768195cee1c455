"""The job layer's typed contracts (issue 59, item 3): each Protocol's implementations offer its face with
the same parameters; no field of the product is typed `object`; the whole JobConfig is taken only where a
job is assembled, and every other function takes the sections it reads."""
from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from jobrunner.jobs import KINDS
from jobrunner.jobs.kind import JobKind, VectorKind
from jobrunner.jobs.lora import LoraJob
from jobrunner.openai.routed import RoutedJob
from jobrunner.output import ResultWriter, RowSink
from jobrunner.parallel.worker import SharedUnits
from jobrunner.pipeline.contracts import JobProgress, RowWriter, WorkSource
from jobrunner.pipeline.plan import AllUnits
from jobrunner.pipeline.progress import Progress

ROOT = Path(__file__).resolve().parent.parent

# The modules that take a whole JobConfig: where a job is assembled (its resolve and build), its entry points
# (the API, the CLI's validate and warmup commands, the parallel launchers and workers). Every other
# function takes the sections it reads (config/sections.py).
ASSEMBLY = {"jobrunner/api/session.py", "jobrunner/api/submit.py", "jobrunner/cli/validate.py",
            "jobrunner/cli/warmup.py", "jobrunner/pipeline/build.py", "jobrunner/pipeline/resolve.py",
            "jobrunner/parallel/__init__.py", "jobrunner/parallel/launcher.py", "jobrunner/parallel/torchrun.py",
            "jobrunner/parallel/ray_driver.py", "jobrunner/parallel/worker.py"}


def _members(protocol) -> list[str]:
    return sorted(m for m in protocol.__protocol_attrs__ if not m.startswith("_")) \
        if hasattr(protocol, "__protocol_attrs__") else sorted(typing._get_protocol_attrs(protocol))


def _parameters(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def _offers(obj, protocol) -> None:
    """obj has every member of `protocol`, and each method takes the protocol's parameters, by name, in order."""
    what = type(obj).__name__
    for name in _members(protocol):
        assert hasattr(obj, name), f"{what} lacks {protocol.__name__}.{name}"
        want = getattr(protocol, name, None)     # a bare annotation (rank: int) has no value
        if inspect.isfunction(want):
            have = getattr(obj, name)
            assert _parameters(have)[:len(_parameters(want))] == _parameters(want), (what, name)
    assert isinstance(obj, protocol)


def test_every_kind_offers_the_job_kind_face():
    kinds = [*KINDS.values(), LoraJob, RoutedJob]
    for cls in kinds:
        for name in ("request", "columns"):
            want = getattr(JobKind, name)
            assert _parameters(getattr(cls, name)) == _parameters(want), (cls.__name__, name)
    assert all(isinstance(k.result_columns, dict) for k in KINDS.values())
    assert {k.name for k in KINDS.values()} == set(KINDS)
    assert hasattr(KINDS["embed"], "vector_size") and hasattr(RoutedJob, "vector_size")
    assert VectorKind.vector_size.__name__ == "vector_size"


def test_a_routed_and_a_lora_kind_are_job_kinds():
    """Made on a tiny tokenizer, the wrappers are JobKinds at run time too (a LoRA job forwards the rest of
    its inner kind's face: vector_size)."""
    from jobrunner.config.job import job_config
    from jobrunner.jobs import make_job

    class _Tokenizer:
        has_chat_template = False
        eos_token_ids = (0,)

        def decode(self, ids):
            return ""

    spec = job_config("x.jsonl").job_spec()
    main = make_job(spec, _Tokenizer())
    assert isinstance(main, JobKind) and not isinstance(main, VectorKind)
    routed = RoutedJob(main, spec, _Tokenizer())
    lora = LoraJob(routed, ("a",), by_model=True)
    assert isinstance(routed, VectorKind) and isinstance(lora, VectorKind)
    assert lora.name == "generate" and "adapter" in lora.result_columns


def test_both_writers_offer_the_row_writer_face(tmp_path):
    _offers(ResultWriter(str(tmp_path / "out"), {"config": {}}), RowWriter)
    _offers(RowSink(), RowWriter)


def test_the_work_sources_offer_their_face():
    from jobrunner.parallel import ray_worker
    shared = SharedUnits(lambda index: index % 2 == 0, 1, 2, 16)
    for source in (AllUnits(), shared, ray_worker.QueueUnits(None, 1, 2)):
        _offers(source, WorkSource)
    assert shared.part_prefix == "part-r1" and not shared.hits_now and AllUnits().hits_now


def test_the_progress_objects_offer_their_face():
    import threading

    from jobrunner.parallel import ray_worker
    from jobrunner.parallel.worker import _StoreProgress
    work = ray_worker.QueueUnits(None, 0, 1)
    for progress in (Progress(total=3), _StoreProgress(None, 0, 0, 3),
                     ray_worker.QueueProgress(None, work, threading.Event())):
        _offers(progress, JobProgress)


def _product_files():
    for folder in ("jobrunner", "jobs"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_field_or_parameter_is_typed_object():
    found = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            ann = getattr(node, "annotation", None)
            if isinstance(node, (ast.AnnAssign, ast.arg)) and isinstance(ann, ast.Name) and ann.id == "object":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def _takes_job_config(fn: ast.FunctionDef) -> bool:
    for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
        ann = ast.unparse(a.annotation) if a.annotation is not None else ""
        if "JobConfig" in ann or (a.arg == "cfg" and not ann):
            return True
    return False


def test_the_whole_job_config_is_taken_only_where_the_job_is_assembled():
    takers: dict[str, list[str]] = {}
    for path in (ROOT / "jobrunner").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_job_config(node):
                takers.setdefault(str(path.relative_to(ROOT)), []).append(node.name)
    outside = {m: fns for m, fns in takers.items() if m not in ASSEMBLY}
    assert not outside, f"these take a whole JobConfig but are not where a job is assembled: {outside}"
    assert len(takers) <= len(ASSEMBLY)


def test_a_job_parts_fields_are_typed():
    from jobrunner.pipeline import build, pending
    for cls in (build.JobParts, pending.PendingRow):
        hints = typing.get_type_hints(cls, vars(build) | vars(pending) | _type_names())
        assert "object" not in {getattr(h, "__name__", "") for h in hints.values()}, cls


def _type_names() -> dict:
    from jobrunner.dataset.rows import Row
    from jobrunner.engine import Request
    from jobrunner.images.prepare import RowImages
    from jobrunner.jobs.row import RowNotes
    return {"Row": Row, "Request": Request, "RowImages": RowImages, "RowNotes": RowNotes}


def test_a_jobs_dataset_format_is_sniffed_once(tmp_path, monkeypatch):
    """resolve finds the format of a dataset given as --format auto (a JSONL file's first record tells an
    OpenAI batch file apart); the writer's schema reads the types with that format, not sniffing again."""
    import json
    import os

    from jobrunner.config.job import job_config
    from jobrunner.dataset import formats
    from jobrunner.pipeline.build import load_engine, open_job
    tiny = f"dummy:{os.path.join(ROOT, 'benchmarks', 'configs', 'tiny-llama.json')}"
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"row {i}"}) + "\n" for i in range(3)))
    engine = load_engine(job_config("unused", model=tiny, kv_cache_memory=4 * 10**6))
    sniffed = []
    first_record = formats._first_record
    monkeypatch.setattr(formats, "_first_record", lambda url: sniffed.append(url) or first_record(url))
    cfg = job_config(str(ds), output=str(tmp_path / "out"), model=tiny, max_tokens=1, chat=False)
    try:
        result = open_job(cfg, engine=engine).run()
    finally:
        engine.close()
    assert result.exit_code == 0 and result.stats["rows"] == 3
    assert sniffed == [str(ds)]
