"""The model on its device: the runtime that builds it (weights, quantization, packing, LoRA,
tensor-parallel followers), the model runner's forward, the CPU decode kernel's build, CUDA graphs, the
vision tower's embedding store, and what an open engine changes for the process."""
