"""``mmspec train-head`` (issue 14, part 3): the losses, the multi-token passes, the loop, resuming, the output.

Runs on the tiny float64 models of ``conftest.py``: a few answer tokens, a few steps.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
import math
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

import mmspec_cli
from mmspec_cli.cli.app import app
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.models.head import DraftHead, causal_mask, head_sequence, image_runs
from mmspec_cli.models.head_files import head_config, load_head
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.training import losses
from mmspec_cli.training.answers import AnswerFile, AnswerSettings, generate_answers
from mmspec_cli.training.checkpoint import NAME as CHECKPOINT, save_checkpoint
from mmspec_cli.models.images import load_images
from mmspec_cli.training.acceptance import measure
from mmspec_cli.models.file_lock import OutLock
from mmspec_cli.inputs.sources import SUITES
from mmspec_cli.errors import InputError
from mmspec_cli.training import answers as answers_mod
from mmspec_cli.training.corpus import DEMO_TRAIN, Conversation, conversations
from mmspec_cli.training.locks import lock_answers
from mmspec_cli.training.passes import HeadObjective
from mmspec_cli.training.run import TrainHeadSettings, train_head
from mmspec_cli.training.sequences import SequenceStore, Turn, read_sequence, trainable
from mmspec_cli.training.trainer import TrainConfig, batch_indices, copy_embeddings, train

from tests import tiny
from tests.helpers import assert_one_line_error, own_generate, save_images, write_profile
from tests.test_heads import random_head
from tests.helpers import reference

runner = CliRunner()
QUESTIONS = ["what is in the image?", "describe the picture in detail", "how many shapes are there?",
             "what changed between the two images?"]
ANSWERS = AnswerSettings(temperature=1.0, max_new_tokens=8, suffix="", seed=0, batch_size=2)


# --------------------------------------------------------------------------- the maths, by hand


def test_l1_is_the_summed_absolute_difference_of_the_distributions():
    draft = torch.tensor([[0.0, 0.0]])  # q = (1/2, 1/2)
    target = torch.tensor([[math.log(3.0), 0.0]])  # p = (3/4, 1/4)
    assert losses.l1_distance(draft, target).item() == pytest.approx(0.5)
    assert losses.l1_distance(target, target).item() == pytest.approx(0.0)


def test_list_mle_by_hand():
    target = torch.tensor([[3.0, 2.0, 1.0, -5.0]])  # the target ranks tokens 0, 1, 2, 3
    draft = torch.tensor([[1.0, 2.0, 0.0, 7.0]])
    s = [1.0, 2.0, 0.0]  # the draft's scores of the target's top-3, in the target's order
    expected = sum(math.log(sum(math.exp(x) for x in s[j:])) - s[j] for j in range(3))
    assert losses.list_mle(draft, target, top=3).item() == pytest.approx(expected)
    # the target's own order with huge margins costs nothing
    assert losses.list_mle(torch.tensor([[300.0, 200.0, 100.0, 0.0]]), target, top=3).item() == pytest.approx(0.0)


def test_vispec_loss_and_cross_entropy_by_hand():
    draft = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    target = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    l1 = (0.5 + abs(math.exp(1) / (math.exp(1) + 1) - 0.5) * 2) / 2
    mle_rows = [math.log(2.0) - 0.0 + 0.0, None]  # row 0: scores (0, 0) in order (0, 1): log 2 + 0
    e = math.exp(1.0)
    # row 1: the target's logits tie; topk takes token 0 first: scores (1, 0): log(e + 1) − 1, then 0
    mle_rows[1] = math.log(e + 1) - 1.0
    expected = 10 * l1 + 0.1 * sum(mle_rows) / 2
    assert losses.vispec_loss(draft, target).item() == pytest.approx(expected)
    ce_rows = [-(0.75 * math.log(0.5) + 0.25 * math.log(0.5)),
               -(0.5 * math.log(e / (e + 1)) + 0.5 * math.log(1 / (e + 1)))]
    assert losses.soft_cross_entropy(draft, target).item() == pytest.approx(sum(ce_rows) / 2)


def test_schedule_warms_up_then_decays_to_zero():
    assert [losses.lr_factor(s, 2, 6) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])


def test_noise_is_uniform_within_a_tenth_of_the_rms():
    features = torch.randn(50, 16) * 3
    noise = losses.uniform_noise(features, 0.2, torch.Generator().manual_seed(0))
    rms = features.pow(2).mean().sqrt()
    assert noise.abs().max() <= 0.1 * rms and noise.abs().max() > 0.09 * rms
    assert torch.equal(noise, losses.uniform_noise(features, 0.2, torch.Generator().manual_seed(0)))
    assert not losses.uniform_noise(features, 0.0).any()


def test_batches_cover_every_sequence_once_per_epoch():
    steps = [batch_indices(s, 3, 6, seed=1) for s in range(4)]
    assert sorted(steps[0] + steps[1]) == list(range(6)) == sorted(steps[2] + steps[3])
    assert steps[0] + steps[1] != steps[2] + steps[3]  # a new permutation each epoch


# --------------------------------------------------------------------------- fixtures on the tiny target


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train")
    images = save_images(root, 2)
    (root / "broken.png").write_bytes(b"not a png")
    lines = [{"id": f"s{i}", "images": [Path(images[i % 2]).name], "turns": [q], "category": "demo"}
             for i, q in enumerate(QUESTIONS * 2)]
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with_broken = root / "with_broken.jsonl"
    with_broken.write_text("".join(json.dumps(x) + "\n" for x in lines[:3] + [
        {"id": "bad", "images": ["broken.png"], "turns": ["what is it?"], "category": "demo"}]))
    all_broken = root / "all_broken.jsonl"
    all_broken.write_text(json.dumps({"id": "bad", "images": ["broken.png"], "turns": ["what is it?"],
                                      "category": "demo"}) + "\n")
    (root / "empty.jsonl").write_text("\n")
    profile = write_profile(root / "tiny.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=12)
    return {"root": root, "manifest": str(manifest), "with_broken": str(with_broken),
            "all_broken": str(all_broken), "empty": str(root / "empty.jsonl"), "profile": profile}


def conversation(i: int, n_images: int = 1) -> Conversation:
    return Conversation(f"c{i}", (QUESTIONS[i % len(QUESTIONS)],), (), lambda: tiny.images(n_images))


def settings(out: Path, **kw) -> TrainHeadSettings:
    base = dict(kind="vispec", source="", out=out, steps=4, lr=1e-2, mtp=3, batch_size=2, checkpoint_every=2,
                held_out=0, answers=ANSWERS, measure_before=False)
    base.update(kw)
    return TrainHeadSettings(**base)


# --------------------------------------------------------------------------- the passes simulate drafting


@pytest.mark.parametrize("passes", [3, 12])
def test_pass_k_scores_what_drafting_k_tokens_deep_computes(tiny_models, tmp_path, passes):
    """Pass k's loss at pair q equals the loss of drafting from a context of pairs ≤ q − k, token by token,
    through the head's KV cache as the drafter does (float64, no noise). With 12 passes the deepest chains
    would start inside the prompt's image: those are not drafted (drafting starts after the prompt)."""
    target = tiny_models["target"]
    torch.manual_seed(0)
    head = DraftHead(head_config(target), "vispec").double().eval()
    copy_embeddings(head, target)
    records = generate_answers(target, "t", [conversation(0)], tmp_path / "a.jsonl",
                               AnswerSettings(temperature=0.0, max_new_tokens=10, suffix=""))
    seq = read_sequence(target, Turn(conversation(0), records[0]))
    # the rule's maths runs on the CPU: the head is built there, so the target's features and LM head are copied to it
    seq = type(seq)(seq.ids, seq.prompt_len, seq.embeds.double().cpu(), seq.hidden.double().cpu())
    lm_head = copy.deepcopy(target.model.get_output_embeddings()).cpu()
    objective = HeadObjective(head, lm_head, target.image_token_id, losses.vispec_loss, passes=passes, noise=0.0)
    with torch.no_grad():
        _, stats = objective([seq])
    f, e, ids, P = seq.hidden[:-1], seq.embeds, seq.ids, seq.prompt_len
    lo, hi = P - 2, len(ids) - 3
    images_end = max(t for _, t in image_runs(ids, target.image_token_id, P))
    for k in range(passes):
        per_q = []
        for q in range(max(lo, images_end + k), hi + 1):  # drafted from a text pair after the image
            with torch.no_grad():
                cache = DynamicCache(config=head.config)
                ctx = head_sequence(head, ids[:q - k + 2], f[:q - k + 1], e[:q - k + 2], 0, target.image_token_id,
                                    min(P, q - k + 2))
                out = head.body(ctx.inputs[None], torch.tensor([ctx.positions]),
                                causal_mask(len(ctx.positions), 0, torch.float64, "cpu"), cache)[0]
                h, seen = out[-1], len(ctx.positions)
                for depth in range(1, k + 1):  # drafted pairs q − k + depth, each fed its parent's output
                    p = q - k + depth
                    x = head.fuse(e[p + 1][None], h[None], None if ctx.glob is None else ctx.glob[None])
                    h = head.body(x[None], torch.tensor([[p]]), causal_mask(1, seen, torch.float64, "cpu"), cache)[0, -1]
                    seen += 1
                per_q.append(losses.vispec_loss(lm_head(h[None]), lm_head(seq.hidden[q + 1][None])).item())
        if not per_q:
            assert len(stats) == k
            break
        assert stats[k]["positions"] == len(per_q)
        assert stats[k]["loss"] == pytest.approx(sum(per_q) / len(per_q), rel=1e-9, abs=1e-9), k


# --------------------------------------------------------------------------- training


def test_a_few_steps_lower_the_loss(tiny_models, tmp_path):
    target = tiny_models["target"]
    convs = [conversation(i) for i in range(4)]
    records = generate_answers(target, "t", convs, tmp_path / "a.jsonl", ANSWERS)
    store = SequenceStore(target, [Turn(c, a) for c, a in zip(convs, trainable(records))])
    torch.manual_seed(0)
    head = DraftHead(head_config(target), "eagle")
    copy_embeddings(head, target)
    config = TrainConfig(steps=30, batch_size=4, lr=1e-2, passes=2, noise=0.0, checkpoint_every=100)
    result = train(head, target, store, config, tmp_path / "out", {"kind": "eagle"})
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert last < 0.8 * first, (first, last)


def test_answers_resume_where_they_stopped(tiny_models, tmp_path):
    target = tiny_models["target"]
    convs = [conversation(i) for i in range(5)]
    whole = generate_answers(target, "t", convs, tmp_path / "whole.jsonl", ANSWERS)

    class Killed(Exception):
        pass

    def kill_after_first_batch(n: int) -> None:
        raise Killed

    path = tmp_path / "part.jsonl"
    with pytest.raises(Killed):
        generate_answers(target, "t", convs, path, ANSWERS, kill_after_first_batch)
    assert len(path.read_text().splitlines()) == 1 + 2  # the header and the first batch
    with open(path, "a") as handle:
        handle.write('{"id": "c2", "tu')  # a record cut off by the kill
    resumed = generate_answers(target, "t", convs, path, ANSWERS)
    assert resumed == whole
    assert path.read_text() == (tmp_path / "whole.jsonl").read_text()
    assert len(AnswerFile(path, ANSWERS, "t").records) == 5
    with pytest.raises(Exception, match="other settings"):
        AnswerFile(path, AnswerSettings(temperature=0.5, max_new_tokens=8, suffix="", batch_size=2), "t")


def test_a_later_questions_own_images_are_answered_and_read_with_it(tiny_models, files, tmp_path):
    """A manifest sample whose second question brings an image: its first turn is answered and read with the
    opening image alone, its second with both, each in its own user turn (greedy answers: the target's own
    ``generate`` of that prompt); the head's held-out decoding gets the image in the same turn."""
    target = tiny_models["target"]
    root = Path(files["root"])
    manifest = tmp_path / "turns.jsonl"
    manifest.write_text(json.dumps({"id": "s", "images": [str(root / "img0.png")], "category": "c", "turns": [
        QUESTIONS[0], {"question": QUESTIONS[3], "images": [str(root / "img1.png")]}]}) + "\n")
    [conv] = conversations(str(manifest))
    greedy = AnswerSettings(temperature=0.0, max_new_tokens=8, suffix="", seed=0, batch_size=2)
    first, second = generate_answers(target, "t", [conv], tmp_path / "answers.jsonl", greedy)
    images = load_images([str(root / "img0.png"), str(root / "img1.png")])
    assert first.answer_ids == own_generate(target, QUESTIONS[:1], [], [1], images[:1], max_new_tokens=8)
    text = target.tokenizer.decode(first.answer_ids, skip_special_tokens=True).strip()
    assert second.answer_ids == own_generate(target, [QUESTIONS[0], QUESTIONS[3]], [text], [1, 1], images,
                                             max_new_tokens=8)
    sequences = [read_sequence(target, Turn(conv, answer)) for answer in (first, second)]
    placeholders = [seq.ids[:seq.prompt_len].count(target.image_token_id) for seq in sequences]
    assert placeholders[1] == 2 * placeholders[0] > 0
    assert measure(target, HeadDrafter(target, random_head(target, "eagle")), [conv], max_new_tokens=8).turns == 2


def test_resume_after_a_kill_gives_the_uninterrupted_result(tiny_dirs, tmp_path):
    profile = load_profile(write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["target"],
                                         max_new_tokens=6))
    manifest = tmp_path / "m.jsonl"
    save_images(tmp_path, 1)
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "images": ["img0.png"], "turns": [q], "category": "x"})
                                + "\n" for i, q in enumerate(QUESTIONS)))
    whole = train_head(profile, settings(tmp_path / "whole", source=str(manifest), steps=6), progress=False)

    class Killed(Exception):
        pass

    def kill_at_5(step: int, total: int, stats) -> None:
        if step == 5:
            raise Killed

    out = tmp_path / "killed"
    with pytest.raises(Killed):
        train_head(profile, settings(out, source=str(manifest), steps=6), progress=False, on_step=kill_at_5)
    assert (out / CHECKPOINT).is_file()
    with pytest.raises(Exception, match="--resume"):  # not overwritten without --resume
        train_head(profile, settings(out, source=str(manifest), steps=6), progress=False)
    steps_run = []
    resumed = train_head(profile, settings(out, source=str(manifest), steps=6, resume=True), progress=False,
                         on_step=lambda step, total, stats: steps_run.append(step))
    assert steps_run == [5, 6]  # from the checkpoint of step 4
    assert not (out / CHECKPOINT).exists()
    a = (tmp_path / "whole" / "model.safetensors").read_bytes()
    b = (out / "model.safetensors").read_bytes()
    assert a == b
    assert resumed["steps"] == whole["steps"] == 6


def test_the_output_loads_and_decodes_losslessly(tiny_dirs, tiny_models, files, tmp_path):
    profile = load_profile(files["profile"])
    out = tmp_path / "head"
    report = train_head(profile, settings(out, source=files["manifest"], steps=3, held_out=2), progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["mmspec"]["kind"] == "vispec" and config["mmspec"]["target"] == tiny_dirs["target"]
    assert config["mmspec"]["training"]["acceptance"]["after"]["turns"] == 2
    assert report["acceptance"]["after"]["block_efficiency"] >= 1.0
    target = tiny_models["target"]
    head = load_head(str(out), None, None, target)
    for n_images in (0, 1, 2):
        for tree in (None, "dynamic"):
            decoder = SpeculativeDecoder(target, HeadDrafter(target, head), gamma=3, max_new_tokens=16, tree=tree)
            generation = decoder.generate(tiny.images(n_images), [QUESTIONS[0]])
            assert generation.turns[0].token_ids == reference(target, [QUESTIONS[0]], [], n_images, 16)


def test_an_eagle3_head_trains_on_its_draft_vocabulary_and_decodes_losslessly(tiny_models, files, tmp_path):
    """train-head eagle3: the draft vocabulary is the answers' most frequent tokens (its share reported), the head is
    saved in mmspec's EAGLE-3 layout, loads back, and decodes as the target's own ``generate``, trees included."""
    profile = load_profile(files["profile"])
    out = tmp_path / "eagle3"
    report = train_head(profile, settings(out, kind="eagle3", source=files["manifest"], steps=3, mtp=3, held_out=1,
                                          draft_vocab=12), progress=False)
    answers = [json.loads(line) for line in Path(str(out) + ".answers.jsonl").read_text().splitlines()[1:]]
    counts = Counter(t for record in answers for t in record["answer_ids"])
    assert report["draft_vocab"] == 12 and len(report["final"]["loss"]) == 3 and report["draft_vocab_share"] < 1
    # EAGLE-3's training applies no feature noise: the report, and the head's saved training block, say none
    assert report["noise"] == 0 and json.loads((out / "config.json").read_text())["mmspec"]["training"]["noise"] == 0
    assert report["draft_vocab_share"] == pytest.approx(sum(c for _, c in counts.most_common(12)) / sum(counts.values()),
                                                        abs=1e-4)
    target = tiny_models["target"]
    head = load_head(str(out), None, None, target)
    assert head.kind == "eagle3" and int(head.t2d.sum()) == 12
    ranked = counts.most_common()
    threshold = ranked[11][1]  # ties at the 12th count may go either way
    assert {t for t, c in ranked if c > threshold} <= set(head.target_ids.tolist())
    for tree in (None, "dynamic"):
        decoder = SpeculativeDecoder(target, HeadDrafter(target, head), gamma=3, max_new_tokens=16, tree=tree)
        generation = decoder.generate(tiny.images(1), [QUESTIONS[0]])
        assert generation.turns[0].token_ids == reference(target, [QUESTIONS[0]], [], 1, 16)


def test_an_eagle3_run_resumes_to_the_uninterrupted_head_and_only_with_its_draft_vocabulary(files, tmp_path):
    profile = load_profile(files["profile"])
    eagle3 = dict(kind="eagle3", source=files["manifest"], steps=4, mtp=2, draft_vocab=12)
    train_head(profile, settings(tmp_path / "whole", **eagle3), progress=False)

    class Killed(Exception):
        pass

    def kill_at_3(step: int, total: int, stats) -> None:
        if step == 3:
            raise Killed

    out = tmp_path / "killed"
    with pytest.raises(Killed):
        train_head(profile, settings(out, **eagle3), progress=False, on_step=kill_at_3)
    with pytest.raises(InputError, match=r"draft_vocab 12 \(now 10\)"):
        train_head(profile, settings(out, **{**eagle3, "draft_vocab": 10}, resume=True), progress=False)
    train_head(profile, settings(out, **eagle3, resume=True), progress=False)
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_a_draft_vocabulary_larger_than_the_targets_is_one_line(files, tmp_path):
    result = runner.invoke(app, command(files, "eagle3", files["manifest"], "--out", str(tmp_path / "o"),
                                        "--draft-vocab", "100000"))
    one_line(result, "--draft-vocab 100000 is larger than the target's vocabulary")
    assert not (tmp_path / "o" / "model.safetensors").exists()


# --------------------------------------------------------------------------- the command and its bad inputs


# exactly one line on stderr: these refusals come before any model shows a loading bar
one_line = partial(assert_one_line_error, stdout_allowed=True, loading_bars=False)


def command(files, *args: str) -> list[str]:
    return ["train-head", *args, "--profile", files["profile"], "--steps", "2", "--answer-tokens", "6",
            "--answer-suffix", "", "--held-out", "0", "--batch-size", "2", "--lr", "1e-2"]


def test_the_command_trains_a_head(files, tmp_path):
    out = tmp_path / "cli-head"
    result = runner.invoke(app, command(files, "eagle", files["with_broken"], "--out", str(out), "--json"))
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["skipped"] == 1 and report["sequences"] == 3 and report["steps"] == 2
    assert "skipped 1 of 4 turns" in result.stderr
    records = [json.loads(line) for line in Path(str(out) + ".answers.jsonl").read_text().splitlines()[1:]]
    assert [r["id"] for r in records if r["error"]] == ["bad"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}


def test_empty_source_is_one_line(files, tmp_path):
    one_line(runner.invoke(app, command(files, "vispec", files["empty"], "--out", str(tmp_path / "o"))), "no samples")


def test_unwritable_out_is_one_line(files, tmp_path):
    one_line(runner.invoke(app, command(files, "vispec", files["manifest"], "--out", "/proc/mmspec-head")),
             "can't be written")
    one_line(runner.invoke(app, command(files, "vispec", files["manifest"], "--out", files["manifest"])), "is a file")


def test_out_inside_the_package_is_refused_writing_nothing(files, tmp_path, monkeypatch):
    """The shipped heads were written by train-head, so a run would take one for its own output and replace what
    every user of the installation loads (a helper session's run once began to). The package is a stand-in here,
    so that a run the rule failed to stop writes nowhere that matters."""
    from mmspec_cli.training import out_folder

    assert out_folder.PACKAGE_DIR == Path(mmspec_cli.__file__).resolve().parent
    package = tmp_path / "site-packages" / "mmspec_cli"
    (package / "shipped" / "demo-eagle").mkdir(parents=True)
    monkeypatch.setattr(out_folder, "PACKAGE_DIR", package)
    for out in (package / "shipped" / "demo-eagle", package / "shipped" / "new-head", package):
        one_line(runner.invoke(app, command(files, "eagle", files["manifest"], "--out", str(out))),
                 "is inside mmspec's package")
    assert [p.name for p in package.rglob("*")] == ["shipped", "demo-eagle"]


def test_profile_without_a_target_is_one_line(files, tmp_path):
    path = tmp_path / "no-target.yaml"
    path.write_text("decoding:\n  gamma: 3\n")
    args = command(files, "vispec", files["manifest"], "--out", str(tmp_path / "o"))
    args[args.index("--profile") + 1] = str(path)
    one_line(runner.invoke(app, args), "target")


def test_a_target_that_cant_load_is_one_line(files, tmp_path):
    path = tmp_path / "gone.yaml"
    path.write_text(f"target:\n  model: {tmp_path / 'missing-model'}\n  device: cpu\n")
    args = command(files, "vispec", files["manifest"], "--out", str(tmp_path / "o"))
    args[args.index("--profile") + 1] = str(path)
    one_line(runner.invoke(app, args), "missing-model")


def test_resume_from_another_head_is_one_line(files, tiny_dirs, tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"mmspec": {"kind": "eagle", "target": tiny_dirs["target"]}}))
    one_line(runner.invoke(app, command(files, "vispec", files["manifest"], "--out", str(out), "--resume")),
             "eagle head")
    (out / "config.json").write_text(json.dumps({"mmspec": {"kind": "vispec", "target": "someone/else"}}))
    one_line(runner.invoke(app, command(files, "vispec", files["manifest"], "--out", str(out), "--resume")),
             "someone/else")
    save_checkpoint(out, {"kind": "eagle", "num_q": 2, "target": tiny_dirs["target"], "step": 1})
    one_line(runner.invoke(app, command(files, "vispec", files["manifest"], "--out", str(out), "--resume")),
             "eagle head")


def test_every_image_unreadable_is_one_line(files, tmp_path):
    one_line(runner.invoke(app, command(files, "vispec", files["all_broken"], "--out", str(tmp_path / "o"))),
             "all 1 failed")


@pytest.mark.parametrize("args, fragment", [
    (["mamba", "demo-single"], "KIND"), (["vispec", "demo-single", "--mtp", "0"], "--mtp"),
    (["vispec", "demo-single", "--lr", "0"], "--lr"), (["vispec", "demo-single", "--loss", "mse"], "--loss"),
    (["eagle", "demo-single", "--draft-vocab", "10"], "--draft-vocab is for train-head eagle3"),
    (["eagle3", "demo-single", "--draft-vocab", "0"], "--draft-vocab"),
    (["eagle3", "demo-single", "--loss", "ce"], "--loss is for eagle and vispec heads")])
def test_bad_flags_are_one_line(files, tmp_path, args, fragment):
    full = command(files, *args, "--out", str(tmp_path / "o"))
    if "--lr" in args:
        i = len(full) - 1 - full[::-1].index("--lr")
        del full[i:i + 2]  # the test's own --lr
    one_line(runner.invoke(app, full), fragment)


def test_an_unknown_source_lists_every_suite_train_head_knows():
    with pytest.raises(InputError, match="known suites: ") as refused:
        conversations("demo-trian")
    listed = str(refused.value).split("known suites: ")[1].split(")")[0].split(", ")
    assert sorted(listed) == sorted((DEMO_TRAIN, *SUITES))


def test_answers_in_a_folder_that_doesnt_exist_are_refused_making_none(files, tmp_path, no_model_loading):
    missing = tmp_path / "missing"
    one_line(runner.invoke(app, command(files, "eagle", files["manifest"], "--out", str(tmp_path / "o"), "--answers",
                                        str(missing / "a.jsonl"))), "missing doesn't exist; create it")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- runs at once


def test_a_second_kind_reuses_the_answers_while_the_first_trains(files, tmp_path, monkeypatch):
    """The first run lets go of the answers file once it has read its answers: a run of another kind naming it
    trains meanwhile without answering again. A second run into the same DIR is refused, and not sent to --resume."""
    profile = load_profile(files["profile"])
    shared = tmp_path / "eagle.answers.jsonl"  # the first run's own answers file
    seen = {}

    def during_training(step: int, total: int, stats) -> None:
        if step != 1:
            return
        monkeypatch.setattr(answers_mod, "sample_batch", lambda *a, **k: pytest.fail("answered again"))
        seen["vispec"] = train_head(profile, settings(tmp_path / "vispec", source=files["manifest"], steps=1,
                                                      answers_file=shared), progress=False)
        with pytest.raises(InputError) as refused:
            train_head(profile, settings(tmp_path / "eagle", kind="eagle", source=files["manifest"]), progress=False)
        seen["refused"] = str(refused.value)

    train_head(profile, settings(tmp_path / "eagle", kind="eagle", source=files["manifest"], steps=2),
               progress=False, on_step=during_training)
    assert seen["vispec"]["sequences"] == len(QUESTIONS) * 2
    assert "being trained into by another train-head run" in seen["refused"] and "--resume" not in seen["refused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle", "eagle.answers.jsonl", "vispec"]


def test_a_run_that_waited_never_removes_the_answers_another_run_wrote(tmp_path):
    """The file was not there when the run started; the run it waited for answered into it (other settings, so this
    run is refused): failing, this run leaves that file alone."""
    from mmspec_cli.training.run import Leftovers

    path = tmp_path / "a.jsonl"
    made = Leftovers(tmp_path / "out", path)
    path.write_text('{"settings": "another run\'s"}\n')  # while this run waited for the lock
    made.hold_answers(None)
    made.clean_up(InputError("the answers were generated with other settings"), AnswerSettings(), "target")
    assert path.read_text() == '{"settings": "another run\'s"}\n'


def test_a_run_waits_while_another_answers_into_the_file(tmp_path):
    path = tmp_path / "a.jsonl"
    other = OutLock.acquire(path, what="the answers file")
    said, waits = [], []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            other.release()  # the other run is done answering

    lock = lock_answers(path, said.append, sleep)
    assert lock is not None and len(waits) == 2
    assert said == [f"the answers file {path} is being answered into by another train-head run (PID {os.getpid()}); "
                    f"waiting for it to finish answering, then its answers are reused (Ctrl-C to stop)"]
    lock.release()
