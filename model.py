"""Policies. Every policy implements one protocol, which is all train.py and tasks.py call:
    score(batch) -> {"logp": [N, T], "entropy": [N, T], "value": [N, T] or None}   (with grad)
    params() -> {name: tensor} of the trainable weights (what checkpoints save)
and control policies add act(obs, greedy) -> actions [B] for batched environment stepping.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(n_in, hidden, n_out):
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class MLPPolicy(nn.Module):
    """Categorical actor over discrete actions; a separate critic MLP only when the algorithm learns
    values (ppo), so actor gradients never flow through value features."""

    def __init__(self, obs_dim, n_actions, hidden, critic=False):
        super().__init__()
        self.actor = mlp(obs_dim, hidden, n_actions)
        self.critic = mlp(obs_dim, hidden, 1) if critic else None

    @torch.no_grad()
    def act(self, obs, greedy=False):  # obs [B, D] -> actions [B]
        logits = self.actor(obs)  # [B, A]
        return logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1)[:, 0]

    def score(self, batch):
        logp_all = F.log_softmax(self.actor(batch.obs), -1)  # [N, T, A]
        logp = logp_all.gather(-1, batch.actions[..., None])[..., 0]  # [N, T]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, T]
        value = self.critic(batch.obs)[..., 0] if self.critic is not None else None  # [N, T]
        return {"logp": logp, "entropy": entropy, "value": value}

    def params(self):
        return dict(self.named_parameters())
