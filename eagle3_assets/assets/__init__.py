"""The Dagster layer of the pipeline, from the data to a benchmarked drafter: one module per stage, thin: each says
what runs where and what it records."""

from .acceptance import offline_acceptance
from .conversations import conversations
from .drafter import eagle3_drafter
from .export import drafter_export
from .hidden_states import hidden_state_shards
from .history import benchmark_history, benchmark_regression
from .host import host_preflight
from .integration import integration_check, integration_drafter
from .prompts import prompts
from .serving import serving_benchmark
from .speculation_schedule import speculation_schedule
from .synthetic_prompts import synthetic_prompts
from .target import target_model
from .vocab import vocab_mapping

data_assets = [target_model, prompts, synthetic_prompts, conversations, hidden_state_shards, vocab_mapping]
drafter_assets = [eagle3_drafter, drafter_export, offline_acceptance]
serving_assets = [speculation_schedule, serving_benchmark, benchmark_history, benchmark_regression]
integration_assets = [integration_drafter, integration_check]
# From the data to a benchmarked drafter; the serving eye's and the loop's assets are in eye/ and loop/
pipeline_assets = data_assets + integration_assets + drafter_assets + serving_assets + [host_preflight]
