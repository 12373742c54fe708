"""Stage `extract`: the target's hidden states for every token of the conversations, through the transformers
forward (the hf backend, here) or a serving engine (worker/engines/: each engine's extraction backend).
The files they write: worker/shards/."""
