"""The direction of dependencies (CONVENTIONS.md): lower layers never import higher ones."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    # speculative decoding's drafts and controller work on plain token lists and numbers
    "spec": (
        "cache",
        "core",
        "model",
        "constrained",
        "scheduler",
        "server",
        "engine",
        "output",
        "native",
        "bench",
    ),
    "scheduler": ("server", "engine", "native", "bench"),
    # the frontend language reaches engines through its backends only: HTTP, or the public
    # in-process Engine API (radixserve.engine), never the engine's parts
    "lang": (
        "cache",
        "core",
        "model",
        "constrained",
        "scheduler",
        "server",
        "spec",
        "output",
        "native",
        "bench",
        "tokenizer",
        "config",
        "hardware",
    ),
    "server": ("engine", "bench", "cli"),
    # LoRA adapters: read by the model runner, named at the edge; neither side's parts
    "lora": ("cache", "model", "constrained", "scheduler", "server", "engine", "output", "bench"),
}
# the root modules, by file
ROOT_FORBIDDEN = {
    "config.py": ("cache", "core", "model", "constrained", "scheduler", "server", "engine",
                  "hardware", "output", "native", "bench"),
    "output.py": ("cache", "model", "constrained", "scheduler", "server", "engine", "bench"),
    "native.py": ("cache", "model", "constrained", "scheduler", "server", "engine", "bench"),
    "tokenizer.py": ("cache", "model", "constrained", "scheduler", "server", "engine", "bench"),
    "engine.py": ("server", "bench", "cli"),
    "hardware.py": ("cache", "model", "scheduler", "server", "engine", "output", "bench"),
    "scoring.py": ("cache", "model", "constrained", "scheduler", "server", "engine", "bench"),
    "chat_roles.py": ("cache", "core", "model", "constrained", "scheduler", "server", "engine",
                      "output", "native", "bench"),
}  # fmt: skip


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


def test_only_the_children_module_knows_every_process():
    roles = {"radixserve.server.scheduler_process", "radixserve.server.detokenizer"}
    knowers = [
        file.name for file in sorted(PACKAGE.rglob("*.py")) if roles & imported_modules(file)
    ]
    assert knowers == ["children.py"], knowers


def test_the_children_load_no_http_code():
    """A spawned child imports the module of its entry (server/children.py): the scheduler
    and the detokenizer must not load FastAPI, uvicorn or the routes with it."""
    code = (
        "import importlib, sys\n"
        "from radixserve.server.children import CHILD_MAINS\n"
        "for entry in CHILD_MAINS.values(): importlib.import_module(entry.__module__)\n"
        "import radixserve.server.detokenizer, radixserve.server.scheduler_process\n"
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn')"
        " or m.startswith(('radixserve.server.routes', 'radixserve.server.http',"
        " 'radixserve.server.launch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


@pytest.mark.parametrize("name", sorted(ROOT_FORBIDDEN))
def test_root_modules_import_only_what_they_may(name):
    file = PACKAGE / name
    if not file.exists():
        pytest.skip(f"radixserve/{name} does not exist")
    for module in imported_modules(file):
        parts = module.split(".")
        if parts[0] == "radixserve" and len(parts) > 1:
            assert parts[1].removesuffix(".py") not in ROOT_FORBIDDEN[name], (
                f"radixserve/{name} imports {module}"
            )


def loaded_after_import(*modules: str) -> set[str]:
    """The radixserve modules, torch and its compiler (torch._dynamo) that importing
    `modules` loads, in a fresh interpreter."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(' '.join(m for m in sys.modules if m.startswith('radixserve')"
        " or m in ('torch', 'torch._dynamo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_http_and_detokenizer_processes_load_no_model_or_scheduler_code():
    loaded = loaded_after_import(
        "radixserve.server.detokenizer",
        "radixserve.server.messages",
        "radixserve.server.tokenizer_manager",
        "radixserve.server.http",
        "radixserve.server.launch",  # the main process: it starts the others by name only
    )
    heavy = sorted(m for m in loaded if m.startswith(("radixserve.model", "radixserve.scheduler")))
    assert not heavy, heavy
    # transformers' tokenizers bring torch itself, but nothing loads its compiler (~2 s and
    # ~120 MB: llguidance's torch helpers, which only the scheduler's masks use, would)
    assert "torch._dynamo" not in loaded
    assert not {"radixserve.core.batch", "radixserve.constrained.base"} & loaded


def test_the_frontend_language_loads_no_engine_code():
    """A client machine runs programs over HTTP without torch or the engine."""
    loaded = loaded_after_import("radixserve.lang")
    assert "torch" not in loaded
    assert {m for m in loaded if not m.startswith("radixserve.lang")} == {"radixserve"}


def test_the_config_and_the_cli_help_import_no_torch():
    """`radixserve --help` and `radixserve serve --help` are instant."""
    assert "torch" not in loaded_after_import("radixserve.config", "radixserve.cli")
    code = (
        "import sys, contextlib, io\n"
        "from radixserve.cli import main\n"
        "for argv in (['--help'], ['serve', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
