"""The training data the target makes: stage `generate` (its own replies, greedy and sampled), stage
`synthesize` (prompts it writes itself; dedup.py keeps them clear of every human prompt), both through the
backends of backends.py (transformers in the worker, or a serving engine), and stage `vocab` (the draft
vocabulary from the replies' token counts)."""
