"""Where each asset's files live under the host work directory: the relative paths the stages are given.
One module, so that an asset reading another's output depends on this layout, not on that asset's code
(code_versions.py: each asset is versioned by the modules it imports)."""

TRAIN, EVAL, EVAL_HUMANEVAL = "prompts/train.parquet", "prompts/eval.parquet", "prompts/eval_humaneval.parquet"
PROMPT_SETS = {"eval": EVAL, "humaneval": EVAL_HUMANEVAL, "train": TRAIN}  # the eval sets a benchmark may use
HELD_OUT = [EVAL, EVAL_HUMANEVAL]  # every held-out prompt set: never trained on, nor near-copied by synthesis
SYNTHETIC = "prompts/synthetic.parquet"  # prompts the target wrote (synthetic_prompts)
CONVERSATIONS = "conversations/conversations.parquet"
SHARDS_DIR = "hidden_states"  # shard-NNNNN/ per partition
VOCAB = "vocab/vocab_mapping.safetensors"
DRAFTER_DIR = "drafter"  # <run_name>/ per training run
EXPORT_DIR = "exports"  # <drafter version>/ per export
