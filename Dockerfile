# aserve's OpenAI-compatible server in a container. Needs BuildKit (the default builder since
# Docker 23), which builds only the stages the chosen variant uses.
#
#   docker build --build-arg VARIANT=cpu -t aserve:cpu .
#   docker build --build-arg VARIANT=gpu -t aserve:gpu .
#   docker run -p 8000:8000 -v /path/to/model:/model aserve:cpu --model /model
#
# The model is mounted, not baked in. A hub id works too when the container can reach the hub:
# mount a cache (-v ~/.cache/huggingface:/home/aserve/.cache/huggingface) to keep downloads.

ARG VARIANT=cpu
# A CUDA 12 image with torch >= 2.6 and Python >= 3.10; override with --build-arg GPU_BASE=...
ARG GPU_BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
# The CPU variant's base image and where its torch comes from (a mirror, or a local index)
ARG CPU_BASE=python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CPU_BASE} AS base-cpu
ARG TORCH_INDEX_URL
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}

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
EXPOSE 8000
# Listen on every interface inside the container; publish the port with -p.
ENTRYPOINT ["python", "-m", "aserve", "--host", "0.0.0.0"]
