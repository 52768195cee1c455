"""LoRA adapters (PEFT's format) applied per row: adapter.py reads and checks one, modules.py wraps
the model's projections so every step adds each row's adapter delta, grouped by adapter."""
