"""Hidden-state shards as files: the writer (part buffers filled while the GPU computes, written and hashed by
threads) and the tensors of a part (fp8 quantization, the safetensors layout, the checks before writing). The
format itself: common/shard_format.py. Extraction (hidden_states/, the engines) writes through here, training
reads the parts back."""
