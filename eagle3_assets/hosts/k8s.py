"""The Kubernetes host: each stage runs as a pod through `dagster_k8s.PipesK8sClient` (context in the pod's
environment, Pipes messages read back from its log), on the cluster's GPUs.

Every stage pod mounts one ReadWriteMany PersistentVolumeClaim at `workdir`, so the stages see each other's
files as on one machine: a shard written by one pod is read by training in another. Secrets stay in the cluster:
the config names Kubernetes Secrets, the pod gets them through `envFrom`, and no value ever passes through this
control plane, the pod spec or the UI. `pod_request` builds the whole pod but its name and the Pipes bootstrap
variables (the client adds those): what the tests check without a cluster. dagster-k8s (and the kubernetes
client) is imported only when a pod is started, so the other hosts work without the `k8s` extra.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import ConfigDict, Field, field_validator, model_validator

from ..common.secrets import holds_path, secret_kind, secret_name
from ..common.worker_env import NO_BAR_ENV
from . import preflight
from .base import GpuHost, StageRun, stage_outcome
from .local import LocalGpuHost
from .ssh import UNREACHABLE

GPU = "nvidia.com/gpu"  # the NVIDIA device plugin's resource
CONTAINER = "eagle3-worker"
WORKDIR_VOLUME = "workdir"
SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # DNS-1123 subdomain
# The names the API server validates (apimachinery's validation): what the config names, checked when it is loaded
# rather than refused by the cluster at the first stage's pod
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_LABEL_RULE = "at most 63 characters, lowercase letters, digits and '-', beginning and ending with a letter or digit"
_SUBDOMAIN_RULE = ("at most 253 characters, lowercase letters, digits, '-' and '.', each part between dots beginning "
                   "and ending with a letter or digit")

# The preflight probe run in a pod: the probe prints its JSON answer, and a pod's stdout does not come back
# except through Pipes, so this relays it as the stage result message (`stage_outcome` reads it).
_PIPES_PROBE = f"""import contextlib, io, json, sys
from dagster_pipes import open_dagster_pipes
with open_dagster_pipes() as pipes:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile({preflight.PROBE_SOURCE!r}, "probe.py", "exec"), {{"__name__": "__main__"}})
    pipes.report_custom_message({{"kind": "result", "payload": json.loads(out.getvalue())}})
"""


def _checked_name(field: str, value: str, rule: re.Pattern, most: int, words: str, empty: bool = True) -> str:
    """`value` if the API server would accept it as `rule` allows, else an error naming field, value and rule."""
    if (value or empty) and len(value) <= most and rule.fullmatch(value):
        return value
    size = f" ({len(value)} characters)" if len(value) > most else ""
    kind = secret_kind(value)  # a token put in the wrong field stays out of the error
    shown = f"(not shown: it looks like {kind})" if kind else repr(value if len(value) <= 64 else value[:60] + "...")
    fix = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-")[:most].rstrip("-")  # the nearest name it allows
    hint = f" (e.g. {fix!r})" if fix and fix != value and rule.fullmatch(fix) and not kind else ""
    raise ValueError(f"Kubernetes would refuse {field} {shown}{size}: it must be {words}{hint}")


class K8sHost(GpuHost):
    """Stages as pods on a Kubernetes cluster, from an image with eagle3-assets[worker] installed."""

    # a rejected value is left out of the error: it may be the token someone put in the wrong field
    model_config = ConfigDict(hide_input_in_errors=True)

    image: str = Field(default="", validate_default=True,
                       description="the worker image: eagle3-assets[worker] and a CUDA torch installed, the same "
                                   "eagle3-assets version as this control plane")
    namespace: str = "default"
    pvc: str = Field(default="", validate_default=True,
                     description="PersistentVolumeClaim (ReadWriteMany) mounted at workdir in every stage pod")
    workdir: str = Field(default="/eagle3", description="where the PVC is mounted inside the pods")
    gpus: int = Field(default=1, ge=0, description=f"{GPU} requested by each GPU stage's pod (the others get none)")
    python: str = Field(default="python", description="the image's Python, with the worker's dependencies")
    secrets: list[str] = Field(default_factory=list,
                               description="names of Kubernetes Secrets in the namespace; each key becomes an "
                                           "environment variable of the pod (envFrom), e.g. HF_TOKEN")
    env: dict[str, str] = Field(default_factory=dict, description="plain (not secret) environment, e.g. HF_HOME")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    service_account: str | None = Field(default=None, description="the pods' service account")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets for a private registry")
    cpu: str | None = Field(default=None, description="CPU request of each pod (e.g. '8')")
    memory: str | None = Field(default=None, description="memory request and limit of each pod (e.g. '64Gi')")
    shm_gb: float = Field(default=8.0, ge=0, description="/dev/shm size (a pod's default 64 MB is too small for "
                                                         "NCCL and DataLoader workers); 0: the default")
    in_cluster: bool | None = Field(default=None, description="the control plane runs in the cluster (service "
                                    "account token); empty: in-cluster when KUBERNETES_SERVICE_HOST is set, else "
                                    "kubeconfig")
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; empty: ~/.kube/config")
    kube_context: str | None = None
    control_plane_mount: str | None = Field(default=None, description="where the same PVC is mounted on the "
                                            "Dagster machine: what files, put_file and get_file go through")
    require_gpus: bool = Field(default=True, description="host_preflight asks nvidia-smi in a pod for the GPUs")
    min_free_gb: float = Field(default=2.0, description="preflight refuses a PVC with less free space")
    pod_timeout_s: float = Field(default=0, ge=0, description="fail a pod still running after this long; 0: no "
                                 "limit (a training takes what it takes)")

    @field_validator("image", "pvc")
    @classmethod
    def _needed(cls, v: str, info) -> str:
        if not v:
            fix = {"image": "the worker image, e.g. registry.example.com/eagle3-worker:0.1.0 (README: Kubernetes)",
                   "pvc": "the name of a ReadWriteMany PersistentVolumeClaim in the namespace (README: Kubernetes)"}
            raise ValueError(f"{info.field_name} is required: {fix[info.field_name]}")
        return v

    @field_validator("namespace", "pvc", "service_account")
    @classmethod
    def _object_name(cls, v: str | None, info) -> str | None:
        if v is None or (info.field_name == "pvc" and not v):  # none: the default; no pvc: `_needed` says so
            return v
        if info.field_name == "namespace":
            return _checked_name("namespace", v, DNS_LABEL, 63, f"a DNS-1123 label: {_LABEL_RULE}")
        what = {"pvc": "a PersistentVolumeClaim", "service_account": "a ServiceAccount"}[info.field_name]
        return _checked_name(info.field_name, v, SECRET_NAME, 253, f"the name of {what}, a DNS-1123 subdomain: "
                                                                   f"{_SUBDOMAIN_RULE}")

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secret_names(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            _checked_name(f"image_pull_secrets[{i}]", name, SECRET_NAME, 253,
                          f"the name of a Secret, a DNS-1123 subdomain: {_SUBDOMAIN_RULE}")
        return v

    @field_validator("node_selector")
    @classmethod
    def _node_labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            prefix, _, name = key.rpartition("/")
            if prefix:
                _checked_name(f"node_selector key {key!r}: its prefix", prefix, SECRET_NAME, 253,
                              f"a DNS-1123 subdomain: {_SUBDOMAIN_RULE}")
            _checked_name(f"node_selector key {key!r}: its name", name, LABEL_VALUE, 63,
                          "a label name: 1 to 63 letters, digits, '-', '_' and '.', beginning and ending with a "
                          "letter or digit, after an optional DNS-subdomain prefix and '/'", empty=False)
            _checked_name(f"node_selector.{key}", value, LABEL_VALUE, 63, "a label value: empty, or at most 63 "
                          "letters, digits, '-', '_' and '.', beginning and ending with a letter or digit")
        return v

    @field_validator("secrets", mode="before")
    @classmethod
    def _secret_names(cls, v: Any) -> Any:
        if isinstance(v, dict):
            raise ValueError("secrets lists names of Kubernetes Secrets, not values (a mapping would put the values "
                             "in the pod spec): kubectl create secret generic hf-token --from-literal=HF_TOKEN=..., "
                             "then secrets: [hf-token]")
        for i, name in enumerate(v if isinstance(v, list) else []):
            if not isinstance(name, str) or len(name) > 253 or not SECRET_NAME.fullmatch(name):
                raise ValueError(f"secrets[{i}] (not shown) is not the name of a Kubernetes Secret (lowercase letters, "
                                 "digits, '-', '.'): list Secret names, never a token: kubectl create secret generic "
                                 "hf-token --from-literal=HF_TOKEN=..., then secrets: [hf-token]")
        return v

    @field_validator("env")
    @classmethod
    def _no_secret_in_env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():  # by its name (HF_TOKEN, WANDB_KEY, HF_AUTH) or by its value (hf_..., a PEM)
            kind = ("its name says it holds a secret's path, but its value is not a path" if holds_path(key) else
                    "its name says it is a secret") if secret_name(key, str(value)) else secret_kind(str(value))
            if kind:
                raise ValueError(f"env.{key} looks like a secret ({kind}; not shown), and env values are written into "
                                 f"the pod spec (readable by anyone who can get pods): put it in a Kubernetes Secret "
                                 f"(kubectl create secret generic <name> --from-literal={key}=...) and list <name> "
                                 "under secrets")
        return v

    @model_validator(mode="after")
    def _gpus_for_preflight(self) -> K8sHost:
        if self.require_gpus and self.gpus == 0:
            raise ValueError("gpus: 0 gives the stage pods no GPU while require_gpus is true: set gpus to the GPUs "
                             "each pod gets, or require_gpus: false for a cluster without GPUs")
        return self

    @property
    def where(self) -> str:
        return f"image {self.image} in namespace {self.namespace}"

    # ---- the pod ----------------------------------------------------------------------------------------
    def pod_request(self, stage: str, command: list[str], gpus: bool) -> dict[str, Any]:
        """The keyword arguments of PipesK8sClient.run for one pod: `gpus` says whether it gets the GPUs."""
        n = self.gpus if gpus else 0
        limits = {GPU: str(n)} if n else {}
        requests = {**limits, **({"cpu": self.cpu} if self.cpu else {}), **({"memory": self.memory} if self.memory else {})}
        if self.memory:
            limits["memory"] = self.memory
        env = {**self.env, NO_BAR_ENV: "1", "PYTHONUNBUFFERED": "1"}
        if not n:  # CUDA images set NVIDIA_VISIBLE_DEVICES=all, which hands a pod without a request every GPU
            env["NVIDIA_VISIBLE_DEVICES"] = "void"
        mounts = [{"name": WORKDIR_VOLUME, "mountPath": self.workdir}]
        volumes = [{"name": WORKDIR_VOLUME, "persistentVolumeClaim": {"claimName": self.pvc}}]
        if self.shm_gb:
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{self.shm_gb:g}Gi"}})
        container = {"name": CONTAINER, "workingDir": self.workdir, "volumeMounts": mounts,
                     "envFrom": [{"secretRef": {"name": s}} for s in self.secrets],
                     "resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v}}
        spec = {"containers": [container], "volumes": volumes, "restartPolicy": "Never",
                **({"nodeSelector": dict(self.node_selector)} if self.node_selector else {}),
                **({"tolerations": [dict(t) for t in self.tolerations]} if self.tolerations else {}),
                **({"serviceAccountName": self.service_account} if self.service_account else {}),
                **({"imagePullSecrets": [{"name": s} for s in self.image_pull_secrets]} if self.image_pull_secrets else {})}
        meta = {"labels": {"app.kubernetes.io/component": CONTAINER, "eagle3-assets/stage": stage}}
        return {"namespace": self.namespace, "image": self.image, "command": command, "env": env,
                "base_pod_spec": spec, "base_pod_meta": meta}

    def stage_request(self, stage: str, args: dict[str, Any]) -> dict[str, Any]:
        return self.pod_request(stage, self.worker_command(self.python, stage, args), stage in preflight.GPU_STAGES)

    def _run_pod(self, context, stage: str, request: dict[str, Any]) -> StageRun:
        from dagster_k8s import PipesK8sClient
        from dagster_k8s.client import DagsterK8sError
        from dagster_k8s.pipes import PipesK8sPodLogsMessageReader
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config.config_exception import ConfigException
        from urllib3.exceptions import HTTPError

        class Kept(PipesK8sPodLogsMessageReader):  # keeps the handler: a failed pod's own error message is in it
            handler = None

            @contextmanager
            def read_messages(self, handler):
                self.handler = handler
                with super().read_messages(handler) as params:
                    yield params

        reader = Kept()
        client = PipesK8sClient(message_reader=reader, load_incluster_config=self.in_cluster,
                                kubeconfig_file=None if self.in_cluster or not self.kubeconfig
                                else str(Path(self.kubeconfig).expanduser()),
                                kube_context=None if self.in_cluster else self.kube_context)
        try:
            client.run(context=context, extras={"stage": stage}, pod_wait_timeout=self.pod_timeout_s, **request)
        except DagsterK8sError as e:  # the pod failed (or timed out): the worker's reported error, else the pod's
            if reader.handler is None:
                raise
            return stage_outcome(stage, None, reader.handler, how=f"the pod failed: {str(e)[-3000:]}")
        except ConfigException as e:
            raise dg.Failure(description=f"no Kubernetes config to reach the cluster with ({e}): set kubeconfig "
                                         "(and kube_context), or in_cluster: true when Dagster runs in the cluster",
                             allow_retries=False) from None
        except ApiException as e:
            hint = {403: f": the identity Dagster runs as needs create/get/list/watch/delete on pods and get on "
                         f"pods/log in namespace {self.namespace} (README: Kubernetes, RBAC)",
                    404: f": does namespace {self.namespace} exist?", 422: ": the cluster refused the pod spec"}
            raise dg.Failure(description=f"the Kubernetes API answered {e.status} {e.reason}"
                                         f"{hint.get(e.status, '')}: {(e.body or '')[:1000]}",
                             allow_retries=e.status >= 500) from None
        except (HTTPError, OSError) as e:  # nobody answered: marked so, like an SSH host that is down
            raise dg.Failure(description=f"the Kubernetes cluster does not answer ({type(e).__name__}: {e})",
                             metadata={UNREACHABLE: True}) from None
        return stage_outcome(stage, 0, reader.handler)

    # ---- GpuHost ------------------------------------------------------------------------------------------
    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        # No preflight pod before each stage: the scheduler places a pod only where its GPUs are free.
        context.log.info(f"running {stage} as a pod ({self.where}, {self.gpus if stage in preflight.GPU_STAGES else 0} "
                         f"GPU(s), workdir {self.pvc} at {self.workdir})")
        return self._run_pod(context, stage, self.stage_request(stage, args))

    def check(self, context, gpus: bool, need_bytes: int | None = None) -> dict[str, Any]:
        """The probe the other hosts run, in a pod of the image (with the GPUs when `gpus`): the image's Python
        and worker code, nvidia-smi in the pod, free space on the PVC."""
        probe_args = json.dumps({"workdir": self.workdir, "gpus": gpus})
        cmd = [self.python, "-c", _PIPES_PROBE, probe_args]
        info = self._run_pod(context, "preflight", self.pod_request("preflight", cmd, gpus)).result
        found = preflight.problems(info, where=self.where, gpus=gpus, min_free_bytes=int(self.min_free_gb * 1e9),
                                   code="installed", need_bytes=need_bytes)
        if found:
            raise dg.Failure(description="the host is not ready:\n- " + "\n- ".join(found), allow_retries=False)
        context.log.info(f"{self.where}: {preflight.summary(info)}")
        return info

    def _mounted(self) -> LocalGpuHost:
        """The PVC as the control plane sees it: a local directory, handled as the local host handles its own."""
        if not self.control_plane_mount:
            raise dg.Failure(description=f"the control plane cannot read or write the k8s host's files: set "
                                         f"control_plane_mount to where PVC {self.pvc} is mounted on the Dagster "
                                         f"machine (README: Kubernetes)", allow_retries=False)
        if not Path(self.control_plane_mount).expanduser().is_dir():
            raise dg.Failure(description=f"control_plane_mount {self.control_plane_mount} is not a directory here: "
                                         f"mount PVC {self.pvc} there", allow_retries=False)
        return LocalGpuHost(workdir=str(Path(self.control_plane_mount).expanduser()))

    @contextmanager
    def files(self) -> Iterator[tuple[Any, str]]:
        with self._mounted().files() as f:
            yield f

    def put_file(self, local_path: str, rel_path: str) -> None:
        self._mounted().put_file(local_path, rel_path)

    def get_file(self, rel_path: str, local_path: str) -> None:
        self._mounted().get_file(rel_path, local_path)
