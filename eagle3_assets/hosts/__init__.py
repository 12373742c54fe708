"""Where worker stages run: `LocalGpuHost` (a subprocess here), `SshGpuHost` (a GPU machine over SSH),
`K8sHost` (a pod per stage on a Kubernetes cluster), or a `HostPool` of them (one host per run, by its
`eagle3/host` tag)."""

from .base import GpuHost, Held, StageRun
from .k8s import K8sHost
from .local import LocalGpuHost
from .pool import HOST_TAG, HostPool
from .ssh import SshGpuHost

__all__ = ["HOST_TAG", "GpuHost", "Held", "HostPool", "K8sHost", "LocalGpuHost", "SshGpuHost", "StageRun"]
