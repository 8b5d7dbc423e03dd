# ddpq: one image for the API (`ddpq serve`), the one-shot migration (`ddpq db upgrade`) and
# workers (`ddpq worker`). CPU torch by default; for GPU workers build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
# and run the worker with the NVIDIA container runtime.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DDPQ_HOME=/var/lib/ddpq

# torch first, from the wheel index of your choice (the project pins it loosely on purpose).
RUN pip install --index-url "${TORCH_INDEX_URL}" torch

WORKDIR /opt/ddpq
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
COPY examples ./examples
RUN pip install .

RUN useradd --create-home --uid 1000 ddpq \
    && mkdir -p /var/lib/ddpq/artifacts \
    && chown -R ddpq:ddpq /var/lib/ddpq
USER ddpq

EXPOSE 8000
CMD ["ddpq", "serve", "--host", "0.0.0.0", "--port", "8000"]
