# aserve's OpenAI-compatible server in a container. Needs BuildKit (the default builder since
# Docker 23), which builds only the stages the chosen variant uses.
#
#   docker build --build-arg VARIANT=cpu -t aserve:cpu .
#   docker build --build-arg VARIANT=gpu -t aserve:gpu .
#   docker run -p 8000:8000 -v /path/to/model:/model aserve:cpu --model /model
#
# The model is mounted, not baked in. A hub id works too when the container can reach the hub:
# mount a cache (-v ~/.cache/huggingface:/home/aserve/.cache/huggingface, or a named volume
# there, which takes the image's ownership of the folder) to keep downloads.
#
# The CPU variant has a C++ compiler and its kernels compiled at build time, for the build
# machine's CPU (-march=native): a container on the same kind of CPU runs them from its first
# request; on another kind it compiles them once at start (about a minute), then serves.
# No Triton on CPU (a GPU build of torch brings its own).

ARG VARIANT=cpu
# A CUDA 12 image with torch >= 2.6 and Python >= 3.10; override with --build-arg GPU_BASE=...
ARG GPU_BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
# The CPU variant's base image and where its torch comes from (a mirror, or a local index)
ARG CPU_BASE=python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CPU_BASE} AS base-cpu
ARG TORCH_INDEX_URL
# g++ for the kernels, and Python's headers where the base's Python lacks them (a distribution's)
RUN pkgs=g++ \
    && if ! python -c "import pathlib, sys, sysconfig; \
sys.exit(not (pathlib.Path(sysconfig.get_paths()['include']) / 'Python.h').exists())"; then \
         pkgs="$pkgs python3-dev"; fi \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}
ENV ASERVE_PREBUILD_KERNELS=1

FROM ${GPU_BASE} AS base-gpu

FROM base-${VARIANT}
ENV PYTHONUNBUFFERED=1
WORKDIR /opt/aserve
COPY pyproject.toml README.md ./
COPY aserve ./aserve
RUN pip install --no-cache-dir . \
    && useradd --create-home aserve
USER aserve
WORKDIR /home/aserve
# the HF cache's folder, the user's own (a mount there is written to); the CPU kernels built
# into the user's torch extension cache (the CPU variant: where the ENV above asks for it)
RUN mkdir -p /home/aserve/.cache/huggingface \
    && if [ -n "${ASERVE_PREBUILD_KERNELS:-}" ]; then \
         python -c "from aserve.kernels import cpu_extension as c; assert c.load() is not None"; \
       fi
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Listen on every interface inside the container; publish the port with -p.
ENTRYPOINT ["python", "-m", "aserve", "--host", "0.0.0.0"]
