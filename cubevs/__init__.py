"""cubevs: per-sandbox network isolation (netns/veth plumbing, eBPF switch, nftables fallback)."""
from .registry import Registry
from .switch import SandboxNet, Switch, SwitchError

__all__ = ["Switch", "SandboxNet", "SwitchError", "Registry"]
