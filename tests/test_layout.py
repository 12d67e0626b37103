"""The web tier's import directions (docs/architecture.md): arrows point one way, so no two modules
import each other, and the development tools stand apart. Read from the source, without importing it."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Lower layers never import higher ones; modules of one layer may import each other only inside
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


def web_modules() -> dict[str, set[str]]:
    """{module: the web modules it imports}, from the source."""
    modules = {}
    for path in sorted((REPO / "web").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "web":
                # `from web.access import keys` imports web.access.keys (a module) or a name of web.access
                imported |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.split(".")[0] == "web"}
        modules[name] = imported
    return {name: {m for m in imported if m in modules and m != "web"} for name, imported in modules.items()}


def layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_web_module_has_a_place():
    modules = web_modules()
    assert {"web.api.jobs", "web.access.ownership", "web.dev.devserver", "web.settings"} <= set(modules)
    assert [m for m in modules if layer(m) is None and not m.startswith("web.dev") and m != "web"] == []


def test_imports_point_one_way():
    wrong = []
    for module, imported in web_modules().items():
        for target in imported:
            if module.startswith("web.dev") or target.startswith("web.dev"):
                if package(module) != package(target):
                    wrong.append(f"{module} -> {target} (web.dev stands apart)")
            elif layer(target) > layer(module) or (layer(target) == layer(module) and package(target) != package(module)):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_access_and_the_error_handlers_do_not_import_each_other():
    modules = web_modules()
    assert "web.api.errors" not in modules["web.access"] and "web.access" in modules["web.api.errors"]
