"""The Dagster layer: one module per stage, thin: each says what runs where and what it records."""

from .conversations import conversations
from .hidden_states import hidden_state_shards
from .prompts import prompts
from .target import target_model
from .vocab import vocab_mapping

data_assets = [target_model, prompts, conversations, hidden_state_shards, vocab_mapping]
