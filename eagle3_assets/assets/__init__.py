"""The Dagster layer: one module per stage, thin: each says what runs where and what it records."""

from .acceptance import offline_acceptance
from .conversations import conversations
from .drafter import eagle3_drafter
from .drift_report import make_drift_report
from .export import drafter_export
from .hidden_states import hidden_state_shards
from .history import benchmark_history, benchmark_regression
from .host import host_preflight
from .integration import integration_check, integration_drafter
from .promotion import production_drafter, promotion_gate
from .prompts import prompts
from .retrain import challenger_drafter, challenger_export, retrain_conversations, retrain_data, retrain_shards
from .rollout import rollout
from .serving import serving_benchmark
from .synthetic_prompts import synthetic_prompts
from .target import target_model
from .traffic import traffic
from .traffic_acceptance import traffic_acceptance
from .vocab import vocab_mapping

data_assets = [target_model, prompts, synthetic_prompts, conversations, hidden_state_shards, vocab_mapping]
drafter_assets = [eagle3_drafter, drafter_export, offline_acceptance]
# drift_report here without the watched servers' live assets upstream; definitions.py makes it with them
serving_assets = [serving_benchmark, benchmark_history, benchmark_regression, traffic, traffic_acceptance,
                  make_drift_report([])]
integration_assets = [integration_drafter, integration_check]
loop_assets = [retrain_data, retrain_conversations, retrain_shards, challenger_drafter, challenger_export,
               promotion_gate, production_drafter, rollout]
all_assets = data_assets + integration_assets + drafter_assets + serving_assets + loop_assets + [host_preflight]
