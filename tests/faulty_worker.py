"""A worker that dies like a crash: `python tests/faulty_worker.py RANK:ROWS [ARGS...]` (see command()).

The worker of rank RANK ends its process (os._exit(DIE_CODE)) in its first round as soon as it has
finished ROWS rows, with the requests still in its engine: they and its unflushed rows are lost.
Other ranks run normally.

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
    """Wrap the progress of the first Job a worker opens (round 0: every worker's first round) in this
    process: the step that finishes its ROWS-th row ends the process. Not a claim: a rank whose units
    were all claimed before its first row finished makes no claim after it, and lived (a flaky test)."""
    real = worker.open_job

    class DyingProgress:
        def __init__(self, progress):
            self.progress = progress

        def update(self, stats, force: bool = False) -> None:
            if stats.rows >= rows:
                os._exit(DIE_CODE)
            self.progress.update(stats, force)

        def close(self) -> None:
            self.progress.close()

    def faulty_open_job(cfg, resolved, *, progress, **kw):
        worker.open_job = real          # later rounds run as they would
        return real(cfg, resolved, progress=DyingProgress(progress), **kw)

    worker.open_job = faulty_open_job


def main(argv: list[str]) -> int:
    rank, rows = (int(x) for x in argv[0].split(":"))
    if os.environ["RANK"] == str(rank):
        die_after_rows(rows)
    if argv[1:]:
        from jobrunner.cli.main import main as cli
        return cli(args=argv[1:], prog_name="jobrunner")
    from jobrunner.parallel.launcher import worker_process_main
    return worker_process_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
