"""microvm sandbox backend: QEMU -M microvm guests restored from template snapshots."""
from .backend import MicrovmBackend

__all__ = ["MicrovmBackend"]
