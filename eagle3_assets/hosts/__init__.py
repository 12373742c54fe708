"""Where worker stages run: `LocalGpuHost` (a subprocess here); the SSH host implements the same interface."""

from .base import GpuHost, StageRun
from .local import LocalGpuHost

__all__ = ["GpuHost", "LocalGpuHost", "StageRun"]
