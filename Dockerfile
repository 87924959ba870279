# The Conductor gateway image (also runs `conductor emulate` for GPU-less test clusters).
FROM python:3.11-slim
# the Mooncake Store client (optional extra) links against the RDMA user-space libraries
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY conductor ./conductor
COPY predictors ./predictors
COPY policies ./policies
COPY adapters ./adapters
COPY traces ./traces
RUN pip install --no-cache-dir '.[mooncake]'
USER 65534
EXPOSE 8000
ENTRYPOINT ["conductor"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
