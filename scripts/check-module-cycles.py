#!/usr/bin/env python3
"""Fails when the modules of a crate depend on each other in a cycle.

    scripts/check-module-cycles.py [SRC_DIR ...]    default: idem-runtime/src

A module is a top-level folder or file under SRC_DIR (`consume/` and
`consume/pull.rs` are both `consume`). Module A depends on B when a line of A
names a path `crate::B...`, in a `use` or inline, or a name that `lib.rs`
re-exports from B (`crate::Error` is `error`'s). Inside a folder the same rule
holds one level down (`crate::consume::pull`, `super::pull`), so the files of
a folder cannot form a cycle either. Comments and `#[cfg(test)]` modules
(at the end of a file, or in files of their own) are skipped: a unit test
may build what it tests from the parts above it.

For idem-runtime it also checks the layers below: a module imports only
modules of lower layers, so a low-level module cannot reach up even without
a cycle. A new top-level module must be given its layer here.

With --graph, prints the top-level dependency edges instead.
"""

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


# idem-runtime's top-level modules, bottom layer first (see ARCHITECTURE.md).
LAYERS = [
    ["codec", "message_id", "tasks", "guide"],  # leaves: bytes, ids, task lifetimes, the guide (docs only)
    ["error"],  # what went wrong, and its class
    ["observe", "store"],  # counters and metrics; everything that speaks SQL
    ["handler", "retention"],  # what a handler is; how long claims are kept
    ["route", "fault"],  # where messages come from; test-only fault hooks
    ["reply", "dead_letter", "outbox"],  # the features around a message
    ["consume"],  # the path of one message
    ["status"],  # what operators read
    ["router"],  # start-up, running, shutdown
]


def strip_comments(text):
    tests = re.search(r"^#\[cfg\(test\)\]\s*\n\s*mod \w+ \{", text, flags=re.M)
    if tests:
        text = text[: tests.start()]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        # A `//` inside a string literal is rare in this code base; good enough.
        cut = line.find("//")
        lines.append(line if cut < 0 else line[:cut])
    return "\n".join(lines)


def paths_after(text, prefix):
    """Every path that follows `prefix::`, with `{a, b::c}` groups expanded."""
    out = []
    for m in re.finditer(r"\b" + prefix + r"::", text):
        out.extend(expand(text, m.end()))
    return out


def expand(text, i):
    """Expands the path tree starting at text[i] into lists of segments."""
    segs = []
    while True:
        m = re.match(r"\s*(" + IDENT + r")\s*", text[i:])
        if m:
            segs.append(m.group(1))
            i += m.end()
            if text.startswith("::", i):
                i += 2
                continue
            return [segs]
        m = re.match(r"\s*\{", text[i:])
        if not m:
            return [segs] if segs else []
        i += m.end()
        depth, start, parts = 1, i, []
        while depth:
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            if (c == "," and depth == 1) or depth == 0:
                parts.append(text[start:i])
                start = i + 1
            i += 1
        out = []
        for part in parts:
            for sub in expand(part, 0):
                out.append(segs + sub)
        return out or [segs]


def module_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    return rel.parts


def root_reexports(src, modules):
    """Maps each name lib.rs re-exports from a module to that module."""
    lib = strip_comments((src / "lib.rs").read_text())
    names = {}
    for m in re.finditer(r"pub\s+use\s+", lib):
        for segs in expand(lib, m.end()):
            if segs and segs[0] == "crate":
                segs = segs[1:]
            if len(segs) >= 2 and segs[0] in modules:
                names[segs[-1]] = segs[0]
    return names


def find_cycle(graph):
    """One cycle in `graph` as a list of nodes, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_only_files(src, files):
    """The files of modules declared under `#[cfg(test)]` (`mod tests;`)."""
    out = set()
    for path in files:
        text = path.read_text()
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\(crate\))?\s+)?mod\s+(\w+)\s*;", text):
            folder = path.parent if path.name in ("mod.rs", "lib.rs") else path.with_suffix("")
            out.add(folder / f"{m.group(1)}.rs")
            out.add(folder / m.group(1) / "mod.rs")
    return out


def check(src, show_graph):
    files = sorted(p for p in src.rglob("*.rs"))
    skipped = test_only_files(src, files)
    files = [p for p in files if p not in skipped]
    modules = {module_of(src, p)[0] for p in files if p.name != "lib.rs"}
    modules.discard("main")
    exports = root_reexports(src, modules)
    top, inner = {}, {}
    for path in files:
        parts = module_of(src, path)
        if parts == ("lib",):
            continue
        if parts[-1] == "mod":
            parts = parts[:-1]
        me = parts[0]
        text = strip_comments(path.read_text())
        for segs in paths_after(text, "crate"):
            if not segs:
                continue
            target = segs[0] if segs[0] in modules else exports.get(segs[0])
            if target and target != me:
                top.setdefault(me, set()).add(target)
            if target == me and len(parts) >= 2 and len(segs) >= 2:
                folder_edge(inner, me, parts[1], segs[1])
        if len(parts) >= 2:
            for segs in paths_after(text, "super"):
                if segs and not segs[0] == "super":
                    folder_edge(inner, me, parts[1], segs[0])
    if show_graph:
        for a in sorted(top):
            print(f"{a} -> {', '.join(sorted(top[a]))}")
        return 0
    failed = 0
    if src.parent.name == "idem-runtime":
        failed |= check_layers(src, modules, top)
    cycle = find_cycle(top)
    if cycle:
        print(f"{src}: module cycle: {' -> '.join(cycle)}")
        failed = 1
    for folder, graph in sorted(inner.items()):
        cycle = find_cycle(graph)
        if cycle:
            print(f"{src}/{folder}: file cycle: {' -> '.join(cycle)}")
            failed = 1
    return failed


def check_layers(src, modules, top):
    layer = {m: i for i, names in enumerate(LAYERS) for m in names}
    failed = 0
    for m in sorted(modules - set(layer)):
        print(f"{src}: module `{m}` has no layer; add it to LAYERS in {sys.argv[0]}")
        failed = 1
    for a in sorted(top):
        for b in sorted(top[a]):
            if a in layer and b in layer and layer[b] >= layer[a]:
                print(f"{src}: `{a}` (layer {layer[a]}) imports `{b}` (layer {layer[b]}), which is not below it")
                failed = 1
    return failed


def folder_edge(inner, folder, me, target):
    if me != target and target[0].islower():
        files = inner.setdefault(folder, {})
        files.setdefault(me, set()).add(target)


def main(argv):
    show_graph = "--graph" in argv
    dirs = [a for a in argv if a != "--graph"] or ["idem-runtime/src"]
    failed = 0
    for d in dirs:
        failed |= check(Path(d), show_graph)
    if not failed and not show_graph:
        print("no module cycles in " + ", ".join(dirs))
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
