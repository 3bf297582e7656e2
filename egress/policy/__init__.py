"""Pure egress policy layer: load YAML, compile, decide. No sockets, no mitmproxy.

The gateway codes against: RequestInfo, Decision, CompiledPolicySet
(decide / policy_for / name_may_resolve / hosts_allowed / digest / sources),
load_policy_dir, load_policy_files, PolicyError, PolicyStore.
Precedence rules: PRECEDENCE.md next to this file.
"""

from .builtins import BUILTIN_DENIED_CIDRS, BUILTIN_DENIED_DOMAINS
from .compiled import CompiledPolicy, CompiledPolicySet
from .errors import ErrorItem, PolicyError
from .hosts import HostPattern, InvalidHost, InvalidPath, normalize_host, normalize_path, parse_host_pattern
from .loader import load_policy_dir, load_policy_files, parse_policy_document, parse_policy_text
from .model import AppliesTo, Decision, GlobalDenies, Match, Policy, RequestInfo, Rule
from .reload import PolicyStore, ReloadResult

__all__ = [
    "BUILTIN_DENIED_CIDRS",
    "BUILTIN_DENIED_DOMAINS",
    "AppliesTo",
    "CompiledPolicy",
    "CompiledPolicySet",
    "Decision",
    "ErrorItem",
    "GlobalDenies",
    "HostPattern",
    "InvalidHost",
    "InvalidPath",
    "Match",
    "Policy",
    "PolicyError",
    "PolicyStore",
    "ReloadResult",
    "RequestInfo",
    "Rule",
    "load_policy_dir",
    "load_policy_files",
    "normalize_host",
    "normalize_path",
    "parse_host_pattern",
    "parse_policy_document",
    "parse_policy_text",
]
