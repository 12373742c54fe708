"""The engines' contracts where a real engine cannot run here. SGLang cannot run on these machines: its
command line is checked against the flags of the SGLang release we support, and its accept-length parsing
against its documented output. vLLM's metric parsing is also exercised for real in test_vllm.py. And the
registry (common/engines.py): every engine implements one interface, and a third engine is one file."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_assets.worker import engines
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

    got = vllm.acceptance_between(scrape(10, 30, 12, [8, 3, 1]), scrape(110, 330, 162, [88, 53, 21]), k=3)
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
    # on a host without GPUs the model runs in the engine core's process, unless the user asks for parallelism
    assert ("uni" in argv) == vllm.ONE_PROCESS == ("VLLM_ENABLE_V1_MULTIPROCESSING" in vllm.SERVER_ENV)
    parallel = vllm.server_command("/venv/bin/python", "/models/t", 8001, drafter=None, k=3, dtype="bfloat16",
                                   max_model_len=4096, seed=0, extra=["--tensor-parallel-size=2"])
    assert "uni" not in parallel and "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm.EXTRACT_ENV


@pytest.mark.skipif(not vllm.ONE_PROCESS, reason="the attention backend is chosen so only on a host without GPUs")
def test_an_mla_target_vllms_amx_kernels_cannot_run_gets_the_cpu_mla_backend(tmp_path):
    """vLLM 0.32 picks its AMX MLA kernels on any AMX CPU, and they load only bfloat16 at latent width 576:
    other MLA targets (the tests' tiny Kimi, any target in float32) get the reference CPU MLA backend."""
    def command(latent: tuple[int, int] | None, dtype: str, extra=()):
        model = tmp_path / f"{latent}-{dtype}"
        model.mkdir(exist_ok=True)
        mla = {"kv_lora_rank": latent[0], "qk_rope_head_dim": latent[1]} if latent else {}
        (model / "config.json").write_text(json.dumps({"text_config": {"model_type": "deepseek_v3", **mla}}))
        argv = vllm.server_command("p", str(model), 1, drafter=None, k=3, dtype=dtype, max_model_len=64, seed=0,
                                   extra=list(extra))
        extract = vllm.extract_command("p", str(model), 1, layer_ids=[2], root="r", aux_columns=[0], final_column=1,
                                       part_bytes=1, io_threads=1, dtype=dtype, max_model_len=64, storage="native",
                                       tensor_parallel_size=1, data_parallel_size=1, seed=0, extra=list(extra))
        got = [a[a.index("--attention-backend") + 1] if "--attention-backend" in a else None for a in (argv, extract)]
        assert got[0] == got[1]
        return got[0]

    assert command((16, 8), "float32") == "CPU_MLA"
    assert command((512, 64), "float32") == "CPU_MLA"  # a real Kimi's width, but not in bfloat16
    assert command((512, 64), "bfloat16") is None  # what the AMX kernels take: vLLM's choice stands
    assert command(None, "float32") is None  # not MLA
    assert command((16, 8), "float32", ["--attention-backend", "TORCH_SDPA"]) == "TORCH_SDPA"  # the user's


def test_a_servers_failure_names_the_first_error_in_its_log_not_only_its_tail(tmp_path):
    """vLLM's engine process fails first and its parents then raise their own errors: the root cause is the
    first exception in the log, far above the tail."""
    from eagle3_assets.worker.engines.server import EngineServer

    log = tmp_path / "server.log"
    script = ("import sys; p = lambda s: print(s, flush=True); "
              "p('(Worker pid=7) ERROR 12-03 07:40:35 [multiproc_executor.py:953] RuntimeError: invalid weight "
              "input features 16'); [p(f'(EngineCore pid=6) ERROR traceback line {i}') for i in range(400)]; "
              "p('RuntimeError: Engine core initialization failed. See root cause above.'); sys.exit(1)")
    with EngineServer("vllm (test)", [sys.executable, "-c", script], 1, log) as server:
        with pytest.raises(Exception) as e:
            server.wait_ready(60)
    assert "exited with status 1; the first error in its log: RuntimeError: invalid weight input features 16" \
        in str(e.value)
    assert "Engine core initialization failed" in str(e.value)  # the tail still follows


def test_the_benchmarks_servers_start_together_only_on_a_cpu_host_with_the_memory_for_all(tmp_path):
    from eagle3_assets.worker.serving.bench import start_together

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    small = {"VLLM_CPU_KVCACHE_SPACE": "0.01"}
    assert start_together("auto", 2, tmp_path, small, "cpu")[0]
    assert not start_together("auto", 2, tmp_path, small, "cuda")[0]  # each takes most of a GPU's memory
    assert not start_together("auto", 1, tmp_path, small, "cpu")[0]
    assert not start_together("one_at_a_time", 2, tmp_path, small, "cpu")[0]
    assert start_together("together", 2, tmp_path, small, "cuda")[0]
    huge, why = start_together("auto", 2, tmp_path, {"VLLM_CPU_KVCACHE_SPACE": str(2**20)}, "cpu")  # 1 PiB each
    assert not huge and "GiB is available" in why


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


# ---- SGLang's hidden-state capture (worker/engines/sglang/capture.py) against the source of the release it targets ----
import ast  # noqa: E402

SGLANG_SRC = Path(__file__).resolve().parents[2] / ".venv" / "engine-src" / "sglang-0.5.14" / "sglang"
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
    ours = _tree(Path(__file__).resolve().parents[2] / "eagle3_assets" / "worker" / "engines" / "sglang" / "capture.py")
    out = []
    for n in ast.walk(ours):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == func_name:
                out.append({k.arg for k in n.keywords if k.arg})
    assert out, f"no call to {func_name} in sglang/capture.py"
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



# ---- the registry: one interface, the names read from the modules, a third engine in one file ----

def test_every_engine_implements_the_interface_and_a_miss_names_the_engines():
    assert engines.NAMES == ("vllm", "sglang")  # the reference engine first, then by name
    for name in engines.NAMES:
        e = engines.get(name)
        assert e.NAME == name and not [n for n in engines.INTERFACE if not hasattr(e, n)]
    with pytest.raises(ValueError, match="unknown engine 'tgi': the engines are vllm, sglang"):
        engines.get("tgi")


class _Server:
    """An EngineServer's `get` over canned answers, one list per route, popped in order."""

    def __init__(self, answers: dict[str, list]):
        self.answers = answers

    def get(self, route: str):
        body = self.answers[route].pop(0)
        return 200, (body if isinstance(body, bytes) else json.dumps(body).encode())


def test_acceptance_as_each_engine_counts_it_through_one_protocol():
    line = 'vllm:spec_decode_{}_total{{engine="0"}} {}\n'
    scrape = lambda d, t, a: "".join(line.format(n, v) for n, v in  # noqa: E731
                                     [("num_drafts", d), ("num_draft_tokens", t), ("num_accepted_tokens", a)]).encode()
    server = _Server({"/metrics": [scrape(10, 30, 12), scrape(110, 330, 162)]})
    before = vllm.measure_start(server)
    got = vllm.acceptance(server, before, 3)
    assert got["acceptance_length"] == 2.5 and got["acceptance_rate"] == 0.5
    server = _Server({sglang.SERVER_INFO: [{"internal_states": [{"avg_spec_accept_length": 2.5}]}]})
    assert sglang.acceptance(server, sglang.measure_start(server), 3) == {"acceptance_length": 2.5,
                                                                         "acceptance_rate": 0.5}
    # counters read before and after on one server; a cumulative accept length needs a fresh server each
    assert vllm.server_plan([1, 8]) == [[1, 8]] and sglang.server_plan([1, 8]) == [[1], [8]]
    assert vllm.WARM_UP and not sglang.WARM_UP  # a warm-up would count in SGLang's accept length


def test_each_dialect_writes_and_reads_back_its_layer_ids_and_sglang_refuses_what_it_would_misserve(tmp_path):
    from eagle3_assets.worker.errors import StageError

    ours = [2, 10, 20]
    v, s = vllm.export_fields(ours, "llama", 32), sglang.export_fields(ours, "llama", 32)
    assert v == {"eagle_aux_hidden_state_layer_ids": [3, 11, 21]}  # capture-before
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ours  # output of layer i
    assert vllm.exported_layers(v, "llama") == sglang.exported_layers(s, "llama") == ours
    assert vllm.exported_layers({}, "llama") is None is sglang.exported_layers({}, "llama")
    with pytest.raises(StageError, match="first id"):
        sglang.export_fields(ours, "kimi_k2", 32)
    assert sglang.id_rule([2, 30, 58], "kimi_k2")[0] == -1 and sglang.id_rule([1, 29, 57], "kimi_k2") is None
    vllm.check_export(tmp_path, {"num_hidden_layers": 2})
    with pytest.raises(StageError, match="residual"):
        sglang.check_export(tmp_path, {"num_hidden_layers": 2})
    with pytest.raises(StageError, match="midlayer"):
        sglang.check_tensors(tmp_path, ["layers.0.self_attn.q_proj.weight"])


# A third engine: only this file, added to worker/engines/. Nothing else in the package names it.
THIRD = '''
"""A third engine, for the registry's test: the interface with nothing behind it."""
from . import support_probe

NAME = "fake"
TITLE = "Fake"
INSTALL = "pip install fake-engine"
HEALTH = "/health"
SERVER_ENV = {"FAKE_ENGINE": "1"}
WARM_UP = True
LAYER_IDS_FIELD = "fake_layer_ids"
GENERATION_FIELDS = {}
SUPPORT_PROBE = support_probe("fake", "")
EXTRACT_PROBE = support_probe("fake", "")


def text_only(target, info, choice):
    return bool(choice)


def server_command(python, target, port, *, drafter, k, dtype, max_model_len, seed, extra,
                   language_model_only=False):
    return [python, "-m", "fake.serve", target, "--port", str(port)] + (["--draft", drafter] if drafter else []) + extra


def server_plan(concurrencies):
    return [list(concurrencies)]


def measure_start(server):
    return None


def acceptance(server, before, k):
    return {"acceptance_length": None, "acceptance_rate": None}


def export_fields(aux, model_type, num_layers):
    return {LAYER_IDS_FIELD: [i + 100 for i in aux]}


def serve_refusals(target, info, dtype, extra):
    return []


def exported_layers(cfg, model_type):
    return [i - 100 for i in cfg[LAYER_IDS_FIELD]] if LAYER_IDS_FIELD in cfg else None


def id_rule(ids, model_type):
    return None


def check_export(src, cfg):
    pass


def check_tensors(d, names):
    pass


def capture_layers(aux, num_layers):
    return sorted(aux), [sorted(aux).index(i) for i in aux], len(aux)


def extract(target, samples, tmp, aux_layers, num_layers, args, reporter, what):
    raise NotImplementedError
'''

LISTS_IT = """
import sys, typing
import eagle3_assets
assert eagle3_assets.__file__.startswith(sys.argv[1]), eagle3_assets.__file__
from eagle3_assets.worker import engines
assert engines.NAMES == ("vllm", "fake", "sglang"), engines.NAMES
assert engines.get("fake").NAME == "fake"
from eagle3_assets import stages
from eagle3_assets.stages.extract import ExtractSettings
from eagle3_assets.stages.generate import GenerateSettings
from eagle3_assets.stages.export import ExportSettings
assert "fake" in typing.get_args(ExtractSettings.model_fields["backend"].annotation)
assert "fake" in typing.get_args(GenerateSettings.model_fields["backend"].annotation)
assert ExportSettings().dialects is None  # every engine that can take the drafter: the registry's
assert "vllm, fake, sglang" in ExportSettings.model_fields["dialects"].description
try:
    ExportSettings(dialects=["tgi"])
    raise AssertionError("an unknown dialect was accepted")
except ValueError as e:
    assert "'fake'" in str(e), e
assert stages.validate("serve_bench", {"engine": "fake", "target": "t", "drafter": "d", "prompts": "p",
                                       "history": "h", "out_dir": "o"}).engine == "fake"
assert stages.validate("engine_check", {"engine": "fake", "target": "t"}).engine == "fake"
try:
    stages.validate("engine_check", {"engine": "tgi", "target": "t"})
    raise AssertionError("an unknown engine was accepted")
except stages.ArgsError as e:
    assert "'fake'" in str(e), e
from eagle3_assets.assets.partitions import engine_partitions
assert engine_partitions.get_partition_keys() == ["vllm", "fake", "sglang"]
from eagle3_assets.worker.data import backends
from eagle3_assets.worker.serving import export
assert "fake" in backends.BACKENDS
assert export.layer_fields("fake", [2, 10, 20], 30) == {"fake_layer_ids": [102, 110, 120]}
assert export.engine_capture_layers("fake", {"fake_layer_ids": [102, 110, 120]}, 30) == [2, 10, 20]
from eagle3_assets import code_versions as cv
assert "worker/engines/fake.py" in cv.files_of("eagle3_assets.assets.hidden_states", "hidden_state_shards")
print("listed")
"""


def test_a_third_engine_is_one_file(tmp_path):
    """A copy of the package plus worker/engines/fake.py and nothing else: the registry, the stage contracts
    (generate and extract backends, serve_bench's and engine_check's engine, export's dialects), the serving
    partitions and the worker's dispatch all list it, and the code versions of the assets that may run it count
    its file."""
    shutil.copytree(Path(engines.__file__).parents[2], tmp_path / "eagle3_assets",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "eagle3_assets" / "worker" / "engines" / "fake.py").write_text(THIRD)
    done = subprocess.run([sys.executable, "-c", LISTS_IT, str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path),
                                                       "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("listed"), done.stdout + done.stderr


def test_an_engines_extract_stays_callable_once_its_extraction_code_is_loaded():
    """A long-lived worker (a test, a notebook) extracts twice: the engine's extraction module must not replace
    the engine's `extract` on the package when it is imported."""
    import importlib

    for name in engines.NAMES:
        engine = engines.get(name)
        importlib.import_module(f"{engine.__name__}.extraction")
        assert callable(engine.extract), name


def test_a_servers_reply_keeps_its_own_ids_and_gets_the_stop_token_only_where_the_engine_gave_none():
    """vLLM returns the reply's ids with its stop token (return_token_ids): kept as they are, whatever the
    tokenizer's end token. SGLang returns text and the stop token it matched: tokenized, with that token."""
    from eagle3_assets.worker.data.backends import _from_server
    from eagle3_assets.worker.engines.load import Completion
    from tiny_targets import smollm2_tokenizer

    tok = smollm2_tokenizer()
    end, other_end = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    text_ids = tok("Paris.", add_special_tokens=False)["input_ids"]
    vllm_done = Completion("0", "Paris.", text_ids + [other_end], "stop")
    assert _from_server(vllm_done, [1, 2], tok, {end}).ids == text_ids + [other_end]  # nothing appended
    sglang_done = Completion("0", "Paris.", None, "stop", matched_stop=end)
    got = _from_server(sglang_done, [1, 2], tok, {end})
    assert got.ids == text_ids + [end] and not got.capped
    cut = _from_server(Completion("0", "Paris is", None, "length"), [1, 2], tok, {end})
    assert cut.capped and end not in cut.ids


def test_an_engines_yes_is_kept_per_install_and_a_no_is_asked_again(tmp_path, monkeypatch):
    """The support probe imports the engine (30-60 s on 2 cores): a yes is kept for the same install and
    question, asked again once the install changes; a no is never kept."""
    import types

    from eagle3_assets.worker.engines.server import check_support
    from eagle3_assets.worker.errors import StageError

    site = tmp_path / "site"
    (site / "toy_engine").mkdir(parents=True)
    init = site / "toy_engine" / "__init__.py"
    init.write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("EAGLE3_ENGINE_CHECK_CACHE", str(tmp_path / "cache"))
    runs = tmp_path / "probe-runs"
    probe = ("import json, sys, pathlib\n"
             f"pathlib.Path({str(runs)!r}).open('a').write('x')\n"
             "ok = sys.argv[2] != 'unsupported'\n"
             "print(json.dumps({'installed': True, 'supported': ok, 'version': '1.0', 'reasons': ['no such model'],"
             " 'architecture': sys.argv[1]}))\n")
    engine = types.SimpleNamespace(NAME="toy_engine", SUPPORT_PROBE=probe, INSTALL="pip install toy")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')

    first = check_support(engine, sys.executable, target)
    again = check_support(engine, sys.executable, target)
    assert runs.read_text() == "x" and first["supported"] and again["checked"].startswith("kept")
    os.utime(init, ns=(init.stat().st_atime_ns, init.stat().st_mtime_ns + 10**9))  # a reinstall, as the key sees it
    check_support(engine, sys.executable, target)
    assert runs.read_text() == "xx"

    (target / "config.json").write_text('{"architectures": ["Other"], "model_type": "unsupported"}')
    for n in (3, 4):  # refused, and asked again each time
        with pytest.raises(StageError, match="no such model"):
            check_support(engine, sys.executable, target)
        assert runs.read_text() == "x" * n


def test_language_model_only_is_one_setting_for_every_stage_that_starts_the_engine(tmp_path):
    """A multimodal wrapper is served text-only (--language-model-only) by extraction, generation and the
    benchmark alike: one setting in each contract, one decision, in each argv."""
    from eagle3_assets.stages.extract import ExtractSettings
    from eagle3_assets.stages.generate import GenerateSettings
    from eagle3_assets.stages.serve_bench import ServeBenchSettings
    from eagle3_assets.stages.synthesize import SynthesizeSettings
    from eagle3_assets.worker.errors import StageError
    from tiny_targets import save_kimi_k25_like, save_tiny_llama

    fields = [c.model_fields["language_model_only"] for c in (ExtractSettings, GenerateSettings, ServeBenchSettings,
                                                               SynthesizeSettings)]
    assert all(f.default is None and f.description == fields[0].description for f in fields)
    kimi, llama = save_kimi_k25_like(tmp_path / "kimi").path, save_tiny_llama(tmp_path / "llama")
    has_flag, lacks_flag = {"language_model_only": True, "version": "0.32.0"}, {"language_model_only": False}
    assert vllm.text_only(kimi, has_flag, None) is True  # the default: a wrapper, served text-only
    assert vllm.text_only(llama, has_flag, None) is False
    assert vllm.text_only(kimi, has_flag, False) is False  # the user's choice wins
    assert vllm.text_only(kimi, lacks_flag, None) is False
    with pytest.raises(StageError, match="has no --language-model-only flag"):
        vllm.text_only(llama, lacks_flag, True)
    with pytest.raises(StageError, match="SGLang's server has no such flag"):
        sglang.text_only(kimi, {}, True)
    common = dict(drafter=None, k=0, dtype="float32", max_model_len=512, seed=0, extra=[])
    assert "--language-model-only" in vllm.server_command("python", str(kimi), 1, language_model_only=True, **common)
    assert "--language-model-only" not in vllm.server_command("python", str(kimi), 1, **common)
    # the installed vLLM answers whether it has the flag (its probe reads its own argument parser)
    from eagle3_assets.worker.engines.server import check_support

    assert check_support(vllm, sys.executable, llama)["language_model_only"] is True


def _config_only_target(d: Path, cfg: dict) -> Path:
    """The preflight reads config.json alone: a target of no weights is enough to ask the engine."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.slow  # three probes of the installed vLLM (it is imported each time: a refusal is never kept)
def test_the_vllm_preflight_refuses_what_the_server_would_fail_on_later(tmp_path):
    """An MLA latent width vLLM's MLA kernels do not take fails the first request 77 s after a start that the
    preflight had allowed; an architecture vLLM spells otherwise is a rename, not an upgrade."""
    from eagle3_assets.worker.engines.server import check_support
    from eagle3_assets.worker.errors import StageError
    from tiny_targets import kimi_k25_text_config, smollm2_tokenizer

    tc = kimi_k25_text_config(smollm2_tokenizer(), layers=4, hidden=64, heads=8, vocab=1024).to_dict()
    mla = {**tc, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    fits = _config_only_target(tmp_path / "latent-320", mla)  # 256 + 64: a width vLLM's MLA takes
    info = check_support(vllm, sys.executable, fits, probe=vllm.EXTRACT_PROBE, purpose="extract hidden states")
    assert info["supported"], info
    narrow = _config_only_target(tmp_path / "latent-48", {**mla, "kv_lora_rank": 32, "qk_rope_head_dim": 16})
    with pytest.raises(StageError) as e:
        check_support(vllm, sys.executable, narrow, probe=vllm.EXTRACT_PROBE, purpose="extract hidden states")
    msg = str(e.value)
    assert "latent widths [320, 512, 576]" in msg and "this target's is 48 (kv_lora_rank 32" in msg
    # the width is the target's: another backend is the advice, not an upgrade
    assert "about this target, not this vllm release: use the other backend (hf, sglang)" in msg, msg
    assert "upgrade" not in msg.lower(), msg
    spelled = _config_only_target(tmp_path / "spelled", {"architectures": ["Kimi_K25ForConditionalGeneration"],
                                                        "model_type": "kimi_k25", "text_config": mla})
    with pytest.raises(StageError) as e:
        check_support(vllm, sys.executable, spelled)
    msg = str(e.value)
    assert "has 'KimiK25ForConditionalGeneration'" in msg and "Upgrade" not in msg, msg


@pytest.mark.slow  # two probes of the installed vLLM (a Kimi wrapper, a Llama); the Kimi's yes is kept between asks
def test_the_serve_preflight_refuses_a_kimi_target_vllm_would_die_on_after_loading_the_drafter(tmp_path, monkeypatch):
    """vLLM 0.32's CPU build loaded the tiny Kimi and its EAGLE-3 drafter, then died: its EAGLE proposer reads
    media_placeholder_token_id from the wrapper's config (transformers' Kimi_K25Config writes none), and, with
    that key added, its MLA and plain attention backends share no block size. The preflight says both before any
    server starts, from the installed engine's code; the target alone (generation) and a plain target pass."""
    from eagle3_assets.worker.engines.server import check_support, serve_preflight
    from eagle3_assets.worker.errors import StageError
    from tiny_targets import kimi_k25_config, kimi_k25_text_config, smollm2_tokenizer

    monkeypatch.setenv("EAGLE3_ENGINE_CHECK_CACHE", str(tmp_path / "cache"))
    tc = kimi_k25_text_config(smollm2_tokenizer(), layers=4, hidden=64, heads=8, vocab=1024).to_dict()
    text = {**tc, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    kimi = _config_only_target(tmp_path / "kimi", kimi_k25_config(text))
    with pytest.raises(StageError) as e:
        serve_preflight(vllm, sys.executable, kimi, dtype="float32")
    msg = str(e.value)
    for words in ("reads 'media_placeholder_token_id' from the config of a KimiK25ForConditionalGeneration target",
                  "vllm/v1/spec_decode/llm_base_proposer.py", f"{kimi / 'config.json'} has no 'media_placeholder_token_id'",
                  "Kimi_K25Config gives it no default", "the original checkpoint's config.json",
                  # vLLM 0.32's CPU build, as its cpu_mla.py and cpu_attn.py declare them
                  "CPU_MLA (the MLA target's attention) takes block size 16",
                  "its CPU_ATTN (the EAGLE-3 drafter's) multiples of 32: no common block size",
                  "cannot serve an EAGLE-3 drafter for an MLA target", "use vLLM's GPU build or SGLang"):
        assert words in msg, (words, msg)
    # the key written as Moonshot's config.json has it: the backends are what is left
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, "media_placeholder_token_id": 163605}))
    with pytest.raises(StageError) as e:
        serve_preflight(vllm, sys.executable, kimi, dtype="float32")
    assert "media_placeholder_token_id" not in str(e.value) and "no common block size" in str(e.value), str(e.value)
    # serving the target alone (generation) asks the support probe only: still a yes
    assert check_support(vllm, sys.executable, kimi)["checked"].startswith("kept")
    llama = _config_only_target(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                     "hidden_size": 64, "num_attention_heads": 4})
    assert serve_preflight(vllm, sys.executable, llama, dtype="float32")["supported"]
