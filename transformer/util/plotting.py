"""Drawing with matplotlib (Agg backend: no display needed): the shared heatmap and overlay,
saving a figure to a local or remote path, and the sinusoidal positional encoding's figure."""

from __future__ import annotations

import io
import os

import numpy as np
from etils import epath

from transformer.util import atomic

MAX_POSITIONS = 4096  # `positions` draws a [length, length] matrix
MAX_D_MODEL = 8192


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, dpi: int = 100) -> str:
    """Writes `fig` to `path` at `dpi` (its format from the extension; PNG without one), local
    or remote (gs://: rendered in memory, then written whole through `atomic`), and closes it."""
    image = io.BytesIO()
    fig.savefig(image, format=os.path.splitext(path)[1][1:] or None, dpi=dpi)
    pyplot().close(fig)
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_atomically(path, image.getvalue())
    return path


def heatmap(ax, weights: np.ndarray, queries: list[str], keys: list[str], title: str,
             labels: bool = True):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_title(title, fontsize=9)
    if labels:
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
        ax.set_yticks(range(len(queries)), queries, fontsize=7)
        ax.set_xlabel("attends to (keys)")
        ax.set_ylabel("query")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    return image


def overlay(ax, image: np.ndarray, grid_map: np.ndarray, title: str):
    """The image in grey with `grid_map` [G, G] over it, one block per patch, scaled to its
    maximum."""
    h, w = image.shape[:2]
    ax.imshow(image if image.shape[-1] == 3 else image[..., 0], cmap="gray",
              extent=(0, w, h, 0))
    ax.imshow(grid_map / max(float(grid_map.max()), 1e-12), cmap="inferno", alpha=0.55,
              vmin=0.0, vmax=1.0, extent=(0, w, h, 0), interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_positions(d_model: int, length: int, out: str) -> str:
    """The sinusoidal encoding [length, d_model] and its dot products between positions: the
    bands show that the similarity depends on the distance between positions only."""
    from transformer.ops.layers import sinusoidal_position_encoding

    if not (2 <= d_model <= MAX_D_MODEL and d_model % 2 == 0):
        raise ValueError(f"--d_model={d_model} must be even, from 2 to {MAX_D_MODEL}")
    if not 2 <= length <= MAX_POSITIONS:
        raise ValueError(f"--length={length} must be from 2 to {MAX_POSITIONS} positions")
    plt = pyplot()
    table = np.asarray(sinusoidal_position_encoding(length, d_model))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    image = left.imshow(table, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    left.set_title(f"sinusoidal encoding, d_model {d_model}")
    left.set_xlabel("dimension (sin at even, cos at odd)")
    left.set_ylabel("position")
    fig.colorbar(image, ax=left)
    image = right.imshow(table @ table.T, cmap="viridis", aspect="auto")
    right.set_title("PE(pos) . PE(pos'): a function of pos - pos' only")
    right.set_xlabel("position pos'")
    right.set_ylabel("position pos")
    fig.colorbar(image, ax=right)
    return save(fig, out)
