"""Files the CLI tests share: tiny-model profiles and saved test images."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests import tiny


def write_profile(path: Path, target: str, draft: str, **decoding) -> str:
    """A float64 CPU profile for the tiny ``target``/``draft`` directories; ``decoding`` keys as given."""
    spec = {"dtype": "float64", "device": "cpu"}
    data = {"target": {"model": target, **spec}, "draft": {"model": draft, **spec}, "decoding": decoding}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def save_images(root: Path, n: int) -> list[str]:
    """``tiny.images(n)`` saved as root/img0.png, root/img1.png, ...; their paths."""
    paths = []
    for i, image in enumerate(tiny.images(n)):
        paths.append(str(root / f"img{i}.png"))
        image.save(paths[-1])
    return paths


def assert_one_line_error(result, fragment: str, code: int = 2, stdout_allowed: bool = False,
                          loading_bars: bool = True) -> str:
    """Exit ``code`` and one ``error:`` line on stderr holding ``fragment``, last on stderr, with no traceback and
    no rich box; the line. ``stdout_allowed``: a command that printed results before failing may have stdout.
    ``loading_bars``: transformers' "Loading weights" progress lines may come before it. ``warning:`` lines
    (such as profile-latency's note on a busy machine) may come before it too."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    if not stdout_allowed:
        assert result.stdout == ""
    [line] = [line for line in result.stderr.splitlines()  # a "warning:" (a busy machine) may come first
              if line and not line.startswith("warning: ") and not (loading_bars and line.startswith("Loading weights"))]
    assert line.startswith("error: ") and fragment in line, line
    assert result.stderr.endswith(line + "\n")
    assert "Traceback" not in result.stderr and "╭" not in result.stderr
    return line
