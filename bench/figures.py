"""How every benchmark writes its plot: one size and resolution, the folder made, the figure freed."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def save(fig: Figure, path: Path) -> None:
    from matplotlib import pyplot as plt  # after the benchmark chose its backend

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
