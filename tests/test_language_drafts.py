"""Language-only drafts (Gagrani et al.): a causal language model drafts ``t`` (and ``c``, and the text rows of an
ensemble) for a vision-language target, reading and writing the target's ids through one table
(``models/vocabulary.py``). The draft here is the tiny target's own language model, perturbed, saved as a
``LlamaForCausalLM`` folder and loaded through mmspec's loader."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models.loading import check_compatible, load_model, pair_draft
from mmspec_cli.models.profiles import ModelSpec
from mmspec_cli.models.vocabulary import NO_TOKEN, TargetIdEmbedding, TargetIdLogits, match_vocabularies
from tests import tiny
from tests.helpers import QUESTION, assert_one_line_error, cli, reference, save_images, speculative_decoder, \
    write_profile

SWAPPED = ("</s>", "<pad>")  # two special tokens the moved-ids draft keeps at each other's ids


def language_model_of(llava, scale: float, seed: int) -> LlamaForCausalLM:
    """The language model of a tiny LLaVA as a ``LlamaForCausalLM``, with relative noise ``scale`` on its weights."""
    noisy = tiny.perturbed_copy(llava, scale, seed)
    model = LlamaForCausalLM(llava.config.text_config).to(torch.float64)
    model.model.load_state_dict(noisy.model.language_model.state_dict())
    model.lm_head.load_state_dict(noisy.lm_head.state_dict())
    model.generation_config.eos_token_id = 2
    return model


def with_swapped_ids(tokenizer, model, first: str, second: str):
    """The same tokenizer and model with tokens ``first`` and ``second`` at each other's ids (rows swapped too): the
    same draft, whose special tokens sit at other ids than the target's."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    a, b = data["model"]["vocab"][first], data["model"]["vocab"][second]
    data["model"]["vocab"][first], data["model"]["vocab"][second] = b, a
    for added in data["added_tokens"]:
        added["id"] = {a: b, b: a}.get(added["id"], added["id"])
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), unk_token="<unk>",
                                      bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    rows = torch.arange(model.config.vocab_size)
    rows[a], rows[b] = b, a
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[rows])
        model.lm_head.weight.copy_(model.lm_head.weight[rows])
    model.generation_config.eos_token_id = swapped.convert_tokens_to_ids("</s>")
    return swapped, model


def spec(path) -> ModelSpec:
    return ModelSpec(model=str(path), dtype="float64", device="cpu")


@pytest.fixture(scope="module")
def language_dirs(tiny_dirs, tmp_path_factory):
    """The tiny target's language model, perturbed, as a causal LM folder with the target's tokenizer; the same
    draft with two special tokens swapped; and a causal LM with another tokenizer."""
    root = tmp_path_factory.mktemp("language")
    target = load_model(spec(tiny_dirs["target"]), "target")
    tokenizer = target.tokenizer
    dirs = {}
    model = language_model_of(target.model, 0.05, seed=1)
    model.save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    dirs["lm"] = str(root / "lm")
    swapped, moved = with_swapped_ids(tokenizer, language_model_of(target.model, 0.05, seed=1), *SWAPPED)
    moved.save_pretrained(root / "moved")
    swapped.save_pretrained(root / "moved")
    dirs["moved"] = str(root / "moved")
    other = tiny.train_tokenizer(vocab_size=350, corpus=[c[::-1] for c in tiny.CORPUS])
    foreign = language_model_of(tiny.make_model(len(other), seed=3), 0.0, seed=0)
    foreign.save_pretrained(root / "foreign")
    other.save_pretrained(root / "foreign")
    dirs["foreign"] = str(root / "foreign")
    return dirs


@pytest.fixture(scope="module")
def language(tiny_dirs, language_dirs):
    target = load_model(spec(tiny_dirs["target"]), "target")
    drafts = {}
    for name in ("lm", "moved"):
        drafts[name] = load_model(spec(language_dirs[name]), "draft")
        pair_draft(target, drafts[name])
    return {"target": target, **drafts}


def test_a_causal_language_model_loads_as_a_language_only_draft(language):
    draft = language["lm"]
    assert type(draft.model).__name__ == "LlamaForCausalLM"
    assert draft.language_only and draft.image_token_id is None and draft.processor is None


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_text_only_drafting_with_a_language_model_gives_the_targets_own_output(language, n_images):
    target, draft = language["target"], language["lm"]
    turn = speculative_decoder(target, "t", draft, gamma=4).generate(tiny.images(n_images), [QUESTION]).turns[0]
    assert turn.token_ids == reference(target, [QUESTION], [], n_images)
    assert turn.stats.accepted > 0  # the draft is the target's own language model, perturbed


def test_special_tokens_at_other_ids_are_read_and_written_through_the_table(language):
    """The moved-ids draft is the same function as the plain one, in other ids: mapped, it drafts the same."""
    target, plain, moved = language["target"], language["lm"], language["moved"]
    assert isinstance(moved.model.get_input_embeddings(), TargetIdEmbedding)
    assert isinstance(moved.model.get_output_embeddings(), TargetIdLogits)
    assert not isinstance(plain.model.get_input_embeddings(), TargetIdEmbedding)  # identical ids: untouched
    turns = [speculative_decoder(target, "t", draft, gamma=4).generate(tiny.images(1), [QUESTION]).turns[0]
             for draft in (plain, moved)]
    assert turns[0].token_ids == turns[1].token_ids == reference(target, [QUESTION], [], 1)
    assert turns[0].stats.accepted == turns[1].stats.accepted > 0


def test_the_table_maps_moved_specials_and_marks_what_the_draft_lacks(language):
    target = language["target"].tokenizer
    ids = target.convert_tokens_to_ids
    draft = language["moved"].tokenizer
    match = match_vocabularies(target, draft, target_rows=len(target) + 3, draft_rows=len(draft) - 1,
                               draft_name="d", substitute=0)
    last = len(draft) - 1  # the draft's last token falls outside its rows here: lacking
    assert match.to_draft[ids("</s>")] == ids("<pad>") and match.to_draft[ids("<pad>")] == ids("</s>")
    assert match.to_draft[last] == NO_TOKEN and match.lacking == 1 and match.moved == 2
    assert (match.to_draft[len(target):] == NO_TOKEN).all()  # the target's padding rows beyond the draft's
    assert match.reads_other_ids and match.writes_other_ids


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(language, language_dirs):
    foreign = load_model(spec(language_dirs["foreign"]), "draft")
    with pytest.raises(ModelLoadError, match=r"another tokenizer than the target's: \d+ of its \d+ ordinary tokens"):
        check_compatible(language["target"], foreign)


def test_a_drafter_that_shows_images_is_refused_before_loading_a_language_draft(tiny_dirs, language_dirs, tmp_path,
                                                                               no_model_loading):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], language_dirs["lm"])
    image = save_images(tmp_path, 1)[0]
    for drafter in ("m", "tabed", "mt"):
        result = cli("generate", image, "-q", QUESTION, "--profile", profile, "--drafter", drafter)
        assert_one_line_error(result, "is a language model with no vision part; use t or c")


def test_the_text_rows_of_an_ensemble_batch_a_language_draft(language):
    """``tc``'s rows, one of them captioned, are one batched forward of the language model."""
    from mmspec_cli.drafters.captioner import Captioner

    target, draft = language["target"], language["lm"]
    captioner = Captioner(target, max_new_tokens=4)
    turn = speculative_decoder(target, "tabed:tc", draft, gamma=4, build={"captioner": captioner}) \
        .generate(tiny.images(1), [QUESTION]).turns[0]
    assert turn.token_ids == reference(target, [QUESTION], [], 1)


def test_sampling_with_a_language_draft_keeps_the_targets_distribution(language, joint):
    """The moved-ids language draft proposes through the table (its logits reordered, what it lacks at 0): the first
    two sampled tokens follow the target's exact distribution (``tests/distributions.py``)."""
    from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs

    target, draft = language["target"], language["moved"]
    decoder = speculative_decoder(target, "t", draft, gamma=2, max_new_tokens=3, sampling=PARAMS)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    assert {turn.blocks[0].accepted for turn in turns} >= {0, 1}
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_a_target_id_the_draft_lacks_gets_no_logit_even_from_a_wider_head():
    """The table's rows are what the draft both reads and writes; a head wider than the embedding still gives the
    ids the draft lacks -inf, never one of its extra rows' logits."""
    from mmspec_cli.models.vocabulary import VocabularyMatch

    head = torch.nn.Linear(4, 12, bias=False)
    match = VocabularyMatch(to_draft=torch.tensor([0, 1, NO_TOKEN, 3, NO_TOKEN]), draft_rows=10, substitute=0,
                            moved=0, lacking=2)
    logits = TargetIdLogits(head, match)(torch.randn(3, 4))
    assert logits.shape == (3, 5) and torch.isinf(logits[:, [2, 4]]).all() and torch.isfinite(logits[:, [0, 1, 3]]).all()


def test_pairing_a_draft_twice_leaves_its_table_as_it_was(language):
    target, moved = language["target"], language["moved"]
    embedding, head = moved.model.get_input_embeddings(), moved.model.get_output_embeddings()
    pair_draft(target, moved)  # the fixture paired it once
    assert moved.model.get_input_embeddings() is embedding and moved.model.get_output_embeddings() is head


def test_a_draft_with_another_tokenizer_is_refused_before_any_weights_load(tiny_dirs, language_dirs, tmp_path,
                                                                         no_model_loading):
    """The two models' tokenizer and config files decide it: one line, exit 2, and no model loaded."""
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], language_dirs["foreign"])
    image = save_images(tmp_path, 1)[0]
    result = cli("generate", image, "-q", QUESTION, "--profile", profile, "--drafter", "t")
    assert_one_line_error(result, "has another tokenizer than the target's")
