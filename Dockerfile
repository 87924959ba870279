# The Conductor gateway image (also runs `conductor emulate` for GPU-less test clusters).
#
# Base image: pinned to an exact Python patch release and Debian release rather than by digest. The
# digest of python:3.11.11-slim-bookworm could not be read from the registry where this file was
# written (no Docker daemon, no registry access) and a digest copied from a third-party file cannot be
# checked; pin it with
#   docker buildx imagetools inspect python:3.11.11-slim-bookworm --format '{{json .Manifest.Digest}}'
# and pass it as BASE_IMAGE=python:3.11.11-slim-bookworm@sha256:<digest> (CI should) until it is written here.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

# --- builder: the project as a wheel (no compiler needed at run time, no sources in the image) -------
FROM ${BASE_IMAGE} AS builder
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2
COPY pyproject.toml README.md ./
COPY conductor ./conductor
COPY predictors ./predictors
COPY policies ./policies
COPY adapters ./adapters
COPY traces ./traces
RUN python -m build --wheel --outdir /wheels .

# --- runtime: the wheel with its extras, run as nobody ----------------------------------------------
FROM ${BASE_IMAGE} AS runtime
# the Mooncake Store client (the mooncake extra) links against the RDMA user-space libraries
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /wheels /wheels
# otel: tracing.otlp_endpoint needs the OpenTelemetry SDK and exporter (without them the gateway
# refuses to start with tracing configured); mooncake: kv.mooncake, and mooncake_master for the chart
RUN wheel=$(ls /wheels/*.whl) && pip install --no-cache-dir "${wheel}[mooncake,otel]" && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# 65534 (nobody): the numeric user the chart's runAsUser names; no home, nothing writable but /tmp
USER 65534:65534
WORKDIR /tmp
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["conductor"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
