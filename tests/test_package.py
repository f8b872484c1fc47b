"""The package as users meet it: the README's example runs, the core imports no TensorFlow,
`train.py --summary` prints the parameter count."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_python_examples_run(untrained_translation_workdir):
    """Every python block of the README; the one that loads `runs/default` gets an untrained
    run of the same layout instead."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2 and any('"runs/default"' in block for block in blocks)
    for block in blocks:
        block = block.replace('"runs/default"', repr(str(untrained_translation_workdir)))
        exec(compile(block, "README.md", "exec"), {})


def test_core_imports_no_tensorflow():
    code = ("import sys, transformer, transformer.sharding, transformer.step_lib, "
            "transformer.loop, transformer.flops\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', "
            "'tensorflow_datasets')]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_summary_cli_prints_total_params_without_a_workdir():
    result = subprocess.run(
        [sys.executable, "train.py", "--config=configs/wmt14_ende_base.py", "--summary",
         "--config.model.num_heads=16"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip().splitlines()[-1] == "total_params: 63082496"
