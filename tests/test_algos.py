"""The math, pinned with hand-computed values (arithmetic in the comments)."""
import math

import pytest
import torch

from algos import ADVANTAGES, loss_weights, pg_loss, reinforce, reinforce_baseline, returns_to_go, value_loss
from config import Config
from utils import Batch, discounted_cumsum, gae, whiten


def batch(rewards, mask, group=None, values=None):
    rewards, mask = torch.tensor(rewards), torch.tensor(mask)
    N, T = mask.shape
    return Batch(obs=torch.zeros(N, T, 1), actions=torch.zeros(N, T, dtype=torch.long), mask=mask,
                 rewards=rewards, group=torch.tensor(group if group else list(range(N))),
                 truncated=torch.zeros(N, dtype=torch.bool),
                 values=None if values is None else torch.tensor(values))


def cfg(**kw):
    return Config(**kw)


def test_reinforce_return_to_go():
    b = batch([[1.0, 1, 1], [2, 0, 0]], [[1.0, 1, 1], [1, 1, 0]])
    A, R = ADVANTAGES["reinforce"](b, cfg(gamma=0.5, whiten_returns=False))
    # row 0: G2=1, G1=1+.5*1=1.5, G0=1+.5*1.5=1.75; row 1: G1=0, G0=2+.5*0=2, padding 0
    assert torch.allclose(A, torch.tensor([[1.75, 1.5, 1.0], [2.0, 0.0, 0.0]]))
    assert R is None
    A, _ = ADVANTAGES["reinforce"](b, cfg(gamma=0.5))  # whitened (the default) over the 5 real steps
    # G: 1.75 1.5 1 2 0 -> mean 1.25; E[G^2] = (3.0625 + 2.25 + 1 + 4 + 0) / 5 = 2.0625, var = 2.0625 - 1.5625 = .5
    assert torch.allclose(A, torch.tensor([[0.5, 0.25, -0.25], [0.75, -1.25, 0.0]]) / math.sqrt(0.5), atol=1e-6)


def test_a_time_limit_cut_is_bootstrapped_at_the_episodes_own_reward_rate():
    b = batch([[1.0, 1], [1.0, 0]], [[1.0, 1], [1, 0]])
    b.truncated, b.final_obs = torch.tensor([True, False]), torch.zeros(2, 1)  # row 0 cut by the time limit
    A, _ = ADVANTAGES["reinforce"](b, cfg(gamma=0.5, whiten_returns=False))
    # row 0: mean reward 1, the steps after the cut worth 1 / (1 - .5) = 2: G1 = 1 + .5 * 2 = 2, G0 = 1 + .5 * 2 = 2
    # (an episode at its limit forever: the same value at every step); row 1 ended by itself: G0 = 1
    assert A.tolist() == [[2.0, 2.0], [1.0, 0.0]]
    b.final_obs = None  # an LLM batch: a reply cut at the token limit is not bootstrapped
    assert ADVANTAGES["reinforce"](b, cfg(gamma=0.5, whiten_returns=False))[0].tolist() == [[1.5, 1.0], [1.0, 0.0]]


def test_reinforce_baseline_subtracts_token_mean():
    b = batch([[1.0, 1, 1], [2, 0, 0]], [[1.0, 1, 1], [1, 1, 0]])
    A, _ = ADVANTAGES["reinforce_baseline"](b, cfg(gamma=0.5))
    # real G: 1.75, 1.5, 1, 2, 0 -> mean 6.25/5 = 1.25
    assert torch.allclose(A, torch.tensor([[0.5, 0.25, -0.25], [0.75, -1.25, 0.0]]))


def test_gae_by_hand_and_ppo_whitening():
    b = batch([[0.0, 0, 1]], [[1.0, 1, 1]], values=[[0.5, 0.5, 0.5]])
    A, R = gae(b.rewards, b.values, b.mask, gamma=1.0, lam=0.5)
    # delta = (0+.5-.5, 0+.5-.5, 1+0-.5) = (0, 0, .5); A2=.5, A1=0+.5*.5=.25, A0=0+.5*.25=.125
    assert torch.allclose(A, torch.tensor([[0.125, 0.25, 0.5]]))
    assert torch.allclose(R, torch.tensor([[0.625, 0.75, 1.0]]))  # R = A + V
    A_ppo, R_ppo = ADVANTAGES["ppo"](b, cfg(gamma=1.0, lam=0.5))
    # mean 0.875/3 = .29167; population std of (.125, .25, .5) = .15590
    assert torch.allclose(A_ppo, (A - 0.875 / 3) / 0.155902, atol=1e-4)
    assert torch.allclose(R_ppo, R)


def test_gae_matches_a_plain_loop():
    torch.manual_seed(0)
    N, T, gamma, lam = 5, 9, 0.97, 0.9
    r, v = torch.randn(N, T), torch.randn(N, T)
    lengths = [9, 1, 4, 7, 2]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    A, _ = gae(r, v, mask, gamma, lam)
    for i, L in enumerate(lengths):
        last = 0.0
        for t in reversed(range(L)):
            next_v = v[i, t + 1].item() if t + 1 < L else 0.0
            last = r[i, t].item() + gamma * next_v - v[i, t].item() + gamma * lam * last
            assert A[i, t].item() == pytest.approx(last, abs=1e-5)
        assert torch.all(A[i, L:] == 0)


def test_discounted_cumsum_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 99.0]])  # 99 sits on padding and must not leak into earlier steps
    y = discounted_cumsum(x, torch.tensor([[1.0, 1.0, 0.0]]), 0.5)
    assert torch.allclose(y, torch.tensor([[2.0, 2.0, 0.0]]))  # y0 = 1 + .5*2


def test_environment_tokens_are_skipped_not_discounted():
    # gamma .5, rewards [0, 0, env, env, 1, pad]: the env tokens are not steps, so G1 = 0 + .5*1, G0 = .5*.5
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
    y = discounted_cumsum(torch.tensor([[0.0, 0, 7, 7, 1, 9]]), mask, 0.5)  # 7s and 9 sit off the mask
    assert torch.equal(y, torch.tensor([[0.25, 0.5, 0, 0, 1, 0]]))
    # GAE, gamma 1, lam .5, V = (.5, .5, junk, junk, .5): V_t' of step 1 is step 4's V, not the env token's
    # delta = (0+.5-.5, 0+.5-.5, 1+0-.5) on steps 0, 1, 4 = (0, 0, .5); A4 = .5, A1 = .25, A0 = .125
    v = torch.tensor([[0.5, 0.5, 3.0, 3.0, 0.5, 3.0]])
    A, R = gae(torch.tensor([[0.0, 0, 0, 0, 1, 0]]), v, mask, gamma=1.0, lam=0.5)
    assert torch.equal(A, torch.tensor([[0.125, 0.25, 0, 0, 0.5, 0]]))
    assert torch.equal(R, torch.tensor([[0.625, 0.75, 0, 0, 1.0, 0]]))


def test_gae_bootstraps_where_a_time_limit_cut_the_episode():
    # rewards (1, 1), V = (.5, .5), gamma .5, lam 1; the cut state is worth V(s_T) = 2 for row 0, row 1 ended
    # row 0: delta = (1 + .5*.5 - .5, 1 + .5*2 - .5) = (.75, 1.5); A1 = 1.5, A0 = .75 + .5*1.5 = 1.5
    # row 1: delta = (.75, 1 + 0 - .5 = .5); A1 = .5, A0 = .75 + .5*.5 = 1.0
    r, v, m = torch.ones(2, 2), torch.full((2, 2), 0.5), torch.ones(2, 2)
    A, R = gae(r, v, m, gamma=0.5, lam=1.0, last_value=torch.tensor([2.0, 0.0]))
    assert torch.equal(A, torch.tensor([[1.5, 1.5], [1.0, 0.5]])) and torch.equal(R, A + v)


def test_grpo_drgrpo_rloo():
    # two groups: rewards (1, 0, 0, 1) and (3, 3, 3, 3); reward on the last token of each sample
    b = batch([[0.0, 1], [0, 0], [0, 0], [1, 0], [3, 0], [0, 3], [3, 0], [3, 0]],
              [[1.0, 1], [1, 1], [1, 1], [1, 0], [1, 0], [1, 1], [1, 0], [1, 0]], group=[0] * 4 + [1] * 4)
    A, _ = ADVANTAGES["grpo"](b, cfg(adv_eps=0.0))
    # group 0: mean .5, unbiased std sqrt(4 * .25 / 3) = .57735 -> +-.5/.57735 = +-.866025
    s = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(A[:4], torch.tensor([[s, s], [-s, -s], [-s, -s], [s, 0]]), atol=1e-6)
    assert torch.all(A[4:] == 0)  # equal rewards: zero advantage, no division by a zero std
    A, _ = ADVANTAGES["grpo"](b, cfg(norm_std=False))  # Dr.GRPO: R - mean
    assert torch.allclose(A[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    A, _ = ADVANTAGES["rloo"](b, cfg())
    # 1 - mean(0, 0, 1) = 2/3;  0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(A[:4, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.all(A[4:] == 0)


def test_grpo_eps_is_added_to_std():
    b = batch([[1.0], [0.0]], [[1.0], [1.0]], group=[0, 0])
    A, _ = ADVANTAGES["grpo"](b, cfg(adv_eps=0.1))
    # std unbiased of (1, 0) = .70711 -> .5 / (.70711 + .1) = .61949
    assert A[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.1), abs=1e-6)



def test_baselines_count_an_agent_run_in_two_rows_once():
    # one group: run A in two rows (each carries A's reward 1, on its last token), run B in one row (reward 0)
    b = batch([[0.0, 1], [1, 0], [0, 0]], [[1.0, 1], [1, 0], [1, 1]], group=[0, 0, 0])
    b.run = torch.tensor([0, 0, 1])
    A, _ = ADVANTAGES["rloo"](b, cfg())
    assert A[:, 0].tolist() == [1.0, 1.0, -1.0]  # per run: 1 - 0 and 0 - 1 (per row it was .5, .5, -1)
    A, _ = ADVANTAGES["grpo"](b, cfg(adv_eps=0.0))
    s = 0.5 / math.sqrt(0.5)  # runs 1 and 0: mean .5, unbiased std .7071 (per row: .577, .577, -1.155)
    assert torch.allclose(A[:, 0], torch.tensor([s, s, -s]))


def test_turn_credit_numbers_a_runs_replies_across_its_rows():
    # run A: reply 0 in row 0, reply 1 in row 1 (its history rewritten), reward 1; run B: replies 0 and 1 in one
    # row, reward 0. Discount 1: A's returns per reply [1, 1], B's [0, 0]: reply 0 is 1 - 0 = 1 and 0 - 1 = -1,
    # reply 1 the same. Per row, A's second row would be its reply 0 and be compared with B's reply 0.
    b = batch([[1.0, 0], [1, 0], [0, 0]], [[1.0, 0], [1, 0], [1, 1]], group=[0, 0, 0])
    b.run = torch.tensor([0, 0, 1])
    A, _ = ADVANTAGES["rloo"](b, cfg(credit="turn", turn_discount=1.0))
    assert A.tolist() == [[1.0, 0.0], [1.0, 0.0], [-1.0, -1.0]]


@pytest.mark.parametrize("algo,credit", [("grpo", "episode"), ("rloo", "episode"), ("rloo", "turn")])
def test_runs_of_one_row_each_train_exactly_as_rows(algo, credit):
    torch.manual_seed(0)
    mask = (torch.rand(8, 5) < 0.8).float()
    b = batch((torch.rand(8, 5) * mask).tolist(), mask.tolist(), group=[0] * 4 + [1] * 4)
    A, _ = ADVANTAGES[algo](b, cfg(credit=credit, norm_std=credit == "episode"))
    b.run = torch.arange(8)
    assert torch.equal(ADVANTAGES[algo](b, cfg(credit=credit, norm_std=credit == "episode"))[0], A)

def agg(mode, max_len=None):
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[1.0, 2, 3], [4, 0, 0]])
    logp = torch.zeros(2, 3)
    c = cfg(loss_agg=mode)
    w = None if max_len is None else loss_weights(mask, c, max_len)
    return pg_loss(logp, logp, adv, mask, c, weight=w)[0].item()  # ratio 1 -> l = -A


def test_loss_aggregations():
    assert agg("token_mean") == pytest.approx(-10 / 4)  # -(1+2+3+4) / 4 tokens
    assert agg("seq_mean_token_mean") == pytest.approx(-(6 / 3 + 4 / 1) / 2)  # mean of per-seq means
    assert agg("seq_mean_token_sum_norm") == pytest.approx(-10 / (2 * 3))  # / (N * T)
    assert agg("seq_mean_token_sum_norm", max_len=5) == pytest.approx(-10 / (2 * 5))  # / (N * L_max)


def one_token_loss(ratio, A, **kw):
    logp = torch.tensor([[math.log(ratio)]])
    loss, stats = pg_loss(logp, torch.zeros(1, 1), torch.tensor([[A]]), torch.ones(1, 1), cfg(**kw))
    return loss.item(), stats


def test_clip_branches():
    assert one_token_loss(1.5, 1.0)[0] == pytest.approx(-1.2)  # min(1.5, 1.2) * 1
    assert one_token_loss(1.5, 1.0, eps_high=0.28)[0] == pytest.approx(-1.28)  # clip-higher
    assert one_token_loss(0.5, -1.0)[0] == pytest.approx(0.8)  # min(-.5, .8 * -1) = -.8
    assert one_token_loss(0.5, 1.0)[0] == pytest.approx(-0.5)  # low ratio, A > 0: unclipped
    loss, stats = one_token_loss(5.0, -1.0)  # min(-5, 1.2 * -1) = -5 -> l = 5
    assert loss == pytest.approx(5.0) and stats["clipfrac"].item() == 0
    assert one_token_loss(5.0, -1.0, dual_clip=3.0)[0] == pytest.approx(3.0)  # bounded by -c A
    _, stats = one_token_loss(1.5, 1.0)
    assert stats["clipfrac"].item() == 1 and stats["ratio_max"].item() == pytest.approx(1.5)


def test_kl_estimators():
    logp, ref = torch.tensor([[0.5]]), torch.zeros(1, 1)  # d = .5
    expected = {"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) - 1 + 0.5}  # k3 = .60653 - .5 = .10653
    for name, value in expected.items():
        c = cfg(kl_coef=1.0, kl_estimator=name)
        loss, stats = pg_loss(logp, logp, torch.zeros(1, 1), torch.ones(1, 1), c, ref_logp=ref)
        assert loss.item() == pytest.approx(value) and stats["kl"].item() == pytest.approx(value)


def test_k2_gradient_is_the_reverse_kl_gradient():
    logp = torch.tensor([[0.3]], requires_grad=True)
    c = cfg(kl_coef=1.0, kl_estimator="k2")
    pg_loss(logp, logp.detach(), torch.zeros(1, 1), torch.ones(1, 1), c, ref_logp=torch.zeros(1, 1))[0].backward()
    assert logp.grad.item() == pytest.approx(0.3)  # d/dlogp of d^2/2 = d


def test_entropy_bonus_and_tis_weight():
    ent = torch.tensor([[2.0]])
    loss, _ = pg_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                      cfg(ent_coef=0.1), entropy=ent)
    assert loss.item() == pytest.approx(-1.0 - 0.2)  # -ratio*A - .1 * 2
    old, sampler = torch.zeros(1, 1), torch.tensor([[-math.log(4.0)]])  # exp(old - sampler) = 4
    loss, _ = pg_loss(old, old, torch.ones(1, 1), torch.ones(1, 1), cfg(tis_clip=2.0), sampler_logp=sampler)
    assert loss.item() == pytest.approx(-2.0)  # weight min(4, 2) = 2


def test_value_loss_clips_around_old_values():
    w = torch.ones(1, 1)
    c = cfg(vclip=0.2)
    v = lambda x: torch.tensor([[x]])
    # (2-3)^2 = 1 vs (1 + clip(1) = 1.2 - 3)^2 = 3.24 -> .5 * 3.24
    assert value_loss(v(2.0), v(1.0), v(3.0), w, c).item() == pytest.approx(1.62)
    # (.5-.4)^2 = .01 vs (1 + clip(-.5) = .8 - .4)^2 = .16 -> .5 * .16
    assert value_loss(v(0.5), v(1.0), v(0.4), w, c).item() == pytest.approx(0.08)
    assert value_loss(v(0.5), v(1.0), v(0.4), w, cfg(vclip=0.0)).item() == pytest.approx(0.005)


def test_whiten_keeps_padding_zero():
    x, mask = torch.tensor([[1.0, 3.0, 50.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.allclose(whiten(x, mask), torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6)


@pytest.mark.parametrize("gamma", [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
def test_returns_to_go_stay_finite_for_any_gamma_and_spread_of_lengths(gamma):
    # Two time-limit cuts of very different lengths in one batch: gamma^(L - t) must not be taken past L (on padding
    # it overflowed to inf for gamma < ~0.83, and 0 * inf is NaN: whitening then spread it to every row).
    T, lengths = 500, [500, 20]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    b = Batch(obs=torch.zeros(2, T, 4), actions=torch.zeros(2, T, dtype=torch.long), mask=mask, rewards=mask.clone(),
              group=torch.arange(2), truncated=torch.ones(2, dtype=torch.bool), final_obs=torch.zeros(2, 4))
    cfg = Config(gamma=gamma)
    G = returns_to_go(b, cfg)
    assert torch.isfinite(G).all() and torch.isfinite(reinforce(b, cfg)[0]).all()
    assert torch.isfinite(reinforce_baseline(b, cfg)[0]).all() and (G[1, 20:] == 0).all()
    # an episode cut at L with reward 1 per step goes on at 1 a step: G_t = 1 / (1 - gamma) on every real step
    assert torch.allclose(G[mask > 0], torch.full((520,), 1 / (1 - gamma)), rtol=1e-4)
