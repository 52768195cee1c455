"""Who runs next, torch-free: the scheduler, the KV manager over the block pool, sequences and
their prompt images. Tested on CPU with tiny pools and exact block ids."""
