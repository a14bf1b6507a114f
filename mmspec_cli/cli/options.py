"""Command-line options shared by several commands, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

Images = Annotated[list[str] | None, typer.Argument(metavar="IMAGE", help="Image files, in prompt order.",
                                                    show_default=False)]
Questions = Annotated[list[str] | None, typer.Option("-q", "--question", metavar="TEXT",
                                                     help="A question; repeat for a multi-turn conversation.",
                                                     show_default=False)]
ProfileName = Annotated[str | None, typer.Option("--profile", metavar="NAME|PATH",
                                                 help="Built-in profile name or YAML file.")]
Gamma = Annotated[int | None, typer.Option("--gamma", metavar="N", help="Draft tokens per block (1-64).")]
MaxNewTokens = Annotated[int | None, typer.Option("--max-new-tokens", metavar="N",
                                                  help="Tokens to generate per turn, at most.")]
Temperature = Annotated[float | None, typer.Option("--temperature", metavar="X", help="0 for greedy decoding.")]
TopP = Annotated[float | None, typer.Option("--top-p", metavar="X", help="Nucleus sampling mass, in (0, 1].")]
TopK = Annotated[int | None, typer.Option("--top-k", metavar="N", help="Sample from the N likeliest tokens.")]
Seed = Annotated[int | None, typer.Option("--seed", metavar="N", help="Random seed for sampling.")]
GammaScheduleName = Annotated[str | None, typer.Option("--gamma-schedule", metavar="constant|heuristic|fastvlm", help=(
    "Draft length per block: constant γ; heuristic (+2 after a full accept, -1 otherwise, at most γ); "
    "fastvlm (FastVLM Eq. 5, grows with the context from γ)."))]
SsdLayer = Annotated[int | None, typer.Option("--ssd-layer", metavar="N", help=(
    "ssd: draft with the target's first N decoder layers (see `mmspec select-layer`)."))]
TreeWidth = Annotated[int | None, typer.Option("--tree-width", metavar="D", help=(
    "Token trees: D branches per block (1-8), verified in one target forward; 1 = no tree."))]
