"""The engine's settings, torch-free and importing no other folder of the engine: EngineConfig and
the cache directory, a checkpoint's model, MoE and vision settings, the architectures table, generation
and pooling defaults, and the numerics version that result-cache keys carry."""
