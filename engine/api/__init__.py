"""The types the engine's public face speaks (engine/__init__.py re-exports them): requests and
their outputs, the running counters, the engine's info and its errors. Torch-free; imports only config/."""
