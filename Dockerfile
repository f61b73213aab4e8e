# syntax=docker/dockerfile:1.7
# GPU image: a CUDA base, PyPI's torch at the release vLLM's wheel is linked against, vLLM, Transformer Engine
# built against that torch, megatron-core, Ray, rl_megatron. verl builds its images the same way (a CUDA/cuDNN
# base, PyPI torch at vLLM's pin, TE with --no-build-isolation).
#   docker build -t rl_megatron:gpu .
#   docker run --gpus all --rm rl_megatron:gpu python -m rl_megatron.doctor --config configs/demo_cpu.yaml
# UNTESTED: no Docker and no GPU where this was written. The build checks its own assumptions (below) and stops
# with a message rather than producing an image whose torch, vLLM and Transformer Engine do not fit together.
#
# Why not NGC's PyTorch image: its torch is a pre-release build (2.13.0a0+…) while vLLM's PyPI wheel is linked
# against the release (torch==2.13.0); vLLM then fails at import with undefined symbols. Installing vLLM's torch
# over NGC's breaks NGC's Transformer Engine and apex instead. So: PyPI's torch on a plain CUDA base, and TE built
# here against it.
ARG BASE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04
FROM ${BASE}

ARG TE_VERSION=">=2.9,<3"
ENV PYTHONUNBUFFERED=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    VLLM_LOGGING_LEVEL=WARNING \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev git \
 && rm -rf /var/lib/apt/lists/* && python3.12 -m venv /opt/venv && pip install --upgrade pip setuptools wheel

# The pinned stack in one resolve (torch == vLLM's pin), then the check that the torch pip chose is that build and
# that its CUDA is the toolkit's major version (Transformer Engine compiles against both).
COPY requirements-gpu.txt rl_megatron/platform/stack.py /tmp/stack/
RUN pip install -r /tmp/stack/requirements-gpu.txt \
 && python /tmp/stack/stack.py \
 && python -c "import subprocess, sys, torch; \
nvcc = subprocess.run(['nvcc', '--version'], capture_output=True, text=True).stdout; \
major = nvcc.split('release ')[1].split('.')[0]; \
sys.exit(0 if torch.version.cuda.split('.')[0] == major else \
f'torch {torch.__version__} is built for CUDA {torch.version.cuda} but the base has nvcc {major}: rebuild with ' \
f'--build-arg BASE=nvidia/cuda:<{torch.version.cuda}-x>-cudnn-devel-ubuntu24.04')"
# Transformer Engine: built against the torch above (pip's build isolation would fetch another torch to build with).
RUN pip install ninja pybind11 \
 && NVTE_FRAMEWORK=pytorch MAX_JOBS=8 pip install --no-build-isolation "transformer_engine[pytorch]${TE_VERSION}"

WORKDIR /opt/rl_megatron
COPY . .
# The project itself without dependencies: everything above is pinned, and torch must stay the one vLLM needs.
RUN pip install --no-deps -e . \
 && python -m rl_megatron.platform.stack \
 && python -c "import torch, transformer_engine, megatron.core, vllm, ray, rl_megatron.train; \
print('torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
