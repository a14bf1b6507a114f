"""FastVLM's imitation network (IN): what lets ``ssd`` see past its exit layer.

``ssd`` drafts with the target's first n decoder layers, then its final norm and LM head
(FastVLM's "draft without imitation"). The IN sits between layer n and that final norm and is
trained, with the target frozen, to turn layer n's hidden state into what the deeper layers would
have made of it (FastVLM §5, App. B: "two fully connected layers and one layer norm" at the
target's width). Here it is a pre-norm residual block,

    IN(x) = x + W2 · GELU(W1 · LayerNorm(x) + b1) + b2,

with W2 and b2 starting at zero, so an untrained IN is exactly the draft without imitation and
training only adds what the skipped layers carry.

On disk: ``config.json`` (``{"mmspec_imitation": {"layer", "hidden_size", "num_hidden_layers",
"vocab_size", "target"}}``) and ``model.safetensors``; loaded strictly, and refused in one line
when trained for another layer or another target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.loading import LoadedModel, hub_folder, model_location
from mmspec_cli.models.parts import text_decoder
from mmspec_cli.models.head_files import check_finite, save_weights
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import signature, warn_if_other_target


class ImitationNetwork(nn.Module):
    """IN(x) = x + fc2(GELU(fc1(norm(x)))) at width ``hidden``; starts as the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.fc2(nn.functional.gelu(self.fc1(self.norm(hidden))))


def target_facts(target: LoadedModel) -> dict[str, int]:
    """What an IN must match in its target: width, depth and vocabulary."""
    text = target.model.config.get_text_config()
    return {"hidden_size": text.hidden_size, "num_hidden_layers": text.num_hidden_layers,
            "vocab_size": target.vocab_size}


def save_imitation(network: ImitationNetwork, folder: Path, layer: int, target: LoadedModel, target_name: str,
                   dtype: torch.dtype = torch.float16, extra: dict | None = None) -> None:
    """``config.json`` (an ``mmspec_imitation`` block: the layer, the target's shape, name and signature) and
    ``model.safetensors`` in ``dtype``, written together atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"layer": layer, **target_facts(target), "target": target_name,
            "target_signature": signature(target.model), **(extra or {})}
    save_weights(folder, network, dtype, {"mmspec_imitation": meta})


def _folder(model: str, revision: str | None) -> Path:
    location = model_location(model)
    if Path(location).is_dir():
        return Path(location)
    return Path(hub_folder("ssd.imitation", location, revision, patterns=["config.json", "model.safetensors"]))


def _meta(folder: Path, shown: str) -> dict:
    try:
        meta = json.loads((folder / "config.json").read_text())["mmspec_imitation"]
        if isinstance(meta, dict):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise ModelLoadError(f"ssd.imitation: {shown} has no config.json with an mmspec_imitation block; train one "
                         f"with `mmspec train-head imitation`")


def trained_layer(model: str, revision: str | None = None) -> int:
    """The layer the IN named ``model`` was trained after (its config.json says)."""
    layer = _meta(_folder(model, revision), shorten(model)).get("layer")
    if not isinstance(layer, int):
        raise ModelLoadError(f"ssd.imitation: {shorten(model)}'s config.json names no layer")
    return layer


def load_imitation(model: str, layer: int | None, target: LoadedModel, revision: str | None = None) -> ImitationNetwork:
    """Load the IN named by ``ssd.imitation`` for ``ssd.layer`` = ``layer`` of ``target``; one-line refusals."""
    shown = shorten(model)
    if layer is None:
        raise InputError(f"ssd.imitation names an imitation network ({shown}) but ssd.layer is not set; set ssd.layer "
                         f"to the layer it was trained for (its config.json says which)")
    folder = _folder(model, revision)
    meta = _meta(folder, shown)
    if meta.get("layer") != layer:
        raise InputError(f"ssd.imitation {shown} was trained for layer {meta.get('layer')}, but ssd.layer is {layer}; "
                         f"set ssd.layer: {meta.get('layer')} or train one for layer {layer}")
    wanted = target_facts(target)
    have = {k: meta.get(k) for k in wanted}
    if have != wanted:
        diff = ", ".join(f"{k} {have[k]} vs {wanted[k]}" for k in wanted if have[k] != wanted[k])
        raise ModelLoadError(f"ssd.imitation {shown} was trained for another target ({diff} in "
                             f"{shorten(target.name)}); train one for this target with `mmspec train-head imitation`")
    from safetensors.torch import load_file

    try:
        weights = load_file(str(folder / "model.safetensors"))
    except Exception as exc:  # missing or truncated file: one line, whatever the reader raised
        raise ModelLoadError(f"ssd.imitation: {shown}/model.safetensors can't be read ({type(exc).__name__})") from None
    check_finite(weights, f"ssd.imitation {shown}", "mmspec train-head imitation")
    network = ImitationNetwork(wanted["hidden_size"])
    expected = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in weights.items()}
    if found != expected:
        raise ModelLoadError(f"ssd.imitation: {shown} doesn't hold an imitation network's tensors "
                             f"({sorted(expected)} with the target's width {wanted['hidden_size']})")
    warn_if_other_target("ssd.imitation", shown, meta.get("target"), meta.get("target_signature"), target.name,
                         target.model, f"mmspec train-head imitation --ssd-layer {layer}")
    network.load_state_dict(weights, assign=True)  # keep the stored precision until the cast below
    norm = text_decoder(target.model).norm.weight  # the IN feeds the final norm: it lives where that does
    return network.to(device=norm.device, dtype=norm.dtype).eval()
