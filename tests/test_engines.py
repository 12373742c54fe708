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


# ---- SGLang's hidden-state capture (worker/sglang_capture.py) against the source of the release it targets ----
import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SGLANG_SRC = Path(__file__).resolve().parents[1] / ".venv" / "engine-src" / "sglang-0.5.14" / "sglang"
needs_sglang_src = pytest.mark.skipif(not SGLANG_SRC.exists() and os.environ.get("CI") != "true",
                                      reason="the SGLang 0.5.14 source is fetched by `.ci/setup --tests`")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8-sig"))  # some of its files start with a BOM


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(func_name: str) -> list[set[str]]:
    """The keyword names of every call to `func_name` in our capture code."""
    ours = _tree(Path(__file__).resolve().parents[1] / "eagle3_assets" / "worker" / "sglang_capture.py")
    out = []
    for n in ast.walk(ours):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == func_name:
                out.append({k.arg for k in n.keywords if k.arg})
    assert out, f"no call to {func_name} in sglang_capture.py"
    return out


@needs_sglang_src
def test_our_sglang_capture_calls_only_what_sglang_0_5_14_defines():
    srt = SGLANG_SRC / "srt"
    runner = _class(_tree(srt / "model_executor" / "model_runner.py"), "ModelRunner")
    for kw in _calls("ModelRunner"):
        assert kw <= _params(_method(runner, "__init__")), kw - _params(_method(runner, "__init__"))
    for m in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs", "forward"):
        _method(runner, m)
    server_args = _class(_tree(srt / "server_args.py"), "ServerArgs")
    fields = {n.target.id for n in server_args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for kw in _calls("ServerArgs"):
        assert kw <= fields, kw - fields
    _method(_class(_tree(srt / "server_args.py"), "PortArgs"), "init_new")
    sched = _tree(srt / "managers" / "schedule_batch.py")
    req = _class(sched, "Req")
    for kw in _calls("Req"):
        assert kw <= _params(_method(req, "__init__"))
    _method(req, "set_extend_input_len")
    for kw in _calls("init_new"):
        if "reqs" in kw:
            assert kw <= _params(_method(_class(sched, "ScheduleBatch"), "init_new"))
    _method(_class(sched, "ScheduleBatch"), "prepare_for_extend")
    fbi = _tree(srt / "model_executor" / "forward_batch_info.py")
    assert "FULL" in {t.id for n in _class(fbi, "CaptureHiddenMode").body if isinstance(n, ast.Assign) for t in n.targets}
    lp = (srt / "layers" / "logits_processor.py").read_text()
    # FULL capture returns the concatenated aux states of every token, in layer order
    assert "capture_hidden_mode.is_full()" in lp and "torch.cat(aux_hidden_states, dim=-1)" in lp
    for model in ("llama.py", "deepseek_v2.py"):
        src = (srt / "models" / model).read_text()
        assert "self.layers_to_capture" in src and "self.capture_aux_hidden_states" in src
        assert "self.norm(hidden_states, residual)" in src  # the final norm's residual output: the pre-norm state
        assert "if i in self.layers_to_capture" in src  # captured at the loop's top: the input of layer i
    assert "self.language_model" in (srt / "models" / "kimi_k25.py").read_text()


@needs_sglang_src
def test_sglang_model_classes_that_read_layer_ids_by_their_first_id_are_the_ones_we_know():
    """sglang.FIRST_ID_RULE: the model types whose set_eagle3_layers_to_capture adds 1 only when the first id
    is 1 (sglang PR #25454), found in SGLang's source rather than remembered."""
    odd = set()
    for f in sorted((SGLANG_SRC / "srt" / "models").glob("*.py")):
        tree = _tree(f)
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name == "set_eagle3_layers_to_capture" \
                    and "layer_ids[0] == 1" in ast.unparse(fn):
                odd.add(f.stem)
    assert odd == {"deepseek_v2", "glm4_moe_lite"}
    assert {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "glm4_moe_lite"} == set(sglang.FIRST_ID_RULE)
    # and ours follows it: a Kimi export of the default ids means output-of-layer to every release
    assert sglang.captured_layers([1, 29, 57], "kimi_k2") == [1, 29, 57]
    assert sglang.captured_layers([2, 30, 58], "kimi_k2") == [1, 29, 57]
    assert sglang.captured_layers([2, 30, 58], "llama") == [2, 30, 58]


def test_sglang_capture_layer_translation():
    # SGLang captures a layer's input (ours + 1); the last layer's output is the final state
    assert sglang.capture_layers([1, 29, 57], 61) == ([2, 30, 58], [0, 1, 2], 3)
    assert sglang.capture_layers([1, 14, 29], 30) == ([2, 15], [0, 1, 2], 2)
