"""ViSpec's published Qwen2.5-VL draft heads (``JLKang/ViSpec-Qwen2.5-VL-7B-Instruct``): their layout loads strictly.

The layout is ViSpec's published checkpoint layout (the ``JLKang/ViSpec-*`` hub repositories): ``config.json`` with
Llama-style keys plus ``qkv_bias: true`` and ``rope_theta``, and 22 tensors: the 17 of a LLaVA vispec head plus
``layers.0.self_attn.{q,k,v}_proj.bias`` and ``imadpt.{k,v}_proj.bias``. The hub is out of reach here, so a
checkpoint of that layout is written with random tensors shaped for a tiny float64 Qwen2.5-VL target
(``tests/tiny_qwen.py``), loaded with ``load_head``, checked tensor by tensor against a forward computed from the
file's own tensors, and decoded with: greedy decoding must equal the target's own ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.features import tap_for
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models.head import DraftHead, causal_mask
from mmspec_cli.models.head_files import head_config, load_head, save_head
from mmspec_cli.models.prompts import process, render_prompt
from tests import tiny_qwen
from tests.standins import vispec_qwen_shapes
from tests.conftest import load
from tests.helpers import QUESTION, own_generate, uncached_forward

FAMILY = "qwen2_5_vl"
THETA = 1_000_000.0  # Qwen2.5-VL's rope_theta, not Llama's default: the head must read it from config.json
MAX_NEW = 12
BIASES = ["layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias",
          "imadpt.k_proj.bias", "imadpt.v_proj.bias"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny float64 Qwen2.5-VL target (hidden 32, 4 heads of 8, 2 key/value heads), loaded as a hub id would be."""
    tokenizer = tiny_qwen.train_tokenizer()
    model = tiny_qwen.make_model(FAMILY, len(tokenizer), seed=0)
    path = tiny_qwen.save(model, tiny_qwen.make_processor(FAMILY, tokenizer), tmp_path_factory.mktemp("qwen25") / "t")
    return load(path, "target")


def layout_shapes(target) -> dict[str, tuple[int, ...]]:
    """The 22 tensors of ViSpec's published Qwen2.5-VL head, shaped for ``target`` (:func:`vispec_qwen_shapes`,
    written out there, not taken from mmspec's DraftHead, so that a head of another layout fails to load them)."""
    text = target.model.config.get_text_config()
    return vispec_qwen_shapes(text.hidden_size, text.intermediate_size, text.num_attention_heads,
                              text.num_key_value_heads, target.vocab_size)


def write_published(target, folder: Path, seed: int = 0, rope: dict | None = None) -> Path:
    """A published-layout Qwen2.5-VL vispec head for ``target``: Llama-style config.json with qkv_bias and
    rope_theta (no mmspec block, no head_dim), model.safetensors with the 22 tensors, random, in float32."""
    text = target.model.config.get_text_config()
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": text.hidden_size,
              "intermediate_size": text.intermediate_size, "num_attention_heads": text.num_attention_heads,
              "num_key_value_heads": text.num_key_value_heads, "num_hidden_layers": 1,
              "vocab_size": target.vocab_size, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
              "rope_theta": THETA, "qkv_bias": True, "hidden_act": "silu", "bos_token_id": None,
              "eos_token_id": tiny_qwen.EOS_ID, "tie_word_embeddings": False, **(rope or {})}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    weights = {key: 0.3 * torch.randn(shape, generator=gen) for key, shape in layout_shapes(target).items()}
    weights["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().float().clone()
    weights["layers.0.post_attention_layernorm.weight"] += 1.0
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def published(target, tmp_path_factory):
    return write_published(target, tmp_path_factory.mktemp("published") / "vispec-qwen25")


# --------------------------------------------------------------------------- a forward from the file's own tensors


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half) of (heads, n, d) at 1-D ``positions``."""
    d = x.shape[-1]
    angles = positions[:, None].double() * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def file_layer(w: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, heads: int, kv: int,
               theta: float = THETA, eps: float = 1e-6) -> torch.Tensor:
    """The head's decoder layer over (n, H) inputs written out from the file's tensors: q/k/v with their biases,
    rope, causal grouped-query attention, o without bias, residual, post-attention RMS norm, SwiGLU, residual
    (no input norm: ViSpec's fused input is not normed)."""

    def linear(name, t):
        bias = w.get(f"layers.0.{name}.bias")
        return t @ w[f"layers.0.{name}.weight"].T + (0 if bias is None else bias)

    n, d = x.shape[0], x.shape[1] // heads
    q = rope(linear("self_attn.q_proj", x).view(n, heads, d).transpose(0, 1), positions, theta)
    k = rope(linear("self_attn.k_proj", x).view(n, kv, d).transpose(0, 1), positions, theta)
    v = linear("self_attn.v_proj", x).view(n, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    h = x + linear("self_attn.o_proj", (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1))
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w["layers.0.post_attention_layernorm.weight"]
    mlp = linear("mlp.down_proj", torch.nn.functional.silu(linear("mlp.gate_proj", normed)) * linear("mlp.up_proj", normed))
    return h + mlp


def file_adaptor(w: dict[str, torch.Tensor], image: torch.Tensor) -> torch.Tensor:
    """ViSpec's vision adaptor from the file's tensors: its queries over k/v (with biases) of one image's (m, H)."""
    num_q, heads, d = w["imadpt.q"].shape
    keys = (image @ w["imadpt.k_proj.weight"].T + w["imadpt.k_proj.bias"]).view(-1, heads, d).transpose(0, 1)
    values = (image @ w["imadpt.v_proj.weight"].T + w["imadpt.v_proj.bias"]).view(-1, heads, d).transpose(0, 1)
    attended = ((w["imadpt.q"].transpose(0, 1) @ keys.transpose(-1, -2)) / d ** 0.5).softmax(-1) @ values
    return attended.transpose(0, 1).reshape(num_q, -1) @ w["imadpt.o_proj.weight"].T


def file_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.float64) for k, v in load_file(folder / "model.safetensors").items()}


def body(head: DraftHead, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    with torch.no_grad():
        return head.body(x[None], torch.arange(n)[None], causal_mask(n, 0, x.dtype, "cpu"))[0]


# --------------------------------------------------------------------------- loading


def test_all_22_tensors_load_where_the_published_layout_puts_them(target, published):
    w = file_weights(published)
    assert len(w) == 22 and tuple(w["imadpt.q"].shape) == (2, 4, 8)
    head = load_head(str(published), "vispec", None, target).cpu()  # the rules on the CPU's tensors
    assert head.kind == "vispec" and head.num_q == 2 and head.fc.weight.dtype == torch.float64
    layer = head.layers[0]
    assert isinstance(layer, Qwen2DecoderLayer) and layer.self_attn.o_proj.bias is None
    state = head.state_dict()
    assert sorted(state) == sorted(w)
    for key, tensor in w.items():
        assert torch.equal(state[key], tensor), key
    assert torch.equal(layer.self_attn.q_proj.bias, w["layers.0.self_attn.q_proj.bias"])
    assert torch.equal(layer.self_attn.k_proj.bias, w["layers.0.self_attn.k_proj.bias"])
    assert torch.equal(layer.self_attn.v_proj.bias, w["layers.0.self_attn.v_proj.bias"])
    assert torch.equal(head.imadpt.k_proj.bias, w["imadpt.k_proj.bias"])
    assert torch.equal(head.imadpt.v_proj.bias, w["imadpt.v_proj.bias"])


def test_the_loaded_head_computes_what_the_files_tensors_say(target, published):
    """Layer, adaptor and fusion against forwards written out from the file: a tensor loaded into the wrong place
    (k's bias as v's, say), a bias dropped, or Llama's rope theta instead of the file's, and these differ."""
    w = file_weights(published)
    head = load_head(str(published), "vispec", None, target).cpu()  # the rules on the CPU's tensors
    text = target.model.config.get_text_config()
    x = torch.randn(7, text.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(body(head, x), file_layer(w, x, torch.arange(7), text.num_attention_heads,
                                                         text.num_key_value_heads), rtol=1e-6, atol=1e-6)
    image = x[:5]
    with torch.no_grad():
        compressed, glob = head.compress(image)
        torch.testing.assert_close(torch.cat([compressed, glob[None]]), file_adaptor(w, image), rtol=1e-9, atol=1e-9)
        e, f, g = x[:3], x[3:6], x[6]
        fused = torch.cat([e, torch.cat([f, g.expand_as(f)], -1) @ w["img_fc.weight"].T + w["img_fc.bias"]], -1)
        torch.testing.assert_close(head.fuse(e, f, g[None]), fused @ w["fc.weight"].T + w["fc.bias"])


@pytest.mark.parametrize("key", ["layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias",
                                 "layers.0.self_attn.v_proj.bias", "imadpt.v_proj.bias"])
def test_each_bias_changes_the_heads_output(target, published, key):
    """(The adaptor's k bias adds q·b to every score of a query alike, which its softmax cancels: ViSpec's
    adaptor has no positions, so that bias is checked by value only, above.)"""
    head = load_head(str(published), "vispec", None, target).cpu()  # the rules on the CPU's tensors
    x = torch.randn(6, head.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    before = (body(head, x), head.imadpt(x).detach())
    with torch.no_grad():
        head.get_parameter(key).add_(0.5)
    after = (body(head, x), head.imadpt(x).detach())
    changed = after[0] if key.startswith("layers.") else after[1]
    assert not torch.allclose(before[0] if key.startswith("layers.") else before[1], changed, atol=1e-4)


def test_an_mrope_setting_in_the_heads_config_is_read_as_its_plain_rope(target, published, tmp_path):
    """Qwen-VL configs name their rope ``mrope`` with sections; the head reads 1-D positions (same outputs)."""
    other = write_published(target, tmp_path / "mrope",
                            rope={"rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}})
    x = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(body(load_head(str(other), None, None, target).cpu(), x),
                               body(load_head(str(published), None, None, target).cpu(), x), rtol=0, atol=0)


# --------------------------------------------------------------------------- losslessness


def targets_own(target, n_images: int) -> list[int]:
    """The target's own greedy ``generate`` on the prompt mmspec builds, over ``n_images`` tiny Qwen images."""
    return own_generate(target, [QUESTION], [], n_images, tiny_qwen.images(n_images), MAX_NEW)


@pytest.fixture(scope="module")
def guessing(target, published, tmp_path_factory):
    """The published checkpoint made to guess now and then (a random head's drafts are never accepted, so the
    accepting paths would go untested): ``fc`` mostly a constant, half the target's feature after the first answer
    token of the two-image prompt; attention and MLP outputs scaled down."""
    prompt = process(target.processor, render_prompt(target.processor, [QUESTION], [], 2), tiny_qwen.images(2))
    first = targets_own(target, 2)[0]
    vision = dict(prompt.vision)
    vision["mm_token_type_ids"] = torch.nn.functional.pad(vision["mm_token_type_ids"], (0, 1))
    tap = tap_for(target.model)
    with torch.no_grad():
        uncached_forward(target.model, prompt.ids + [first], vision)
    _, hidden = tap.take()

    def guess(w):
        w["fc.weight"] *= 0.05
        w["fc.bias"] = 0.5 * hidden[-1].float()
        w["layers.0.self_attn.o_proj.weight"] *= 0.1
        w["layers.0.mlp.down_proj.weight"] *= 0.1

    return rewritten(published, tmp_path_factory.mktemp("guessing"), guess)


@pytest.mark.parametrize("n_images,tree", [(2, "dynamic"), (1, "chain"), (0, "dynamic")])
def test_greedy_with_the_published_head_equals_target_generate(target, guessing, n_images, tree):
    head = load_head(guessing, "vispec", None, target)
    options = {"tree": "dynamic", "tree_budget": 10, "tree_depth": 3, "tree_topk": 2} if tree == "dynamic" else {}
    decoder = SpeculativeDecoder(target, HeadDrafter(target, head), gamma=4, max_new_tokens=MAX_NEW, **options)
    turn = decoder.generate(tiny_qwen.images(n_images), [QUESTION]).turns[0]
    assert turn.token_ids == targets_own(target, n_images)
    if n_images == 2:
        assert sum(block.accepted for block in turn.blocks) > 0  # drafts accepted too, not only the target's tokens


# --------------------------------------------------------------------------- mmspec's own heads for a Qwen2.5-VL target


@pytest.mark.parametrize("kind,count", [("vispec", 22), ("eagle", 14)])
def test_mmspecs_own_head_for_a_qwen_target_has_the_biases_and_loads_back(target, tmp_path, kind, count):
    """Qwen2.5-VL's attention has q/k/v biases, so a head mmspec trains for it has them (ViSpec's layout), and
    ``save_head`` writes qkv_bias to config.json for ``load_head`` to read back."""
    torch.manual_seed(0)
    head = DraftHead(head_config(target), kind).to(torch.float64)
    assert len(head.state_dict()) == count
    save_head(head, tmp_path / kind, target="tiny-qwen25", dtype=torch.float64)
    assert json.loads((tmp_path / kind / "config.json").read_text())["qkv_bias"] is True
    again = load_head(str(tmp_path / kind), None, None, target)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b.cpu()), name


# --------------------------------------------------------------------------- refusals


def rewritten(published: Path, tmp_path: Path, change_weights=None, change_config=None) -> str:
    out = tmp_path / "changed"
    out.mkdir(parents=True)
    config = json.loads((published / "config.json").read_text())
    weights = load_file(published / "model.safetensors")
    if change_weights:
        change_weights(weights)
    if change_config:
        change_config(config)
    (out / "config.json").write_text(json.dumps(config))
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


def refusal(target, folder: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_head(folder, None, None, target)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("key", BIASES)
def test_a_checkpoint_missing_one_bias_is_refused_in_one_line(target, published, tmp_path, key):
    message = refusal(target, rewritten(published, tmp_path, lambda w: w.pop(key)))
    assert "doesn't have the tensors of a vispec head with q/k/v biases (22 expected)" in message
    assert f"missing {key};" in message and "download it again" in message


def test_other_faults_are_refused_naming_the_fix(target, published, tmp_path):
    no_flag = refusal(target, rewritten(published, tmp_path / "a", change_config=lambda c: c.pop("qkv_bias")))
    assert "(17 expected): unexpected imadpt.k_proj.bias, imadpt.v_proj.bias, layers.0.self_attn.k_proj.bias ..." \
        in no_flag
    assert 'add "qkv_bias": true to its config.json' in no_flag
    no_biases = refusal(target, rewritten(published, tmp_path / "b", lambda w: [w.pop(k) for k in BIASES]))
    assert 'says "qkv_bias": true but it holds no q/k/v biases: set it to false' in no_biases
    extra = refusal(target, rewritten(published, tmp_path / "c", lambda w: w.__setitem__("imadpt.o_proj.bias",
                                                                                            torch.zeros(32))))
    assert "unexpected imadpt.o_proj.bias" in extra
    shape = refusal(target, rewritten(published, tmp_path / "d", lambda w: w.__setitem__(
        "layers.0.self_attn.k_proj.bias", torch.zeros(32))))
    assert "layers.0.self_attn.k_proj.bias has shape (32,), expected (16,) from its config.json" in shape
    heads = refusal(target, rewritten(published, tmp_path / "e", change_config=lambda c: c.update(qkv_bias="yes")))
    assert 'qkv_bias "yes"' in heads
