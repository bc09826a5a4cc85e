"""The layering contract of llmgw, read from the source with ``ast`` (nothing is imported):

- the pure core (llmgw/route, fleet, kv, admin, sim, http1, lifecycle, inputs, tenants) imports no I/O, concurrency or OS
  module and nothing of the shell (llmgw.daemon) or of the commands (tui, cli), neither at the top
  nor inside functions — and neither does anything of llmgw that the core imports, transitively
  (importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too, so those count);
- the core, and what it imports, reads no clock and draws no randomness of its own: a clock or an
  rng comes in as a parameter (a default argument value such as ``timer=time.perf_counter_ns``
  counts), and a ``random.Random(seed)`` may be built from an argument;
- only llmgw/tui/ imports textual, and the console imports nothing of the command line (llmgw.cli):
  what it shares with `ctl` lives in llmgw/admin_client/;
- no module of llmgw/ finds another by name (``importlib``, ``__import__``): every dependency is an
  import statement, which these rules see;
- the modules of llmgw/ import each other without cycles, counting imports inside functions and
  under ``if TYPE_CHECKING:`` too, and so do its folders (each folder's parts, taken as units).

Every failure names the file:line and the statement at fault."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llmgw"
CORE = ("route", "fleet", "kv", "admin", "sim", "http1", "lifecycle", "inputs", "tenants")  # folders of llmgw/ that are the pure core

# What the core may not import (these modules and everything under them).
CORE_MAY_NOT_IMPORT = (
    "trio", "socket", "sqlite3", "zmq", "httpx", "subprocess", "asyncio", "threading", "select", "os",
    "signal", "urllib.request", "llmgw.daemon", "llmgw.tui", "llmgw.cli", "llmgw.admin_client",
)
# Modules the core reaches that may break the rules above, each with why and until when.
KNOWN_IMPURE: dict[str, str] = {}  # module -> why the core may reach it anyway (none: keep it so)
TEXTUAL_HOME = "llmgw.tui"  # the only package that may import textual

# Calls that read the clock (or wait on it) or draw from the OS's randomness.
CLOCK = frozenset({
    "time.time", "time.time_ns", "time.monotonic", "time.monotonic_ns", "time.perf_counter",
    "time.perf_counter_ns", "time.process_time", "time.process_time_ns", "time.thread_time",
    "time.thread_time_ns", "time.clock_gettime", "time.clock_gettime_ns", "time.sleep",
    "datetime.datetime.now", "datetime.datetime.utcnow", "datetime.datetime.today", "datetime.date.today",
    "os.urandom", "os.getrandom", "uuid.uuid1", "uuid.uuid4",
})
# These read the clock only when not given a time: time.localtime() does, time.localtime(t) does not.
CLOCK_WITHOUT_ARGS = {"time.localtime": 1, "time.gmtime": 1, "time.ctime": 1, "time.asctime": 1, "time.strftime": 2}
# Every function of these modules draws randomness of its own, except a seeded random.Random(seed).
RANDOM_MODULES = ("random", "secrets")

# Import cycles being removed (issue 11). Each is allowed, or any part of it, until the list is
# emptied; any other cycle fails. Both close only through `if TYPE_CHECKING:` imports today.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()  # none left; a new one fails the test


@dataclass(frozen=True, slots=True)
class Import:
    targets: tuple[str, ...]  # absolute dotted names: the module, and module.name for each `from m import name`
    line: int
    text: str  # the statement, as written back by ast.unparse
    top_level: bool  # runs when the module is imported (not inside a function)
    type_only: bool  # inside `if TYPE_CHECKING:`


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: str  # relative to the repository, for messages
    tree: ast.Module
    imports: tuple[Import, ...]

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, is_package: bool, tree: ast.Module) -> Iterator[Import]:
    def visit(body: list[ast.stmt], top: bool, type_only: bool) -> Iterator[Import]:
        for node in body:
            if isinstance(node, ast.Import):
                yield Import(tuple(a.name for a in node.names), node.lineno, ast.unparse(node), top, type_only)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node)
                targets = (base, *(f"{base}.{a.name}" for a in node.names if a.name != "*"))
                yield Import(targets, node.lineno, ast.unparse(node), top, type_only)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from visit(node.body, top, True)
                yield from visit(node.orelse, top, type_only)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from visit(node.body, False, type_only)
            else:  # class bodies, if/try/with/for/match blocks: walk their statements too
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(node, field, ()):
                        if isinstance(child, ast.ExceptHandler | ast.match_case):
                            yield from visit(child.body, top, type_only)
                        elif isinstance(child, ast.stmt):
                            yield from visit([child], top, type_only)

    yield from visit(tree.body, True, False)


@functools.cache
def modules() -> dict[str, Module]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports = tuple(_imports(name, path.name == "__init__.py", tree))
        out[name] = Module(name, path.relative_to(ROOT).as_posix(), tree, imports)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def core_modules() -> list[Module]:
    return [m for m in modules().values() if any(_under(m.name, f"{PACKAGE}.{c}") for c in CORE)]


def _parents(name: str) -> Iterator[str]:
    """The packages whose __init__ runs when ``name`` is imported."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


@functools.cache
def core_closure() -> dict[str, tuple[str, ...]]:
    """Every module of llmgw that runs when the core is imported or called: the core, and what it
    imports (at the top or inside functions, not under TYPE_CHECKING), transitively, with the
    packages around each. Module → the chain of imports that reaches it from the core."""
    mods = modules()
    graph = import_graph(with_type_only=False, in_functions=True)
    reach = {m.name: (m.name,) for m in core_modules()}
    todo = list(reach)
    while todo:
        name = todo.pop()
        for nxt in [*graph.get(name, {}), *_parents(name)]:
            if nxt in mods and nxt not in reach:
                reach[nxt] = (*reach[name], nxt)
                todo.append(nxt)
    return reach


def checked_modules() -> list[Module]:
    mods = modules()
    return [mods[n] for n in sorted(core_closure()) if n not in KNOWN_IMPURE]


def _via(name: str) -> str:
    chain = core_closure()[name]
    return "" if len(chain) == 1 else f" (reached from the core: {' → '.join(chain)})"


# -- imports ----------------------------------------------------------------------------------------------
def test_the_core_is_where_the_contract_looks() -> None:
    names = {m.name for m in core_modules()}
    for folder in CORE:
        assert f"{PACKAGE}.{folder}" in names, f"llmgw/{folder}/ has no __init__.py: is it still the core?"
    assert len(names) > 40


def test_the_core_imports_no_io_concurrency_or_shell() -> None:
    bad = []
    for m in checked_modules():
        for imp in m.imports:
            hits = sorted({f for t in imp.targets for f in CORE_MAY_NOT_IMPORT if _under(t, f)})
            if hits and not imp.type_only:
                bad.append(f"{m.where(imp.line)}: `{imp.text}` imports {', '.join(hits)}{_via(m.name)}")
    assert not bad, "the pure core (or what it imports) imports what it must not:\n" + "\n".join(bad)


def test_what_the_core_imports_is_counted() -> None:
    """The closure reaches past the core: the config it reads, and the packages around it."""
    reach = core_closure()
    assert {"llmgw.config", "llmgw.config.schema", "llmgw.config.names", "llmgw.config.fields"} <= set(reach)
    assert not [n for n in reach if _under(n, "llmgw.daemon") or _under(n, "llmgw.cli") or _under(n, "llmgw.tui")]
    assert set(KNOWN_IMPURE) <= set(reach), "a known exception the core no longer reaches: drop it from KNOWN_IMPURE"


def test_no_module_is_found_by_name() -> None:
    bad = []
    for m in modules().values():
        bad += [f"{m.where(imp.line)}: `{imp.text}`" for imp in m.imports
                if any(_under(t, "importlib") for t in imp.targets)]
        bad += [f"{m.where(node.lineno)}: `{ast.unparse(node)}`" for node in ast.walk(m.tree)
                if isinstance(node, ast.Name) and node.id == "__import__"]
    assert not bad, "import what you use, by an import statement (the contract cannot follow a name):\n" + "\n".join(bad)


def test_only_the_console_imports_textual() -> None:
    bad = [f"{m.where(imp.line)}: `{imp.text}`" for m in modules().values() if not _under(m.name, TEXTUAL_HOME)
           for imp in m.imports if any(_under(t, "textual") for t in imp.targets)]
    assert not bad, f"only {TEXTUAL_HOME} may import textual:\n" + "\n".join(bad)


def test_the_console_imports_nothing_of_the_command_line() -> None:
    bad = [f"{m.where(imp.line)}: `{imp.text}`" for m in modules().values() if _under(m.name, TEXTUAL_HOME)
           for imp in m.imports if any(_under(t, f"{PACKAGE}.cli") for t in imp.targets)]
    assert not bad, "the console shares with ctl through llmgw.admin_client, never llmgw.cli:\n" + "\n".join(bad)


# -- clocks and randomness --------------------------------------------------------------------------------
def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name → the absolute name it was imported as, over the whole module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _qualified(node: ast.expr, aliases: dict[str, str]) -> str | None:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(attrs)])
    return None


def _draws(name: str) -> bool:
    """A clock or randomness of the process's own (referenced or called)."""
    return name in CLOCK or (any(_under(name, r) for r in RANDOM_MODULES) and name != "random.Random"
                             and name.count(".") == 1)


def clock_and_random_uses(m: Module) -> Iterator[tuple[int, str]]:
    """(line, what) for each clock read or random draw the module makes itself: a call of one, or
    a reference kept for later (``_now = time.time``). A reference as a parameter's default value
    is an injection and allowed, and so is ``random.Random(seed)`` with a seed."""
    aliases = _aliases(m.tree)
    injected: set[int] = set()
    for node in ast.walk(m.tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for default in (*node.args.defaults, *node.args.kw_defaults):
                if default is not None and not isinstance(default, ast.Call):
                    injected.update(id(n) for n in ast.walk(default))
    called: set[int] = set()
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Call) and (name := _qualified(node.func, aliases)):
            called.add(id(node.func))
            if _draws(name) or (len(node.args) < CLOCK_WITHOUT_ARGS.get(name, 0) and not node.keywords):
                yield node.lineno, f"{ast.unparse(node)} reads the clock or draws randomness"
            elif name in ("random.Random", "random.SystemRandom") and not (node.args or node.keywords):
                yield node.lineno, f"{ast.unparse(node)} is an rng seeded by the OS"
    for node in ast.walk(m.tree):
        if (isinstance(node, ast.Attribute | ast.Name) and id(node) not in called and id(node) not in injected
                and isinstance(node.ctx, ast.Load) and (name := _qualified(node, aliases)) and _draws(name)):
            yield node.lineno, f"{ast.unparse(node)} is kept to be called later, not passed in"


def test_the_core_reads_no_clock_and_draws_no_randomness_of_its_own() -> None:
    bad = [f"{m.where(line)}: {what}{_via(m.name)}" for m in checked_modules() for line, what in clock_and_random_uses(m)]
    assert not bad, ("the pure core must take clocks and rngs as parameters (a default argument value is "
                     "fine: timer=time.perf_counter_ns, rng: random.Random):\n" + "\n".join(sorted(set(bad))))


def test_the_clock_rule_sees_what_it_should() -> None:
    """The rule itself, on a made-up module: calls and kept references fail, injections pass."""
    src = '''
import time, random, secrets
from datetime import datetime as dt
from time import monotonic
NOW = time.time()
_clock = time.perf_counter
def f(timer=time.perf_counter_ns, rng: random.Random | None = None, seed: int = 0, pick=secrets.choice):
    r = random.Random(seed)
    t = time.localtime(timer())
    return dt.now(), monotonic(), random.choice("ab"), random.Random(), time.strftime("%H")
'''
    tree = ast.parse(src)
    m = Module("x", "x.py", tree, ())
    found = sorted((line, what.split(" ")[0]) for line, what in clock_and_random_uses(m))
    assert found == [(5, "time.time()"), (6, "time.perf_counter"), (10, "dt.now()"), (10, "monotonic()"),
                     (10, "random.Random()"), (10, "random.choice('ab')"), (10, "time.strftime('%H')")]


# -- cycles -----------------------------------------------------------------------------------------------
def import_graph(with_type_only: bool, in_functions: bool = True) -> dict[str, dict[str, Import]]:
    """module → {imported module → the first statement importing it}, over the imports that run when
    a module is imported or its functions are called (only at the top without ``in_functions``; plus,
    with ``with_type_only``, those under ``if TYPE_CHECKING:``). ``from p import x`` is an edge to
    p.x when that is a module, else to p."""
    mods = modules()
    graph: dict[str, dict[str, Import]] = {}
    for m in mods.values():
        edges = graph.setdefault(m.name, {})
        for imp in m.imports:
            if (not imp.top_level and not in_functions) or (imp.type_only and not with_type_only):
                continue
            base, *names = imp.targets
            found = [t for t in names if t in mods] if names else [t for t in imp.targets if t in mods]
            if names and len(found) < len(names) and base in mods:
                found.append(base)
            for t in found:
                if t != m.name:
                    edges.setdefault(t, imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _a_cycle(graph: dict[str, dict[str, Import]], comp: list[str]) -> list[str]:
    """One cycle through the component's first module, as the path of modules (first repeated)."""
    start, members = comp[0], set(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                return [*paths[node], start]
            if child in members and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"{comp} is not a cycle")


def describe_cycle(graph: dict[str, dict[str, Import]], comp: list[str]) -> str:
    path = _a_cycle(graph, comp)
    mods = modules()
    steps = [f"  {mods[a].where(graph[a][b].line)}: `{graph[a][b].text}`"
             + ("  (under TYPE_CHECKING)" if graph[a][b].type_only else "") for a, b in zip(path, path[1:])]
    return f"{' → '.join(path)}\n" + "\n".join(steps)


@pytest.mark.parametrize("with_type_only", [False, True], ids=["runtime", "with-type-checking"])
def test_no_import_cycles(with_type_only: bool) -> None:
    graph = import_graph(with_type_only)
    new = [c for c in strongly_connected(graph) if not any(set(c) <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles among llmgw's modules:\n" + "\n".join(describe_cycle(graph, c) for c in new)


def folder_graphs(graph: dict[str, dict[str, Import]]) -> dict[str, dict[str, dict[str, Import]]]:
    """For each package P: its parts (each module or folder right under P, a folder standing for all
    below it) → {the parts it imports → the first statement}, from the module graph."""
    packages = {".".join(n.split(".")[:-1]) for n in graph} | {n for n in graph if (ROOT / n.replace(".", "/")).is_dir()}
    out: dict[str, dict[str, dict[str, Import]]] = {}
    for pkg in sorted(p for p in packages if p):
        def part(name: str) -> str | None:
            if not _under(name, pkg) or name == pkg:
                return None
            return ".".join(name.split(".")[: pkg.count(".") + 2])
        parts: dict[str, dict[str, Import]] = {}
        for a, edges in graph.items():
            pa = part(a)
            if pa is None:
                continue
            parts.setdefault(pa, {})
            for b, imp in edges.items():
                pb = part(b)
                if pb is not None and pb != pa:
                    parts[pa].setdefault(pb, imp)
        out[pkg] = parts
    return out


def test_no_folder_cycles() -> None:
    """A folder's parts import each other without cycles (route/ and config/ under llmgw/, control/
    and router/ under llmgw/daemon/, ...), imports inside functions and under TYPE_CHECKING counted."""
    bad = []
    for pkg, parts in folder_graphs(import_graph(with_type_only=True)).items():
        for comp in strongly_connected(parts):
            bad.append(f"in {pkg}: " + " → ".join(_a_cycle(parts, comp)))
    assert not bad, "import cycles among llmgw's folders:\n" + "\n".join(bad)


def test_the_cycle_finder_on_a_made_up_graph() -> None:
    imp = Import(("x",), 1, "import x", True, False)
    graph = {"a": {"b": imp}, "b": {"c": imp}, "c": {"a": imp, "d": imp}, "d": {}, "e": {"f": imp}, "f": {"e": imp}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["e", "f"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
