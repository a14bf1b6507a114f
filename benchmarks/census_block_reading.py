"""What a reader opens to follow one block: the product functions and files a traced block calls, and the code that
branches on eager against compiled (issue 51's reading figures).

A block here is one ``BlockStep.run`` of a turn of the demo family, after the turn's first two (the first feeds the
prompt): every Python function of ``mmspec_cli`` entered while it runs is recorded (``sys.setprofile``, call
events; frames of inductor's and dynamo's generated code are not mmspec's and are not counted), by file. Eager and
``--compile`` (a warm-up turn compiles first; the traced turn is the second).

The static figures, over ``mmspec_cli/decoding`` and ``mmspec_cli/drafters``:
- lines that branch on eager against compiled outside ``decoding/compiled.py``: a line that tests a state's kind
  (``kv == "compiled"``, ``!= "dynamic"``, ...), whether a compiled step or graph exists (``compiled is (not)
  None``, ``chain is (not) None``, ``if self.compiled``), or whether dynamo is tracing (``is_compiling()``), each
  printed with ``--lines``; a pattern list, so a count to compare between commits, not a proof;
- definitions of a chain runner (``def run_chain``) and of a drafter's catch-up (``def _catch_up``, ``def
  _feed_lead``, ``def catch_up``);
- lines of code in the two folders.

    python benchmarks/census_block_reading.py [--drafters m,tabed,eagle] [--modes eager,compiled] [--lines]
    PYTHONPATH=OLD_TREE python benchmarks/census_block_reading.py ...   # the same figures of an older tree

Prints the machine line; it times nothing.
"""

from __future__ import annotations

import argparse
import collections
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package() -> Path:
    """The mmspec_cli this process imports (an older tree's, given on PYTHONPATH to compare, or this one's)."""
    import mmspec_cli

    return Path(mmspec_cli.__file__).resolve().parent


PACKAGE = _package()
#: The patterns of a line that branches on eager against compiled (module doc).
BRANCHES = (r"""kv\s*[!=]=\s*["'](compiled|dynamic|static)["']""", r"\bcompiled\s+is\s+(not\s+)?None",
            r"\bchain\s+is\s+(not\s+)?None", r"\bif\s+(not\s+)?self\.(compiled|chain)\b", r"is_compiling\(\)",
            r"""["'](compiled|dynamic)["']\s+if\b""", r"\bif\s+compiled\b")
CATCH_UPS = (r"def _catch_up\b", r"def _feed_lead\b", r"def catch_up\b")
TRACED_BLOCK = 3  # the third block of the traced turn: past the prompt's feed and the first block after it


def code_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered lines of ``path`` that are code: not blank, not a comment, not inside a docstring."""
    out, in_doc = [], None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if in_doc:
            if in_doc in stripped:
                in_doc = None
            continue
        if stripped.startswith(('"""', "'''")):
            quote = stripped[:3]
            if stripped.count(quote) == 1 or stripped == quote:
                in_doc = quote
            continue
        if stripped and not stripped.startswith("#"):
            out.append((number, line))
    return out


def static_figures(show: bool) -> None:
    files = sorted(p for folder in ("decoding", "drafters") for p in (PACKAGE / folder).glob("*.py"))
    branches, runners, catch_ups, total = [], [], [], 0
    for path in files:
        lines = code_lines(path)
        total += len(lines)
        shown = path.relative_to(PACKAGE)
        for number, line in lines:
            if path.name != "compiled.py" and any(re.search(p, line) for p in BRANCHES):
                branches.append(f"{shown}:{number}: {line.strip()}")
            if re.search(r"def run_chain\b", line):
                runners.append(f"{shown}:{number}")
            if any(re.search(p, line) for p in CATCH_UPS):
                catch_ups.append(f"{shown}:{number}")
    in_files = len({b.split(":")[0] for b in branches})
    print(f"lines branching on eager against compiled outside decoding/compiled.py: {len(branches)} in {in_files} "
          f"files")
    if show:
        for branch in branches:
            print(f"  {branch}")
    print(f"chain runners (def run_chain): {len(runners)} ({', '.join(runners)})")
    print(f"catch-ups (def _catch_up / _feed_lead / catch_up): {len(catch_ups)} ({', '.join(catch_ups)})")
    print(f"lines of code in decoding/ + drafters/ (no blanks, comments or docstrings): {total}")


def traced_block(drafters: list[str], modes: list[str]) -> None:
    import torch

    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    try:
        from mmspec_cli.inputs.sources import resolve
    except ImportError:  # a tree from before inputs/ (it was bench/sources.py), run to compare
        from mmspec_cli.bench.sources import resolve

    torch.set_num_threads(1)
    [sample] = resolve("demo-single", 1)
    package = str(PACKAGE) + "/"
    for mode in modes:
        profile = apply_overrides(load_profile("demo"), compile=mode == "compiled", max_new_tokens=48)
        models = ModelSet.load(profile, drafters, threads=1)
        for drafter in drafters:
            decoder = models.decoder(drafter)
            calls: collections.Counter = collections.Counter()

            def profiler(frame, event, arg):
                if event == "call" and frame.f_code.co_filename.startswith(package):
                    path = frame.f_code.co_filename[len(package):]
                    calls[(path, frame.f_code.co_qualname)] += 1

            run, seen = decoder.step.run, [0]

            def traced(*args, **kwargs):  # the measuring instrument: the block itself is left as it is
                seen[0] += 1
                if not tracing[0] or seen[0] != TRACED_BLOCK:
                    return run(*args, **kwargs)
                sys.setprofile(profiler)
                try:
                    return run(*args, **kwargs)
                finally:
                    sys.setprofile(None)

            tracing = [False]
            decoder.step.run = traced
            decoder.generate(list(sample.images), list(sample.turns))  # warm-up: compiles every shape
            tracing[0], seen[0] = True, 0
            decoder.generate(list(sample.images), list(sample.turns))
            if not calls:
                print(f"{drafter}, {mode}: the turn had fewer than {TRACED_BLOCK} blocks; nothing traced")
                continue
            files = collections.Counter(path for path, _ in calls)
            print(f"{drafter}, {mode}: one block calls {len(calls)} product functions in {len(files)} files")
            for path, count in files.most_common():
                names = sorted(name for p, name in calls if p == path)
                print(f"  {path} ({count}): {', '.join(names)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="m", help="drafters of the demo profile")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--lines", action="store_true", help="print every line counted as a branch")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    static_figures(args.lines)
    traced_block(args.drafters.split(","), args.modes.split(","))


if __name__ == "__main__":
    main()
