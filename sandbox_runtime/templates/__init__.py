"""Sandbox templates: root filesystems built from Debian packages (mmdebstrap),
content-addressed and cached, mounted read-only with a writable layer.

    definitions.py  defs/<name>.yaml -> Definition (+ its key)       pure
    build.py        mmdebstrap -> <cache>/<key>/{rootfs,manifest.json}
    store.py        TemplateStore: build (locked), resolve, list, remove
    rootfs.py       per-sandbox overlay (template + tmpfs upper layer)
    trust.py        the gateway's CA in every trust store, at sandbox start   pure
    progress.py     build progress display                            pure
"""
from .store import Template, TemplateError, TemplateNotBuilt, TemplateStore

__all__ = ["Template", "TemplateError", "TemplateNotBuilt", "TemplateStore"]
