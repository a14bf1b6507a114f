"""What a new user's odd inputs get: one line and exit 2, before any work, and nothing of theirs overwritten.

Each folder a command writes into, where it can't be made (a file above it, ``/proc``, ``/sys``, a read-only file
system); each file mmspec reads back, made by hand or damaged (a results file to summarise or resume, the latency
cache, a head folder).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, cli

#: Where a folder or file can't be made, each as (the path under tmp_path or absolute, the words of its refusal).
UNMAKEABLE = {
    "under a file": ("userfile/sub", "userfile is a file, not a folder"),
    "two levels under a file": ("userfile/a/b", "userfile is a file, not a folder"),
    "under /proc": ("/proc/mmspec-out", "can't be written (No such file or directory in /proc)"),
    "under /sys": ("/sys/mmspec-out", "in /sys"),
}


def unmakeable(tmp_path: Path, case: str) -> tuple[str, str]:
    path, words = UNMAKEABLE[case]
    (tmp_path / "userfile").write_text("the user's own file")
    return (path if path.startswith("/") else str(tmp_path / path)), words


@pytest.mark.parametrize("case", UNMAKEABLE)
def test_export_head_into_a_folder_that_cant_be_made_is_one_line(tmp_path, case):
    out, words = unmakeable(tmp_path, case)
    result = cli("export-head", "mmspec:demo-eagle3", "--to", "vllm", "--out", out)
    assert_one_line_error(result, words)
    assert (tmp_path / "userfile").read_text() == "the user's own file"


def test_export_head_on_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    """A read-only mount (root writes through permissions, so it is stood in): refused before the export when the
    folder can't be written, and a write that fails anyway leaves nothing and says what to do (not "free space")."""
    from mmspec_cli.models import writing

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    out = tmp_path / "mounted"
    out.mkdir()
    with monkeypatch.context() as patched:
        patched.setattr(writing.tempfile, "TemporaryFile", read_only)
        result = cli("export-head", "mmspec:demo-eagle3", "--to", "vllm", "--out", str(out))
    assert_one_line_error(result, f"--out {out} can't be written (Read-only file system in ")
    monkeypatch.setattr(writing, "open_for_writing", read_only)  # the probe passed, the write fails
    result = cli("export-head", "mmspec:demo-eagle3", "--to", "vllm", "--out", str(out / "new"))
    line = assert_one_line_error(result, "Read-only file system; nothing was written to")
    assert line.endswith("pick a folder you can write") and "free some space" not in line
    assert list(out.iterdir()) == []  # the folder it made is gone again


#: Every other command's output path, as (its arguments before the path, its flag, what the path names).
WRITERS = {
    "train-head --out": (["train-head", "eagle3", "demo-single", "--steps", "1"], "--out", "sub"),
    "bench --out FILE": (["bench", "demo-single", "--limit", "1", "--drafters", "ar"], "--out", "r.jsonl"),
    "bench --format mmspec --out DIR": (["bench", "demo-single", "--limit", "1", "--drafters", "ar", "--format",
                                         "mmspec"], "--out", "sub"),
    "select-layer --write": (["select-layer"], "--write", "p.yaml"),
    "profile-latency --plot": (["profile-latency"], "--plot", "latency.png"),
}


@pytest.mark.parametrize("case", ["under a file", "under /proc"])
@pytest.mark.parametrize("writer", WRITERS)
def test_every_output_path_that_cant_be_made_is_one_line_before_loading(tmp_path, no_model_loading, writer, case):
    folder, _ = unmakeable(tmp_path, case)
    arguments, flag, name = WRITERS[writer]
    result = cli(*arguments, flag, f"{folder}/{name}")
    line = assert_one_line_error(result, flag)
    assert "can't be" in line or "doesn't exist" in line
    assert (tmp_path / "userfile").read_text() == "the user's own file"


# --------------------------------------------------------------------------- files read back: results, the latency cache


@pytest.fixture(scope="module")
def results(tiny_dirs, tmp_path_factory) -> dict:
    """A finished bench run (ar, m, tabed and the hf-assisted peer row; one sample, one turn), its manifest and
    profile."""
    import json

    from tests.helpers import tiny_files

    files = tiny_files(tmp_path_factory.mktemp("results"), tiny_dirs, max_new_tokens=6, gamma=3)
    manifest = files["root"] / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": "s0", "images": [files["images"][0]], "turns": ["what is it?"],
                                    "category": "c"}) + "\n")
    out = files["root"] / "run.jsonl"
    ran = cli("bench", str(manifest), "--drafters", "ar,m,tabed,hf-assisted", "--out", str(out), "--profile",
              files["profile"], "--no-warmup")
    assert ran.exit_code == 0, ran.stderr
    return {**files, "manifest": str(manifest), "lines": out.read_text().splitlines()}


#: Edits a user may make to the second record (m's), each as (field, value); "DELETE" removes the field.
EDITS = [("drafter", 3), ("drafter", None), ("id", ["s0"]), ("category", 7), ("category", "DELETE"), ("turn", "0"),
         ("turn", [0]), ("token_ids", "1 2 3"), ("token_ids", [1, 2]), ("new_tokens", "6"), ("new_tokens", None),
         ("blocks", [2]), ("blocks", 0), ("wall_s", "fast"), ("wall_s", -1), ("drafted", {"n": 1}), ("threads", [1]),
         ("accepted_per_block", 3), ("ensemble", "not json"), ("gamma", 2.5), ("weights", "x")]


def edited(results: dict, tmp_path: Path, field: str, value) -> str:
    import json

    records = [json.loads(line) for line in results["lines"]]
    if value == "DELETE":
        del records[1][field]
    else:
        records[1][field] = value
    path = tmp_path / "edited.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("field, value", EDITS, ids=[f"{f}={v!r}" for f, v in EDITS])
def test_summarize_of_an_edited_record_names_its_line_and_what_is_wrong(results, tmp_path, no_model_loading,
                                                                        field, value):
    path = edited(results, tmp_path, field, value)
    line = assert_one_line_error(cli("bench", "--summarize", path), f"{path} line 2")
    assert field in line or "lacks" in line


@pytest.mark.parametrize("field, value", EDITS[::3], ids=[f"{f}={v!r}" for f, v in EDITS[::3]])
def test_resume_of_an_edited_record_is_one_line_exit_2_and_the_file_is_kept(results, tmp_path, no_model_loading,
                                                                            field, value):
    path = edited(results, tmp_path, field, value)
    before = Path(path).read_bytes()
    result = cli("bench", results["manifest"], "--drafters", "ar,m,tabed,hf-assisted", "--out", path, "--resume",
                 "--profile", results["profile"])
    assert_one_line_error(result, f"{path} line 2")
    assert Path(path).read_bytes() == before


def test_every_record_bench_wrote_reads_back_and_a_peer_row_is_priced(results, tmp_path, monkeypatch,
                                                                        no_model_loading):
    """The unedited file, the hf-assisted row included (it reports no blocks), summarises and resumes as it is; the
    peer row gets Eq. (1) from the draft model's one-row step, as bench prices it."""
    import json

    from mmspec_cli.bench import latency

    path = tmp_path / "run.jsonl"
    path.write_text("".join(line + "\n" for line in results["lines"]))
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    target, draft = (json.loads(results["lines"][0])[key] for key in ("target", "draft"))
    latency.save(latency.LatencyResult(latency.device_name("cpu", 1), target, draft,
                                       {f"{s},{n}": 10.0 * n for s in (16, 256) for n in range(1, 8)},
                                       {"1,16": 0.5, "1,256": 0.5, "2,16": 0.7, "2,256": 0.7}))
    summary = cli("bench", "--summarize", str(path), "--profile", results["profile"], "--format", "json")
    assert summary.exit_code == 0, summary.stderr
    rows = {row["drafter"]: row for row in json.loads(summary.stdout)["rows"] if row["category"] == "all"}
    assert rows["hf-assisted"]["latency_ratio"] == pytest.approx(0.5 / 30.0)  # T_q(B=1, S) / T_p(1, S, γ = 3)
    resumed = cli("bench", results["manifest"], "--drafters", "ar,m,tabed,hf-assisted", "--out", str(path),
                  "--resume", "--profile", results["profile"], "--format", "json")
    assert resumed.exit_code == 0, resumed.stderr


def test_ssd_settings_of_an_edited_record_are_read_as_unset():
    """A record's drafting settings naming ssd's layer or imitation network as something bench never writes (a list,
    a number) are read as not given, not as a key of the latency cache."""
    import json

    from mmspec_cli.cli.bench import _ssd_setting
    from mmspec_cli.models.profiles import profile_from_dict

    profile = profile_from_dict({"target": {"model": "m"}, "ssd": {"layer": 2}})
    odd = [{"ensemble": json.dumps({"ssd": {"layer": [1], "imitation": 3}})}]
    assert _ssd_setting(odd, profile) == (None, None)
    assert _ssd_setting([{"ensemble": json.dumps({"ssd": {"layer": 1, "imitation": "n"}})}], profile) == (1, "n")


ODD_RESULTS = {
    "nested past the decoder's depth": "[" * 100000 + "]" * 100000,
    "a JSON array": "[1, 2]",
    "not UTF-8": "\udce9",
}


@pytest.mark.parametrize("case", ODD_RESULTS)
def test_summarize_of_a_file_mmspec_did_not_write_is_one_line(tmp_path, no_model_loading, case):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(ODD_RESULTS[case].encode("utf-8", "surrogateescape") + b"\n")
    assert_one_line_error(cli("bench", "--summarize", str(path)), f"{path} line 1")


def test_a_manifest_line_nested_too_deeply_or_naming_a_folder_is_one_line_exit_2(results, tmp_path,
                                                                                  no_model_loading):
    import json

    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    assert_one_line_error(cli("bench", str(deep), "--drafters", "ar", "--profile", results["profile"]),
                          "line 1: nested too deeply to read")
    folder = tmp_path / "folder.jsonl"
    folder.write_text(json.dumps({"id": "a", "images": [str(tmp_path)], "turns": ["q"], "category": "c"}) + "\n")
    out = tmp_path / "out.jsonl"
    result = cli("bench", str(folder), "--drafters", "ar", "--profile", results["profile"], "--out", str(out))
    assert_one_line_error(result, f"sample 'a': image '{tmp_path}' is a directory")
    assert not out.exists()


#: Ways the latency cache gets damaged, each as the bytes left in the file (None: a folder where the file was).
DAMAGED = {"cut": b'{"device": "cpu", "target_ms": {"16,1": 1', "emptied": b"", "a folder": None,
           "not an object": b"[1, 2]", "an edited timing": b'{"device": "c", "target": "t", "draft": "d", '
                                                            b'"target_ms": {"16,1": "fast"}}',
           "no verification grid": b'{"device": "c", "target": "t", "draft": "d"}',
           "a zero timing": b'{"device": "c", "target": "t", "draft": "d", "target_ms": {"16,1": 0}}'}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_latency_cache_is_said_in_one_line_and_the_constant_gamma_drafts(results, tmp_path, monkeypatch,
                                                                                 case):
    import json

    from mmspec_cli.bench import latency

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    target, draft = (json.loads(results["lines"][0])[key] for key in ("target", "draft"))
    good = latency.save(latency.LatencyResult(latency.device_name("cpu", 1), target, draft,
                                              {f"{s},{n}": 10.0 * n for s in (16, 256) for n in range(1, 8)},
                                              {"1,16": 0.5, "1,256": 0.5}))
    good.unlink()
    if DAMAGED[case] is None:
        good.mkdir()
    else:
        good.write_bytes(DAMAGED[case])
    args = (results["images"][0], "-q", "what is it?", "--profile", results["profile"], "--json", "--threads", "1",
            "--drafter", "m")
    constant = cli("generate", *args)
    costed = cli("generate", *args, "--gamma-schedule", "cost")
    assert costed.exit_code == 0, costed.stderr
    [note] = [line for line in costed.stderr.splitlines() if line.startswith("note:")]
    assert note.startswith(f"note: the latency cache {good} can't be read (") and "uses the constant γ = 3" in note
    assert json.loads(costed.stdout)["turns"][0]["blocks"] == json.loads(constant.stdout)["turns"][0]["blocks"]
    summary = cli("bench", "--summarize", str(Path(results["root"]) / "run.jsonl"), "--profile", results["profile"])
    assert summary.exit_code == 0, summary.stderr
    assert f"Eq. (1) not shown: the latency cache {good} can't be read (" in summary.stdout + summary.stderr
    assert good.exists()  # the damaged file is left for profile-latency to write anew


# --------------------------------------------------------------------------- a head folder that is not a head

SHIPPED = Path(__file__).resolve().parents[1] / "mmspec_cli" / "shipped"

#: Folders a user may name as ``head.model``, each as (how to make it from the shipped heads, the refusal's words).
NOT_HEADS = {
    "empty": (lambda folder, kind: folder.mkdir(), "has no config.json"),
    "the target's own folder": (SHIPPED / "demo-target", "holds a whole llava model, not a draft head"),
    "an imitation network": (SHIPPED / "demo-imitation", "holds an imitation network (ssd.imitation), not a draft head"),
    "cut weights": ("cut", "model.safetensors can't be read (SafetensorError"),
    "no attention heads": ({"num_attention_heads": 0}, "doesn't describe a head that can be built (ZeroDivisionError"),
    "heads that don't divide the width": ({"num_attention_heads": 5}, "doesn't describe a head that can be built"),
    "a word for a number": ({"rms_norm_eps": "small"}, "Field 'rms_norm_eps' expected float"),
    "an unknown activation": ({"hidden_act": "nope"}, "doesn't describe a head that can be built (KeyError: 'nope')"),
    "an unknown kind": ({"mmspec": "kind: foo"}, 'names kind "foo", which is no head kind mmspec knows'),
    "an mmspec block that is no object": ({"mmspec": "text"}, "has an mmspec block that is not an object"),
}


def not_a_head(tmp_path: Path, kind: str, case: str) -> Path:
    """The folder of ``case``, made from the shipped ``kind`` head where it is one."""
    import json
    import shutil

    made, _ = NOT_HEADS[case]
    folder = tmp_path / "head"
    if isinstance(made, Path):
        return made
    if callable(made):
        made(folder, kind)
        return folder
    shutil.copytree(SHIPPED / f"demo-{kind}", folder)
    if made == "cut":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return folder
    config = json.loads((folder / "config.json").read_text())
    for key, value in made.items():
        if key == "mmspec" and value == "text":
            config["mmspec"] = "x"
        elif key == "mmspec":
            config["mmspec"]["kind"] = value.split(": ")[1]
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("case", NOT_HEADS)
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_head_folder_that_is_not_a_head_is_one_line(tmp_path, kind, case):
    """``--drafter eagle`` or ``eagle3`` over a profile whose ``head.model`` the user made: one line naming the folder
    and what is wrong with it, exit 2."""
    import yaml

    folder = not_a_head(tmp_path, kind, case)
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": "mmspec:demo-target", "dtype": "float32", "device": "cpu"},
                                       "head": {"model": str(folder)}}))
    image = tmp_path / "a.png"
    from PIL import Image

    Image.new("RGB", (64, 48), "blue").save(image)
    result = cli("generate", str(image), "-q", "hi", "--profile", str(profile), "--drafter", kind,
                 "--max-new-tokens", "2")
    line = assert_one_line_error(result, NOT_HEADS[case][1])
    assert str(folder) in line or folder.name in line


@pytest.mark.parametrize("line, words", [
    ("null", "is not a bench record (a JSON object)"),
    ('{"drafter": ["m"], "block_efficiency": 2.0}', 'drafter must be a non-empty string, got ["m"]'),
    ('{"drafter": "m", "block_efficiency": "2.0"}', 'block_efficiency must be a number >= 0, got "2.0"'),
    ('{"drafter": "m", "block_efficiency": NaN}', "block_efficiency must be a number >= 0, got NaN"),
    ("[" * 100000, "is not JSON")], ids=["null", "a list for a name", "text for a number", "NaN", "nested too deeply"])
def test_profile_latency_results_that_bench_did_not_write_are_one_line_before_loading(tmp_path, no_model_loading,
                                                                                      line, words):
    path = tmp_path / "results.jsonl"
    path.write_text('{"drafter": "m", "block_efficiency": 2.0}\n' + line + "\n")
    assert_one_line_error(cli("profile-latency", "--results", str(path)), f"line 2 of '{path}'")
    assert words in cli("profile-latency", "--results", str(path)).stderr


def test_a_latency_cache_of_a_newer_release_loads_and_every_field_is_checked(tmp_path, monkeypatch):
    """Keys this release does not know (a newer one's) are left out, not called damage; every field of the cached
    result has its check."""
    import dataclasses
    import json

    from mmspec_cli.bench import latency

    assert set(latency.CACHE_FIELDS) == {f.name for f in dataclasses.fields(latency.LatencyResult)}
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    saved = latency.save(latency.LatencyResult("dev", "t", "d", target_ms={"16,1": 2.0}))
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "a_newer_field": [1]}))
    assert latency.load("dev", "t", "d").target_ms == {"16,1": 2.0}
