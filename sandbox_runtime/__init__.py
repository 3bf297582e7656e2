"""Sandboxes for agent code: lifecycle, backends, exec agent. Imports only cubevs.

    backend.py   the interface every backend implements (SandboxSpec, Handle, ExecResult)
    manager.py   create/exec/destroy with admission (capacity.py), state (state.py), metrics
    namespace.py bubblewrap backend (cgroups.py, seccomp.py, uids.py)
    microvm/     QEMU microvm backend (assets, templates, tap wiring, serial agent channel)
    agent/       the static exec agent (C) and its Python client

The daemon wires it (cubegate/runtime_service.py) and serves it (cubegate/runtime_api.py).
"""
