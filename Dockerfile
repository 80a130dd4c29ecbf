# syntax=docker/dockerfile:1
# The asyncrl image: every role (rollout server, trainer, controller) runs from it.
#
#   CPU (default):  docker build -t asyncrl:0.1.0 .
#   GPU + SGLang:   docker build -t asyncrl:0.1.0-cuda \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     --build-arg EXTRAS=sglang .
#
# torch is installed first, pinned, from the chosen index: installing the project first would
# let pip resolve an unpinned torch (the CUDA build from PyPI). The build fails if a later
# install replaced it (SGLang pins its own torch: then set TORCH_VERSION to SGLang's pin,
# within asyncrl's range torch>=2.5,<2.14). tini is PID 1 and forwards
# SIGTERM to the role's process, so the rollout server parks its partials and the trainer
# checkpoints when Kubernetes stops a pod (a Python PID 1 without a handler ignores SIGTERM).
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ARG GIT_SHA=unknown

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    ASYNCRL_GIT_SHA=${GIT_SHA}

# tini: PID 1; redis-server: `asyncrl train` can start an embedded buffer on one machine;
# build-essential: DeepSpeed compiles its CPU ops (cpu_adam) on first use; libnuma1: SGLang.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini redis-server build-essential libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/asyncrl
# Dependencies first (a layer that survives source edits), then the source.
COPY pyproject.toml README.md ./
COPY asyncrl/__init__.py asyncrl/__init__.py
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && pip uninstall -y asyncrl
COPY asyncrl asyncrl
COPY rollout_server rollout_server
COPY trainer trainer
COPY buffers buffers
COPY configs configs
COPY monitoring monitoring
RUN pip install --no-deps . && python -c "import torch, asyncrl; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

RUN useradd --create-home --uid 1000 asyncrl && mkdir -p /shared && chown asyncrl /shared
USER asyncrl
WORKDIR /home/asyncrl

# asyncrl rollout-server (30000), controller and trainer metrics (9400, 9401), torch rendezvous (29500)
EXPOSE 30000 9400 9401 29500
STOPSIGNAL SIGTERM
ENTRYPOINT ["tini", "--"]
CMD ["asyncrl", "--help"]
