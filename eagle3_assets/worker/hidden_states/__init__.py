"""Hidden states: stage `extract` (the transformers backend; the engines' backends are in worker/engines/),
the shard writer and the tensors of a shard part (fp8, part files). The format itself: common/shard_format.py."""
