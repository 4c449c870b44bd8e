"""Straightforward NumPy (float64, explicit loops) references for the loss library."""

import math

import numpy as np

CLAMP = 20.0


def _ratio(lp, old):
    return math.exp(min(max(lp - old, -CLAMP), CLAMP))


def _adv(A, b, t):
    return A[b] if A.ndim == 1 else A[b, t]


def _seq_adv(A, m, b):
    if A.ndim == 1:
        return A[b]
    n = m[b].sum()
    return sum(A[b, t] for t in range(m.shape[1]) if m[b, t]) / max(n, 1)


def token_mean(v, m):
    return sum(v[b, t] for b in range(m.shape[0]) for t in range(m.shape[1]) if m[b, t]) / max(m.sum(), 1)


def sequence_mean(v, m):
    per = []
    for b in range(m.shape[0]):
        n = m[b].sum()
        if n == 0:
            continue
        per.append(v[b] if v.ndim == 1 else sum(v[b, t] for t in range(m.shape[1]) if m[b, t]) / n)
    return sum(per) / len(per) if per else 0.0


def sequence_sum_norm(v, m, max_len):
    total = 0.0
    for b in range(m.shape[0]):
        if v.ndim == 1:
            total += v[b] if m[b].sum() > 0 else 0.0
        else:
            total += sum(v[b, t] for t in range(m.shape[1]) if m[b, t])
    return total / m.shape[0] / max_len


def group_advantages(r, normalize_std=True, eps=1e-6):
    out = np.zeros_like(r, dtype=np.float64)
    for g in range(r.shape[0]):
        row = r[g].astype(np.float64)
        if np.all(row == row[0]):
            continue
        centered = row - row.mean()
        out[g] = centered / (row.std(ddof=1) + eps) if normalize_std else centered
    return out


def rloo(r):
    out = np.zeros_like(r, dtype=np.float64)
    n = r.shape[1]
    for g in range(r.shape[0]):
        for i in range(n):
            out[g, i] = r[g, i] - sum(r[g, j] for j in range(n) if j != i) / (n - 1)
    return out


def ploo(r, tau):
    out = np.zeros_like(r, dtype=np.float64)
    n = r.shape[1]
    for g in range(r.shape[0]):
        for i in range(n):
            others = [r[g, j] / tau for j in range(n) if j != i]
            mx = max(others)
            out[g, i] = r[g, i] - tau * (mx + math.log(sum(math.exp(o - mx) for o in others) / (n - 1)))
    return out


def reward_to_go(r, m, gamma):
    out = np.zeros_like(r, dtype=np.float64)
    for b in range(r.shape[0]):
        acc = 0.0
        for k in reversed(range(r.shape[1])):
            if m[b, k]:
                acc = r[b, k] + gamma * acc
                out[b, k] = acc
            else:
                acc = gamma * acc
    return out


def reinforce(lp, A, m):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t]:
                out[b, t] = -_adv(A, b, t) * lp[b, t]
    return out


def ppo_clip(lp, old, A, m, eps_low=0.2, eps_high=0.2, dual_clip=None):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if not m[b, t]:
                continue
            a = _adv(A, b, t)
            r = _ratio(lp[b, t], old[b, t])
            loss = max(-r * a, -min(max(r, 1 - eps_low), 1 + eps_high) * a)
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            out[b, t] = loss
    return out


def gspo(lp, old, A, m, eps_low=3e-4, eps_high=4e-4):
    out = np.zeros(m.shape[0])
    for b in range(m.shape[0]):
        n = m[b].sum()
        if n == 0:
            continue
        log_s = sum(min(max(lp[b, t] - old[b, t], -CLAMP), CLAMP) for t in range(m.shape[1]) if m[b, t]) / n
        s = math.exp(log_s)
        a = _seq_adv(A, m, b)
        out[b] = max(-s * a, -min(max(s, 1 - eps_low), 1 + eps_high) * a)
    return out


def cispo(lp, old, A, m, eps_low, eps_high):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t]:
                w = min(max(_ratio(lp[b, t], old[b, t]), max(1 - eps_low, 0.0)), 1 + eps_high)
                out[b, t] = -w * _adv(A, b, t) * lp[b, t]
    return out


def keep(lp, old, A, m, eps_low=None, eps_high=None, delta=None):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if not m[b, t]:
                continue
            r = _ratio(lp[b, t], old[b, t])
            drop = (eps_low is not None and r < 1 - eps_low) or (eps_high is not None and r > 1 + eps_high)
            a = _adv(A, b, t)
            if delta is not None and np.sign(a) * (math.exp(lp[b, t]) - math.exp(old[b, t])) > delta:
                drop = True
            out[b, t] = 0.0 if drop else 1.0
    return out


def mirror_descent(lp, old, A, m, tau, level, clip_eps_low=None, clip_eps_high=None, clip_delta=None):
    k = keep(lp, old, A, m, clip_eps_low, clip_eps_high, clip_delta)
    if level == "token":
        out = np.zeros(m.shape)
        for b in range(m.shape[0]):
            for t in range(m.shape[1]):
                if m[b, t]:
                    x = lp[b, t] - old[b, t]
                    out[b, t] = -k[b, t] * _adv(A, b, t) * lp[b, t] + 0.5 * tau * x * x
        return out
    out = np.zeros(m.shape[0])
    for b in range(m.shape[0]):
        n = m[b].sum()
        if n == 0:
            continue
        a = _seq_adv(A, m, b)
        delta = sum(lp[b, t] - old[b, t] for t in range(m.shape[1]) if m[b, t])
        kept = sum(k[b, t] * (lp[b, t] - old[b, t]) for t in range(m.shape[1]) if m[b, t])
        out[b] = (a * a / (2 * tau) - a * kept + 0.5 * tau * delta * delta) / n
    return out


def decoupled_ppo(lp, prox, behav, A, m, eps_low=0.2, eps_high=0.2, cap=None):
    surrogate = ppo_clip(lp, prox, A, m, eps_low, eps_high)
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t]:
                w = _ratio(prox[b, t], behav[b, t])
                if cap is not None:
                    w = min(w, cap)
                out[b, t] = w * surrogate[b, t]
    return out


def kl(lp, ref, m, estimator):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if not m[b, t]:
                continue
            x = min(max(lp[b, t] - ref[b, t], -CLAMP), CLAMP)
            if estimator == "k1":
                out[b, t] = x
            elif estimator == "k2":
                out[b, t] = 0.5 * x * x
            else:
                out[b, t] = min(max(math.exp(-x) - 1 + x, -10.0), 10.0)
    return out


def entropy(logits):
    flat = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    out = []
    for row in flat:
        p = np.exp(row - row.max())
        p /= p.sum()
        out.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
    return np.array(out).reshape(logits.shape[:-1])


def _seq_log_ratio(lp, slp, m, b, level, t):
    if level == "token":
        return min(max(lp[b, t] - slp[b, t], -CLAMP), CLAMP)
    n = m[b].sum()
    return sum(min(max(lp[b, s] - slp[b, s], -CLAMP), CLAMP) for s in range(m.shape[1]) if m[b, s]) / n


def tis(lp, slp, m, cap, level):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t]:
                out[b, t] = min(math.exp(_seq_log_ratio(lp, slp, m, b, level, t)), cap)
    return out


def icepop(lp, slp, m, low, high, level):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t]:
                rho = math.exp(_seq_log_ratio(lp, slp, m, b, level, t))
                out[b, t] = 1.0 if low <= rho <= high else 0.0
    return out
