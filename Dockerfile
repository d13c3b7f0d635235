# pcdist on an official PyTorch CUDA runtime image (its torch satisfies pyproject's torch>=2.4).
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler for pcdist's fused CPU kernel (built on first use; GPU runs do not need it).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Dependency layer: only pyproject changes invalidate it. torch comes from the base image;
# the other versions are bounded in pyproject.toml.
COPY pyproject.toml README.md ./
# hadolint ignore=DL3013
RUN mkdir pcdist && touch pcdist/__init__.py \
    && pip install ".[wandb]" \
    && pip uninstall -y pcdist \
    && rm -rf pcdist

# Source layer.
COPY pcdist ./pcdist
COPY conf ./conf
COPY train.py ./
# hadolint ignore=DL3013
RUN pip install --no-deps . \
    && useradd --create-home --uid 1000 pcdist \
    && mkdir -p runs data \
    && chown -R pcdist:pcdist /app

USER 1000:1000
ENV WANDB_DIR=/app/runs \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc_per_node=1", "train.py"]
