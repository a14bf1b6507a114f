"""Tests for ``mmspec compare``: the pure comparison logic, then the command on tiny models.

CLI runs use the tiny float64 LLaVA models of ``conftest.py`` on CPU (target, and the
perturbed copy as the draft, so drafts are partly rejected).
"""

import dataclasses
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mmspec_cli import api
from mmspec_cli.cli import compare as compare_cli
from mmspec_cli.cli.app import app
from mmspec_cli.cli.comparison import Divergence, ShareSpec, first_divergence, share_spec, sparkline, weight_share
from mmspec_cli.decoding.events import BlockVerified, Generation, TurnResult
from mmspec_cli.errors import InputError
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.models.profiles import load_profile

from tests.helpers import save_images, tiny_files, write_profile

QUESTION = "what is in the image?"
MAX_NEW = 12
DRAFTERS = "ar,m,t,mt,tabed"
STATS_KEYS = {"new_tokens", "blocks", "block_efficiency", "acceptance_rate", "wall_s", "tokens_per_s"}

runner = CliRunner()


# --------------------------------------------------------------------------- first_divergence


def test_identical_outputs_have_no_divergence():
    same = [[1, 2, 3], [4, 5]]
    assert first_divergence({"a": same, "b": [list(t) for t in same], "c": same}) is None
    assert first_divergence({"only": same}) is None
    assert first_divergence({}) is None


def test_divergence_at_turn_1_index_3_is_reported_exactly():
    base = [[1, 2], [5, 6, 7, 8, 9]]
    outputs = {"a": base, "b": [[1, 2], [5, 6, 7, 0, 9]], "c": base}
    d = first_divergence(outputs)
    assert d == Divergence(turn=1, index=3, reference="a", differing=("b",), tokens={"a": 8, "b": 0, "c": 8},
                           prefix=[5, 6, 7])
    assert d.groups() == [(("a", "c"), 8), (("b",), 0)]


def test_divergence_is_the_earliest_over_all_drafters():
    outputs = {"a": [[1, 2, 3, 4]], "b": [[1, 2, 3, 9]], "c": [[1, 7, 7, 7]]}
    d = first_divergence(outputs)
    assert (d.turn, d.index, d.differing, d.prefix) == (0, 1, ("c",), [1])


def test_a_chosen_reference():
    outputs = {"m": [[1, 2, 4]], "ar": [[1, 2, 3]], "t": [[1, 2, 3]]}
    d = first_divergence(outputs, reference="ar")
    assert (d.reference, d.differing, d.tokens) == ("ar", ("m",), {"m": 4, "ar": 3, "t": 3})
    assert d.groups() == [(("ar", "t"), 3), (("m",), 4)]
    with pytest.raises(ValueError, match="reference"):
        first_divergence(outputs, reference="zz")


def test_different_lengths_diverge_at_the_shorter_length():
    d = first_divergence({"long": [[1, 2, 3, 4, 5]], "short": [[1, 2, 3]]})
    assert (d.turn, d.index, d.differing) == (0, 3, ("short",))
    assert d.tokens == {"long": 4, "short": None} and d.prefix == [1, 2, 3]


def test_a_missing_turn_counts_as_empty():
    d = first_divergence({"a": [[1], [2, 3]], "b": [[1]]})
    assert (d.turn, d.index, d.tokens) == (1, 0, {"a": 2, "b": None})


# --------------------------------------------------------------------------- sparkline, weight_share


def test_sparkline_maps_min_to_the_lowest_bar_and_max_to_the_highest():
    assert sparkline([0.0, 1.0]) == "▁█"
    assert sparkline([3, 5, 7]) == "▁▅█"
    assert sparkline([10, 17, 11, 16, 12, 15, 13, 14]) == "▁█▂▇▃▆▄▅"
    assert sparkline([]) == ""


def test_sparkline_of_constant_input_is_the_middle_bar():
    assert sparkline([0.3, 0.3, 0.3]) == "▅▅▅"


def test_sparkline_fixed_range_clamps_and_gaps():
    assert sparkline([0.0, 0.5, 1.0], lo=0.0, hi=1.0) == "▁▅█"
    assert sparkline([-1.0, 2.0], lo=0.0, hi=1.0) == "▁█"
    assert sparkline([0.0, None, 1.0]) == "▁ █"
    assert sparkline([None, None]) == "  "


def test_weight_share_of_m_over_m_and_t():
    weights = [[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], None]
    shares = weight_share(weights, ["m", "t"])
    assert shares[:3] == pytest.approx([0.5, 0.9, 0.2]) and shares[3] is None  # no weights: drafted nothing
    assert weight_share([[0.1, 0.9]], ["t", "m"]) == [pytest.approx(0.9)]  # members give the order


def test_weight_share_with_other_members_and_of_all():
    weights = [[0.6, 0.2, 0.2], [0.0, 0.0, 1.0]]
    assert weight_share(weights, "mtc") == [pytest.approx(0.75), None]  # w_m + w_t = 0: undefined
    assert weight_share(weights, "mtc", member="c", other=None) == [pytest.approx(0.2), pytest.approx(1.0)]
    with pytest.raises(ValueError, match="'p'"):
        weight_share(weights, "mtc", member="p")


def test_share_spec_prefers_m_over_t():
    assert share_spec(("m", "t")) == ShareSpec("m", "t") and share_spec(("t", "c", "m")) == ShareSpec("m", "t")
    assert share_spec(("c", "p")) == ShareSpec("c", None) and share_spec(()) is None
    assert ShareSpec("m", "t").label == "w_m/(w_m+w_t)" and ShareSpec("c", None).label == "w_c/Σw"


def test_drafter_names_are_split_and_checked():
    assert compare_cli.drafter_names(" m, t,tabed:mtp ", ("m", "t")) == ["m", "t", "tabed:mtp"]
    for bad, fragment in [("m,zz", "drafter 'zz'"), ("m,,t", "empty name"), ("m,t,m", "'m' more than once"),
                          ("", "no drafter given")]:
        with pytest.raises(InputError, match=fragment):
            compare_cli.drafter_names(bad, ("m", "t"))


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    return tiny_files(tmp_path_factory.mktemp("compare"), tiny_dirs, max_new_tokens=MAX_NEW)


def invoke(files: dict, *args: str):
    return runner.invoke(app, ["compare", *files["images"], "--profile", files["profile"], *args])


@pytest.fixture(scope="module")
def greedy_json(files) -> dict:
    result = invoke(files, "-q", QUESTION, "--drafters", DRAFTERS, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_json_schema_and_identical_greedy_outputs(greedy_json):
    data = greedy_json
    assert set(data) == {"profile", "identical", "divergence", "drafters"}
    assert (data["profile"], data["identical"], data["divergence"]) == ("tiny", True, None)
    assert [d["drafter"] for d in data["drafters"]] == DRAFTERS.split(",")
    for entry in data["drafters"]:
        [turn] = entry["turns"]
        assert set(turn) == {"text", "token_ids", "stats"} and set(turn["stats"]) == STATS_KEYS
        assert set(entry["stats"]) == STATS_KEYS and turn["stats"]["new_tokens"] == MAX_NEW == len(turn["token_ids"])
        assert turn["token_ids"] == data["drafters"][0]["turns"][0]["token_ids"]
        assert turn["text"] == data["drafters"][0]["turns"][0]["text"]
        if entry["drafter"] in ("mt", "tabed"):
            assert set(entry) == {"drafter", "members", "turns", "stats", "weights"}
            assert entry["members"] == ["m", "t"]
            assert len(entry["weights"]) == entry["stats"]["blocks"]
            assert all(w is None or (len(w) == 2 and sum(w) == pytest.approx(1.0)) for w in entry["weights"])
        else:
            assert set(entry) == {"drafter", "turns", "stats"}
    by_name = {d["drafter"]: d for d in data["drafters"]}
    assert by_name["ar"]["stats"]["acceptance_rate"] is None
    assert by_name["mt"]["weights"][0] == [0.5, 0.5]


def test_plain_report_shows_every_drafter_and_the_verdict(files, greedy_json):
    result = invoke(files, "-q", QUESTION, "--drafters", DRAFTERS)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    text = greedy_json["drafters"][0]["turns"][0]["text"]
    for header in ("== ar ==", "== m ==", "== t ==", "== mt (m+t) ==", "== tabed (m+t) =="):
        assert f"{header}\n{text}\n" in out
    assert "identical: all 5 outputs have the same token ids" in out
    weight_lines = [line for line in out.splitlines() if "w_m/(w_m+w_t)" in line]
    assert [line.split()[0] for line in weight_lines] == ["mt", "tabed"]
    assert weight_lines[0].split()[2] == "▅" * len(weight_lines[0].split()[2])  # static: 0.50 on every block
    assert weight_lines[0].endswith("0.50 → 0.50")


def alter_token(monkeypatch, drafter: str, turn: int, index: int) -> None:
    """Make ``drafter``'s decoder report one different token id, as a buggy drafter would."""
    original = api.ModelSet.decoder

    def decoder(self, name, **kwargs):
        dec = original(self, name, **kwargs)
        if name == drafter:
            real = dec.generate

            def generate(*args, **kwargs):
                generation = real(*args, **kwargs)
                turns = list(generation.turns)
                ids = list(turns[turn].token_ids)
                ids[index] = ids[index] + 1 if ids[index] == 0 else ids[index] - 1
                turns[turn] = dataclasses.replace(turns[turn], token_ids=ids)
                return dataclasses.replace(generation, turns=turns)

            dec.generate = generate
        return dec

    monkeypatch.setattr(api.ModelSet, "decoder", decoder)


def test_a_divergence_is_reported_with_exit_1(files, monkeypatch):
    alter_token(monkeypatch, "t", turn=1, index=3)
    args = ["-q", QUESTION, "-q", "and then?", "--drafters", "ar,m,t", "--max-new-tokens", "6"]
    result = invoke(files, *args, "--json")
    assert result.exit_code == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["identical"] is False
    d = data["divergence"]
    assert (d["turn"], d["index"], d["reference"], d["differing"]) == (1, 3, "ar", ["t"])
    ar_ids = data["drafters"][0]["turns"][1]["token_ids"]
    assert d["tokens"]["ar"] == d["tokens"]["m"] == ar_ids[3] != d["tokens"]["t"]
    assert d["prefix_ids"] == ar_ids[:3] and set(d["token_texts"]) == {"ar", "m", "t"}

    plain = invoke(files, *args)
    assert plain.exit_code == 1, plain.stderr
    out = plain.stdout
    assert "NOT IDENTICAL" in out
    assert "first divergence: turn 2 of 2 ('and then?'), token index 3 (turns[1].token_ids[3])" in out
    assert f"  ar, m: {ar_ids[3]} " in out and f"  t: {d['tokens']['t']} " in out
    assert "differ from ar: t" in out and "common prefix (3 tokens): " in out


def test_sampling_skips_the_identity_check(files):
    args = ["-q", QUESTION, "--drafters", "ar,mt", "--temperature", "0.8", "--seed", "1", "--max-new-tokens", "6"]
    result = invoke(files, *args, "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["identical"] is None and data["divergence"] is None
    plain = invoke(files, *args)
    assert plain.exit_code == 0 and "the identity check applies only to greedy decoding" in plain.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--drafters", "m,zz"], "drafter 'zz'"),
    (["--drafters", "m,m"], "'m' more than once"),
    (["--drafters", "c"], "has no captioner"),
    (["--gamma", "0"], "--gamma: expected"),
    (["--tree", "chain", "--tree-width", "3"], "--tree chain and --tree-width 3 disagree; drop --tree-width"),
    (["--tree", "bushy"], 'expected one of chain, width, dynamic, got "bushy"'),
    (["--threads", "100000"], "--threads: 100000 CPU threads is more than 2 per core"),
    (["--turn-image", "1:x.png"], "compare shows every IMAGE in the first turn and takes no --turn-image; run"),
])
def test_bad_input_is_one_line_with_exit_2_before_loading(files, no_model_loading, args, fragment):
    result = invoke(files, "-q", QUESTION, *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and fragment in line


def test_no_question_is_refused(files, no_model_loading):
    result = invoke(files, "--drafters", "m")
    assert result.exit_code == 2 and result.stderr.startswith("error: no question given")


# --------------------------------------------------------------------------- rich rendering


def synthetic_outcome(tokenizer, diverge: bool) -> compare_cli.Outcome:
    """Two drafters over the same words; ``tabed`` accepts drafts, ``ar`` emits everything."""
    ids = tokenizer("the red car", add_special_tokens=False)["input_ids"]
    stats = RunStats(new_tokens=len(ids), blocks=2, drafted=4, accepted=len(ids) - 2, wall_s=0.5)
    half = len(ids) // 2
    blocks = [BlockVerified(0, 0, ids[: half - 1] + [0], half - 1, ids[half - 1], ids[:half], 0.0, 0.0, weights=[0.5, 0.5]),
              BlockVerified(0, 1, ids[half:-1] + [0], len(ids) - half - 1, ids[-1], ids[half:], 0.0, 0.0,
                            weights=[0.9, 0.1])]
    other = ids[:-1] + [ids[-1] + 1] if diverge else ids
    gens = {"ar": Generation("ar", [TurnResult(QUESTION, "the red car", ids, dataclasses.replace(stats, drafted=0),
                                               [])]),
            "tabed": Generation("tabed", [TurnResult(QUESTION, "the red car", other, stats, blocks)], ("m", "t"))}
    divergence = first_divergence({n: [t.token_ids for t in g.turns] for n, g in gens.items()})
    profile = dataclasses.replace(load_profile("llava15-7b"), name="p")
    return compare_cli.Outcome(profile, [QUESTION], gens, tokenizer, True, divergence)


def render(outcome, color: bool) -> str:
    console = Console(file=io.StringIO(), width=100, force_terminal=color, color_system="standard" if color else None)
    console.print(compare_cli.rich_report(outcome))
    return console.file.getvalue()


def test_rich_report_colours_outputs_and_draws_the_weights(tiny_models):
    outcome = synthetic_outcome(tiny_models["target"].tokenizer, diverge=False)
    text = render(outcome, color=False)
    assert "the red car" in text and "tabed (m+t)" in text
    assert "w_m/(w_m+w_t)" in text and "0.50" in text and "0.90" in text
    assert "▅▇" in text  # 0.5 then 0.9 on a 0..1 scale
    assert "identical: all 2 outputs" in text
    coloured = render(outcome, color=True)
    assert "\x1b[32m" in coloured and "\x1b[1;36m" in coloured  # accepted green, target-emitted bold cyan


def test_rich_report_shows_the_divergence(tiny_models):
    text = render(synthetic_outcome(tiny_models["target"].tokenizer, diverge=True), color=False)
    assert "NOT IDENTICAL" in text and "differ from ar: tabed" in text


def test_compare_counts_one_drafter_in_the_singular(tiny_dirs, tmp_path):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=3)
    [image] = save_images(tmp_path, 1)
    result = runner.invoke(app, ["compare", image, "-q", "what?", "--drafters", "ar", "--profile", profile])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0].endswith(", 1 drafter")
