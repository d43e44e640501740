"""The math. Algorithms differ only in how rewards become a per-token advantage A [N, T]; all of them
share one clipped policy loss and one value loss. Pure functions of tensors, no I/O. Read after tasks.play;
then model.HFPolicy.score, which gives pg_loss its logp.
"""
import torch

from utils import Batch, all_reduce_sum, discounted_cumsum, gae, masked_sum, reply_ends, whiten


# --- advantage estimators: fn(batch, cfg) -> (A [N, T], returns [N, T] or None) ----------------

def returns_to_go(b, cfg):
    """G_t = sum_{s>=t} gamma^(s-t) r_s. A control episode cut by a time limit did not end: the steps it would have
    gone on for are added at its own mean reward, + gamma^(L-t) r_mean / (1 - gamma) (partial-episode bootstrapping,
    arXiv 1712.00378). Without it a CartPole episode at the limit says its last ~100 actions were its worst, and a
    solved policy drifts (benchmarks/README.md "CartPole that stays solved")."""
    G = discounted_cumsum(b.rewards, b.mask, cfg.gamma)  # [N, T]
    if b.final_obs is None or cfg.gamma >= 1:  # LLM: a reply cut at the token limit is just cut; gamma 1: no tail
        return G
    L = b.mask.sum(1, keepdim=True)  # [N, 1]
    tail = b.truncated[:, None] * (b.seq_reward[:, None] / L.clamp(min=1)) / (1 - cfg.gamma)  # [N, 1]
    to_cut = (L - torch.arange(G.shape[1])).clamp(min=0)  # [N, T] steps from t to the cut; 0 on padding, where
    return G + tail * cfg.gamma ** to_cut * b.mask  # gamma^(L - t) would overflow to inf, and 0 * inf is NaN


def reinforce(b, cfg):
    """A_t = G_t, the discounted return-to-go (Williams 1992); whiten_returns: (G_t - mean) / std over the batch's
    real steps (slightly biased: the mean includes the sample's own G). --credit turn: the reply's return G_k."""
    G = reply_returns(b, cfg)[0] if cfg.credit == "turn" else returns_to_go(b, cfg)  # [N, T]
    return whiten(G, b.mask) if cfg.whiten_returns else G, None


def reinforce_baseline(b, cfg):
    """A_t = G_t - b, b the mean of G_t over the batch's real steps. --credit turn: turn_credit."""
    if cfg.credit == "turn":
        return turn_credit(b, cfg), None
    G = returns_to_go(b, cfg)  # [N, T]
    total = all_reduce_sum(torch.stack([masked_sum(G, b.mask), b.mask.sum()]))
    return (G - total[0] / total[1]) * b.mask, None


def ppo(b, cfg):
    """GAE under the OLD critic (arXiv 1506.02438), whitened; R = A + V the critic's target. LLMs: gamma = lam = 1.
    --kl-in-reward: the per-token reward r_t - kl_coef (old_logp - ref_logp), and no KL term in the loss."""
    r = b.rewards - cfg.kl_coef * (b.old_logp - b.ref_logp) * b.mask if cfg.kl_in_reward else b.rewards  # [N, T]
    A, R = gae(r, b.values, b.mask, cfg.gamma, cfg.lam, b.last_value)
    return whiten(A, b.mask), R


def group_stats(R, group):
    """-> (R - group mean, unbiased group std, group size), each [N]. A group is adjacent rows with one id (tasks build
    them so, serve.unpack_batch checks a worker's, torchrun ranks take whole groups); the estimators pass one row per
    run (run_stats). A group whose rewards are all equal gets exactly 0 (not float dust like 1e-17 / eps)."""
    _, g, size = torch.unique_consecutive(group, return_inverse=True, return_counts=True)  # [N], [groups]
    assert len(size) == len(torch.unique(group)), f"a group's rows must be adjacent; got groups {group.tolist()}"
    per_group = torch.zeros(len(size))

    def reduce(x, how):  # [N] -> [groups]
        return per_group.scatter_reduce(0, g, x, how, include_self=False)
    centered = torch.where((reduce(R, "amax") > reduce(R, "amin"))[g], R - reduce(R, "mean")[g], 0.0)
    std = (reduce(centered**2, "sum") / (size - 1).clamp(min=1)).sqrt()
    return centered, std[g], size[g]


def runs_of(b):
    """-> (first [U], last [U]: each run's first and last row; of [N]: each row's run 0..U-1). A run is one episode;
    an agent run whose calls did not extend each other is several adjacent rows (b.run), each carrying the run's
    reward. Baselines are taken over runs, never rows: a run in two rows would otherwise weigh twice in its group's
    mean and std, and under RLOO enter its own baseline."""
    rows = torch.arange(len(b.mask))
    if b.run is None:
        return rows, rows, rows
    _, of = torch.unique_consecutive(b.run, return_inverse=True)  # [N]
    per_run = torch.zeros(int(of.max()) + 1, dtype=torch.long)
    first, last = (per_run.scatter_reduce(0, of, rows, how, include_self=False) for how in ("amin", "amax"))
    return first, last, of


def run_stats(b):
    """group_stats over runs (the reward of each run's last row), spread back to every row of the run. A group of
    runs A (two rows, reward 1) and B (one row, reward 0): centered .5, .5, -.5; std .707; size 2."""
    _, last, of = runs_of(b)
    return tuple(x[of] for x in group_stats(b.seq_reward[last], b.group[last]))


def grpo(b, cfg):
    """A_i = (R_i - mean_g R) / (std_g R + adv_eps), std unbiased (arXiv 2402.03300), on every token of sample i;
    norm_std false: Dr.GRPO's A_i = R_i - mean_g R (arXiv 2503.20783). --credit turn: turn_credit."""
    if cfg.credit == "turn":
        return turn_credit(b, cfg), None
    centered, std, _ = run_stats(b)  # [N]
    A = torch.where(std > 0, centered / (std + cfg.adv_eps), 0.0) if cfg.norm_std else centered
    return A[:, None] * b.mask, None


def rloo(b, cfg):
    """A_i = R_i - mean_{j != i} R_j = G / (G - 1) (R_i - mean_g R) (arXiv 2402.14740). --credit turn: turn_credit."""
    if cfg.credit == "turn":
        return turn_credit(b, cfg), None
    centered, _, G = run_stats(b)
    return (G / (G - 1) * centered)[:, None] * b.mask, None


def reply_returns(b, cfg):
    """--credit turn: reply k earns r_k (on its last token); its return G_k = r_k + turn_discount G_(k+1) is on each of
    its tokens. -> (G [N, T], reply index k [N, T]). Rewards [0, 1, .5], discount .5 -> [.625, 1.25, .5]"""
    ends = reply_ends(b.mask)  # [N, T]
    G = discounted_cumsum(b.rewards, b.mask, torch.where(ends, cfg.turn_discount, 1.0))
    return G, (ends.cumsum(1) - ends.long()) * (b.mask > 0)


def turn_credit(b, cfg):
    """--credit turn, group estimators: A = G_ik - mean of G_jk over the OTHER runs j of i's group that reached
    reply k (no other did: baseline 0), on every token of reply k; a run's replies are numbered across its rows.
    Leaving run i out keeps the estimate unbiased though the policy decides which runs reach reply k: the
    baseline then depends on no action of run i (README "Per-turn credit"; tested by Monte Carlo against the
    exact gradient).
    A group of three, discount 1: returns per reply [1, 1], [0, 0] and [1] (one reply) -> reply 0: A = 1 - (0 + 1) / 2
    = .5, 0 - (1 + 1) / 2 = -1, 1 - (1 + 0) / 2 = .5; reply 1, reached by the first two only: 1 - 0 = 1, 0 - 1 = -1."""
    G, k = reply_returns(b, cfg)  # [N, T] each, k numbered within the row
    first, last, of = runs_of(b)
    replies = reply_ends(b.mask).sum(1)  # [N]
    before = replies.cumsum(0) - replies  # [N] replies in the rows above; minus the run's first row's: in the run
    real = b.mask > 0
    k = k + (before - before[first][of])[:, None] * real  # [N, T] numbered across the run's rows
    K = int(k.max()) + 1
    slot = torch.where(real, k, K)  # [N, T]; padding and environment tokens land in a spare column K
    per_run = [G.new_zeros(len(last), K).index_add(0, of, G.new_zeros(len(G), K + 1).scatter(1, slot, x)[:, :K])
               for x in (G, real.float())]  # each [U, K]: each reply's return (one value per reply); 1 where it exists
    V, reached = per_run
    _, g = torch.unique(b.group[last], return_inverse=True)  # [U] each run's group
    total, count = (G.new_zeros(int(g.max()) + 1, K).index_add(0, g, x) for x in (V, reached))  # per group and k
    others = count[g] - reached  # [U, K] how many OTHER runs of the group reached reply k
    A = (V - torch.where(others > 0, (total[g] - V) / others.clamp(min=1), 0.0)) * reached  # [U, K]
    return A[of].gather(1, k) * b.mask


ADVANTAGES = {"reinforce": reinforce, "reinforce_baseline": reinforce_baseline, "ppo": ppo,
              "grpo": grpo, "rloo": rloo}


def needs_groups(advantage, cfg):
    """Does the estimator give a sample alone in its group no signal (A all 0 or not finite)? Asked of the estimator
    itself, on two one-step samples with rewards 1 and 0, so an algorithm a user adds is covered too."""
    def signal(group):
        one = torch.ones(2, 1)
        b = Batch(obs=one, actions=one.long(), mask=one, rewards=torch.tensor([[1.0], [0.0]]),
                  group=torch.tensor(group), truncated=torch.zeros(2, dtype=torch.bool), values=torch.zeros(2, 1))
        A = advantage(b, cfg)[0]
        return bool(torch.isfinite(A).all() and A.abs().sum() > 0)
    return not signal([0, 1]) and signal([0, 0])


# --- losses -------------------------------------------------------------------------------------

def loss_weights(mask, cfg, max_len):
    """w [N, T] such that sum(w * l) over EVERY micro-batch and rank is the chosen aggregation. The
    denominators are summed globally once, so splitting the batch never rescales the gradient.
      token_mean               sum(m l) / sum(m)
      seq_mean_token_mean      mean_i sum_t(m l) / sum_t(m)          (original GRPO, length-biased)
      seq_mean_token_sum_norm  sum(m l) / (N * max_len)              (Dr.GRPO: a constant denominator)"""
    if cfg.loss_agg == "token_mean":
        return mask / all_reduce_sum(mask.sum()).clamp(min=1)
    n = all_reduce_sum(torch.tensor(float(mask.shape[0]), device=mask.device))
    if cfg.loss_agg == "seq_mean_token_mean":
        return mask / mask.sum(1, keepdim=True).clamp(min=1) / n
    return mask / (n * max_len)


def pg_loss(logp, old_logp, adv, mask, cfg, weight=None, entropy=None, ref_logp=None, sampler_logp=None):
    """Per token: l = -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A), ratio = exp(logp - old_logp)
    (arXiv 1707.06347; clip-higher from DAPO, arXiv 2503.14476); dual-clip bounds l <= -c A for A < 0
    (arXiv 1912.09729); times min(exp(old_logp - sampler_logp), tis_clip) when TIS is on; minus
    ent_coef * entropy; plus kl_coef * KL-estimate(logp - ref_logp). loss = sum(weight * l), weight from
    loss_weights (this tensor alone when None, with max_len = T). All inputs [N, T].
    -> (loss, stats): stats are sums over real tokens ('tokens' counts them), 'ratio_max' a max."""
    assert logp.shape == old_logp.shape == adv.shape == mask.shape, "pg_loss wants [N, T] everywhere"
    weight = loss_weights(mask, cfg, mask.shape[1]) if weight is None else weight
    real = mask > 0  # off the mask (padding, environment tokens) nothing may reach exp(): 0 * inf would be NaN,
    logp, old_logp, ref_logp, sampler_logp = (  # in the loss and in its gradient alike
        x if x is None else torch.where(real, x, 0.0) for x in (logp, old_logp, ref_logp, sampler_logp))
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - cfg.eps, 1 + cfg.eps_high)
    l = -torch.min(ratio * adv, clipped * adv)
    if cfg.dual_clip:
        l = torch.where(adv < 0, torch.min(l, -cfg.dual_clip * adv), l)
    if cfg.tis_clip and sampler_logp is not None:
        l = l * torch.exp(old_logp - sampler_logp).clamp(max=cfg.tis_clip)
    if cfg.ent_coef and entropy is not None:
        l = l - cfg.ent_coef * entropy
    kl = None
    if cfg.kl_coef and not cfg.kl_in_reward and ref_logp is not None:
        d = logp - ref_logp
        kl = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[cfg.kl_estimator]
        l = l + cfg.kl_coef * kl
    loss = (weight * l).sum()
    with torch.no_grad():
        log_ratio = logp - old_logp
        stats = {"tokens": mask.sum(), "ratio": masked_sum(ratio, mask),
                 "ratio_max": (ratio * mask).max() if mask.any() else ratio.new_zeros(()),
                 "clipfrac": masked_sum((clipped * adv < ratio * adv).float(), mask),
                 "approx_kl": masked_sum(ratio - 1 - log_ratio, mask)}  # k3 of old -> new
        if entropy is not None:
            stats["entropy"] = masked_sum(entropy, mask)
        if kl is not None:
            stats["kl"] = masked_sum(kl, mask)
    return loss, stats


def value_loss(v, v_old, R, weight, cfg):
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -vclip, vclip) - R)^2): clipped around the OLD
    values, so the critic moves at most vclip per batch (clipping around R would be a no-op)."""
    l = (v - R) ** 2
    if cfg.vclip:
        l = torch.max(l, (v_old + (v - v_old).clamp(-cfg.vclip, cfg.vclip) - R) ** 2)
    return 0.5 * (weight * l).sum()
