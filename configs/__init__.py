"""The run configs, one file each, given to the commands as `--config=configs/<name>.py`.

A config file returns its ConfigDict from `get_config()`. ml_collections' `config_flags` loads
it by path, and a file that builds on another imports it as a module, as big_vision's configs
do: `from configs import common`. That import finds this package from the repository root,
which is on `sys.path` when a command runs from there (`python train.py`, `python -m ...`), and
from anywhere once the project is installed (`pip install -e .` installs this package too).

The files without a `get_config` hold what several configs share: `common.py` (the mesh
section, the data keys of files, the paper's WMT14 recipe) and `lm_common.py` (the language
models' recipe). `holders(key)` names the configs that hold a key, for the error about a key
that the config in use lacks.
"""

import importlib
import pathlib


def holders(key: str, limit: int = 3) -> str:
    """Names the config files here that hold the dotted `key`, such as "data.text_field".

    The line that says a config lacks a key can then point to one that has it, for example
    "configs/help_topics.py, configs/lm_125m.py and 8 more hold it". The answer is "" where
    no config holds the key. A config whose `get_config` needs an argument is read with its
    default argument, or left out. Nothing here imports JAX.
    """
    names = []
    for path in sorted(pathlib.Path(__file__).parent.glob("[!_]*.py")):
        try:
            cfg = importlib.import_module(f"{__name__}.{path.stem}").get_config()
        except Exception:  # a shared module (no get_config), or one that needs an argument
            continue
        if _holds(cfg, key):
            names.append(f"configs/{path.name}")
    if not names:
        return ""
    named = ", ".join(names[:limit])
    if len(names) > limit:
        return f"{named} and {len(names) - limit} more hold it"
    return f"{named} {'holds' if len(names) == 1 else 'hold'} it"


def _holds(cfg, key: str) -> bool:
    """Whether the ConfigDict `cfg` has the dotted `key`, whatever its value (None included)."""
    node = cfg
    for name in key.split("."):
        if not hasattr(node, "keys") or name not in node:
            return False
        node = node[name]
    return True
