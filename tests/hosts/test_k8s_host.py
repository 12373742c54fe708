"""The Kubernetes host without a cluster: the pod dagster-k8s would submit for a stage (built by dagster-k8s's
own `build_pod_body` from what the host hands `PipesK8sClient.run`), the config a user writes (a hosts file, the
README's example, the mistakes that would leak a secret), the preflight probe's relay through Pipes, and the way
an unreachable cluster fails. Nothing here reaches a cluster; no pod ever runs."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from conftest import failure_text
from eagle3_assets.hosts import GpuHost, HostPool, K8sHost
from eagle3_assets.hosts.k8s import _PIPES_PROBE
from eagle3_assets.hosts.ssh import UNREACHABLE

kubernetes = pytest.importorskip("kubernetes")  # the `k8s` extra (in `test`)
pipes_k8s = pytest.importorskip("dagster_k8s.pipes")

ROOT = Path(__file__).resolve().parents[2]
README_HEADING = "## Kubernetes: each stage a Pipes pod"
GUIDE = "docs/guides/scale-out.md"  # where the docs keep the Kubernetes steps
TOKEN = "hf_NotARealTokenButShapedLikeOne1234"  # as the control plane's own environment might hold it
BASE = dict(image="registry.example.com/eagle3-worker:0.1.0", namespace="ml", pvc="eagle3-work", workdir="/eagle3",
            gpus=2, secrets=["hf-token", "wandb"], node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            service_account="eagle3-worker", python="/opt/venv/bin/python")


def pod_for(host: K8sHost, request: dict, bootstrap: dict | None = None) -> dict:
    """The pod PipesK8sClient.run would create from `request` (its own build_pod_body), as the API gets it."""
    env = {**(bootstrap or {"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msgs"}), **request["env"]}
    body = pipes_k8s.build_pod_body(pod_name="dagster-run-step-0", image=request["image"], command=request["command"],
                                    env_vars=env, base_pod_meta=request["base_pod_meta"],
                                    base_pod_spec=request["base_pod_spec"])
    return kubernetes.client.ApiClient().sanitize_for_serialization(body)


def test_gpu_stage_pod_requests_the_gpus_mounts_the_pvc_and_runs_the_worker(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # never copied from here into a pod
    host = K8sHost(**BASE)
    args = {"shard": "00003", "dtype": "bfloat16"}
    pod = pod_for(host, host.stage_request("extract", args))
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert c["image"] == BASE["image"]
    assert c["command"] == host.worker_command("/opt/venv/bin/python", "extract", args)
    assert c["command"][:4] == ["/opt/venv/bin/python", "-m", "eagle3_assets.worker", "extract"]
    assert json.loads(c["command"][c["command"].index("--args") + 1]) == args
    assert c["command"][c["command"].index("--workdir") + 1] == "/eagle3"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert c["envFrom"] == [{"secretRef": {"name": "hf-token"}}, {"secretRef": {"name": "wandb"}}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/eagle3")
    assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": "eagle3-work"}
    assert c["workingDir"] == "/eagle3"
    assert any(m["mountPath"] == "/dev/shm" and volumes[m["name"]]["emptyDir"]["medium"] == "Memory"
               for m in c["volumeMounts"])
    assert spec["nodeSelector"] == BASE["node_selector"] and spec["tolerations"] == BASE["tolerations"]
    assert spec["serviceAccountName"] == "eagle3-worker" and spec["restartPolicy"] == "Never"
    assert pod["metadata"]["labels"]["eagle3-assets/stage"] == "extract"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DAGSTER_PIPES_CONTEXT"] == "ctx" and env["EAGLE3_NO_BAR"] == "1"
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # the device plugin sets it for the requested GPUs

    # No secret value anywhere in the pod, and the command and arguments carry no secret and no Secret's name.
    text = json.dumps(pod)
    assert TOKEN not in text and "HF_TOKEN" not in text
    assert not any(e.get("valueFrom") or "TOKEN" in e["name"] for e in c["env"])
    command = json.dumps(c["command"] + c.get("args", []))
    assert "hf-token" not in command and "wandb" not in command


def test_cpu_stage_pod_gets_no_gpu_and_sees_none():
    host = K8sHost(**BASE)
    pod = pod_for(host, host.stage_request("vocab", {"conversations": "conversations"}))
    (c,) = pod["spec"]["containers"]
    assert "nvidia.com/gpu" not in json.dumps(c.get("resources") or {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in c["env"]
    assert c["envFrom"] == [{"secretRef": {"name": "hf-token"}}, {"secretRef": {"name": "wandb"}}]


def test_cpu_and_memory_requests_and_plain_env_pass_through():
    host = K8sHost(**{**BASE, "cpu": "16", "memory": "128Gi", "env": {"HF_HOME": "/eagle3/hf"}, "shm_gb": 0,
                      "image_pull_secrets": ["regcred"]})
    pod = pod_for(host, host.stage_request("train", {}))
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["requests"] == {"nvidia.com/gpu": "2", "cpu": "16", "memory": "128Gi"}
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2", "memory": "128Gi"}
    assert {"name": "HF_HOME", "value": "/eagle3/hf"} in c["env"]
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/eagle3"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


def hosts_file(tmp_path: Path, **k8s) -> str:
    p = tmp_path / "hosts.yaml"
    p.write_text(yaml.safe_dump({"hosts": [
        {"name": "cluster", "kind": "k8s", **k8s},
        {"name": "here", "kind": "local", "workdir": str(tmp_path / "work"), "require_gpus": False}]}))
    return str(p)


def test_pool_file_with_kind_k8s_builds_a_k8s_host(tmp_path):
    names = {"namespace": "ml-team", "service_account": "eagle3-runner", "image_pull_secrets": ["regcred"],
             "node_selector": {"node.kubernetes.io/instance-type": "p5.48xlarge", "gpu": ""}}  # names Kubernetes takes
    pool = HostPool(hosts_file=hosts_file(tmp_path, image="reg/w:1", pvc="eagle3.work-1", gpus=4, secrets=["hf-token"],
                                          **names))
    member = pool.members()["cluster"]
    assert isinstance(member.host, K8sHost)
    assert (member.host.image, member.host.pvc, member.host.gpus, member.host.secrets) == ("reg/w:1", "eagle3.work-1",
                                                                                           4, ["hf-token"])
    assert {k: getattr(member.host, k) for k in names} == names
    assert pool.primary.name == "cluster"


@pytest.mark.parametrize("bad, field, fix", [
    ({"pvc": "w"}, "image", "the worker image"),
    ({"image": "reg/w:1"}, "pvc", "ReadWriteMany PersistentVolumeClaim"),
    ({"image": "reg/w:1", "pvc": "w", "gpus": -1}, "gpus", "greater than or equal to 0"),
    ({"image": "reg/w:1", "pvc": "w", "gpus": 0}, "gpus: 0", "require_gpus: false"),
    ({"image": "reg/w:1", "pvc": "w", "env": {"HF_TOKEN": TOKEN}}, "env.HF_TOKEN", "list <name> under secrets"),
    # a token under a name the old check let through, and one under a harmless name, found by its value
    ({"image": "reg/w:1", "pvc": "w", "env": {"HF_AUTH": TOKEN}}, "env.HF_AUTH", "list <name> under secrets"),
    ({"image": "reg/w:1", "pvc": "w", "env": {"WANDB_KEY": "0123abcd"}}, "env.WANDB_KEY", "list <name> under secrets"),
    ({"image": "reg/w:1", "pvc": "w", "env": {"DOWNLOAD_OPTS": TOKEN}}, "Hugging Face token", "list <name> under secrets"),
    ({"image": "reg/w:1", "pvc": "w", "secrets": [TOKEN]}, "secrets[0]", "never a token"),
    ({"image": "reg/w:1", "pvc": "w", "secrets": {"HF_TOKEN": TOKEN}}, "secrets", "names of Kubernetes Secrets, not values"),
    # names the API server validates, refused as the file loads rather than by the cluster at the first pod
    ({"image": "reg/w:1", "pvc": "Eagle3_Work/../x!"}, "pvc 'Eagle3_Work/../x!'", "DNS-1123 subdomain"),
    ({"image": "reg/w:1", "pvc": "w" * 254}, "(254 characters)", "at most 253 characters"),
    ({"image": "reg/w:1", "pvc": "w", "namespace": "ML Team"}, "namespace 'ML Team'", "DNS-1123 label"),
    ({"image": "reg/w:1", "pvc": "w", "namespace": "n" * 64}, "(64 characters)", "at most 63 characters"),
    ({"image": "reg/w:1", "pvc": "w", "namespace": "team.ml"}, "namespace 'team.ml'", "e.g. 'team-ml'"),
    ({"image": "reg/w:1", "pvc": "w", "service_account": "Eagle3"}, "service_account 'Eagle3'", "e.g. 'eagle3'"),
    ({"image": "reg/w:1", "pvc": "w", "image_pull_secrets": ["regcred", "Reg Cred"]}, "image_pull_secrets[1]",
     "the name of a Secret"),
    ({"image": "reg/w:1", "pvc": "w", "node_selector": {"gpu.example.com/model": "H100 SXM"}},
     "node_selector.gpu.example.com/model 'H100 SXM'", "a label value"),
    ({"image": "reg/w:1", "pvc": "w", "namespace": TOKEN}, "namespace (not shown: it looks like", "DNS-1123 label"),
])
def test_bad_k8s_config_names_the_field_and_the_fix_and_never_echoes_a_secret(tmp_path, bad, field, fix):
    pool = HostPool(hosts_file=hosts_file(tmp_path, **bad))
    with pytest.raises(ValueError) as e:
        pool.members()
    assert "host 'cluster' (k8s)" in str(e.value) and field in str(e.value) and fix in str(e.value), str(e.value)
    assert TOKEN not in str(e.value)


def test_a_secret_in_the_wrong_field_stays_out_of_the_error_in_code_too():
    with pytest.raises(Exception) as e:
        K8sHost(**{**BASE, "env": {"GITHUB_TOKEN": TOKEN}})
    assert "env.GITHUB_TOKEN" in str(e.value) and TOKEN not in str(e.value)


def test_gpu_host_from_env_builds_the_k8s_host(monkeypatch):
    from eagle3_assets.definitions import gpu_host_from_env

    for k in ("EAGLE3_HOSTS", "EAGLE3_SSH_HOST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("EAGLE3_K8S_IMAGE", "reg/w:1")
    monkeypatch.setenv("EAGLE3_K8S_PVC", "eagle3-work")
    monkeypatch.setenv("EAGLE3_K8S_GPUS", "8")
    monkeypatch.setenv("EAGLE3_K8S_SECRETS", "hf-token, wandb")
    host = gpu_host_from_env()
    assert isinstance(host, K8sHost) and (host.gpus, host.secrets, host.pvc) == (8, ["hf-token", "wandb"], "eagle3-work")
    monkeypatch.setenv("EAGLE3_SSH_HOST", "gpu-box")
    with pytest.raises(ValueError, match="unset one"):
        gpu_host_from_env()


def test_the_control_plane_loads_without_dagster_k8s_with_a_k8s_host():
    """dagster-k8s and the kubernetes client are imported when a pod starts, not when the code location loads."""
    env = {**os.environ, "EAGLE3_K8S_IMAGE": "reg/w:1", "EAGLE3_K8S_PVC": "w"}
    env.pop("EAGLE3_HOSTS", None)
    env.pop("EAGLE3_SSH_HOST", None)
    code = ("import sys, eagle3_assets.definitions as d\n"
            "print(type(d.gpu_host).__name__, sorted(m for m in ('dagster_k8s', 'kubernetes') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["K8sHost", "[]"], r.stdout


def test_files_need_the_control_plane_mount(tmp_path):
    with pytest.raises(dg.Failure, match="set control_plane_mount to where PVC eagle3-work is mounted"):
        K8sHost(**BASE).put_file(__file__, "x.py")
    with pytest.raises(dg.Failure, match="is not a directory here"):
        with K8sHost(**BASE, control_plane_mount=str(tmp_path / "absent")).files():
            pass
    mount = tmp_path / "pvc"
    mount.mkdir()
    host = K8sHost(**BASE, control_plane_mount=str(mount))
    src = tmp_path / "prompts.parquet"
    src.write_bytes(b"PAR1 rows")
    host.put_file(str(src), "prompts/prompts.parquet")
    assert (mount / "prompts" / "prompts.parquet").read_bytes() == b"PAR1 rows"
    host.get_file("prompts/prompts.parquet", str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == b"PAR1 rows"
    with host.files() as (fs, root):
        assert root == str(mount.resolve()) and fs.exists(f"{root}/prompts/prompts.parquet")


def test_preflight_pod_runs_the_probe_and_relays_its_answer_through_pipes(tmp_path):
    """The probe command the preflight pod runs, run here under a real Pipes session: its answer arrives as the
    stage result the host reads."""
    host = K8sHost(**{**BASE, "python": sys.executable, "workdir": str(tmp_path)})

    @dg.asset
    def probed(context: dg.AssetExecutionContext):
        request = host.pod_request("preflight", [sys.executable, "-c", _PIPES_PROBE,
                                                 json.dumps({"workdir": str(tmp_path), "gpus": False})], gpus=False)
        assert request["command"][2] == _PIPES_PROBE
        messages = dg.PipesSubprocessClient().run(command=request["command"], context=context).get_custom_messages()
        answer = next(m["payload"] for m in messages if m.get("kind") == "result")
        assert answer["workdir"] == str(tmp_path) and answer["python"] and "torch" in answer["deps"]
        return dg.MaterializeResult(metadata={"free": answer["disk"]["free_bytes"]})

    result = dg.materialize([probed])
    assert result.success
    assert result.asset_materializations_for_node("probed")[0].metadata["free"].value > 0


@dg.asset
def staged(context: dg.AssetExecutionContext, gpu_host: GpuHost) -> dg.MaterializeResult:
    return gpu_host.run_stage(context, "extract", {"shard": "00000"}).materialize_result()


def test_run_stage_hands_pipes_k8s_client_the_pod_and_fails_clearly_when_no_cluster_answers(tmp_path, monkeypatch):
    """The real PipesK8sClient, a kubeconfig naming an API server on a closed port: the pod it would create is
    ours plus the Pipes bootstrap, and the step fails saying the cluster does not answer (marked unreachable)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}]}))
    built, build = [], pipes_k8s.build_pod_body

    def spy(**kw):  # what the client submits, recorded on its way to the (absent) API server
        built.append(build(**kw))
        return built[-1]

    monkeypatch.setattr(pipes_k8s, "build_pod_body", spy)
    host = K8sHost(**BASE, kubeconfig=str(kubeconfig))
    result = dg.materialize([staged], resources={"gpu_host": host}, raise_on_error=False)
    assert not result.success
    assert "the Kubernetes cluster does not answer" in failure_text(result)
    failure = next(ev for ev in result.all_events if ev.is_step_failure).step_failure_data.user_failure_data
    assert failure.metadata[UNREACHABLE].value is True

    (pod,) = [kubernetes.client.ApiClient().sanitize_for_serialization(b) for b in built]
    (c,) = pod["spec"]["containers"]
    assert c["command"] == host.worker_command(BASE["python"], "extract", {"shard": "00000"})
    assert c["image"] == BASE["image"] and c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"} <= set(env)  # the client's bootstrap, then ours
    assert env["EAGLE3_NO_BAR"] == "1"
    assert pod["metadata"]["name"].startswith("dagster-")


def test_no_kubeconfig_fails_naming_the_setting(tmp_path):
    host = K8sHost(**BASE, kubeconfig=str(tmp_path / "missing"))
    result = dg.materialize([staged], resources={"gpu_host": host}, raise_on_error=False)
    assert not result.success
    assert "no Kubernetes config to reach the cluster" in failure_text(result)
    assert "set kubeconfig" in failure_text(result)


def readme_k8s_hosts() -> str:
    """The hosts file in the scale-out guide's Kubernetes section: the first ```yaml block under its heading."""
    text = (ROOT / GUIDE).read_text()
    assert README_HEADING in text, f"{GUIDE} has no section {README_HEADING!r}"
    section = text.split(README_HEADING, 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert m, f"no ```yaml block under {README_HEADING!r}"
    return m.group(1)


def test_readme_kubernetes_config_builds_a_working_k8s_host(tmp_path, monkeypatch):
    text = readme_k8s_hosts()
    for var in re.findall(r"\{env:\s*(\w+)\}", text):  # secrets the example reads from the environment
        monkeypatch.setenv(var, "x")
    (tmp_path / "hosts.yaml").write_text(text)
    pool = HostPool(hosts_file=str(tmp_path / "hosts.yaml"))
    k8s = [m.host for m in pool.members().values() if isinstance(m.host, K8sHost)]
    assert k8s, "the README's hosts file has no kind: k8s host"
    for host in k8s:
        pod = pod_for(host, host.stage_request("train", {}))
        (c,) = pod["spec"]["containers"]
        assert c["image"] == host.image and host.gpus >= 1
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(host.gpus)
        assert host.secrets and c["envFrom"] == [{"secretRef": {"name": s}} for s in host.secrets]
        assert {"name": "workdir", "persistentVolumeClaim": {"claimName": host.pvc}} in pod["spec"]["volumes"]
