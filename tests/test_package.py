"""The package as users meet it: the core imports no TensorFlow, `train.py --summary` prints
the parameter count; and as its next reader meets it: commands at the
top, libraries in folders, no import circle, no file over 500 lines."""

import ast
import pathlib
import subprocess
import sys

import transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_core_imports_no_tensorflow():
    code = ("import sys, transformer, transformer.parallel.sharding, transformer.training.step, "
            "transformer.training.loop, transformer.sizing.flops\n"
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
    commands = {name for name, path in modules.items() if name.count(".") == 1
                and 'if __name__ == "__main__"' in path.read_text()}
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
