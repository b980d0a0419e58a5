"""zerompi: ZeRO stages 0-3 over MPI, for torch models on Slurm/InfiniBand clusters."""
from setuptools import find_packages, setup

setup(
    name="zerompi",
    version=open("zerompi/version.py").read().split('"')[-2],
    description="ZeRO (Zero Redundancy Optimizer) over MPI and NCCL for PyTorch",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # cuda_src/ (top level in the repo) ships inside the package as zerompi/cuda_src, so
    # installed copies can compile the kernels (and the offload's host pass, *.cpp) at run time.
    packages=find_packages(include=["zerompi", "zerompi.*"]) + ["zerompi.cuda_src"],
    package_dir={"zerompi.cuda_src": "cuda_src"},
    package_data={"zerompi.cuda_src": ["*.cu", "*.cuh", "*.cpp"]},
    install_requires=[
        "mpi4py>=4.0",
        "numpy>=1.24",
        # install.sh installs torch==2.13.0 first (the CPU or the CUDA build, see there);
        # an unpinned torch pulls the newest CUDA build (several GB).
        "torch>=2.3",
        "h5py>=3.8",
        "tqdm>=4.60",
        # `python -m zerompi.plot` must work right after the README's first command.
        "matplotlib>=3.6",
    ],
    extras_require={
        # An MPI library from PyPI for machines without a site MPI (workstations, CI).
        "mpich": ["mpich"],
        # CuPy and NCCL for the CUDA major version of the installed torch
        # (python -c "import torch; print(torch.version.cuda)"): 12.x -> cuda12, 13.x ->
        # cuda13 (CuPy >= 14). `cuda` stays what it always was, CUDA 12.
        "cuda12": ["cupy-cuda12x>=13", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x>=14", "nvidia-nccl-cu13"],
        "cuda": ["cupy-cuda12x>=13", "nvidia-nccl-cu12"],
        # The trainer's `tensorboard = true` / `wandb = true` (zerompi/trainer/sinks.py).
        "logging": ["tensorboard>=2.10", "wandb>=0.16"],
        # transformers: tests build BERT, T5, GPT-2, Llama, Mixtral from configs (no download);
        # nvrtc: CI compiles cuda_src/ with NVRTC exactly as CuPy does at run time;
        # tensorboard, wandb: the trainer's logging is read back (offline W&B: no network);
        # pytest < 9.2: from 9.2 a node id no longer follows item._nodeid, which is how
        # pytest-xdist (3.8) applies xdist_group, so every group would be split (conftest.py checks)
        "test": ["pytest>=7,<9.2", "pytest-xdist>=3.5", "transformers>=4.40", "accelerate>=1.1", "nvidia-cuda-nvrtc-cu12",
                 "pyarrow>=12", "datasets>=2.14", "tensorboard>=2.10", "wandb>=0.16"],
        # the Hugging Face Trainer on zerompi (zerompi/integrations/transformers.py): the Trainer needs accelerate
        "hf": ["transformers>=4.40", "accelerate>=1.1"],
        # python -m zerompi.prepare: Parquet input, tokenizer.json tokenizers and datasets
        # save_to_disk folders (docs/data.md)
        "data": ["pyarrow>=12", "tokenizers>=0.15", "datasets>=2.14"],
    },
    entry_points={"console_scripts": [
        "zerompi-train=zerompi.train:main",
        "zerompi-prepare=zerompi.prepare:main",
    ]},
)
