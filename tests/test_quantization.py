"""Quantized models (bitsandbytes on the CPU): what is guaranteed, and why.

**Rows on their own.** Speculative decoding gives the target's own output when a token verified beside others
gets the logits it gets alone, as ``generate`` runs it. Two things in bitsandbytes decide that:

- 8 bits: LLM.int8 computes in floating point the columns where any row of a call has an outlier (|x| > 6 by
  default), for every row of that call, so rows are coupled. mmspec loads an 8-bit target without outlier columns
  (``TARGET_INT8_THRESHOLD``): every row is quantized on its own (``int8_vectorwise_quant``, one scale per row).
- 4 bits: on an AVX512-BF16 CPU, bitsandbytes 0.50 packs the weights for its own kernel
  (``gemv_4bit_inference``) and runs every 4-bit matmul there, whatever the number of rows: the activations are
  rounded to bfloat16 one by one, each output element is one row's own dot product (accumulated in float32, one
  scale per block of 64 weights), rounded to bfloat16. Nothing is shared between rows, so rows are on their own
  with bitsandbytes' defaults. The kernel needs every quantized layer's output size to be a multiple of 32 (its
  column block), so the models here are a tiny family whose every width is (``FAMILY``); the tiny models of the
  other tests (a 16-wide vision tower) abort in it.

``test_every_quantized_layer_computes_each_row_on_its_own`` checks this on whole models, layer by layer: every call
of every quantized layer during decoding (the prompt with its image, chains, trees, batched draft rows) is run
again one row at a time, and must give the same bits. The whole model's logits are not bit-for-bit the same
verified together and alone, with or without quantization: float32 attention and matmuls outside the quantized
layers differ in the last bit (about 1e-6 here, in float32 and at 4 and 8 bits alike; 1e-15 in float64), which
is why greedy equality is asserted on tokens, over a sharpened LM head.

The tiny target has activation outliers on purpose (its language model's norms scaled ×5 on four channels:
activations above 6, as real models of 7B parameters and more have); a plain tiny model has none, and any
threshold would pass. Measured when written, with bitsandbytes' default threshold (6.0) for the 8-bit target: the
row check fails, and ``m``, ``t``, ``c`` and ``tabed`` differ from the target's ``generate`` (``ar`` never: it
verifies one token at a time). With rows coupled inside the 4-bit layers (one activation scale per call, patched in
by hand), the 4-bit row check, every 4-bit drafter but ``ar`` and the sampling test fail.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

pytest.importorskip("bitsandbytes")

from mmspec_cli.drafters.captioner import Captioner  # noqa: E402
from mmspec_cli.models import loading  # noqa: E402
from mmspec_cli.models.profiles import ModelSpec  # noqa: E402
from mmspec_cli.models.prompts import render_prompt  # noqa: E402
from tests import tiny  # noqa: E402
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, exact_joint, sampled_pairs  # noqa: E402
from tests.helpers import DEVICE, QUESTION, assert_one_line_error, cli, own_generate, save_images, speculative_decoder  # noqa: E402

OUTLIER_SCALE = 5.0
#: Every quantized Linear's output size a multiple of 32 and its input size one of 64: CLIP 64 wide (MLP 128), a
#: language model 64 wide (MLP 128; 4 heads of 16, 2 key/value heads: 32). The LM head (400 tokens) stays in
#: floating point, as transformers leaves it.
FAMILY = dict(hidden=64, layers=2, vision_hidden=64)
BITS = ("8bit", "4bit")
#: Each drafter kind with the decoder settings that drive it: chains, a width tree, a dynamic tree.
DRAFTERS = {
    "ar": ("ar", {}),
    "m": ("m", {}),
    "t": ("t", {}),
    "c": ("c", {}),
    "p": ("p", {}),
    "tabed": ("tabed", {}),
    "tree: width": ("m", dict(tree_width=2)),
    "tree: dynamic": ("tabed", dict(tree="dynamic", tree_budget=12, tree_depth=3, tree_topk=3)),
}
QUESTIONS = (QUESTION, "how many shapes are there?")
#: A prompt longer than the 4-bit kernel's row block (32) with three images.
LONG_QUESTION = "finish the story: the cat sat on the mat, then it jumped over the fence and ran away."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(role, quantization)``: the tiny target (with outliers) or a draft close to it, saved in float32 and
    loaded as that role with that quantization (None: float32), each once for the module."""
    root = tmp_path_factory.mktemp("quantized")
    tokenizer = tiny.train_tokenizer()
    processor = tiny.make_processor(tokenizer)
    target = tiny.make_model(len(tokenizer), seed=0, **FAMILY)
    with torch.no_grad():
        for name, weight in target.named_parameters():
            if "language_model" in name and "layernorm" in name:
                weight[:4].mul_(OUTLIER_SCALE)
    draft = tiny.perturbed_copy(target, 0.05, seed=1)
    dirs = {"target": tiny.save(target.to(torch.float32), processor, root / "target"),
            "draft": tiny.save(draft.to(torch.float32), processor, root / "draft")}
    loaded = {}

    def load(role: str, quantization: str | None):
        if (role, quantization) not in loaded:
            spec = ModelSpec(model=dirs[role], dtype="float32", device=DEVICE, quantization=quantization)
            loaded[role, quantization] = loading.load_model(spec, role)
        return loaded[role, quantization]

    load.dirs = dirs
    return load


def decode_and_compare(target, draft, drafter: str, settings: dict) -> None:
    """Greedy decoding of each question about one image gives the target's own ``generate``."""
    captioner = Captioner(draft, max_new_tokens=6)
    for question in QUESTIONS:
        images = tiny.images(1)
        decoder = speculative_decoder(target, drafter, draft, gamma=3, build=dict(captioner=captioner), **settings)
        turn = decoder.generate(images, [question]).turns[0]
        assert turn.token_ids == own_generate(target, [question], [], 1, images), (drafter, settings, question)


def test_an_8bit_target_has_no_outlier_columns_and_a_draft_keeps_the_default():
    target = loading._quantization_config("8bit", torch.float32, "target")
    draft = loading._quantization_config("8bit", torch.float32, "draft")
    assert target.load_in_8bit and target.llm_int8_threshold == loading.TARGET_INT8_THRESHOLD == 0.0
    assert draft.load_in_8bit and draft.llm_int8_threshold == 6.0


def test_the_int8_threshold_is_each_roles_default_or_the_profiles_and_only_for_8bit(tmp_path):
    """``quantization_threshold`` (``--int8-threshold``): unset, 0 for a target and bitsandbytes' 6.0 for a draft;
    set, that value; refused in one line on a model that is not 8-bit, named by the key or by the flag."""
    from mmspec_cli.errors import ProfileError
    from mmspec_cli.models.profiles import apply_overrides, profile_from_dict

    eight = ModelSpec(model="m", quantization="8bit")
    assert loading.int8_threshold(eight, "target") == 0.0 and loading.int8_threshold(eight, "draft") == 6.0
    chosen = ModelSpec(model="m", quantization="8bit", quantization_threshold=6.0)
    assert loading.int8_threshold(chosen, "target") == 6.0
    assert loading.int8_threshold(ModelSpec(model="m", quantization="4bit"), "target") is None
    assert loading._quantization_config("8bit", torch.float32, "target", 6.0).llm_int8_threshold == 6.0
    assert loading.coupled_rows_caveat(6.0, "target").startswith("warning: target.quantization_threshold 6: ")
    assert loading.coupled_rows_caveat(0.0, "target") is None and loading.coupled_rows_caveat(6.0, "draft") is None
    with pytest.raises(ProfileError, match=r"^target\.quantization_threshold is LLM\.int8's outlier threshold, for "
                                           r"quantization: 8bit, and this model's quantization is null"):
        profile_from_dict({"target": {"model": "m", "quantization_threshold": 6}})
    quantized = profile_from_dict({"target": {"model": "m", "quantization": "8bit"}})
    assert apply_overrides(quantized, int8_threshold=6.0).target.quantization_threshold == 6.0
    with pytest.raises(ProfileError, match=r"^--int8-threshold: target\.quantization_threshold is LLM\.int8's"):
        apply_overrides(profile_from_dict({"target": {"model": "m"}}), int8_threshold=6.0)
    with pytest.raises(ProfileError, match=r"^--int8-threshold: expected a number >= 0, got -1"):
        apply_overrides(quantized, int8_threshold=-1.0)


def test_at_bitsandbytes_default_threshold_ar_gives_the_users_own_8bit_generate(models):
    """``quantization_threshold: 6`` loads the 8-bit model a user's own ``from_pretrained(load_in_8bit=True)`` does
    (every 8-bit layer at threshold 6), and ``ar``, which verifies one token at a time, gives its ``generate``'s
    tokens. The default target (threshold 0) is another model: its tokens differ from that one's here."""
    import bitsandbytes
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    spec = ModelSpec(model=models.dirs["target"], dtype="float32", device="cpu", quantization="8bit",
                     quantization_threshold=6.0)
    target = loading.load_model(spec, "target")
    layers = [m for m in target.model.modules() if isinstance(m, bitsandbytes.nn.Linear8bitLt)]
    assert layers and {m.state.threshold for m in layers} == {6.0} and target.int8_threshold == 6.0
    own = AutoModelForImageTextToText.from_pretrained(models.dirs["target"], dtype=torch.float32, device_map="cpu",
                                                      quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    users = loading.LoadedModel("target", "users-own", own.eval(), target.processor)
    images = tiny.images(1)
    expected = own_generate(users, [QUESTION], [], 1, images)
    decoder = speculative_decoder(target, "ar", None, gamma=3)
    assert decoder.generate(images, [QUESTION]).turns[0].token_ids == expected
    text = render_prompt(target.processor, [QUESTION], [], 1)
    inputs = target.processor(images=[images], text=text, return_tensors="pt")
    with torch.no_grad():
        logits = {name: model(**inputs).logits[0, -1] for name, model in
                  (("users", own), ("six", target.model), ("default", models("target", "8bit").model))}
    assert torch.equal(logits["six"], logits["users"])  # the same model, bit for bit
    assert (logits["default"] - logits["users"]).abs().max() > 1e-3  # threshold 0 is another model here


def test_generate_and_bench_name_the_8bit_targets_threshold(models, tmp_path):
    """``--int8-threshold 6``: generate's summary line and every bench record say the threshold used, a warning says
    what it costs, and a resume with another threshold is refused in one line; the default says 0."""
    profile = tmp_path / "eight.yaml"
    spec = {"dtype": "float32", "device": "cpu"}
    profile.write_text(yaml.safe_dump({"target": {"model": models.dirs["target"], **spec, "quantization": "8bit"},
                                       "draft": {"model": models.dirs["draft"], **spec},
                                       "decoding": {"max_new_tokens": 4, "gamma": 2}}))
    [image] = save_images(tmp_path, 1)
    result = cli("generate", image, "-q", QUESTION, "--profile", str(profile), "--drafter", "ar", "--no-live",
                 "--int8-threshold", "6")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[-1].endswith(", target 8-bit, int8 threshold 6")
    assert "warning: target.quantization_threshold 6: " in result.stderr
    default = cli("generate", image, "-q", QUESTION, "--profile", str(profile), "--drafter", "ar", "--json")
    assert default.exit_code == 0 and json.loads(default.stdout)["int8_threshold"] == 0.0
    assert "warning" not in default.stderr
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": [QUESTION], "category": "c"}) + "\n")
    out = tmp_path / "r.jsonl"
    ran = cli("bench", str(manifest), "--profile", str(profile), "--drafters", "ar,m", "--out", str(out),
              "--int8-threshold", "6", "--no-warmup")
    assert ran.exit_code == 0, ran.stderr
    assert [json.loads(line)["int8_threshold"] for line in out.read_text().splitlines()] == [6.0, 6.0]
    again = cli("bench", str(manifest), "--profile", str(profile), "--drafters", "ar,m", "--out", str(out), "--resume")
    assert_one_line_error(again, f"--out {out} holds results made with int8_threshold 6.0 but this run uses 0.0")
    refused = cli("generate", image, "-q", QUESTION, "--profile", str(profile), "--int8-threshold", "6",
                  "--drafter", "ar")
    assert refused.exit_code == 0  # (the same flag, accepted) and on a float target, one line:
    float_profile = tmp_path / "float.yaml"
    float_profile.write_text(yaml.safe_dump({"target": {"model": models.dirs["target"], **spec},
                                             "draft": {"model": models.dirs["draft"], **spec},
                                             "decoding": {"max_new_tokens": 4, "gamma": 2}}))
    unquantized = cli("bench", str(manifest), "--profile", str(float_profile), "--drafters", "ar,m", "--out", str(out),
                      "--resume")  # a float target's records say null: not resumed from 8-bit ones
    assert_one_line_error(unquantized, f"--out {out} holds results made with int8_threshold 6.0 but this run uses null")
    assert_one_line_error(cli("generate", image, "-q", QUESTION, "--profile", str(float_profile), "--int8-threshold",
                              "6"), "--int8-threshold: target.quantization_threshold is LLM.int8's outlier threshold")


@pytest.mark.parametrize("bits", BITS)
def test_every_quantized_layer_computes_each_row_on_its_own(models, bits):
    """Every call with several rows of every quantized layer of the target, while ``tabed`` drafts dynamic trees
    over the quantized draft, gives each row the bits it gets alone (a prompt of 46 rows with three images, then
    chains and trees). With the 8-bit target at bitsandbytes' default threshold this fails."""
    from bitsandbytes.functional import has_avx512bf16

    if bits == "4bit" and DEVICE == "cpu" and not has_avx512bf16():  # elsewhere 4 bits dequantize and run torch's float matmul
        pytest.skip("bitsandbytes' 4-bit CPU kernel (one row's own dot products) needs AVX512-BF16")
    if bits == "4bit" and DEVICE.startswith("cuda"):  # measured on an H100: a vision q_proj's 15 rows differed
        pytest.skip("on CUDA, bitsandbytes runs a one-row 4-bit call in gemv and several rows as a float matmul: "
                    "rows are not on their own there, which loading.rows_caveat warns of")
    target, draft = models("target", bits), models("draft", bits)
    layers = {name: module for name, module in target.model.named_modules()
              if type(module).__name__ in ("Linear8bitLt", "Linear4bit")}
    assert len(layers) == 22  # vision tower 6 + projector 2 + language model 2 × 7; the LM head is not quantized
    calls = []
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: calls.append((name, args[0], out)))
             for name, module in layers.items()]
    try:
        drafter, settings = DRAFTERS["tree: dynamic"]
        speculative_decoder(target, drafter, draft, gamma=3, max_new_tokens=8, **settings).generate(
            tiny.images(3), [LONG_QUESTION])
    finally:
        for hook in hooks:
            hook.remove()
    several = [(name, x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])) for name, x, out in calls
               if x.numel() > x.shape[-1]]
    assert {name for name, _, _ in several} == set(layers) and max(len(x) for _, x, _ in several) > 32
    with torch.no_grad():
        for name, x, out in several:
            alone = torch.cat([layers[name](row[None]) for row in x])
            assert torch.equal(alone, out), (name, tuple(x.shape))


def test_a_4bit_target_on_a_gpu_is_warned_that_its_rows_round_apart():
    """The rule of the one warning line a 4-bit target on CUDA gets at load (a draft's rounding never changes the
    output; 8 bits and the CPU's 4-bit kernel keep rows on their own)."""
    assert loading.rows_caveat("4bit", "target", "cuda").startswith("warning: target.quantization: 4bit on cuda: ")
    assert loading.rows_caveat("4bit", "target", "cuda:1") is not None
    quiet = [("4bit", "target", "cpu"), ("8bit", "target", "cuda"), ("4bit", "draft", "cuda"), (None, "target", "cuda")]
    assert [loading.rows_caveat(*case) for case in quiet] == [None] * len(quiet)


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("bits", BITS)
def test_greedy_with_a_quantized_target_and_draft_is_the_targets_own_output(models, bits, drafter):
    name, settings = DRAFTERS[drafter]
    decode_and_compare(models("target", bits), models("draft", bits), name, settings)


@pytest.mark.parametrize("bits", BITS)
def test_a_quantized_draft_leaves_a_float_targets_output_alone(models, bits):
    decode_and_compare(models("target", None), models("draft", bits), "tabed", {})


def test_sampling_with_a_quantized_target_keeps_its_distribution(models):
    """``m`` over the 4-bit draft, chains of γ = 2, for the 4-bit target: the first two sampled tokens of
    ENGINE_RUNS seeded runs against the quantized target's exact distribution (tests/test_engine_sampling.py says
    how). What it catches, measured when written: the float32 target's distribution in its place gives p ≈ 0 (the
    4-bit one's is 0.35 from it in total variation), and rows coupled inside the 4-bit layers (one activation scale
    per call) fail too."""
    target, draft = models("target", "4bit"), models("draft", "4bit")
    decoder = speculative_decoder(target, "m", draft, gamma=2, max_new_tokens=3, sampling=PARAMS)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    assert {turn.blocks[0].accepted for turn in turns} >= {0, 1, 2}
    assert chi_square_p_value(counts, exact_joint(target), ENGINE_RUNS) > 1e-3


@pytest.mark.parametrize("role", ["target", "draft"])
def test_compile_with_a_quantized_model_is_refused_before_loading(tmp_path, no_model_loading, role):
    """``--compile`` refuses a quantized model in one line, exit 2, from the profile alone (``no_model_loading``)."""
    specs = {r: {"model": str(tmp_path / r), "dtype": "float32", "device": "cpu"} for r in ("target", "draft")}
    specs[role]["quantization"] = "4bit"
    profile = tmp_path / "quantized.yaml"
    profile.write_text(yaml.safe_dump(specs))
    result = cli("generate", *save_images(tmp_path, 1), "-q", QUESTION, "--profile", str(profile), "--compile")
    assert_one_line_error(result, f"--compile: the {role} model can't be compiled here: a quantized (bitsandbytes) "
                                  f"model is not compiled ({role}.quantization: 4bit)")


def test_a_4bit_model_whose_widths_the_cpu_kernel_refuses_runs_with_one_warning(tmp_path, capsys):
    """The tests' plain tiny LLaVA (a 16-wide vision tower): bitsandbytes' AVX512-BF16 kernel would abort on it
    (``N must be divisible by block_n``); its odd layers take the dequantizing path, and a warning says so."""
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("bitsandbytes' packed 4-bit kernel runs on AVX512-BF16 CPUs only")
    tokenizer = tiny.train_tokenizer()
    folder = tiny.save(tiny.make_model(len(tokenizer), seed=0).to(torch.float32), tiny.make_processor(tokenizer),
                       tmp_path / "plain")
    target = loading.load_model(ModelSpec(model=folder, dtype="float32", device="cpu", quantization="4bit"), "target")
    assert "don't fit bitsandbytes' AVX512-BF16 kernel" in capsys.readouterr().err
    assert own_generate(target, [QUESTION], [], 1, tiny.images(1), max_new_tokens=4)
