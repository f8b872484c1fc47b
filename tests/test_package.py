"""The package as users meet it: the core imports no TensorFlow, `train.py --summary` prints
the parameter count. And as its next reader meets it: commands at the top, libraries in
folders that import only the folders below them (the table in docs/architecture.md), every
module on the architecture page, no import circle, no file over 500 lines."""

import ast
import pathlib
import re
import subprocess
import sys

import transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_core_imports_no_tensorflow():
    code = ("import sys, transformer, transformer.parallel.sharding, transformer.sizing.flops, "
            "transformer.training.train_state, transformer.training.loop\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', "
            "'tensorflow_datasets')]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_summary_cli_prints_total_params_without_a_workdir():
    result = subprocess.run(
        [sys.executable, "train.py", "--config=configs/wmt14_ende_base.py", "--summary",
         "--config.model.num_heads=16"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip().splitlines()[-1] == "total_params: 63082496"


PACKAGE = ROOT / "transformer"
MAX_LINES = 500


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, modules) -> set[str]:
    """The package's modules that `path` imports, at any depth of the file (a function's own
    imports included): `from a.b import c` is module a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_circle_and_only_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_library_imports_a_command():
    """A verb at the top of the package is a command; libraries never import one."""
    modules = _modules()
    commands = _commands(modules)
    assert {"transformer.evaluate", "transformer.translate", "transformer.check"} <= commands
    offenders = {name: sorted(_imports(path, modules) & commands)
                 for name, path in modules.items() if name not in commands}
    assert not {k: v for k, v in offenders.items() if v}


def test_top_level_holds_commands_the_run_config_and_folders():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 20, entries
    for entry in entries:
        path = PACKAGE / entry
        if path.is_dir():
            assert (path / "__init__.py").exists(), entry
        elif entry not in ("__init__.py", "config.py"):
            assert 'if __name__ == "__main__"' in path.read_text(), f"{entry} is not a command"


def test_no_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_tests_mirror_the_package_folders():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()
                       and any(p.glob("test_*.py"))}


def test_the_pure_function_modules_import_by_name():
    """`from transformer import attention` (the research API's spelling) gives the modules."""
    from transformer import attention, decoding, layers, masks

    assert attention.dot_product_attention is transformer.dot_product_attention
    assert masks.make_causal_mask is transformer.make_causal_mask
    assert layers.layer_norm is transformer.layer_norm
    assert callable(decoding.beam_search)


def test_the_masks_are_imported_by_one_path():
    """A mask is `transformer.ops.masks`' and the package's (`transformer.make_causal_mask`):
    no other module of the package offers it as its own."""
    import sys

    from transformer.ops import masks

    names = [name for name in dir(masks) if name.startswith("make_") or name == "combine_masks"]
    offered = [f"{module_name}.{name}" for module_name, module in sorted(sys.modules.items())
               if module_name.startswith("transformer.") and module is not masks
               for name in names if getattr(module, name, None) is getattr(masks, name)]
    assert len(names) >= 10 and offered == []


# Which folder may import which: the same table as docs/architecture.md's "Layering".
# "config" is transformer/config.py; "commands" are the verbs at the top of the package,
# train.py and transformer/__init__.py.
MAY_IMPORT = {
    "util": set(),
    "parallel": {"util"},
    "checkpoint": {"util"},
    "data": {"checkpoint", "util"},
    "ops": {"parallel", "util"},
    "model": {"ops", "data", "parallel", "util"},
    "config": {"model", "data", "parallel", "util"},
    "inference": {"config", "model", "ops", "data", "checkpoint", "parallel", "util"},
    "training": {"inference", "config", "model", "ops", "data", "checkpoint", "parallel",
                 "util"},
    "sizing": {"training", "inference", "config", "model", "ops", "data", "checkpoint",
               "parallel", "util"},
    "huggingface": {"training", "inference", "config", "model", "ops", "data", "checkpoint",
                    "parallel", "util"},
}
# The imports against the table, each with its reason (also on the architecture page).
EXCEPTIONS = {
    ("transformer.config", "transformer.training.optim"):
        "the optimizer's own checks run when the config is checked, before any compile",
    ("transformer.training.loop", "transformer.sizing.flops"):
        "the MFU figure on train lines counts the model's FLOPs",
}
PLOTTING = "transformer.util.plotting"  # imported by the commands alone


def _layer(module: str, commands: set[str]) -> str:
    """The row of MAY_IMPORT that `module` belongs to, or "commands"."""
    if module in commands or module == "transformer":
        return "commands"
    return module.split(".")[1]


def _commands(modules) -> set[str]:
    return {name for name, path in modules.items() if name.count(".") == 1
            and 'if __name__ == "__main__"' in path.read_text()}


def _layering_breaks(graph: dict[str, set[str]], commands: set[str]) -> list[str]:
    """Every import of `graph` that the table, the exceptions and the plotting rule forbid."""
    breaks = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module, commands)
        for target in sorted(targets):
            if layer == "commands" or (module, target) in EXCEPTIONS:
                continue
            if target == PLOTTING:
                breaks.append(f"{module} -> {target} (only commands draw)")
                continue
            target_layer = _layer(target, commands)
            if target_layer != layer and target_layer not in MAY_IMPORT[layer]:
                breaks.append(f"{module} -> {target} ({layer} may not import {target_layer})")
    return breaks


def test_every_folder_has_a_row_in_the_table():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders | {"config"} == set(MAY_IMPORT)


def test_layering_finder_finds_an_upward_import_and_passes_the_listed_ones():
    graph = {"transformer.ops.ring": {"transformer.training.train_state"},
             "transformer.training.loop": {"transformer.sizing.flops", "transformer.ops.ring"},
             "transformer.inference.decoding": {PLOTTING},
             "transformer.visualize": {PLOTTING, "transformer.training.curves"}}
    assert _layering_breaks(graph, {"transformer.visualize"}) == [
        "transformer.inference.decoding -> transformer.util.plotting (only commands draw)",
        "transformer.ops.ring -> transformer.training.train_state (ops may not import training)"]


def test_every_import_follows_the_layering_table():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert not _layering_breaks(graph, _commands(modules))
    used = {(module, target) for module, targets in graph.items() for target in targets}
    assert set(EXCEPTIONS) <= used, "an exception no longer needed: drop it from the table"


def _markdown_table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with `header`."""
    lines = text[text.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_architecture_page_shows_the_same_table():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = _markdown_table(page, "| folder | may import |")
    shown = {folder: set() if imports == "nothing of the package" else set(imports.split(", "))
             for folder, imports in rows if folder != "commands"}
    assert shown == MAY_IMPORT
    exceptions = _markdown_table(page, "| module | imports | why |")
    listed = {(f"transformer.{m.removesuffix('.py').replace('/', '.')}",
               f"transformer.{i.removesuffix('.py').replace('/', '.')}"): why
              for m, i, why in exceptions}
    assert listed == EXCEPTIONS


def test_every_module_is_on_the_architecture_pages_layout():
    """Each module's name appears in its folder's entry of the layout (a command's on the
    commands' line), so that the page lists every module that exists."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page[page.index("```\ntrain.py"):]
    layout = layout[:layout.index("\n```", 4)]
    entries = re.split(r"\n(?=  \S)", layout)  # a folder's entry runs to the next one
    missing = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[-1] == "__init__.py":
            continue
        name = path.stem
        head = f"{parts[0]}/" if len(parts) > 1 else f"{name}.py"
        entry = next((e for e in entries if e.lstrip().startswith(head) or
                      (len(parts) == 1 and re.search(rf"\b{name}\.py\b", e))), "")
        if not re.search(rf"\b{name}\b", entry):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"not on docs/architecture.md's layout: {missing}"
