"""The sections' plots: a figure on the file-only backend, and how one is finished and saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def axes(figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A new figure and its axes, drawn without a display (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def save(fig: Any, path: Path) -> Path:
    """Lay the figure out, write it as PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(
    fig: Any,
    ax: Any,
    path: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    legend_size: float | None = None,
) -> Path:
    """Label the axes, add a grid and the legend (`legend_size` None: matplotlib's default
    size), and save the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    return save(fig, path)


def save_ratio_plot(fig: Any, ax: Any, path: Path, xlabel: str, title: str) -> Path:
    """Finish a plot of eval loss / data-parallel at equal tokens: the parity line at 1, the
    labels, a small legend; write it as PNG."""
    ax.axhline(1.0, color="gray", linestyle="--", label="data-parallel")
    ylabel = "eval loss / data-parallel at equal tokens"
    return finish(fig, ax, path, xlabel, ylabel, title, legend_size=8)
