"""The MMSpec suite in and out (issue 33 §4): ``mmspec bench DIR`` on a folder in MMSpec's layout, ``--protocol
mmspec``, and ``--format mmspec --out DIR`` writing one results file per drafter in MMSpec's layout.

A small fixture in that layout (3 records, 1-2 turns, tiny images), not MMSpec's data; the tiny LLaVA models of
``conftest.py`` on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmspec_cli.bench import mmspec_results
from mmspec_cli.inputs.sources import resolve
from mmspec_cli.models.profiles import load_profile
from tests import tiny
from tests.helpers import assert_one_line_error, cli, write_profile

MAX_NEW = 6
RECORDS = [  # an int id, as MMSpec's may be; the image as MMSpec's loader joins it (images/x) and from the folder
    {"id": 1, "image": "a.png", "turns": ["what is in the image?", "and then?"], "category": "GQA",
     "topic": "multi-turn conversation"},
    {"id": "r2", "image": "images/b.png", "turns": ["describe the image."], "category": "COCO",
     "topic": "image captioning"},
    {"id": "r3", "image": "a.png", "turns": ["what colour is it?"], "topic": "general vqa"},  # no category
]


def write_folder(root: Path, records=RECORDS, images=("a.png", "b.png")) -> Path:
    (root / "images").mkdir(parents=True)
    for name, image in zip(images, tiny.images(len(images))):
        image.save(root / "images" / name)
    (root / "mmspec.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return root


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def suite(tiny_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mmspec")
    # temperature 1 and 3 new tokens in the profile: the protocol sets temperature 0; --max-new-tokens still wins
    profile = write_profile(root / "tiny.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], gamma=3,
                            temperature=1.0, max_new_tokens=3)
    return {"root": root, "folder": write_folder(root / "MMSpec"), "profile": profile}


def bench(suite: dict, *args: str):
    return cli("bench", *args, "--profile", suite["profile"])


@pytest.fixture(scope="module")
def run(suite) -> dict:
    out = suite["root"] / "results"
    result = bench(suite, str(suite["folder"]), "--drafters", "ar,m", "--protocol", "mmspec", "--max-new-tokens",
                   str(MAX_NEW), "--format", "mmspec", "--out", str(out))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return {"out": out, "result": result, "records": read_jsonl(out / "bench.jsonl")}


# --------------------------------------------------------------------------- in: the folder


def test_a_folder_in_mmspecs_layout_reads_as_a_manifest_with_topic_as_category(suite):
    folder = suite["folder"]
    samples = resolve(str(folder))
    assert [(s.id, s.category, s.turns) for s in samples] == [
        ("1", "multi-turn conversation", ("what is in the image?", "and then?")),
        ("r2", "image captioning", ("describe the image.",)), ("r3", "general vqa", ("what colour is it?",))]
    # both forms of `image`: a name in images/ (MMSpec's own join) and a path from the folder
    assert [s.images for s in samples] == [(folder / "images" / "a.png",), (folder / "images" / "b.png",),
                                           (folder / "images" / "a.png",)]
    assert [dict(s.source) for s in samples] == [{"question_id": 1, "category": "GQA"},
                                                 {"question_id": "r2", "category": "COCO"},
                                                 {"question_id": "r3", "category": "general vqa"}]
    assert len(resolve(str(folder), limit=2)) == 2


def test_a_folder_without_mmspec_jsonl_is_refused_in_one_line(tmp_path, no_model_loading):
    (tmp_path / "images").mkdir()
    result = cli("bench", str(tmp_path), "--drafters", "ar")
    assert_one_line_error(result, "is a folder without mmspec.jsonl, so not in MMSpec's layout")


@pytest.mark.parametrize("record, fragment", [
    ({"id": "x1", "image": "gone.png", "turns": ["q?"], "topic": "t"},
     "(record 'x1'): image 'gone.png' is missing (neither"),
    ({"id": "x2", "turns": ["q?"], "topic": "t"}, "(record 'x2'): missing 'image'; each MMSpec record needs"),
    ({"id": "x3", "image": "a.png", "turns": ["q?"]}, "(record 'x3'): missing 'topic'"),
    ({"image": "a.png", "turns": ["q?"], "topic": "t"}, "line 2: missing 'id'"),
    ({"id": "x4", "image": "a.png", "turns": [], "topic": "t"}, "(record 'x4'): 'turns' must be a non-empty list"),
])
def test_a_bad_record_is_refused_in_one_line_naming_it(tmp_path, no_model_loading, record, fragment):
    folder = write_folder(tmp_path / "MMSpec", [RECORDS[2], record], images=("a.png",))
    line = assert_one_line_error(cli("bench", str(folder), "--drafters", "ar"), fragment)
    assert "mmspec.jsonl line 2" in line


def test_a_repeated_id_is_refused(tmp_path, no_model_loading):
    folder = write_folder(tmp_path / "MMSpec", [RECORDS[2], RECORDS[2]], images=("a.png",))
    assert_one_line_error(cli("bench", str(folder), "--drafters", "ar"), "id 'r3' repeats line 1")


# --------------------------------------------------------------------------- the protocol


def test_the_protocol_sets_temperature_0_and_1024_new_tokens(suite):
    profile = mmspec_results.apply_protocol(load_profile(suite["profile"]))
    assert (profile.decoding.temperature, profile.decoding.max_new_tokens) == (0.0, 1024)


def test_the_protocol_bounds_a_qwen_vl_models_images_and_leaves_llava_alone(tmp_path, tiny_models):
    from tests import tiny_qwen
    from tests.conftest import load

    tokenizer = tiny_qwen.train_tokenizer()
    path = tiny_qwen.save(tiny_qwen.make_model("qwen2_5_vl", len(tokenizer), seed=0),
                          tiny_qwen.make_processor("qwen2_5_vl", tokenizer), tmp_path / "qwen")
    qwen = load(path, "target")
    llava = tiny_models["perturbed"]
    llava_size = dict(llava.processor.image_processor.size) if isinstance(llava.processor.image_processor.size, dict) \
        else llava.processor.image_processor.size
    assert mmspec_results.bound_pixels(SimpleNamespace(target=qwen, draft=llava)) == ["target"]
    size = qwen.processor.image_processor.size
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key)
    assert (get("shortest_edge"), get("longest_edge")) == (256 * 28 * 28, 1280 * 28 * 28)
    assert llava.processor.image_processor.size == llava_size


def test_the_protocol_refuses_a_sample_whose_later_turn_brings_images(tmp_path, tiny_dirs, no_model_loading):
    tiny.images(1)[0].save(tmp_path / "a.png")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "s", "images": ["a.png"], "category": "c",
                                    "turns": ["q?", {"question": "and this?", "images": ["a.png"]}]}) + "\n")
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"])
    result = cli("bench", str(manifest), "--drafters", "ar", "--protocol", "mmspec", "--profile", profile)
    assert_one_line_error(result, "sample 's': a later turn brings images, which --protocol mmspec (MMSpec shows "
                                  "images in the first turn only) does not read")


@pytest.mark.parametrize("args, fragment", [
    (["--protocol", "vicuna"], "--protocol: expected mmspec, got 'vicuna'"),
    (["--protocol", "mmspec", "--prompt-style", "paper"], "--protocol mmspec prompts through the chat template"),
    (["--format", "mmspec"], "--format mmspec writes MMSpec's results files into a folder; pass --out DIR"),
])
def test_flags_that_cant_go_together_are_refused(suite, no_model_loading, args, fragment):
    assert_one_line_error(bench(suite, str(suite["folder"]), "--drafters", "ar", *args), fragment)


def test_format_mmspec_does_not_summarise_files(suite, no_model_loading):
    assert_one_line_error(cli("bench", "--summarize", "x.jsonl", "--format", "mmspec"),
                          "--format mmspec writes a run's results into --out DIR")


# --------------------------------------------------------------------------- out: the results files


def test_one_results_file_per_drafter_in_mmspecs_layout(run):
    out, records = run["out"], run["records"]
    assert sorted(p.name for p in out.iterdir()) == ["ar-temperature-0.0.jsonl", "bench.jsonl",
                                                     "m-temperature-0.0.jsonl"]
    assert {(r["temperature"], r["max_new_tokens"]) for r in records} == {(0.0, MAX_NEW)}  # protocol, then the flag
    files = {d: read_jsonl(out / f"{d}-temperature-0.0.jsonl") for d in ("ar", "m")}
    for drafter, lines in files.items():
        assert [(x["question_id"], x["topic"], x["category"], x["model_id"]) for x in lines] == [
            (1, "multi-turn conversation", "GQA", drafter), ("r2", "image captioning", "COCO", drafter),
            ("r3", "general vqa", "general vqa", drafter)]
        for line in lines:
            [choice] = line["choices"]
            ours = sorted((r for r in records if r["drafter"] == drafter and r["id"] == str(line["question_id"])),
                          key=lambda r: r["turn"])
            assert choice["turns"] == [r["text"] for r in ours]
            assert choice["new_tokens"] == [r["new_tokens"] for r in ours]
            assert choice["wall_time"] == [r["wall_s"] for r in ours]
            assert choice["idxs"] == [r["blocks"] for r in ours]  # verification rounds per turn
            # a list per turn: the accepted draft tokens of each round
            assert [len(rounds) for rounds in choice["acceptance_length"]] == choice["idxs"]
            assert [sum(rounds) for rounds in choice["acceptance_length"]] == [r["accepted"] for r in ours]
    assert all(n == 0 for x in files["ar"] for rounds in x["choices"][0]["acceptance_length"] for n in rounds)
    assert any(n > 0 for x in files["m"] for rounds in x["choices"][0]["acceptance_length"] for n in rounds)
    assert [x["choices"][0]["turns"] for x in files["ar"]] == [x["choices"][0]["turns"] for x in files["m"]]
    assert "MMSpec results: " in run["result"].stderr


def test_an_out_folder_holding_a_results_file_this_run_would_write_is_refused(suite, tmp_path, no_model_loading):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "eagle-temperature-0.0.jsonl").write_text("MMSpec's own\n")
    (out / "ar-temperature-0.0.jsonl").write_text("someone's ar\n")
    result = bench(suite, str(suite["folder"]), "--drafters", "ar,m", "--protocol", "mmspec", "--format", "mmspec",
                   "--out", str(out))
    assert_one_line_error(result, f"--out {out} already holds ar-temperature-0.0.jsonl, which this run would write")
    assert sorted(p.name for p in out.iterdir()) == ["ar-temperature-0.0.jsonl", "eagle-temperature-0.0.jsonl"]
    assert (out / "ar-temperature-0.0.jsonl").read_text() == "someone's ar\n"


def test_an_out_folder_with_other_files_keeps_them(suite, tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    (out / "eagle-temperature-0.0.jsonl").write_text("MMSpec's own\n")
    result = bench(suite, str(suite["folder"]), "--drafters", "ar", "--protocol", "mmspec", "--max-new-tokens", "2",
                   "--limit", "1", "--format", "mmspec", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert (out / "eagle-temperature-0.0.jsonl").read_text() == "MMSpec's own\n"
    assert [x["question_id"] for x in read_jsonl(out / "ar-temperature-0.0.jsonl")] == [1]


def test_out_a_file_is_refused_with_format_mmspec(suite, tmp_path, no_model_loading):
    (tmp_path / "f.jsonl").write_text("")
    result = bench(suite, str(suite["folder"]), "--drafters", "ar", "--format", "mmspec", "--out",
                   str(tmp_path / "f.jsonl"))
    assert_one_line_error(result, "is a file; with --format mmspec, --out names a folder")


def test_a_run_refused_after_making_its_out_folder_leaves_no_folder(suite, tmp_path, no_model_loading):
    folder = write_folder(tmp_path / "MMSpec", [RECORDS[2]], images=("a.png",))
    (folder / "images" / "a.png").unlink()  # refused when the run checks its image files, after --out was made
    out = tmp_path / "new"
    result = bench(suite, str(folder), "--drafters", "ar", "--format", "mmspec", "--out", str(out))
    assert result.exit_code == 2 and "image 'a.png' is missing" in result.stderr
    assert not out.exists()


def test_resume_rewrites_the_results_files_from_the_records_it_continues(suite, run, no_model_loading):
    out = run["out"]
    before = {d: read_jsonl(out / f"{d}-temperature-0.0.jsonl") for d in ("ar", "m")}
    result = bench(suite, str(suite["folder"]), "--drafters", "ar,m", "--protocol", "mmspec", "--max-new-tokens",
                   str(MAX_NEW), "--format", "mmspec", "--out", str(out), "--resume")
    assert result.exit_code == 0, result.stderr  # every turn recorded: no model loads
    after = {d: read_jsonl(out / f"{d}-temperature-0.0.jsonl") for d in ("ar", "m")}
    strip = lambda lines: [{k: v for k, v in x.items() if k not in ("answer_id", "tstamp")} for x in lines]  # noqa: E731
    assert {d: strip(v) for d, v in after.items()} == {d: strip(v) for d, v in before.items()}
