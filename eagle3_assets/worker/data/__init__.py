"""The training data the target makes: stage `generate` (the target's own replies, on transformers or a
serving engine) and stage `vocab` (the draft vocabulary from their token counts)."""
