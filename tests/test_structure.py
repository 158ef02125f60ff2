"""The package's rooms and floors, read from the code's own imports (every `import scalelm...`, at module level and
inside functions): a room is the first level under scalelm (`train`, `measure`, ...; a top-level module is a room
of its own: `config`, `site`, ...). The rooms form no circle, nor do the modules inside a room, and every import goes
to the same or a lower floor but for the one arrow listed in `UPWARD`."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "scalelm"
# bottom to top: a room imports from its own floor and those below. A new room must be placed here.
FLOORS = [
    ["errors", "seeds", "files", "settings_yaml"],
    ["config", "version"],
    ["model", "optim"],
    ["parallel"],
    ["data", "launch", "cli", "site"],
    ["plan"],
    ["measure", "hang"],
    ["train"],
    ["report", "selftest"],
    ["study"],
    ["__main__"],
]
# an import allowed to point up, and why (none: what one needed moved down)
UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Arrow:
    module: str  # the importing module, scalelm.x.y
    line: int
    target: str  # the imported module (or the package a name is taken from)

    @property
    def source_room(self) -> str:
        return room_of(self.module)

    @property
    def target_room(self) -> str:
        return room_of(self.target)

    def __str__(self) -> str:
        return f"{self.module} (line {self.line}) imports {self.target}"


def room_of(module: str) -> str:
    return module.split(".")[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether `name` (scalelm.x.y) is a module or package of the source tree."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The scalelm modules an import statement of `module` reads: `from scalelm.a import b` reads scalelm.a.b where
    that is a module, else scalelm.a; relative imports are resolved against `module`'s package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")[: None if is_package else -1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]


def arrows(across_rooms: bool = True) -> list[Arrow]:
    """Every import of a scalelm module by another room's module (the package's root, which only holds the version,
    is no room); with `across_rooms` False, those inside one room instead."""
    found: dict[Arrow, None] = {}  # one arrow per imported module, though a statement names several of its names
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported(node, module, path.name == "__init__.py"):
                if target.split(".")[0] != "scalelm" or target == "scalelm" or module == "scalelm":
                    continue
                arrow = Arrow(module, node.lineno, target)
                if (arrow.source_room != arrow.target_room) == across_rooms and arrow.module != arrow.target:
                    found[arrow] = None
    return list(found)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as its rooms in order (the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for after in sorted(edges.get(node, ())):
            if state.get(after) == "open":
                return [*path[path.index(after) :], after]
            if after not in state and (cycle := visit(after)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def refuse_circles(found: list[Arrow], ends, what: str) -> None:
    """Fail naming a circle of the graph whose edges are `ends(arrow)` of the `found` arrows, and its imports."""
    edges: dict[str, set[str]] = {}
    for arrow in found:
        source, target = ends(arrow)
        edges.setdefault(source, set()).add(target)
    cycle = find_cycle(edges)
    if cycle:
        steps = set(zip(cycle, cycle[1:]))
        imports = [str(a) for a in found if ends(a) in steps]
        raise AssertionError(f"the {what} import in a circle: {' -> '.join(cycle)}, by\n  " + "\n  ".join(imports))


def test_the_cycle_finder_names_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_root_imports_nothing_of_scalelm():
    """Imports of `scalelm` itself (its version) are left out of the rooms' arrows: sound only while the root
    imports nothing of the package."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_every_room_has_a_floor():
    rooms = {room_of(module_name(path)) for path in PACKAGE.rglob("*.py") if module_name(path) != "scalelm"}
    placed = [room for floor in FLOORS for room in floor]
    assert len(placed) == len(set(placed)), "a room placed on two floors"
    assert not rooms - set(placed), f"rooms without a floor (place them in FLOORS): {sorted(rooms - set(placed))}"
    assert not set(placed) - rooms, f"floors name rooms that do not exist: {sorted(set(placed) - rooms)}"


def test_the_rooms_form_no_circle():
    """Without the allowed arrow up (a late import, which closes a circle with the arrows down by design)."""
    found = [arrow for arrow in arrows() if (arrow.module, arrow.target) not in UPWARD]
    refuse_circles(found, lambda arrow: (arrow.source_room, arrow.target_room), "rooms")


def test_the_modules_inside_a_room_form_no_circle():
    """A circle inside a room (train: consolidate -> engine -> evaluation -> consolidate, once, closed by an import
    inside a function) is as much a tangle as one between rooms: each module of it needs the others to be read."""
    refuse_circles(arrows(across_rooms=False), lambda arrow: (arrow.module, arrow.target), "modules")


def test_every_import_goes_to_the_same_or_a_lower_floor_but_one():
    assert len(UPWARD) <= 1, "one arrow up at most: move what it needs down instead"
    floor = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
    upward = [a for a in arrows() if floor.get(a.target_room, -1) > floor.get(a.source_room, len(FLOORS))]
    unlisted = [
        f"{arrow}: {arrow.source_room} (floor {floor[arrow.source_room]}) -> {arrow.target_room} "
        f"(floor {floor[arrow.target_room]})"
        for arrow in upward
        if (arrow.module, arrow.target) not in UPWARD
    ]
    assert not unlisted, "imports that point up:\n  " + "\n  ".join(unlisted)
    still_there = {(arrow.module, arrow.target) for arrow in upward}
    assert set(UPWARD) <= still_there, (
        f"an allowed upward arrow is gone, drop it from UPWARD: {set(UPWARD) - still_there}"
    )
