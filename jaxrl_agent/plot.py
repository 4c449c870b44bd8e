"""A run's curves on one page: `jaxrl-agent plot <workdir> [--out curves.png]`.

Reads `<workdir>/metrics.jsonl` and writes a PNG of six panels against the run's global step (SFT
updates, then `sft.steps` + RL iteration; a dotted line marks where RL starts): held-out greedy
pass@1 per difficulty and `eval/success`; RL training success and reward; sampled-token entropy
per environment; the learning signal (share of groups with a non-zero advantage); drift (the
learner-sampler log-prob gap, mean and max, and the mean policy lag); the SFT loss. A second page,
`invariants.png` beside it, has the three invariants (`jaxrl_agent/invariants`) — exploration,
learning signal, drift — with the iterations their alarms were on shaded. Uses matplotlib's Agg
backend (no display needed).
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


INVARIANT_ALARMS = {"exploration": ("entropy",), "signal": ("signal",), "drift": ("serve_gap", "lag")}


def invariant_panels(records: list[dict]) -> list[tuple[str, list[tuple[tuple[str, ...], str, str]]]]:
    """The invariants page: [(title, [(stages, key, label), ...]), ...]."""
    def line(key, label):
        return (("rl",), f"invariants/{key}", label)

    shares = sorted({k for r in records if r.get("stage") == "rl" for k in r
                     if k.startswith("invariants/signal/all_") and "/d" in k})
    return [
        ("exploration", [line("exploration/entropy_min", "lowest sampled-token entropy (nats)"),
                         line("exploration/pass_gap", "pass@k - pass@1"),
                         line("exploration/identical_group_share", "groups all identical")]),
        ("learning signal", [line("signal/nonzero_share", "groups with non-zero advantage"),
                             line("signal/advantage_magnitude", "mean |advantage|")]
         + [(("rl",), k, k.split("/", 2)[2]) for k in shares]),
        ("drift", [line("drift/serve_gap_p99", "train/serve gap p99 (same version)"),
                   line("drift/serve_gap_max", "... max"),
                   line("drift/policy_kl", "policy movement KL(start||end)"),
                   line("drift/lag_max", "policy lag max (versions)"),
                   (EVAL_STAGES, "eval/deploy_gap", "deploy gap: greedy - sampled held-out success")]),
    ]


def _alarm_spans(records: list[dict], names: tuple[str, ...]) -> list[tuple[float, float]]:
    """Global-step intervals during which any of the named alarms was on."""
    spans, start = [], None
    for r in records:
        if r.get("stage") != "rl":
            continue
        on = any(r.get(f"invariants/alarm/{n}") == 1.0 for n in names)
        if on and start is None:
            start = _x(r) - 0.5
        elif not on and start is not None:
            spans.append((start, _x(r) - 0.5))
            start = None
    if start is not None:
        spans.append((start, max(_x(r) for r in records if r.get("stage") == "rl") + 0.5))
    return spans


def _draw(records, page, out, rows, cols, title, *, log_titles=(), shade=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl_start = min((_x(r) - r.get("step", 0) for r in records if r.get("stage") == "rl"), default=None)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.75 * rows), squeeze=False)
    for ax, (name, lines) in zip(axes.flat, page):
        for stages, key, label in lines:
            xs, ys = series(records, stages, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label,
                        linewidth=2.2 if key == "eval/success" else 1.2)
        if name in log_titles:
            ax.set_yscale("symlog", linthresh=1e-5 if shade else 1e-3)
        for left, right in (shade or {}).get(name, []):
            ax.axvspan(left, right, color="red", alpha=0.12, label="alarm on" if left == shade[name][0][0] else None)
        if rl_start is not None and name != "SFT":
            ax.axvline(rl_start, color="grey", linestyle=":", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("global step (SFT updates, then RL iterations)", fontsize=8)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot(workdir: str, out: str | None = None) -> str:
    """Writes the curves page (`out`, default <workdir>/curves.png) and the invariants page beside it
    (`invariants.png`, or `<out stem>_invariants.png`); returns the curves page's path."""
    records = load_records(workdir)
    out = out or os.path.join(workdir, "curves.png")
    name = os.path.basename(os.path.abspath(workdir))
    _draw(records, panels(records), out, 2, 3, name, log_titles=("drift",))
    shade = {title: _alarm_spans(records, names) for title, names in INVARIANT_ALARMS.items()}
    _draw(records, invariant_panels(records), invariants_path(out), 1, 3, f"{name}: the three invariants",
          log_titles=("drift",), shade=shade)
    return out


def invariants_path(out: str) -> str:
    """The invariants page's path for a curves page at `out`."""
    folder, base = os.path.split(out)
    stem, ext = os.path.splitext(base)
    return os.path.join(folder, "invariants.png" if base == "curves.png" else f"{stem}_invariants{ext or '.png'}")


def run(argv=None) -> int:
    """`jaxrl-agent plot <workdir> [--out PNG]` (argv[0] is the program name)."""
    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog=argv[0], description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--out", default=None, help="PNG path (default: <workdir>/curves.png)")
    args = parser.parse_args(argv[1:])
    out = plot(args.workdir, args.out)
    print(out)
    print(invariants_path(out))
    return 0


def main(argv=None) -> None:
    """`python -m jaxrl_agent.plot <workdir>` (argv without the program name)."""
    run(["python -m jaxrl_agent.plot", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
