# The agent's image: the training runtime, the transfer engine and the gRPC server (torch).
# Build from the repository root (the context must hold pyproject.toml and the source roots):
#   docker build -f docker/agent.Dockerfile -t liveshard-agent:0.1.0 .
# The operator renders worker pods whose first container runs `liveshard-agent`, configured by
# LIVESHARD_* environment variables (docs/agent.md). pip installs the torch wheel of PyPI; for
# GPUs pick a CUDA base image and torch build that match the nodes' driver.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/liveshard
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY operator ./operator
COPY proto ./proto
COPY e2e/liveshard_e2e ./e2e/liveshard_e2e
# A plain (not editable) install: the image keeps only the venv, not /src.
RUN /opt/liveshard/bin/pip install ".[agent]" \
    && /opt/liveshard/bin/python -c "import torch, grpc, liveshard_agent.server.process"
# The built-in model directory and its tokens (the preset qwen3-tiny), made once at build time.
ENV LIVESHARD_CACHE=/opt/liveshard/cache
RUN /opt/liveshard/bin/python -c \
    "from liveshard_agent.data.builtin import builtin_tokens; builtin_tokens()"

FROM python:3.11-slim
ENV PATH=/opt/liveshard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LIVESHARD_CACHE=/opt/liveshard/cache \
    HOME=/tmp
COPY --from=build /opt/liveshard /opt/liveshard
# A fixed non-root user, no home directory, no shell login.
RUN groupadd --system --gid 65532 liveshard \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin liveshard
USER 65532:65532
WORKDIR /tmp
# The agent API (LIVESHARD_PORT); c10d stores and process groups use further ports on the pod IP.
EXPOSE 7070
ENTRYPOINT ["liveshard-agent"]
