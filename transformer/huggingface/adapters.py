"""LoRA adapters (`model/lora.py`) in and out as PEFT writes them: `adapter_config.json` and
`adapter_model.safetensors` beside (not inside) the base checkpoint.

PEFT's LoRA on a Linear layer W [out, in] is W + (lora_alpha / r) B A with A = `lora_A.weight`
[r, in] and B = `lora_B.weight` [out, r], named `base_model.model.<module>.lora_A.weight` after
the `transformers` model's module. Ours on the kernel that module maps to (`mapping.Tensors`) is
W + (alpha / r) A B with A [in..., r] and B [r, out...], so A = PEFT's A transposed with our
input axes split out, B likewise; this holds where the family maps the Linear weight to the
kernel by a transpose and a split of its axes (`heads_in`, `heads_out`, `transposed`), which
`adapter_groups` checks on each targeted kernel. Only PEFT's plain LoRA maps (no rsLoRA, DoRA,
per-layer ranks, biases or extra trained modules), and an adapter must cover a targeted module
in every layer: our targets are by name, as `lora_targets`. `lora_dropout` goes out and comes
back with `r` and `lora_alpha` (PEFT's dropout of the adapter's input is ours, `model/lora.py`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from transformer.huggingface.mapping import Tensors
from transformer.model import lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's name of the wrapped transformers model
TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder_decoder": "SEQ_2_SEQ_LM"}
# adapter_config.json options with no counterpart here, and the value that means "not used".
UNSUPPORTED = dict(use_rslora=False, use_dora=False, fan_in_fan_out=False, bias="none",
                   modules_to_save=None, layers_to_transform=None, rank_pattern={},
                   alpha_pattern={}, target_parameters=None)


def _module(hf_weight: str) -> str:
    return hf_weight.removesuffix(".weight")


def adapter_groups(groups: list[Tensors], shapes: dict[str, tuple], targets: tuple[str, ...],
                   rank: int) -> list[Tensors]:
    """PEFT's `lora_A`/`lora_B` tensors <-> our `lora_a`/`lora_b` for each kernel of `groups`
    (a family's tensor groups) whose module is in `targets`, given our parameters' `shapes`."""
    out = []
    for group in groups:
        if len(group.ours) != 1 or not group.ours[0].endswith("/kernel"):
            continue
        path = group.ours[0].removesuffix("kernel")
        if path.rstrip("/").rsplit("/", 1)[-1] not in targets:
            continue
        kernel = shapes[group.ours[0]]
        num_in = len(shapes[path + lora.A]) - 1
        in_shape, out_shape = kernel[:num_in], kernel[num_in:]
        n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
        probe = np.arange(n_in * n_out, dtype=np.float32).reshape(kernel)
        if not np.array_equal(group.to_hf([probe])[0], probe.reshape(n_in, n_out).T):
            raise ValueError(f"{group.hf[0]} is not a plain Linear layout of {group.ours[0]}: "
                             f"LoRA on it has no PEFT form; leave it out of "
                             f"finetune.lora_targets")
        module = PREFIX + _module(group.hf[0])
        out.append(Tensors(
            (f"{module}.lora_A.weight", f"{module}.lora_B.weight"),
            (path + lora.A, path + lora.B),
            lambda t, i=in_shape, o=out_shape: [t[0].T.reshape(*i, rank),
                                                t[1].T.reshape(rank, *o)],
            lambda t, n=n_in, m=n_out: [t[0].reshape(n, rank).T, t[1].reshape(rank, m).T]))
    return out


def write(out_dir: str, ours: dict[str, np.ndarray], groups: list[Tensors], model_cfg,
          base_dir: str) -> str:
    """Writes our adapters `ours` (path -> array) as a PEFT adapter in `out_dir` for the base
    checkpoint written to `base_dir`. Returns the safetensors file."""
    from safetensors.numpy import save_file

    if model_cfg.architecture not in TASK_TYPES:
        raise ValueError(f"LoRA export: model.architecture={model_cfg.architecture!r} has no "
                         f"PEFT task type (decoder or encoder_decoder only)")
    pairs = adapter_groups(groups, {k: v.shape for k, v in ours.items()} | _kernel_shapes(
        ours, groups), lora.targets(model_cfg), model_cfg.lora_rank)
    placed = {name for group in pairs for name in group.ours}
    left = sorted(set(ours) - placed)
    if left:
        raise ValueError(f"LoRA export: adapter {left[0]} has no module in the checkpoint")
    tensors = {}
    for group in pairs:
        for name, value in zip(group.hf, group.to_hf([ours[n] for n in group.ours]),
                               strict=True):
            tensors[name] = np.ascontiguousarray(value, np.float32)
    modules = sorted({_module(name).rsplit(".", 2)[-2] for name in tensors})
    config = dict(peft_type="LORA", task_type=TASK_TYPES[model_cfg.architecture],
                  r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                  lora_dropout=model_cfg.lora_dropout, target_modules=modules,
                  base_model_name_or_path=os.path.abspath(base_dir), inference_mode=True,
                  init_lora_weights=True, **UNSUPPORTED)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    path = os.path.join(out_dir, WEIGHTS_FILE)
    save_file(tensors, path)
    return path


def _kernel_shapes(ours: dict, groups: list[Tensors]) -> dict[str, tuple]:
    """The kernel shapes that `ours`' adapters imply: A's input axes and B's output axes."""
    shapes = {}
    for name in ours:
        if name.endswith("/" + lora.A):
            path = name.removesuffix(lora.A)
            shapes[path + "kernel"] = ours[name].shape[:-1] + ours[path + lora.B].shape[1:]
    return shapes


def read_config(adapter_dir: str) -> dict:
    """The `finetune` section of a PEFT LoRA adapter directory, its options checked."""
    path = os.path.join(adapter_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--adapter={adapter_dir} holds no {CONFIG_FILE}: give a directory "
                         f"that PEFT's save_pretrained wrote")
    with open(path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}; only LORA adapters "
                         f"import")
    for option, off in UNSUPPORTED.items():
        if config.get(option) and config[option] != off:  # absent, empty or off: plain LoRA
            raise ValueError(f"{path}: {option}={config[option]!r} is not supported (plain "
                             f"LoRA only: {option}={off!r})")
    return dict(lora_rank=int(config["r"]), lora_alpha=float(config["lora_alpha"]),
                lora_dropout=float(config.get("lora_dropout") or 0.0))


def read_tensors(adapter_dir: str) -> dict[str, np.ndarray]:
    """The adapter's tensors by name, float32."""
    from safetensors.numpy import load_file

    path = os.path.join(adapter_dir, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--adapter={adapter_dir} holds no {WEIGHTS_FILE}: save the adapter "
                         f"with save_pretrained(..., safe_serialization=True)")
    return {name: np.asarray(value, np.float32) for name, value in load_file(path).items()}


def check_shapes(pairs: list[Tensors], shapes: dict[str, tuple], tensors: dict,
                 adapter_dir: str) -> None:
    """Each adapter tensor has the shape our parameters (`shapes`) imply for it."""
    for group in pairs:
        wanted = group.to_hf([np.zeros(shapes[name], np.float32) for name in group.ours])
        for name, value in zip(group.hf, wanted, strict=True):
            if tensors[name].shape != value.shape:
                raise ValueError(f"{adapter_dir}: {name} has shape {tensors[name].shape}; the "
                                 f"base checkpoint implies {value.shape}: an adapter for "
                                 f"another model?")


def targets_of(names, groups: list[Tensors], adapter_dir: str) -> str:
    """Our `lora_targets` for the adapter tensor `names` on a base of tensor `groups`: the
    kinds of kernel their modules map to. Every module must map to one."""
    kernels = {_module(g.hf[0]): g.ours[0] for g in groups
               if len(g.ours) == 1 and g.ours[0].endswith("/kernel")}
    kinds = set()
    for name in sorted(names):
        module = name.removeprefix(PREFIX).rsplit(".lora_", 1)[0]
        if not name.startswith(PREFIX) or ".lora_" not in name or module not in kernels:
            raise ValueError(f"{adapter_dir}: tensor {name} names no Linear layer of the base "
                             f"checkpoint: an adapter for another model?")
        kinds.add(kernels[module].removesuffix("/kernel").rsplit("/", 1)[-1])
    return ",".join(kind for kind in lora.TARGETS if kind in kinds)
