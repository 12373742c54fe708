"""The base drafter shipped for the embedded target (bench/base_drafter.py): its files are the ones its lineage
names, and the main command's preset finetunes it through the layer-id check."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from eagle3_assets.worker.errors import StageError
from eagle3_assets.worker.training.base_drafters import SHIPPED, init_dir

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "eagle3_assets" / "presets" / "embedded_cpu.yaml"


def test_shipped_base_drafter_is_the_one_its_lineage_describes():
    d = SHIPPED / "smollm2-135m-instruct"
    lineage = json.loads((d / "lineage.json").read_text())
    # (dot files: the hash caches a finetune's fingerprint writes beside the weights)
    files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.iterdir()
             if f.name != "lineage.json" and not f.name.startswith(".")}
    assert files == lineage["files"]
    assert lineage["commit"] and lineage["device"] and lineage["recipe"]["epochs"] > 0
    assert all((d / name).stat().st_size < 16 << 20 for name in files)


def test_embedded_preset_finetunes_the_shipped_drafter_on_its_target_layers():
    from transformers import AutoConfig

    from eagle3_assets.common.shard_format import default_aux_layers
    from eagle3_assets.worker.target.prepare import embedded_gguf
    from eagle3_assets.worker.training.checkpoint import check_finetune_layers, load_drafter_dir, read_aux_ids

    init_from = yaml.safe_load(PRESET.read_text())["ops"]["eagle3_drafter"]["config"]["init_from"]
    d = init_dir("/nonexistent", init_from)
    gguf = embedded_gguf()
    tc = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg, weights = load_drafter_dir(d, tc)  # validates every tensor against the target
    ids = read_aux_ids(json.loads((d / "config.json").read_text()), tc.num_hidden_layers, tc.model_type)
    # what the main command's shards hold: the default aux layers
    check_finetune_layers(d, ids, default_aux_layers(tc.num_hidden_layers), tc.num_hidden_layers)
    assert cfg.draft_vocab_size == weights["d2t"].shape[0]


def test_unknown_shipped_drafter_is_refused_naming_the_shipped_ones():
    with pytest.raises(StageError, match=r"no base drafter 'llama-8b' ships .*shipped: smollm2-135m-instruct"):
        init_dir("/work", "shipped:llama-8b")
