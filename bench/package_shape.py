"""The package's shape as a newcomer checks it: modules at the root of eagle3_assets, the rooms (top-level packages
and modules) and the imports between them, the floors (the longest chain of rooms each importing the next), the
circles, and which root modules each asset module reaches. `python bench/package_shape.py [SRC_DIR]` (default: this
checkout) prints JSON; run it on an older checkout (git worktree) to compare."""

import json
import sys
from pathlib import Path

import grimp

PKG = "eagle3_assets"
SHARED_OR_WORKER = {"worker", "common", "stages"}


def shape(src: Path) -> dict:
    sys.path.insert(0, str(src))
    graph = grimp.build_graph(PKG, cache_dir=None)
    sys.path.pop(0)
    root = sorted(p.stem for p in (src / PKG).glob("*.py"))
    rooms = sorted({m.split(".")[1] for m in graph.modules if m.count(".") >= 1})
    room = {r: f"{PKG}.{r}" for r in rooms}
    arrows = set()
    for a in rooms:
        for b in rooms:
            if a != b and graph.direct_import_exists(importer=room[a], imported=room[b], as_packages=True):
                arrows.add((a, b))
    # circles: rooms that reach each other; floors: the longest chain over the rest
    reach = {r: {b for a, b in arrows if a == r} for r in rooms}
    changed = True
    while changed:
        changed = False
        for r in rooms:
            more = set().union(*(reach[x] for x in reach[r])) - reach[r] if reach[r] else set()
            if more:
                reach[r] |= more
                changed = True
    circles = sorted({tuple(sorted({r} | {x for x in reach[r] if r in reach[x]})) for r in rooms if r in reach[r]})
    floor: dict[str, int] = {}

    def depth(r, seen=()):
        if r in floor:
            return floor[r]
        below = [b for a, b in arrows if a == r and b not in seen and r not in reach.get(b, set())]
        floor[r] = 1 + max((depth(b, seen + (r,)) for b in below), default=0)
        return floor[r]

    floors = max(depth(r) for r in rooms)
    control_root = [m for m in root if m != "__init__"]
    asset_modules = sorted(m for m in graph.modules if any("@dg.asset" in line or "@dg.multi_asset" in line
                           for line in _source(src, m)))
    walks = {}
    for m in asset_modules:
        reached = graph.find_upstream_modules(m) | {m}
        walks[m.removeprefix(PKG + ".")] = sorted(r for r in control_root if f"{PKG}.{r}" in reached)
    return {"root_modules": len(root), "root": root, "rooms": len(rooms), "arrows": len(arrows),
            "floors": floors, "circles": circles, "asset_modules_reach_root": walks}


def _source(src: Path, module: str) -> list[str]:
    path = src / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = src / module.replace(".", "/") / "__init__.py"
    return path.read_text().splitlines() if path.exists() else []


if __name__ == "__main__":
    print(json.dumps(shape(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])), indent=1))
