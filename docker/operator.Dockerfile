# The operator's image: kopf, the Kubernetes client and gRPC; no torch.
# Build from the repository root (the context must hold pyproject.toml and the source roots):
#   docker build -f docker/operator.Dockerfile -t liveshard-operator:0.1.0 .
# The chart runs it as `liveshard-operator --all-namespaces ...` (charts/liveshard/templates/deployment.yaml).

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
RUN /opt/liveshard/bin/pip install ".[operator]" \
    && if /opt/liveshard/bin/python -c "import torch" 2>/dev/null; then \
        echo "torch must not be in the operator image" >&2; exit 1; fi

FROM python:3.11-slim
ENV PATH=/opt/liveshard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/liveshard /opt/liveshard
# A fixed non-root user (the chart's runAsUser), no home directory, no shell login.
RUN groupadd --system --gid 65532 liveshard \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin liveshard
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["liveshard-operator"]
CMD ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
