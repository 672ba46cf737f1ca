"""The layers' nevers, read from the import statements of the sources (ast; lazy imports inside
functions count): the IR and the ops import no pass and no runtime; passes import no runtime;
the runtime imports neither the pipeline nor the compiler nor any pass: jitgraph/compiler.py
runs the passes and hands the runtime their products, whose types (kernel graph, memory plan)
live in the core's jitgraph/plan.py, which imports neither. The IR imports neither the op
library nor its JSON format (the ops install Tensor's operators, serialize.py Graph's
to_json/from_json), the core (jitgraph/'s own modules, ops/, passes/, runtime/) imports no
application (cli/, formats/, models/), formats/ and models/ import no cli/, and no modules of
passes/ or runtime/ import each other in a circle. And the runtime compares no node's op with
an op's name outside the backends' tables (read from the comparisons)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"jitgraph": ROOT / "jitgraph", "jitgraph.passes": ROOT / "passes",
            "jitgraph.runtime": ROOT / "runtime"}


def modules(package):
    """{module name: path} of the package's sources (not its subpackages' of another layer)."""
    out = {}
    for path in sorted(PACKAGES[package].rglob("*.py")):
        rel = path.relative_to(PACKAGES[package]).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        name = ".".join([package, *parts])
        if package == "jitgraph" and parts and parts[0] in ("passes", "runtime"):
            continue
        out[name] = path
    return out


def _walk(tree, lazy):
    """ast.walk, leaving out function bodies unless `lazy` (imports run when a function runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if lazy or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def imports(name, path, lazy=True):
    """(imported module, imported name or None, line) for every import in the file (with
    lazy=False, only those that run when the module is imported)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _walk(ast.parse(path.read_text(), str(path)), lazy):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                yield mod, a.name, node.lineno


def targets(mod, what):
    """The modules an import may load: `from a import b` is a.b when b is a submodule."""
    return {mod} if what is None else {mod, f"{mod}.{what}"}


def violations(package, forbidden, allowed=lambda mod, what: False, only=None,
               lazy=lambda name: True):
    out = []
    for name, path in modules(package).items():
        if only and not only(name):
            continue
        for mod, what, line in imports(name, path, lazy(name)):
            hit = [t for t in targets(mod, what) if any(t == f or t.startswith(f + ".")
                                                       for f in forbidden)]
            if hit and not allowed(mod, what):
                out.append(f"{path.relative_to(ROOT)}:{line}: imports {hit[0]}")
    return out


def test_the_modules_are_found():
    assert {"jitgraph.ir", "jitgraph.registry", "jitgraph.ops", "jitgraph.ops.shape",
            "jitgraph.training", "jitgraph.cli", "jitgraph.formats.gguf",
            "jitgraph.formats.llama_checkpoint", "jitgraph.testing.grad", "jitgraph.testing.runner",
            "jitgraph.models.llama"} <= set(modules("jitgraph"))
    assert "jitgraph.passes.pipeline" in modules("jitgraph.passes")
    assert "jitgraph.runtime.executor" in modules("jitgraph.runtime")
    found = {m for m, _, _ in imports("jitgraph.passes.simplify",
                                      PACKAGES["jitgraph.passes"] / "simplify.py")}
    assert {"jitgraph.ir", "jitgraph.passes.report"} <= found


def test_ir_ops_and_plan_import_no_pass_and_no_runtime():
    core = violations("jitgraph", ["jitgraph.passes", "jitgraph.runtime", "jitgraph.compiler"],
                      only=lambda m: m in ("jitgraph.ir", "jitgraph.registry", "jitgraph.plan")
                      or m.startswith("jitgraph.ops"))
    assert not core, "\n".join(core)


def test_ir_imports_neither_the_ops_nor_serialize():
    bad = violations("jitgraph", ["jitgraph.ops", "jitgraph.serialize"],
                     only=lambda m: m == "jitgraph.ir")
    assert not bad, "\n".join(bad)
    found = {m for m, _, _ in imports("jitgraph.ir", ROOT / "jitgraph" / "ir.py")}
    assert "jitgraph.registry" in found      # what the IR reads op facts from


APPS = ["jitgraph.cli", "jitgraph.formats", "jitgraph.models"]


def is_app(name):
    return any(name == a or name.startswith(a + ".") for a in APPS)


@pytest.mark.parametrize("package", list(PACKAGES))
def test_the_core_imports_no_application(package):
    """Lazy imports count too: only jg.data, jg.models and jg.formats (importlib, by name, in
    jitgraph/__init__.py's __getattr__) reach an application, and only when asked for."""
    bad = violations(package, APPS, only=lambda m: not is_app(m))
    assert not bad, "\n".join(bad)


def test_formats_and_models_import_no_cli():
    """The command line is the top layer: the file formats and the models serve it, never the
    reverse (a checkpoint format the command writes lives in formats/)."""
    bad = violations("jitgraph", ["jitgraph.cli"], only=lambda m: is_app(m)
                     and not m.startswith("jitgraph.cli"))
    assert not bad, "\n".join(bad)


def test_fit_and_evaluate_load_no_application():
    code = ("import sys, jitgraph as jg; jg.fit, jg.evaluate, jg.training_graph; "
            "print(sorted(m for m in sys.modules if m.startswith('jitgraph')))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout)
    assert "jitgraph.training" in loaded
    assert not [m for m in loaded if is_app(m)], loaded


def test_importing_jitgraph_loads_no_application():
    code = "import sys, jitgraph; print(sorted(m for m in sys.modules if m.startswith('jitgraph')))"
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout)
    assert "jitgraph.ops" in loaded and "jitgraph.serialize" in loaded
    assert not [m for m in loaded if is_app(m)], loaded


def test_passes_import_no_runtime():
    bad = violations("jitgraph.passes", ["jitgraph.runtime", "jitgraph.compiler"])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("forbidden", [["jitgraph.passes.pipeline"], ["jitgraph.compiler"],
                                       ["jitgraph.passes"]],
                         ids=["pipeline", "compiler", "any pass"])
def test_runtime_runs_no_pass(forbidden):
    bad = violations("jitgraph.runtime", forbidden)
    assert not bad, "\n".join(bad)



# modules that still import each other (lazy imports included); this list may only shrink
MUTUAL = set()


def test_no_two_modules_import_each_other():
    """A pair that imports each other is one module in two files: the shared part gets a module
    of its own (cli/report.py for bench and roofline), or the caller hands over a function
    (the pipeline gives passes/checkpoint.py its arena measure). A package and its own
    submodules are exempt (the package's __init__ re-exports them)."""
    mods = {name: path for p in PACKAGES for name, path in modules(p).items()}
    edges = {name: {t for mod, what, _ in imports(name, path) for t in targets(mod, what)
                    if t in mods and t != name} for name, path in mods.items()}
    pairs = {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges[b]}
    pairs = {(a, b) for a, b in pairs if not b.startswith(a + ".")}
    assert {("jitgraph.cli.bench", "jitgraph.cli.roofline"),
            ("jitgraph.passes.checkpoint", "jitgraph.passes.pipeline"),
            ("jitgraph.cli", "jitgraph.cli.llama_train")}.isdisjoint(pairs)
    assert pairs <= MUTUAL, sorted(pairs - MUTUAL)


def test_the_commands_share_only_public_names():
    """What one command module takes from another (cli/common.py's option types and helpers) is
    public: no `from .x import _private` between the modules of jitgraph/cli."""
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {mod}.{what}"
           for name, path in modules("jitgraph").items() if name.startswith("jitgraph.cli")
           for mod, what, line in imports(name, path)
           if mod.startswith("jitgraph.cli") and what and what.startswith("_")]
    assert not bad, "\n".join(bad)


def import_graph(packages):
    """{module: set of modules of `packages` it imports} (lazy imports count: a cycle through
    a function-level import is still a cycle)."""
    mods = {}
    for p in packages:
        mods.update(modules(p))
    graph = {}
    for name, path in mods.items():
        graph[name] = {t for mod, what, _ in imports(name, path)
                       for t in ([f"{mod}.{what}"] if f"{mod}.{what}" in mods else [mod])
                       if t in mods and t != name}
    return graph


def cycles(graph):
    """Every strongly connected component of more than one module (Tarjan), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycles_finds_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_the_edges():
    g = import_graph(["jitgraph.passes", "jitgraph.runtime"])
    assert "jitgraph.passes.fuse" in g["jitgraph.passes.pipeline"] or \
        "jitgraph.passes.planning" in g["jitgraph.passes.pipeline"]
    assert "jitgraph.runtime.cpu.fused" in g["jitgraph.runtime.cpu.codegen"]    # from . import
    assert "jitgraph.runtime.cpu.codegen" in g["jitgraph.runtime.cpu.backend"]  # lazy import


def test_no_import_cycle_in_passes_or_runtime():
    found = cycles(import_graph(["jitgraph.passes", "jitgraph.runtime"]))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


PROTOCOL = {"name", "kinds", "before_step", "generate", "check_fits", "build", "allocate", "view",
            "address"}


def test_the_backends_meet_the_protocol():
    """runtime/backend.Backend lists what the compiler and the Program use; the CPU backend
    (instantiated) and the CUDA class (read from its source: instantiating it needs a device)
    have every member."""
    from jitgraph.runtime.backend import BACKENDS, Backend, get_backend
    members = set(Backend.__annotations__) | {k for k, v in vars(Backend).items()
                                              if callable(v) and not k.startswith("_")}
    assert members == PROTOCOL
    cpu = get_backend("cpu")
    assert isinstance(cpu, Backend) and callable(cpu.before_step)
    assert set(BACKENDS) == {"cpu", "cuda"}
    tree = ast.parse((PACKAGES["jitgraph.runtime"] / "cuda" / "backend.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CUDA")
    have = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} | {
        t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
        if isinstance(t, ast.Name)}
    assert PROTOCOL <= have, PROTOCOL - have
    assert BACKENDS["cuda"].endswith(":CUDA")


def test_the_compiler_and_executor_use_only_the_protocol():
    """Every `backend.<member>` / `products.backend.<member>` the compiler and the Program read
    is a member of the protocol (one used but not listed would be a hidden requirement on a new
    target), and the protocol lists nothing they do not use."""
    used = set()
    for src in ((PACKAGES["jitgraph.runtime"] / "executor.py").read_text(),
                (PACKAGES["jitgraph"] / "compiler.py").read_text()):
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Attribute):
                v = n.value
                if (isinstance(v, ast.Name) and v.id == "backend") or \
                        (isinstance(v, ast.Attribute) and v.attr in ("backend", "_backend")):
                    used.add(n.attr)
    assert used == PROTOCOL, (used - PROTOCOL, PROTOCOL - used)


def op_name_tests(path, names):
    """(line, op name) of every comparison of an `.op` (a node's op) with a registered op's
    name in the file: `n.op == "softmax"`, `n.op in ("sum", "mean")`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(s, ast.Attribute) and s.attr == "op" for s in sides):
            continue
        for s in sides:
            for c in ast.walk(s):
                if isinstance(c, ast.Constant) and c.value in names:
                    out.append((node.lineno, c.value))
    return out


def test_the_runtime_names_no_op_outside_the_backends_tables(tmp_path):
    """A backend dispatches through its table (op -> rule) and renders elementwise and row ops
    from their registered expressions: no module of runtime/ but a table (table.py) or a
    spelling (spelling.py) compares a node's op with a registered op's name (leaf ops aside)."""
    import jitgraph  # noqa: F401  (fills the registry)
    from jitgraph.registry import OPS
    names = {name for name, d in OPS.items() if d.kind != "leaf"}
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for path in sorted(PACKAGES["jitgraph.runtime"].rglob("*.py"))
           if path.name not in ("table.py", "spelling.py")
           for line, name in op_name_tests(path, names)]
    assert not bad, "\n".join(bad)
    planted = tmp_path / "planted.py"       # what the check finds
    planted.write_text('if n.op == "softmax" or x.op in ("sum", "input"):\n    pass\n')
    assert sorted(op_name_tests(planted, names)) == [(1, "softmax"), (1, "sum")]
