"""Where worker stages run: `LocalGpuHost` (a subprocess here), `SshGpuHost` (a GPU machine over SSH), or a
`HostPool` of them (one host per run, by its `eagle3/host` tag)."""

from .base import GpuHost, Held, StageRun
from .local import LocalGpuHost
from .pool import HOST_TAG, HostPool
from .ssh import SshGpuHost

__all__ = ["HOST_TAG", "GpuHost", "Held", "HostPool", "LocalGpuHost", "SshGpuHost", "StageRun"]
