"""What the product's folders share: storage through fsspec and the one atomic write (storage.py), a compact
set of ids (idset.py), CPU threads (threads.py), a run's figures (run_stats.py) and durations as a person
reads them (durations.py). Imports no other folder of the product."""
