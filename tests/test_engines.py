"""The engines' contracts where a real engine cannot run here. SGLang cannot run on these machines: its
command line is checked against the flags of the SGLang release we support, and its accept-length parsing
against its documented output. vLLM's metric parsing is also exercised for real in test_vllm.py."""

import json
import os
import subprocess
import sys
import time

from eagle3_assets.worker.engines import sglang, vllm

# SGLang's launch_server flags for the fields we set, as ServerArgs declares them
# (python/sglang/srt/server_args.py, sgl-project/sglang main @001067ff, the 0.5 line): the flag is the field
# name with dashes, plus declared aliases. --speculative-algorithm takes EAGLE3 (uppercased, then checked).
SGLANG_FLAGS = {
    "--model-path": str, "--model": str, "--served-model-name": str, "--host": str, "--port": int,
    "--dtype": {"auto", "half", "float16", "bfloat16", "float", "float32"}, "--context-length": int,
    "--random-seed": int, "--mem-fraction-static": float, "--enable-metrics": None, "--decode-log-interval": int,
    "--speculative-algorithm": {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"},
    "--speculative-draft-model-path": str, "--speculative-num-steps": int, "--speculative-eagle-topk": int,
    "--speculative-num-draft-tokens": int, "--skip-server-warmup": None, "--log-level": str,
}


def _parse_flags(argv: list[str]) -> dict:
    """argv after `-m sglang.launch_server` -> {flag: value or None}, failing on anything SGLang would reject."""
    out, i = {}, 0
    while i < len(argv):
        flag = argv[i]
        assert flag in SGLANG_FLAGS, f"{flag} is not a flag of the supported SGLang release"
        kind = SGLANG_FLAGS[flag]
        if kind is None:
            out[flag], i = None, i + 1
            continue
        value = argv[i + 1]
        if isinstance(kind, set):
            assert value in kind, f"{flag} {value!r} not in {sorted(kind)}"
        else:
            kind(value)  # raises if SGLang's parser would
        out[flag], i = value, i + 2
    return out


def test_sglang_eagle3_command_line_uses_only_the_supported_flags():
    argv = sglang.server_command("/venv/bin/python", "/models/t", 30001, drafter="/exports/sglang", k=3,
                                 dtype="bfloat16", max_model_len=4096, seed=0, extra=["--mem-fraction-static", "0.8"])
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    flags = _parse_flags(argv[3:])
    assert flags["--speculative-algorithm"] == "EAGLE3"  # EAGLE with an EAGLE-3 draft accepts ~nothing, silently
    assert flags["--speculative-draft-model-path"] == "/exports/sglang"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"], flags["--speculative-num-draft-tokens"]) \
        == ("3", "1", "4")  # a chain of k drafts, k+1 tokens verified
    assert flags["--mem-fraction-static"] == "0.8"  # extra arguments pass through
    baseline = _parse_flags(sglang.server_command("p", "/models/t", 1, drafter=None, k=3, dtype="float32",
                                                  max_model_len=2048, seed=0, extra=[])[3:])
    assert not any(f.startswith("--speculative") for f in baseline)


def test_sglang_accept_length_from_its_documented_server_info():
    # GET /get_server_info: server args merged with internal_states (one per data-parallel rank) and version
    info = {"model_path": "/models/t", "speculative_algorithm": "EAGLE3", "version": "0.5.6",
            "internal_states": [{"avg_spec_accept_length": 2.71, "last_gen_throughput": 151.2}]}
    assert sglang.accept_length(info) == 2.71
    assert sglang.accept_length({"internal_states": [{}], "version": "0.5.6"}) is None  # nothing counted yet
    assert sglang.accept_length({"avg_spec_accept_length": 1.9}) == 1.9  # older releases: top level


def test_vllm_acceptance_from_two_metrics_scrapes():
    def scrape(drafts, drafted, accepted, per_pos):
        lines = ["# TYPE vllm:spec_decode_num_drafts counter",
                 f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="target"}} {drafts}',
                 'vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e9',
                 f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="target"}} {drafted}',
                 f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="target"}} {accepted}']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="target",position="{i}"}} {v}'
                  for i, v in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    got = vllm.acceptance(scrape(10, 30, 12, [8, 3, 1]), scrape(110, 330, 162, [88, 53, 21]), k=3)
    assert got["num_drafts"] == 100 and got["num_accepted_tokens"] == 150
    assert got["acceptance_length"] == 2.5  # 1 + accepted/drafts, the bonus token included
    assert got["acceptance_rate"] == 0.5
    assert got["acceptance_per_pos"] == [0.8, 0.5, 0.2]


def test_vllm_command_line_is_vllm_serve_with_an_eagle3_speculative_config():
    argv = vllm.server_command("/venv/bin/python", "/models/t", 8001, drafter="/exports/vllm", k=3, dtype="bfloat16",
                               max_model_len=4096, seed=0, extra=["--enforce-eager"])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/exports/vllm", "num_speculative_tokens": 3}
    assert argv[-1] == "--enforce-eager"


def test_sglang_missing_on_the_host_is_a_clear_error_in_seconds(built, tmp_path):
    t = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.worker", "serve_bench", "--workdir", str(built.workdir), "--args",
         json.dumps({"engine": "sglang", "target": built.latest("target_model")["path"], "drafter": "x",
                     "prompts": "prompts/eval.parquet", "out_dir": str(tmp_path), "history": str(tmp_path / "h")})],
        capture_output=True, text=True, env={**os.environ, "EAGLE3_NO_BAR": "1"}, timeout=120)
    assert done.returncode != 0
    assert "sglang is not installed for" in done.stderr and "pip install 'sglang[all]'" in done.stderr
    assert time.monotonic() - t < 60
