"""`python -m jobrunner.engine.run.follower`: rank r > 0 of a tensor-parallel group (started by launch.Followers).

It builds its shard of the model and of the KV cache exactly as rank 0 builds its own (the same
EngineConfig, the same runtime code), then runs rank 0's plans until rank 0 ends the group. Exit
codes: 0 when rank 0 ended it, 1 when rank 0 went away (its connection closed or it died), 2 when
the model could not be built here.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"%(asctime)s tp-rank {os.environ['JOBRUNNER_TP_RANK']} %(levelname)s %(message)s")
    leader = int(os.environ["JOBRUNNER_TP_LEADER_PID"])
    threading.Thread(target=_orphan_watch, args=(leader,), daemon=True).start()

    from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
    from jobrunner.engine.api.errors import ModelError
    from jobrunner.engine.run.model_runner import ModelRunner
    from jobrunner.engine.parallel.channel import StepChannel
    from jobrunner.engine.parallel.launch import destroy_group, join_group
    from jobrunner.engine.run.runtime import build_runtime, resolve_device

    config = EngineConfig(**json.loads(os.environ["JOBRUNNER_TP_CONFIG"]))
    rank = int(os.environ["JOBRUNNER_TP_RANK"])
    device = resolve_device(config.device, rank)
    tp = join_group(config, rank, int(os.environ["JOBRUNNER_TP_PORT"]), device)
    try:
        try:
            rt = build_runtime(config, tp=tp)
        except (ModelError, ConfigError) as e:
            logging.error("%s", e)
            return 2
        runner = ModelRunner(rt.model, rt.num_blocks, config.block_size, rt.kv_dtype, rt.device, rt.eos_token_ids,
                             channel=StepChannel(tp, rt.device), loras=rt.loras)
        if config.cuda_graphs and rt.device.type == "cuda" and not config.loras:   # rank 0 captures the same graphs, collectives and all
            runner.enable_graphs(rt.max_num_seqs, rt.max_model_len(config.block_size))
        runner.follow()
    except RuntimeError as e:           # rank 0's connection closed: it is gone, and its rows are its to redo
        logging.warning("rank 0 went away (%s)", str(e).splitlines()[0][:200])
        return 1
    finally:
        destroy_group()                 # before exit: a group torn down by the interpreter aborts the process
    return 0


def _orphan_watch(leader: int) -> None:
    """Rank 0's process is gone (killed): stop at once."""
    while os.getppid() == leader:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
