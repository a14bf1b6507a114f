"""Synthetic scenes of coloured shapes on a 3x3 grid, scene pairs and five-frame stories.

Everything here is deterministic: a scene, a change or a story depends only on the
``random.Random`` passed in (or the integer seed it is built from), never on global state.

Vocabulary (the only words the answers in :mod:`mmspec_cli.demo.tasks` use for facts):

- colours: red, green, blue, yellow, purple, orange (RGB values far apart, see ``COLOURS``)
- kinds: circle, square, triangle, cross
- sizes: small (about half a grid cell), large (most of a grid cell)
- positions: a 3x3 grid of cells numbered 0..8 in reading order, named
  top left, top middle, top right, middle left, center, middle right,
  bottom left, bottom middle, bottom right

A scene holds one to four shapes, at most one per cell. Shapes are kept in reading order
(cell 0 first), which is also the order every description lists them in.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 25, 35),
    "green": (20, 160, 50),
    "blue": (30, 70, 230),
    "yellow": (240, 220, 0),
    "purple": (140, 40, 180),
    "orange": (255, 125, 0),
}
KINDS: tuple[str, ...] = ("circle", "square", "triangle", "cross")
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
SIZES: tuple[str, ...] = ("small", "large")
ROWS: tuple[str, ...] = ("top", "middle", "bottom")
COLUMNS: tuple[str, ...] = ("left", "middle", "right")
POSITIONS: tuple[str, ...] = (
    "top left", "top middle", "top right",
    "middle left", "center", "middle right",
    "bottom left", "bottom middle", "bottom right",
)
BACKGROUND = (255, 255, 255)
MAX_SHAPES = 4
_DIRECTIONS = {(-1, 0): "up", (1, 0): "down", (0, -1): "left", (0, 1): "right"}
DISPLAY_SIZE = 192  # pixels: how suites, examples and training images are drawn (processors resize)
_SUPERSAMPLE = 4  # draw at 4x and box-filter down: clean edges at 48 px


def neighbours(cell: int) -> list[int]:
    """Cells sharing an edge with ``cell`` (up, down, left, right), in increasing order."""
    r, c = divmod(cell, 3)
    out = [(r + dr) * 3 + (c + dc) for dr, dc in ((-1, 0), (0, -1), (0, 1), (1, 0))
           if 0 <= r + dr < 3 and 0 <= c + dc < 3]
    return sorted(out)


def direction(a: int, b: int) -> str:
    """'up', 'down', 'left' or 'right' for a move between edge-sharing cells."""
    (ra, ca), (rb, cb) = divmod(a, 3), divmod(b, 3)
    return _DIRECTIONS[(rb - ra, cb - ca)]


def article(word: str) -> str:
    return "an" if word[0] in "aeio" else "a"


@dataclass(frozen=True)
class Shape:
    kind: str  # one of KINDS
    colour: str  # one of COLOURS
    size: str  # "small" | "large"
    cell: int  # 0..8, row-major

    def __post_init__(self):
        if self.kind not in KINDS or self.colour not in COLOURS or self.size not in SIZES or not 0 <= self.cell < 9:
            raise ValueError(f"invalid shape {self!r}")

    @property
    def row(self) -> int:
        return self.cell // 3

    @property
    def col(self) -> int:
        return self.cell % 3

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]

    def noun(self, size: bool = False) -> str:
        """'red circle' or, with ``size``, 'large red circle'."""
        return f"{self.size} {self.colour} {self.kind}" if size else f"{self.colour} {self.kind}"

    def indefinite(self, size: bool = True) -> str:
        """'a large red circle', 'an orange square'."""
        text = self.noun(size)
        return f"{article(text)} {text}"


@dataclass(frozen=True)
class Scene:
    """One to four shapes, at most one per cell, kept in reading order."""

    shapes: tuple[Shape, ...] = field(default_factory=tuple)

    def __post_init__(self):
        shapes = tuple(sorted(self.shapes, key=lambda s: s.cell))
        cells = [s.cell for s in shapes]
        if len(set(cells)) != len(cells):
            raise ValueError(f"two shapes in one cell: {shapes!r}")
        object.__setattr__(self, "shapes", shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def at(self, cell: int) -> Shape | None:
        for s in self.shapes:
            if s.cell == cell:
                return s
        return None

    def free_cells(self) -> list[int]:
        used = {s.cell for s in self.shapes}
        return [c for c in range(9) if c not in used]

    def select(self, colour: str | None = None, kind: str | None = None, size: str | None = None) -> list[Shape]:
        return [s for s in self.shapes
                if (colour is None or s.colour == colour) and (kind is None or s.kind == kind)
                and (size is None or s.size == size)]

    def count(self, colour: str | None = None, kind: str | None = None, size: str | None = None) -> int:
        return len(self.select(colour, kind, size))

    def without(self, shape: Shape) -> "Scene":
        return Scene(tuple(s for s in self.shapes if s != shape))

    def plus(self, shape: Shape) -> "Scene":
        return Scene(self.shapes + (shape,))

    def swap(self, old: Shape, new: Shape) -> "Scene":
        return Scene(tuple(new if s == old else s for s in self.shapes))


def refer(scene: Scene, shape: Shape) -> str:
    """The shortest unambiguous name of ``shape`` in ``scene``: 'the red circle', or with its position."""
    if scene.count(colour=shape.colour, kind=shape.kind) <= 1:
        return f"the {shape.noun()}"
    return f"the {shape.noun()} in the {shape.position}"


def random_shape(rng: random.Random, cell: int, others: Iterable[Shape] = ()) -> Shape:
    """A shape in ``cell``; now and then it repeats the colour or kind of one of ``others``."""
    others = list(others)
    colour = rng.choice(list(COLOURS))
    kind = rng.choice(KINDS)
    if others and rng.random() < 0.35:
        colour = rng.choice(others).colour
    if others and rng.random() < 0.3:
        kind = rng.choice(others).kind
    return Shape(kind, colour, rng.choice(SIZES), cell)


def random_scene(rng: random.Random | int, n: int | None = None) -> Scene:
    """A scene of ``n`` (default: 1-4, more often 2-3) shapes in distinct random cells."""
    if not isinstance(rng, random.Random):
        rng = random.Random(rng)
    if n is None:
        n = rng.choices((1, 2, 3, 4), weights=(15, 30, 30, 25))[0]
    if not 1 <= n <= MAX_SHAPES:
        raise ValueError(f"a scene holds 1 to {MAX_SHAPES} shapes, not {n}")
    shapes: list[Shape] = []
    for cell in rng.sample(range(9), n):
        shapes.append(random_shape(rng, cell, shapes))
    return Scene(tuple(shapes))


# --- rendering -----------------------------------------------------------------------------------

def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, cell_px: float) -> None:
    cx = (shape.col + 0.5) * cell_px
    cy = (shape.row + 0.5) * cell_px
    r = (0.44 if shape.size == "large" else 0.26) * cell_px  # half extent: large fills most of a cell
    fill = COLOURS[shape.colour]
    if shape.kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape.kind == "square":
        q = r * 0.9  # a little smaller so its area matches the circle's by eye
        draw.rectangle((cx - q, cy - q, cx + q, cy + q), fill=fill)
    elif shape.kind == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.85), (cx - r, cy + r * 0.85)], fill=fill)
    else:  # cross: a plus sign with arms a third of its width thick
        w = r * 0.36
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)


def render(scene: Scene, size: int = 48) -> Image.Image:
    """The scene as a ``size`` x ``size`` RGB image: white background, each grid cell size/3 px."""
    if size < 9:
        raise ValueError(f"image size must be at least 9 px, not {size}")
    big = size * _SUPERSAMPLE
    img = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for shape in scene.shapes:
        _draw_shape(draw, shape, big / 3)
    return img.resize((size, size), Image.Resampling.BOX)


# --- controlled changes (scene pairs) ------------------------------------------------------------

CHANGE_KINDS: tuple[str, ...] = ("move", "recolour", "remove", "add", "resize")


@dataclass(frozen=True)
class Change:
    """One edit between two scenes. ``before`` is None for 'add', ``after`` is None for 'remove'."""

    kind: str  # one of CHANGE_KINDS
    before: Shape | None
    after: Shape | None
    description: str  # e.g. "The red circle moved from the top left to the center."


def describe_change(kind: str, before: Shape | None, after: Shape | None, old: Scene, new: Scene) -> str:
    """A past-tense sentence for a change, naming shapes unambiguously in the scene they are in."""
    if kind == "move":
        return f"{refer(old, before).capitalize()} moved from the {before.position} to the {after.position}."
    if kind == "recolour":
        return f"{refer(old, before).capitalize()} changed colour from {before.colour} to {after.colour}."
    if kind == "remove":
        return f"{refer(old, before).capitalize()} was removed from the {before.position}."
    if kind == "add":
        return f"{after.indefinite().capitalize()} was added in the {after.position}."
    if kind == "resize":
        verb = "grew from small to large" if after.size == "large" else "shrank from large to small"
        return f"{refer(old, before).capitalize()} {verb}."
    raise ValueError(f"unknown change kind {kind!r}")


def possible_changes(scene: Scene, avoid: Collection[int] = ()) -> list[str]:
    """The change kinds that apply to ``scene`` without touching the cells in ``avoid``."""
    movable = [s for s in scene.shapes if s.cell not in avoid]
    free = [c for c in scene.free_cells() if c not in avoid]
    kinds = []
    if movable and free:
        kinds.append("move")
    if movable:
        kinds += ["recolour", "resize"]
    if len(movable) and len(scene) >= 2:
        kinds.append("remove")
    if free and len(scene) < MAX_SHAPES:
        kinds.append("add")
    return kinds


def change(scene: Scene, rng: random.Random, kind: str | None = None,
           avoid: Collection[int] = ()) -> tuple[Scene, Change]:
    """Apply one controlled change (moved, recoloured, removed, added or resized) to ``scene``.

    ``kind`` forces the change kind; otherwise one of those that apply is drawn. Shapes in the
    cells of ``avoid`` are left alone and no shape is moved or added there. The scene always
    keeps 1..4 shapes.
    """
    kinds = possible_changes(scene, avoid)
    if kind is None:
        if not kinds:
            raise ValueError("no change applies to this scene")
        kind = rng.choice(kinds)
    elif kind not in kinds:
        raise ValueError(f"a {kind!r} change does not apply to this scene")
    movable = [s for s in scene.shapes if s.cell not in avoid]
    free = [c for c in scene.free_cells() if c not in avoid]
    before = after = None
    if kind == "add":
        after = random_shape(rng, rng.choice(free), scene.shapes)
        new = scene.plus(after)
    else:
        before = rng.choice(movable)
        if kind == "remove":
            new = scene.without(before)
        else:
            if kind == "move":
                after = replace(before, cell=rng.choice(free))
            elif kind == "recolour":
                after = replace(before, colour=rng.choice([c for c in COLOURS if c != before.colour]))
            else:  # resize
                after = replace(before, size="small" if before.size == "large" else "large")
            new = scene.swap(before, after)
    return new, Change(kind, before, after, describe_change(kind, before, after, scene, new))


# --- five-frame stories --------------------------------------------------------------------------

STORY_THEMES: tuple[str, ...] = ("journey", "meeting", "recolour", "grow", "visitor")
STORY_FRAMES = 5


@dataclass(frozen=True)
class Story:
    """Five scenes of a protagonist shape acting among one or two bystanders, with per-frame captions.

    ``path`` is the protagonist's cell in each frame; ``events`` names what it did in each frame
    ('start', 'move', 'stay', 'recolour', 'grow', 'visitor').
    """

    theme: str
    frames: tuple[Scene, ...]
    captions: tuple[str, ...]
    protagonist: Shape  # as in frame 1
    path: tuple[int, ...]
    events: tuple[str, ...]
    friend: Shape | None = None  # the shape met ('meeting') or the newcomer ('visitor')

    def hero(self, frame: int) -> Shape:
        """The protagonist in frame ``frame`` (0-based)."""
        return next(s for s in self.frames[frame].shapes if s.kind == self.protagonist.kind)


def _walks(start: int, steps: int, blocked: Collection[int]) -> list[tuple[int, ...]]:
    """Every self-avoiding walk of ``steps`` edge moves from ``start`` avoiding ``blocked``."""
    out: list[tuple[int, ...]] = []

    def grow(path: tuple[int, ...]):
        if len(path) == steps + 1:
            out.append(path)
            return
        for nxt in neighbours(path[-1]):
            if nxt not in path and nxt not in blocked:
                grow(path + (nxt,))

    grow((start,))
    return out


def _story_path(theme: str, rng: random.Random, bystanders: list[Shape]) -> tuple[int, ...] | None:
    blocked = {s.cell for s in bystanders}
    moves = 4 if theme in ("journey", "meeting") else 3
    walks = [w for start in range(9) if start not in blocked for w in _walks(start, moves, blocked)]
    if theme == "meeting":
        friend = bystanders[0].cell
        near = set(neighbours(friend))
        walks = [w for w in walks if w[-1] in near and w[0] not in near]
    if theme == "visitor":  # the newcomer needs a free cell next to the protagonist's last cell
        walks = [w for w in walks if any(c not in blocked and c not in w for c in neighbours(w[-1]))]
    if not walks:
        return None
    walk = rng.choice(walks)
    return walk if len(walk) == STORY_FRAMES else walk + (walk[-1],)


def _at(shape: Shape, verb: str = "") -> str:
    """'a large red circle in the top left', or with ``verb`` 'a large red circle waits in the top left'."""
    return f"{shape.indefinite()}{verb} in the {shape.position}"


def _move_caption(rng: random.Random, name: str, a: int, b: int) -> str:
    d, pos = direction(a, b), POSITIONS[b]
    templates = (
        f"{name.capitalize()} moves {d} to the {pos}.",
        f"Then {name} slides {d} into the {pos}.",
        f"Next, {name} goes {d} to the {pos}.",
        f"{name.capitalize()} takes a step {d} and reaches the {pos}.",
    )
    return rng.choice(templates)


def make_story(rng: random.Random | int, theme: str | None = None) -> Story:
    """Five frames: the protagonist walks across cells, then meets a friend, changes colour, grows or gets a visitor."""
    if not isinstance(rng, random.Random):
        rng = random.Random(rng)
    theme = theme or rng.choice(STORY_THEMES)
    if theme not in STORY_THEMES:
        raise ValueError(f"unknown story theme {theme!r}")
    while True:  # a few themes need a layout with room; redraw until one fits (always quick)
        kind = rng.choice(KINDS)
        colour = rng.choice(list(COLOURS))
        size = "small" if theme == "grow" else rng.choice(SIZES)
        n_by = 1 if theme == "visitor" else rng.choice((1, 1, 2))  # 'meeting': the first one is the friend
        other_kinds = [k for k in KINDS if k != kind]
        bystanders: list[Shape] = []
        cells = rng.sample(range(9), n_by)
        for cell in cells:
            bystanders.append(Shape(rng.choice(other_kinds), rng.choice(list(COLOURS)), rng.choice(SIZES), cell))
        if len({(b.kind, b.colour) for b in bystanders}) < len(bystanders):
            continue
        path = _story_path(theme, rng, bystanders)
        if path is not None:
            break
    hero = Shape(kind, colour, size, path[0])
    name = f"the {hero.noun()}"
    frames: list[Scene] = []
    captions: list[str] = []
    events: list[str] = []
    friend = bystanders[0] if theme == "meeting" else None
    # frame 1: introduce everyone
    others = " and ".join(_at(b) for b in bystanders)
    first = _at(hero)
    intro = (
        f"{first.capitalize()} starts the story, and {others} is there too.",
        f"Our story begins with {first}; {_at(bystanders[0], ' waits')}.",
        f"{first.capitalize()} sits quietly, while {_at(bystanders[0], ' watches')}.",
    ) if len(bystanders) == 1 else (
        f"{first.capitalize()} starts the story, with {others}.",
        f"Our story begins with {first}; {others} are there as well.",
    )
    frames.append(Scene((hero, *bystanders)))
    captions.append(rng.choice(intro))
    events.append("start")
    current = hero
    for t in range(1, STORY_FRAMES):
        last = t == STORY_FRAMES - 1
        scene_extra: list[Shape] = []
        if path[t] != path[t - 1]:
            current = replace(current, cell=path[t])
            if last and theme == "meeting":
                caption = rng.choice((
                    f"Finally, {name} moves {direction(path[t - 1], path[t])} to the {current.position} "
                    f"and meets {refer(frames[0], friend)}.",
                    f"{name.capitalize()} steps {direction(path[t - 1], path[t])} into the {current.position}, "
                    f"right next to {refer(frames[0], friend)}, and the two friends meet.",
                ))
            elif last:
                caption = rng.choice((
                    f"{name.capitalize()} takes a last step {direction(path[t - 1], path[t])} to the "
                    f"{current.position} and its journey ends.",
                    f"Finally, {name} moves {direction(path[t - 1], path[t])} to the {current.position}, "
                    f"where its journey ends.",
                ))
            else:
                caption = _move_caption(rng, name, path[t - 1], path[t])
            events.append("move")
        elif theme == "recolour":
            used = {current.colour} | {b.colour for b in bystanders}
            new_colour = rng.choice([c for c in COLOURS if c not in used])
            caption = rng.choice((
                f"{name.capitalize()} stays in the {current.position} and turns {new_colour}.",
                f"Suddenly {name} changes colour and becomes {new_colour}, still in the {current.position}.",
            ))
            current = replace(current, colour=new_colour)
            events.append("recolour")
        elif theme == "grow":
            caption = rng.choice((
                f"{name.capitalize()} stays in the {current.position} and grows large.",
                f"Suddenly {name} grows from small to large, right there in the {current.position}.",
            ))
            current = replace(current, size="large")
            events.append("grow")
        else:  # visitor
            taken = set(path) | {b.cell for b in bystanders}
            cell = rng.choice([c for c in neighbours(current.cell) if c not in taken])
            used = {(b.kind, b.colour) for b in bystanders} | {(current.kind, current.colour)}
            while True:
                newcomer = Shape(rng.choice([k for k in KINDS if k != current.kind]), rng.choice(list(COLOURS)),
                                 rng.choice(SIZES), cell)
                if (newcomer.kind, newcomer.colour) not in used:
                    break
            friend = newcomer
            scene_extra.append(newcomer)
            caption = rng.choice((
                f"{newcomer.indefinite().capitalize()} appears in the {newcomer.position} to visit {name}.",
                f"A visitor arrives: {newcomer.indefinite()} shows up in the {newcomer.position}, right next to {name}.",
            ))
            events.append("visitor")
        frames.append(Scene((current, *bystanders, *scene_extra)))
        captions.append(caption)
    return Story(theme, tuple(frames), tuple(captions), hero, path, tuple(events), friend)
