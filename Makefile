# One command to set up and run the demo, one to set up and run all tests.
#   make demo   — installs everything, starts a lab network + the gateway, shows allowed/denied/injected requests
#   make test   — installs everything, runs the whole test suite
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := gcc libc6-dev qemu-system-x86 busybox-static clang llvm libbpf-dev bpftool nftables bubblewrap iproute2 curl dnsutils tinyproxy procps psmisc hey squid nginx-light mmdebstrap chromium chromium-driver

.PHONY: setup apt venv demo test bench bpf clean

setup: apt venv bpf

apt:
	@if [ "$$(id -u)" != 0 ]; then echo "run as root (network namespaces, eBPF)"; exit 1; fi
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "apt-get install:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $$(scripts/find-python.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

bpf: venv
	$(PY) -m cubevs.build            # cubevs/bpf/build/switch.o and splice.o
	$(PY) -m sandbox_runtime.build_agent
	$(PY) -m sandbox_runtime.microvm build

demo: setup
	$(VENV)/bin/cubegate demo

# Most tests wait (process starts, network, timeouts): they share the cores on TEST_WORKERS workers,
# a file per worker (its module fixtures start once). The load- and timing-sensitive ones (marker
# serial, tests/conftest.py) run after, alone. Both parts always run; make fails if either failed.
TEST_WORKERS ?= 2
test: setup
	@rc=0; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m "not serial" || rc=$$?; \
	$(PY) -m pytest -q -p no:cacheprovider -m serial || rc=$$?; \
	exit $$rc

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
