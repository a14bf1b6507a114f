"""CPU thread choice (models/threads.py): the rules, and what the commands report."""

from __future__ import annotations

import pytest
import torch

from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.models.threads import SMALL_MODEL_PARAMS, choose_threads
from tests.helpers import write_profile

BIG = 10 * SMALL_MODEL_PARAMS


def test_the_flag_then_the_environment_win():
    assert choose_threads(3, {"MMSPEC_THREADS": "2"}, True, BIG, 2, 0.0).count == 3
    assert choose_threads(None, {"MMSPEC_THREADS": "2"}, True, 100, 2, 5.0).count == 2
    assert choose_threads(None, {"MMSPEC_THREADS": " "}, True, 100, 2, 0.0).reason.startswith("small target")


@pytest.mark.parametrize("value, source", [(0, "--threads"), ("-1", "MMSPEC_THREADS"), ("two", "MMSPEC_THREADS")])
def test_bad_counts_are_one_line(value, source):
    requested, env = (value, {}) if source == "--threads" else (None, {"MMSPEC_THREADS": value})
    with pytest.raises(InputError, match=rf"^{source}: expected a number of CPU threads >= 1"):
        choose_threads(requested, env, True, BIG, 2, 0.0)


def test_gpu_models_keep_torchs_default():
    choice = choose_threads(None, {}, False, BIG, 16, 0.0)
    assert choice.count is None and "GPU" in choice.reason


def test_a_small_target_takes_one_thread_whatever_the_cores():
    assert choose_threads(None, {}, True, SMALL_MODEL_PARAMS - 1, 64, 0.0).count == 1


@pytest.mark.parametrize("cores, load, expected", [(2, 0.1, 2), (2, 1.2, 1), (2, 2.5, 1), (8, 2.4, 6), (4, None, 4)])
def test_a_big_target_takes_the_idle_cores(cores, load, expected):
    assert choose_threads(None, {}, True, BIG, cores, load).count == expected


def test_busy_warning_only_when_the_load_exceeds_the_cores():
    from mmspec_cli.models.threads import ThreadChoice, busy_warning

    one = ThreadChoice(1, "small target")
    assert busy_warning(one, True, load=1.5, cores=2) is None
    assert busy_warning(one, False, load=9.0, cores=2) is None  # GPU timings are not the CPU's
    line = busy_warning(one, True, load=3.4, cores=2)
    assert line.startswith("warning: the load average is 3.40, above the 2 cores") and "\n" not in line


def test_generate_reports_its_choice_and_bench_records_carry_it(tiny_dirs, tmp_path, monkeypatch):
    import json

    import torch
    from typer.testing import CliRunner

    from mmspec_cli.cli.app import app
    from tests.helpers import save_images, write_profile
    from tests.helpers import assert_one_line_error

    monkeypatch.delenv("MMSPEC_THREADS", raising=False)
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=4)
    [image] = save_images(tmp_path, 1)
    runner = CliRunner()
    before = torch.get_num_threads()
    try:
        out = runner.invoke(app, ["generate", image, "-q", "what?", "--profile", profile, "--json"])
        assert out.exit_code == 0, out.stderr
        assert json.loads(out.stdout)["threads"]["count"] == 1 and torch.get_num_threads() == 1  # a tiny target
        out = runner.invoke(app, ["generate", image, "-q", "what?", "--profile", profile, "--json", "--threads", "2"])
        assert json.loads(out.stdout)["threads"] == {"count": 2, "reason": "--threads"}
        manifest = tmp_path / "m.jsonl"
        manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": ["what?"], "category": "x"}) + "\n")
        results = tmp_path / "r.jsonl"
        out = runner.invoke(app, ["bench", str(manifest), "--drafters", "ar,m", "--profile", profile, "--out",
                                  str(results)], env={"MMSPEC_THREADS": "1"})
        assert out.exit_code == 0, out.stderr
        assert {json.loads(line)["threads"] for line in results.read_text().splitlines()} == {1}
        assert_one_line_error(runner.invoke(app, ["generate", image, "-q", "what?", "--profile", profile,
                                                  "--threads", "0"]), "--threads: expected a number of CPU threads >= 1")
        assert_one_line_error(runner.invoke(app, ["generate", image, "-q", "what?", "--profile", profile],
                                            env={"MMSPEC_THREADS": "many"}),
                              "MMSPEC_THREADS: expected a number of CPU threads >= 1")
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the library's threads


def test_load_decoder_applies_the_clis_thread_choice_unless_told_otherwise(tiny_dirs, tmp_path, monkeypatch):
    from mmspec_cli.api import ModelSet, load_decoder

    monkeypatch.delenv("MMSPEC_THREADS", raising=False)
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_decoder(profile, drafter="ar")
        assert torch.get_num_threads() == 1  # a small target: 1 thread, as the CLI chooses
        torch.set_num_threads(2)
        load_decoder(profile, drafter="ar", threads=None)
        assert torch.get_num_threads() == 2  # left alone
        load_decoder(profile, drafter="ar", threads=3)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("MMSPEC_THREADS", "2")
        models = ModelSet.load(load_profile(profile), ["ar"])
        assert torch.get_num_threads() == 2 and models.threads.reason == "MMSPEC_THREADS"
        with pytest.raises(InputError, match="threads: expected a number of CPU threads >= 1"):
            load_decoder(profile, drafter="ar", threads=0)
    finally:
        torch.set_num_threads(before)
