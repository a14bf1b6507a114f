"""Session-scoped tiny model pairs, saved to a temp dir and loaded through mmspec's loader."""

from __future__ import annotations

import pytest
import torch

from mmspec_cli.models.loading import load_model
from mmspec_cli.models.profiles import ModelSpec

from tests import tiny
from tests.helpers import DEVICE


# Tiny models: one thread is faster than two and keeps timings steady on a shared 2-core machine.
torch.set_num_threads(1)


def load(path: str, role: str):
    return load_model(ModelSpec(model=path, dtype="float64", device=DEVICE), role)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Paths of saved tiny models: target, an identical draft, a perturbed draft, an unrelated one."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny.train_tokenizer()
    processor = tiny.make_processor(tokenizer)
    vocab = len(tokenizer)
    target = tiny.make_model(vocab, seed=0)
    dirs = {
        "target": tiny.save(target, processor, root / "target"),
        "same": tiny.save(target, processor, root / "same"),
        "perturbed": tiny.save(tiny.perturbed_copy(target, 0.15, seed=1), processor, root / "perturbed"),
        "random": tiny.save(tiny.make_model(vocab, seed=7, hidden=16, layers=1), processor, root / "random"),
    }
    plain = tiny.make_processor(tokenizer, chat_template=None)
    dirs["no_template"] = tiny.save(target, plain, root / "no_template")
    other_tok = tiny.train_tokenizer(vocab_size=350, corpus=[c[::-1] for c in tiny.CORPUS])
    dirs["other_tokenizer"] = tiny.save(tiny.make_model(len(other_tok), seed=3), tiny.make_processor(other_tok),
                                        root / "other_tokenizer")
    return dirs


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """LoadedModel objects for each saved tiny model (loaded once per session)."""
    return {name: load(path, "draft" if name != "target" else "target") for name, path in tiny_dirs.items()}


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """After each test, accelerate's process-wide state is reset, as its own test cases do: a training run that
    made an ``Accelerator`` for a GPU target would otherwise refuse the next test's CPU one (``cpu=True``)."""
    yield
    import sys

    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading a model fails the test: the refusals under test must come before any work."""
    from mmspec_cli import api
    from mmspec_cli.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(api, "load_model", refuse)
    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.fixture(scope="session")
def joint(tiny_models):
    """The tiny target's exact distribution {(x1, x2): p} of its first two tokens sampled with
    ``tests.distributions.PARAMS``, for the engine-level distribution tests."""
    from tests.distributions import exact_joint

    return exact_joint(tiny_models["target"])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """``MMSPEC_CACHE`` in a fresh folder under ``tmp_path``; ``tmp_path``."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture(scope="module")
def one_image_files(tiny_dirs, tmp_path_factory, request) -> dict:
    """One image and a profile of the tiny models (max_new_tokens 5), in a folder of the test module's own."""
    from tests.helpers import tiny_files

    return tiny_files(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), tiny_dirs, images=1,
                      max_new_tokens=5)
