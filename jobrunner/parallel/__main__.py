"""`python -m jobrunner.parallel`: one worker process, started by the launcher (launcher.WORKER_COMMAND)."""
import sys

from jobrunner.parallel.launcher import worker_process_main

sys.exit(worker_process_main())
