"""The demo's plots as PNG files: the loss curve and the per-expert load over training.

Drawn with matplotlib's object-oriented API (a Figure, saved through the Agg renderer):
no GUI backend is needed and no pyplot state of the calling process is touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure


def plot_loss(losses, path: Path) -> None:
    """The cross entropy of steps 1..len(losses)."""
    fig = Figure(figsize=(6.4, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(np.arange(1, len(losses) + 1), losses, linewidth=1)
    ax.set(xlabel="step", ylabel="cross entropy (nats per character)", ylim=(0, None), title="training loss")
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=120)


def plot_expert_load(tokens_per_expert, path: Path) -> None:
    """tokens_per_expert [steps, L, E], the (token, expert) pairs routed to each expert, as
    one heatmap per layer (up to 4 a column): expert against step, coloured by the load over
    the balanced load (1: balanced, 0: idle)."""
    load = np.asarray(tokens_per_expert, np.float64)
    steps, layers, experts = load.shape
    relative = load / np.maximum(load.mean(axis=-1, keepdims=True), 1e-9)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(relative.max())))
    rows = min(layers, 4)
    cols = -(-layers // rows)
    fig = Figure(figsize=(1 + 5.4 * cols, 1 + rows * float(np.clip(0.15 * experts, 1.2, 2.5))), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True).T.ravel()
    for layer, ax in enumerate(axes):
        if layer >= layers:
            ax.set_axis_off()
            continue
        image = ax.imshow(relative[:, layer].T, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                          extent=(0.5, steps + 0.5, experts - 0.5, -0.5))
        ax.set(ylabel=f"layer {layer}: expert")
        if layer % rows == rows - 1 or layer == layers - 1:
            ax.set_xlabel("step")
    fig.suptitle("per-expert load / balanced load")
    fig.colorbar(image, ax=list(axes), label="load / balanced")
    fig.savefig(path, dpi=120)
