"""Fail closed on our own bugs: every mitmproxy hook an addon implements, guarded once.

mitmproxy (and HookTableAddons, which copies it) logs an addon's exception and lets the
flow go on: a bug in the gate's request check would send the request upstream unchecked,
one in the response scrub would deliver the response unscrubbed. `fail_closed` wraps each
hook method of a class so that an exception calls the instance's
`hook_failed(hook, args, exc)` instead, which refuses the flow or connection. The wrapper
sits on the class, so it holds for every caller: mitmproxy's dispatch, ours, the fast path.
"""
from __future__ import annotations

import functools
import inspect

from mitmproxy import exceptions, hooks

from egress.log_redact import where  # noqa: F401 - file:line frames of an exception, no message

_PASS_THROUGH = (exceptions.AddonHalt, exceptions.OptionsError)   # mitmproxy's control flow, not bugs


def _guard(name: str, func):
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def hook(self, *args):
            try:
                return await func(self, *args)
            except _PASS_THROUGH:
                raise
            except Exception as e:   # noqa: BLE001 - fail closed, see the module doc
                self.hook_failed(name, args, e)
    else:
        @functools.wraps(func)
        def hook(self, *args):
            try:
                return func(self, *args)
            except _PASS_THROUGH:
                raise
            except Exception as e:   # noqa: BLE001
                self.hook_failed(name, args, e)
    hook._cubegate_fail_closed = True
    return hook


def fail_closed(cls):
    """Class decorator: every method of `cls` named like a mitmproxy hook fails closed."""
    if not callable(getattr(cls, "hook_failed", None)):
        raise TypeError(f"{cls.__name__} has no hook_failed(hook, args, exc)")
    for name in hook_names(cls):
        func = getattr(cls, name)
        if not getattr(func, "_cubegate_fail_closed", False):
            setattr(cls, name, _guard(name, func))
    return cls


def hook_names(cls) -> list[str]:
    return sorted(n for n in hooks.all_hooks if callable(getattr(cls, n, None)))


def guarded(obj) -> bool:
    """Every hook `obj` implements fails closed (build_master checks it for the gate)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return all(getattr(getattr(cls, n), "_cubegate_fail_closed", False) for n in hook_names(cls))
