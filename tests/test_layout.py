"""The repository's import directions (docs/architecture.md): packages by concern, arrows one way, no
cycles; inside the web tier, layers. Read from the source with ast, without importing it."""
from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP = ("web", "worker", "models", "nanogpt", "bench", "processor", "wsgi")

# Which package may import which. A module belongs to the longest package here that names it or a
# package above it; an import from one package into another must be listed.
ARROWS = {
    "models": set(),  # what is served: registry, tokenizers, checkpoint formats; torch-free
    "nanogpt.kernels": set(),  # CPU kernels, the kernel plan, int8 quantization
    "nanogpt.runtime": {"nanogpt.kernels"},  # KV cache, precision, compile, CUDA graphs
    "nanogpt": {"models"},  # the model families, and MODEL_ARROWS
    "nanogpt.training": {"nanogpt", "models"},
    "worker.protocol": set(),  # the job payload and events web and worker share; torch-free
    "worker": {"worker.protocol", "nanogpt", "nanogpt.kernels", "nanogpt.runtime", "models"},
    "web": {"worker.protocol", "models"},
    "web.dev": {"models", "worker.protocol"},  # the development server: starts redis, a worker and gunicorn
    "processor": {"worker", "worker.protocol", "nanogpt", "nanogpt.kernels", "nanogpt.runtime", "models"},
    "wsgi": {"web"},
    # bench builds jobs as web does (web.api.structured's grammars), never the other way round
    "bench": {"processor", "worker", "worker.protocol", "nanogpt", "nanogpt.kernels", "nanogpt.runtime",
              "models", "web.dev", "web"},
}
# The model modules reach into nanogpt's subpackages only where the design needs it: the serving
# forward attends through the KV cache's windows. Layers and families import no kernel: loading
# swaps their nn.Linear modules (nanogpt/kernels/planner.py, quantize.py).
MODEL_ARROWS = {("nanogpt.serving", "nanogpt.runtime.kv_cache")}
TORCH_FREE = ("models", "web", "worker.protocol")

# Lower web layers never import higher ones; modules of one layer may import each other only inside
# their own package (web/api/, web/access/). `web.dev` stands alone.
LAYERS = [
    ("web.durations",),
    ("web.settings", "web.redis_pool"),
    ("web.access",),
    ("web.metrics", "web.logs"),
    ("web.batch",),
    ("web.api",),
    ("web.health", "web.cli", "web.playground"),
    ("web.app",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[str, Path]:
    """{module: its file} of the project's code (tests, fixtures and the venv aside)."""
    paths = [REPO / f"{name}.py" for name in TOP if (REPO / f"{name}.py").exists()]
    paths += [p for name in TOP if (REPO / name).is_dir() for p in (REPO / name).rglob("*.py")]
    return {module_name(p): p for p in sorted(paths)}


@cache
def imports() -> dict[str, frozenset[str]]:
    """{module: the project's modules it imports}, at the top or inside a function: `from a import b`
    imports the module a.b where there is one, else a name of a."""
    modules = sources()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else known(node.module))
            elif isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
        graph[name] = frozenset(t for t in targets if t and t != name)
    return graph


def third_party(path: Path) -> set[str]:
    """The top-level names of what the module at `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
    return names


def package(module: str) -> str:
    """The ARROWS package a module belongs to."""
    return max((p for p in ARROWS if module == p or module.startswith(p + ".")), key=len)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_package():
    modules = sources()
    assert {"nanogpt.model", "nanogpt.kernels.planner", "nanogpt.runtime.kv_cache", "nanogpt.training.train",
            "models.formats", "worker.engine", "worker.protocol", "web.app", "processor"} <= set(modules)
    assert {package(m) for m in modules} == set(ARROWS)


def test_packages_import_only_what_the_table_allows():
    wrong = []
    for module, targets in imports().items():
        for target in targets:
            source, dest = package(module), package(target)
            if source != dest and dest not in ARROWS[source] and (module, target) not in MODEL_ARROWS:
                wrong.append(f"{module} -> {target}")
    assert sorted(wrong) == []


def test_the_arrows_point_one_way():
    table = {p: set(targets) for p, targets in ARROWS.items()}
    for module, target in MODEL_ARROWS:
        table[package(module)].add(package(target))
    assert cycles(table) == []
    between = {}  # as the code has them
    for module, targets in imports().items():
        between.setdefault(package(module), set()).update(package(t) for t in targets if package(t) != package(module))
    assert cycles(between) == []
    assert cycles({m: set(targets) for m, targets in imports().items()}) == []  # nor do two modules


def test_layers_and_families_import_no_kernel():
    into_subpackages = {(m, t) for m, targets in imports().items() if package(m) == "nanogpt"
                        for t in targets if package(t) != "nanogpt" and t.startswith("nanogpt.")}
    assert into_subpackages == MODEL_ARROWS


def test_the_torch_free_packages_import_no_torch():
    modules = sources()
    assert [m for m in modules if package(m) in TORCH_FREE and third_party(modules[m]) & {"torch", "numpy"}] == []


def test_the_kernels_sources_are_packaged():
    """The C++ sources the extension builds and hashes ship with the package (pyproject's package-data)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"nanogpt.kernels", "nanogpt.runtime", "nanogpt.training"} <= set(setuptools["packages"])
    kernels = REPO / "nanogpt" / "kernels"
    shipped = {p for pattern in setuptools["package-data"]["nanogpt.kernels"] for p in kernels.glob(pattern)}
    assert shipped and shipped == set((kernels / "csrc").iterdir())


# ---- the web tier's layers ----

def web_modules() -> dict[str, set[str]]:
    """{web module: the web modules it imports}."""
    return {m: {t for t in targets if t.startswith("web.") and t != "web"}
            for m, targets in imports().items() if m == "web" or m.startswith("web.")}


def layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def web_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_web_module_has_a_place():
    modules = web_modules()
    assert {"web.api.jobs", "web.access.ownership", "web.dev.devserver", "web.settings"} <= set(modules)
    assert [m for m in modules if layer(m) is None and not m.startswith("web.dev") and m != "web"] == []


def test_web_imports_point_one_way():
    wrong = []
    for module, imported in web_modules().items():
        for target in imported:
            if module.startswith("web.dev") or target.startswith("web.dev"):
                if web_package(module) != web_package(target):
                    wrong.append(f"{module} -> {target} (web.dev stands apart)")
            elif layer(target) > layer(module) or (layer(target) == layer(module)
                                                   and web_package(target) != web_package(module)):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_access_and_the_error_handlers_do_not_import_each_other():
    modules = web_modules()
    assert "web.api.errors" not in modules["web.access"] and "web.access" in modules["web.api.errors"]
