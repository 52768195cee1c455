"""What the product's folders share: storage through fsspec and the one atomic write (storage.py), a compact
set of ids (idset.py), CPU threads (threads.py) and a run's figures (run_stats.py). Imports no other folder
of the product."""
