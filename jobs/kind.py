"""The face of a job kind: what the product's pipeline asks of every kind (jobs.KINDS' classes, the
LoRA wrapper jobs.lora.LoraJob and an OpenAI batch's routed kind jobrunner.openai.routed.RoutedJob).

    request, notes = kind.request(row_id, prompt_ids, data, options)    # the intake: a row -> the engine
    rows = kind.columns(out, data, options, notes)                      # the emitter: an output -> rows

A kind keeps no per-row state: what its request step notes for its columns step travels as `notes`
(jobs.row.RowNotes) with the row. `result_columns` declares every column it may write, name -> kind
(jobrunner.output.values), so the output's schema is known before any row is written; a kind with a
"vector" column (embed) also says its size (VectorKind.vector_size)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jobrunner.engine import Request, RequestOutput
    from jobrunner.jobs.row import RowNotes, RowOptions


@runtime_checkable
class JobKind(Protocol):
    name: str                               # the --kind it answers (a wrapper: its inner kind's)
    result_columns: Mapping[str, str]       # column -> kind (jobrunner.output.values), every one it may write

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = ...) -> tuple[Request, RowNotes]:
        """The row's engine Request (its prompt ids, sampling, constraint) and the notes its columns step
        reads; RowError when this row cannot run (it becomes an error row, the job goes on)."""
        ...

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = ...,
                notes: RowNotes = ...) -> list[dict]:
        """The result columns of the row's output rows: one dict per output row (n > 1: one per sample)."""
        ...


@runtime_checkable
class VectorKind(JobKind, Protocol):
    """A kind with a "vector" result column (jobrunner.output.schema.VECTOR): its size is the job's."""

    def vector_size(self, hidden_size: int) -> int:
        ...
