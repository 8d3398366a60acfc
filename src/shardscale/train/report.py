"""Outputs of a run (rank 0 only): ``metrics.jsonl``, ``loss_scale.png``, the summary table."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
PLOT = "loss_scale.png"
SUMMARY = "summary.json"


class MetricsWriter:
    """Appends one JSON line per step to ``<out>/metrics.jsonl``.

    Keys: ``step`` (1-based), ``loss`` (mean over ranks), ``scale`` (the loss scale the step's
    backward used), ``skipped`` (bool: the optimizer step was skipped on rank 0),
    ``ranks_skipped`` (how many ranks skipped it: 0 or world size when the ranks agree).

    Args:
        out: the run directory (created if needed).
        start_step: steps already done (resume). Lines of a previous run with ``step >
            start_step`` are dropped, so the file always describes one consistent history.
    """

    def __init__(self, out: str | Path, start_step: int = 0) -> None:
        self.path = Path(out) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] <= start_step] if start_step else []
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append ``rows`` (dicts with the keys above)."""
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (empty list if it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Loss (left axis) and loss scale (right axis, log scale) against step; skipped steps are
    marked with red crosses on the scale curve. Written with matplotlib's Agg backend.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(
        steps, [r["loss"] for r in rows], color="tab:blue", lw=1, label="loss (mean over ranks)"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    ax2 = ax.twinx()
    ax2.step(
        steps,
        [r["scale"] for r in rows],
        where="post",
        color="tab:orange",
        lw=1.5,
        label="loss scale",
    )
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        ax2.scatter(
            [r["step"] for r in skipped],
            [r["scale"] for r in skipped],
            marker="x",
            color="tab:red",
            zorder=3,
            label=f"skipped step ({len(skipped)})",
        )
    ax2.set_yscale("log", base=2)
    ax2.set_ylabel("loss scale (log2)", color="tab:orange")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    # below the axes: inside, it would hide part of the curves whatever the corner
    ax.legend(
        lines[0] + lines2[0],
        lines[1] + lines2[1],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.13),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_summary(out: str | Path, summary: dict[str, Any]) -> None:
    """Write ``<out>/summary.json``."""
    with open(Path(out) / SUMMARY, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


def table(summary: dict[str, Any]) -> str:
    """The end-of-run table printed by rank 0."""
    s = summary
    if s["task"] == "digits":
        result = (
            "test accuracy",
            f"{100 * s['test_accuracy']:.2f} %  (test loss {s['test_loss']:.4f})",
        )
    else:
        result = ("val loss", f"{s['test_loss']:.4f}  (perplexity {s['perplexity']:.2f})")
    scale = s["final_scale"]
    scale_txt = f"{scale:g}" + (f"  (2**{math.log2(scale):g})" if scale > 0 else "")
    resumed = bool(s["start_step"])
    skips = f"{s['skipped_steps']}  (backoffs {s['backoffs']}, growths {s['growths']}"
    first, last = s.get("skip_counts_steps") or (1, s["steps"])
    if first > 1:
        skips += f"; this run segment: steps {first}-{last}"
    elif resumed:
        skips += f"; steps {first}-{last}"
    rows = [
        ("run", s["setup"]),
        result,
        ("steps", f"{s['steps']}" + (f"  (resumed at {s['start_step']})" if resumed else "")),
    ]
    if resumed:
        note = s.get("scaler_state_note") or ""
        if s["scaler_state_restored"]:
            rows.append(("scaler state", "restored" + (f" ({note})" if note else "")))
        else:
            rows.append(("scaler state", f"not restored: {note}"))
        if s.get("run_changes"):
            rows.append(
                (
                    "not bit-exact",
                    "; ".join(s["run_changes"]) + ": not the checkpoint's run continued",
                )
            )
    if s.get("superseded"):
        sup = s["superseded"]
        rows.append(
            (
                "superseded",
                f"{sup['checkpoints']} later checkpoint(s) of a previous run here moved to "
                f"{sup['folder']}",
            )
        )
    rows += [
        ("skipped steps", skips + ")"),
        ("final scale", scale_txt),
        ("time / step", f"{1000 * s['time_per_step']:.2f} ms  ({s['train_time']:.1f} s)"),
        (
            "output",
            f"{s['out']}  ({METRICS}, {PLOT}, {SUMMARY}, checkpoints/{Path(s['checkpoint']).name})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
