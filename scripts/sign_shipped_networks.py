"""Store the demo target's signature (``models/target_identity.signature``: LM-head entries) in the shipped demo
networks' ``config.json``, their weights unchanged: how the networks saved with the norms of rows got their entries.

    python scripts/sign_shipped_networks.py

Each network must be the one trained for ``mmspec:demo-target`` (``scripts/train_demo_heads.py``): the signature
says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmspec_cli.models.loading import load_model, shipped_models_dir
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.models.target_identity import signature
from mmspec_cli.models.writing import write_atomically

#: The shipped networks trained for ``mmspec:demo-target``, with their config.json's block.
SHIPPED_NETWORKS = {"demo-eagle": "mmspec", "demo-vispec": "mmspec", "demo-imitation": "mmspec_imitation"}


def sign_again(folder: Path, block: str, model: Any) -> None:
    """Store ``model``'s signature as the target signature of the network in ``folder`` (its config.json's ``block``:
    ``mmspec`` for a head, ``mmspec_imitation`` for an imitation network); nothing else changes."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config[block]["target_signature"] = signature(model)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"  # as save_weights writes it
    write_atomically({path: lambda handle: handle.write(text.encode("utf-8"))})


def main() -> None:
    target = load_model(load_profile("demo").target, "target").model
    for name, block in SHIPPED_NETWORKS.items():
        sign_again(shipped_models_dir() / name, block, target)
        print(f"signed {shipped_models_dir() / name / 'config.json'}")


if __name__ == "__main__":
    main()
