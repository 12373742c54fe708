"""Where worker stages run: `LocalGpuHost` (a subprocess here) or `SshGpuHost` (a GPU machine over SSH)."""

from .base import GpuHost, StageRun
from .local import LocalGpuHost
from .ssh import SshGpuHost

__all__ = ["GpuHost", "LocalGpuHost", "SshGpuHost", "StageRun"]
