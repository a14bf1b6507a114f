"""What ``mmspec generate`` shows: coloured live text, plain streamed text, summaries, JSON.

Colours (live mode): accepted draft tokens green, tokens the target emitted itself
(corrections and bonus tokens) bold cyan, and the rejected draft tokens of the latest
block struck through in red after the text, until the next block replaces them.
"""

from __future__ import annotations

import sys

from collections.abc import Sequence
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from mmspec_cli.decoding.events import BlockVerified, Event, Generation, TurnFinished, TurnResult, TurnStarted
from mmspec_cli.decoding.metrics import RunStats

ACCEPTED = "green"
EMITTED = "bold cyan"
REJECTED = "red strike"
INCOMPLETE_CHAR = "\ufffd"


class IncrementalText:
    """The text of a growing token list, handed out piece by piece.

    The whole list is decoded each time and only the new suffix is returned, so a token
    that splits a character, or that carries a word's leading space, comes out right; an
    incomplete character at the end is held back until later tokens complete it.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def add(self, ids: Sequence[int]) -> str:
        """Append ``ids``; return the text they add."""
        self.ids.extend(ids)
        text = self._decode(self.ids).rstrip(INCOMPLETE_CHAR)
        new = text[self.shown:]
        self.shown = max(self.shown, len(text))
        return new

    def peek(self, ids: Sequence[int]) -> str:
        """The text ``ids`` would add, without appending them."""
        return self._decode(self.ids + list(ids))[self.shown:]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).lstrip()


def color_block(text: IncrementalText, block: BlockVerified) -> tuple[Text, Text]:
    """The text ``block`` adds (accepted drafts, then the target's token) and its rejected drafts."""
    kept = Text.assemble((text.add(block.tokens[: block.accepted]), ACCEPTED))
    rejected = Text(text.peek(block.draft[block.accepted:]), style=REJECTED)
    kept.append(text.add(block.tokens[block.accepted:]), style=EMITTED)
    return kept, rejected


def weight_bars(members: Sequence[str], weights: Sequence[float], width: int = 10) -> Text:
    """A small bar per ensemble member, e.g. ``m ███████··· 0.70  t ███······· 0.30``."""
    bars = Text()
    for name, w in zip(members, weights):
        filled = round(w * width)
        bars.append(f"{name} ", style="bold")
        bars.append("█" * filled, style="magenta")
        bars.append("·" * (width - filled), style="dim")
        bars.append(f" {w:.2f}  ")
    return bars


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an open terminal; False for None (a closed std stream), a closed file, or an object
    without ``isatty`` (what some embedding hosts put in ``sys.stdout``), so output modes never crash on it."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # None or no isatty; "I/O operation on closed file"; a bad fd
        return False


def summary_line(stats: RunStats, model: str = "") -> str:
    """One line of turn statistics; acceptance rate ``-`` when nothing was drafted; ``model``: what the line says of
    the target (:func:`model_note`), after the figures."""
    rate = "-" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.2f}"
    return (f"{stats.new_tokens} new tokens, {stats.blocks} blocks, block efficiency {stats.block_efficiency:.2f}, "
            f"acceptance rate {rate}, {stats.tokens_per_s:.1f} tokens/s, {stats.wall_s:.2f} s"
            + (f", {model}" if model else ""))


def model_note(target: Any) -> str:
    """What a summary line says of a loaded target (``models.loading.LoadedModel``): its LLM.int8 outlier threshold
    when it is 8-bit (which decides whether every drafter gives its own ``generate``'s output; README), else nothing."""
    threshold = getattr(target, "int8_threshold", None)
    return "" if threshold is None else f"target 8-bit, int8 threshold {threshold:g}"


class LiveView:
    """Renders events on a terminal with rich ``Live``, one live region per turn."""

    def __init__(self, tokenizer: Any, console: Console | None = None, members: Sequence[str] = (), model: str = ""):
        self.tokenizer = tokenizer
        self.members = members
        self.model = model  # what the summary line says of the target (model_note)
        self.console = console or Console()
        self.live: Live | None = None
        self.text = Text()
        self.decoded = IncrementalText(tokenizer)

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop()

    def handle(self, event: Event) -> None:
        if isinstance(event, TurnStarted):
            self._start(event)
        elif isinstance(event, BlockVerified):
            kept, rejected = color_block(self.decoded, event)
            self.text.append_text(kept)
            shown = Text.assemble(self.text, rejected)
            if event.weights is not None and self.members:
                shown = Text("\n").join([shown, weight_bars(self.members, event.weights)])
            self.live.update(shown, refresh=True)
        elif isinstance(event, TurnFinished):
            self._stop()
            self.console.print(summary_line(event.result.stats, self.model), style="dim", highlight=False,
                               soft_wrap=True)

    def _start(self, event: TurnStarted) -> None:
        self.console.print(Text(f"> {event.question}", style="dim"), soft_wrap=True)
        self.text = Text()
        self.decoded = IncrementalText(self.tokenizer)
        self.live = Live(Text(), console=self.console, auto_refresh=False)
        self.live.start()

    def _stop(self) -> None:
        """Leave the turn's text without the struck-through tail."""
        if self.live is not None:
            self.live.update(self.text, refresh=True)
            self.live.stop()
            self.live = None


class PlainView:
    """Streams each turn's text to stdout as it is verified; summaries go to stderr."""

    def __init__(self, tokenizer: Any, model: str = ""):
        self.tokenizer = tokenizer
        self.decoded = IncrementalText(tokenizer)
        self.model = model  # what the summary line says of the target (model_note)

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def handle(self, event: Event) -> None:
        if isinstance(event, TurnStarted):
            self.decoded = IncrementalText(self.tokenizer)
        elif isinstance(event, BlockVerified):
            typer.echo(self.decoded.add(event.tokens), nl=False)
        elif isinstance(event, TurnFinished):
            typer.echo()
            typer.echo(summary_line(event.result.stats, self.model), err=True)


def block_json(block: BlockVerified) -> dict:
    out = {"draft": block.draft, "accepted": block.accepted, "emitted": block.emitted}
    if block.weights is not None:
        out["weights"] = block.weights
    if block.tree is not None:
        out["tree"] = block.tree  # every branch of a token-tree block; "draft" is the one the target followed
    return out


def turn_json(turn: TurnResult, members: Sequence[str] = ()) -> dict:
    out = {"question": turn.question, "text": turn.text, "token_ids": turn.token_ids}
    if members:
        out["members"] = list(members)  # the order of each block's "weights"
    out.update(stats=turn.stats.as_dict(), blocks=[block_json(b) for b in turn.blocks])
    if turn.caption_s:
        out["caption_s"] = turn.caption_s  # captioning time for caption drafting, apart from decoding
    return out


def generation_json(generation: Generation, profile: str) -> dict:
    """The ``--json`` object of a whole run."""
    return {"drafter": generation.drafter, "profile": profile,
            "turns": [turn_json(t, generation.members) for t in generation.turns],
            "stats": generation.stats.as_dict()}


def forget_compiling() -> None:
    """Start the compile log afresh for this command (in a test process, an earlier command compiled too)."""
    from mmspec_cli.decoding.compiled import LOG

    LOG.clear()


def report_compiling() -> None:
    """One line on stderr saying what ``--compile`` compiled and how long it took (nothing when nothing was)."""
    from mmspec_cli.decoding.compiled import LOG

    line = LOG.summary()
    if line:
        print(f"note: {line}", file=sys.stderr)
