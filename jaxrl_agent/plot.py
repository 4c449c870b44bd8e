"""Curves of a run: `python -m jaxrl_agent.plot <workdir> [--out curves.png]`.

Reads `<workdir>/metrics.jsonl` and writes a PNG with four panels against wall-clock minutes since
the run started: held-out pass@1 per difficulty (every evaluation, SFT and RL), the SFT loss, the
RL training success and reward, and the RL signal/drift figures (share of groups with a non-zero
advantage, sampled-token entropy, policy lag). Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def load_records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file at {path}; expected a run's workdir")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                # A run killed mid-write leaves a torn last line; everything before it is kept.
                print(f"skipping unreadable line {number} of {path}", file=sys.stderr)
    return records


def series(records: list[dict], stages: tuple[str, ...], key: str) -> tuple[list[float], list[float]]:
    """(minutes since the first record, values) of `key` over the records of the given stages."""
    if not records:
        return [], []
    start = records[0]["time"]
    xs, ys = [], []
    for r in records:
        if r.get("stage") in stages and isinstance(r.get(key), (int, float)):
            xs.append((r["time"] - start) / 60.0)
            ys.append(float(r[key]))
    return xs, ys


def plot(workdir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(workdir)
    out = out or os.path.join(workdir, "curves.png")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    eval_stages = ("initial_eval", "sft_eval", "rl_eval")
    eval_keys = sorted({k for r in records if r.get("stage") in eval_stages for k in r if k.startswith("eval/")})
    panels = collections.OrderedDict([
        ("held-out evaluation", [(eval_stages, k) for k in eval_keys]),
        ("SFT", [(("sft",), "loss"), (("sft",), "entropy")]),
        ("RL training", [(("rl",), "success"), (("rl",), "reward")]),
        ("RL signal and drift", [(("rl",), "nonzero_advantage_group_share"), (("rl",), "entropy"),
                                 (("rl",), "policy_lag_max")]),
    ])
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for stages, key in lines:
            xs, ys = series(records, stages, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("minutes")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run(argv=None) -> int:
    """`jaxrl-agent plot <workdir> [--out PNG]` (argv[0] is the program name)."""
    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog=argv[0], description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--out", default=None, help="PNG path (default: <workdir>/curves.png)")
    args = parser.parse_args(argv[1:])
    print(plot(args.workdir, args.out))
    return 0


def main(argv=None) -> None:
    """`python -m jaxrl_agent.plot <workdir>` (argv without the program name)."""
    run(["python -m jaxrl_agent.plot", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
