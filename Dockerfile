# GPU image: NGC PyTorch (CUDA, cuDNN, Transformer-Engine, apex) + megatron-core, vLLM, Ray, rl_megatron.
#   docker build -t rl_megatron:gpu .
#   docker run --gpus all --rm rl_megatron:gpu python -m rl_megatron.bench update --json
# vllm==0.32.0 pins torch==2.13.0: choose the NGC release that ships torch 2.13 (BASE below), or pip
# replaces the image's torch and Transformer-Engine/apex, built against it, stop importing.
ARG BASE=nvcr.io/nvidia/pytorch:26.09-py3
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    VLLM_LOGGING_LEVEL=WARNING

WORKDIR /opt/rl_megatron
COPY setup.py README.md ./
COPY rl_megatron ./rl_megatron
# The image's torch, Transformer-Engine and apex stay; the rest comes pinned from setup.py's gpu extra.
RUN pip install --no-cache-dir "vllm==0.32.0" "ray==2.60.0" "megatron-core>=0.16.1" \
        "omegaconf>=2.3,<2.5" "tensorboard>=2.16" safetensors psutil tqdm pytest \
 && pip install --no-cache-dir --no-deps -e . \
 && python -c "import torch, megatron.core, vllm, ray, transformer_engine; print('torch', torch.__version__)"
COPY configs ./configs
COPY launch ./launch
COPY tests ./tests
