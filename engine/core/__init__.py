"""The step: the Engine's loop (schedule, launch, collect, process), turning finished sequences into
outputs, and the stop checks. The top of the engine: it imports the folders below, none imports it."""
