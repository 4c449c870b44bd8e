"""A run's curves on one page: `jaxrl-agent plot <workdir> [--out curves.png]`.

Reads `<workdir>/metrics.jsonl` and writes a PNG of six panels against the run's global step (SFT
updates, then `sft.steps` + RL iteration; a dotted line marks where RL starts): held-out greedy
pass@1 per difficulty and `eval/success`; RL training success and reward; sampled-token entropy
per environment; the learning signal (share of groups with a non-zero advantage); drift (the
learner-sampler log-prob gap, mean and max, and the mean policy lag); the SFT loss. Uses
matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
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


def _x(record) -> float:
    return float(record.get("global_step", record.get("step", 0)))


def series(records: list[dict], stages: tuple[str, ...], key: str) -> tuple[list[float], list[float]]:
    """(global steps, values) of `key` over the records of the given stages."""
    xs, ys = [], []
    for r in records:
        if r.get("stage") in stages and isinstance(r.get(key), (int, float)):
            xs.append(_x(r))
            ys.append(float(r[key]))
    return xs, ys


EVAL_STAGES = ("initial_eval", "sft_eval", "rl_eval")


def panels(records: list[dict]) -> list[tuple[str, list[tuple[tuple[str, ...], str, str]]]]:
    """[(title, [(stages, key, label), ...]), ...]: what each panel draws (keys the run has)."""
    def keys(stages, test):
        return sorted({k for r in records if r.get("stage") in stages for k in r if test(k)})

    per_level = keys(EVAL_STAGES, lambda k: k.startswith("eval/") and "/pass@1/" in k and "sampled" not in k)
    entropies = keys(("rl",), lambda k: k.startswith("sampled_entropy/"))
    return [
        ("held-out success (greedy pass@1)",
         [(EVAL_STAGES, k, k[len("eval/"):].replace("pass@1/", "")) for k in per_level]
         + [(EVAL_STAGES, "eval/success", "eval/success")]),
        ("RL training", [(("rl",), "success", "success"), (("rl",), "reward", "reward")]),
        ("exploration: sampled-token entropy (nats)", [(("rl",), k, k.split("/", 1)[1]) for k in entropies]),
        ("learning signal", [(("rl",), "nonzero_advantage_group_share", "groups with non-zero advantage")]),
        ("drift", [(("rl",), "drift/sampler_abs_diff_mean", "|logp learner - sampler| mean"),
                   (("rl",), "drift/sampler_abs_diff_max", "... max"),
                   (("rl",), "policy_lag_mean", "policy lag (versions)")]),
        ("SFT", [(("sft",), "loss", "loss"), (("sft",), "entropy", "entropy")]),
    ]


def plot(workdir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(workdir)
    out = out or os.path.join(workdir, "curves.png")
    rl_start = min((_x(r) - r.get("step", 0) for r in records if r.get("stage") == "rl"), default=None)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (title, lines) in zip(axes.flat, panels(records)):
        for stages, key, label in lines:
            xs, ys = series(records, stages, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label,
                        linewidth=2.2 if key == "eval/success" else 1.2)
        if title == "drift":
            ax.set_yscale("symlog", linthresh=1e-3)
        if rl_start is not None and title != "SFT":
            ax.axvline(rl_start, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("global step (SFT updates, then RL iterations)", fontsize=8)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(os.path.abspath(workdir)), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
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
