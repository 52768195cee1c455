"""A worker that dies like a crash: `python tests/faulty_worker.py RANK:ROWS [ARGS...]` (see command()).

The worker of rank RANK wraps its first round's claim: once it has written ROWS rows, the next claim,
with requests still in its engine, ends the process (os._exit(DIE_CODE)) holding unfinished units:
they and its unflushed rows are lost. Other ranks run normally.

Without ARGS it is a launcher's worker (point jobrunner.parallel.launcher.WORKER_COMMAND at it); with
them it runs `jobrunner ARGS...`, as each rank does under torchrun.
"""
from __future__ import annotations

import os
import sys

from jobrunner.parallel import worker

DIE_CODE = 17


def command(rank: int, rows: int) -> list[str]:
    """This worker's command line: for launcher.WORKER_COMMAND, or with `submit ...` added, a torchrun rank."""
    return [sys.executable, os.path.abspath(__file__), f"{rank}:{rows}"]


def die_after_rows(rows: int) -> None:
    """Wrap the claim of the first Job a worker opens (round 0: every worker's first round) in this process."""
    from dataclasses import replace
    real = worker.open_job

    def faulty_open_job(cfg, resolved, *, work, **kw):
        worker.open_job = real          # later rounds run as they would
        built = []

        def claim_or_die(index: int) -> bool:
            job = built[0]
            if job.stats.rows >= rows and job.engine.num_in_flight:
                os._exit(DIE_CODE)
            return work.claim(index)
        built.append(real(cfg, resolved, work=replace(work, claim=claim_or_die), **kw))
        return built[0]

    worker.open_job = faulty_open_job


def main(argv: list[str]) -> int:
    rank, rows = (int(x) for x in argv[0].split(":"))
    if os.environ["RANK"] == str(rank):
        die_after_rows(rows)
    if argv[1:]:
        from jobrunner.cli import main as cli
        return cli(args=argv[1:], prog_name="jobrunner")
    from jobrunner.parallel.launcher import worker_process_main
    return worker_process_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
