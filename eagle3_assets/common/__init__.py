"""What both halves read: the engine registry, the hidden-state shard format, the host probe, Markdown charts and
the environment a worker is started with. Standard library only (torch appears in no import), so the control
plane, the stage contracts and the worker all import from here; nothing here imports either half."""
