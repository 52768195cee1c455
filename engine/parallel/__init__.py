"""Tensor parallelism: one engine spread over the devices of a group of processes (torch.distributed).

    group.py     this process's place in its group, the collectives the layers call, and the scoped
                 context the model is built under
    shards.py    which part of each checkpoint tensor a rank holds (local shapes, weight slices)
    channel.py   rank 0's step plans to the other ranks
    launch.py    rank 0 starts the other ranks and watches them
    follower.py  what the other ranks run: the same forward, from rank 0's plans

Rank 0 runs everything an engine has (scheduler, KV manager, sampling, outputs); the others hold
their shard of the weights and of the KV cache and run each step's forward from rank 0's plan.
"""
