"""The direction of dependencies (CONVENTIONS.md): lower layers never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "radixserve"
FORBIDDEN = {
    "core": (
        "cache",
        "model",
        "constrained",
        "scheduler",
        "server",
        "engine",
        "output",
        "native",
        "bench",
    ),
    "cache": ("model", "constrained", "scheduler", "server", "engine", "output", "native", "bench"),
    "model": ("constrained", "scheduler", "server", "engine", "output", "native", "bench"),
    # grammar backends see requests and configs, never the model or the scheduler
    "constrained": ("cache", "model", "scheduler", "server", "engine", "output", "native", "bench"),
    "scheduler": ("server", "engine", "native", "bench"),
    "server": ("engine", "bench", "cli"),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_lower_layers(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no modules in radixserve/{layer}"
    for file in files:
        for name in imported_modules(file):
            parts = name.split(".")
            if parts[0] == "radixserve" and len(parts) > 1:
                assert parts[1] not in FORBIDDEN[layer], (
                    f"{file.relative_to(PACKAGE.parent)} imports {name}: "
                    f"radixserve/{layer} must not depend on radixserve/{parts[1]}"
                )


def test_only_the_launch_module_knows_every_process():
    roles = {"radixserve.server.scheduler_process", "radixserve.server.detokenizer"}
    knowers = [
        file.name for file in sorted(PACKAGE.rglob("*.py")) if roles & imported_modules(file)
    ]
    assert knowers == ["launch.py"], knowers
