"""Local `evaluate` metric modules, so `evaluate.load` works offline (the Hub versions need a download).

Each metric lives in `metrics/<name>/<name>.py`, the layout `evaluate.load(folder)` expects.
"""

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent
AVAILABLE = ("accuracy", "perplexity")


def metric_path(name: str) -> str:
    """Folder of the local metric `name` (pass it to `evaluate.load`)."""
    if name not in AVAILABLE:
        raise ValueError(f"unknown local metric {name!r}; available: {', '.join(AVAILABLE)}")
    return str(METRICS_DIR / name)


def load_metric(name: str, **kwargs):
    """`evaluate.load` of the local metric `name`, with no network access."""
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)
