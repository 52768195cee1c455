"""RMSNorm: the torch reference and dispatch (norm.py) beside its Triton kernel."""
