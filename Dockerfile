# pcdist with the torch that CI tests (the Makefile's TORCH_PIN), from PyPI: on Linux x86_64 that wheel is
# the CUDA build and carries its CUDA libraries, so the host needs only the NVIDIA driver and container
# toolkit (docker run --gpus); without GPUs it runs on the CPU (gloo).
FROM python:3.11-slim-bookworm

ARG TORCH_PIN=torch==2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# A C compiler for pcdist's fused CPU kernel (built on first use; GPU runs do not need it).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch alone (the largest layer), pinned as in CI (hadolint cannot see the pin inside the ARG).
# hadolint ignore=DL3013
RUN pip install "${TORCH_PIN}"

# Dependency layer: only the packaging files invalidate it; the versions are bounded in pyproject.toml.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
# hadolint ignore=DL3013
RUN mkdir -p pcdist conf && touch pcdist/__init__.py \
    && pip install ".[wandb]" \
    && pip uninstall -y pcdist \
    && rm -rf pcdist conf build ./*.egg-info

# Source layer: pcdist installed as a wheel would be (conf/ inside it, as pcdist/conf), run as `python -m pcdist`.
COPY pcdist ./pcdist
COPY conf ./conf
RUN pip install --no-deps . && rm -rf /src

# Any uid may run the image (launch/docker.sh passes the host user's, so what it writes under the mounted
# runs/ belongs to that user): HOME and the caches are in /tmp, USER spares lookups of a uid /etc/passwd lacks
# (getpass.getuser), runs/ is writable by all.
WORKDIR /app
RUN useradd --create-home --uid 1000 pcdist \
    && mkdir -p runs data \
    && chmod 1777 runs
USER 1000:1000
ENV HOME=/tmp \
    USER=pcdist \
    LOGNAME=pcdist \
    WANDB_DIR=/app/runs \
    MPLCONFIGDIR=/tmp/matplotlib \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc_per_node=1", "-m", "pcdist"]
