"""Tasks turn a policy into a Batch and score it. Every task implements:
    rollout(policy, step) -> Batch      samples for training step `step` (deterministic in seed, step)
    evaluate(policy) -> {"eval_...": x} greedy, on a fixed held-out set
    solved(metrics) -> bool             the task's threshold reached (ends the run early)
Control tasks wrap gymnasium; LLM tasks are prompts + reward functions. TASKS maps --task to a class.
"""
import random

import gymnasium as gym
import numpy as np
import torch

from utils import Batch


class GymTask:
    """Any gymnasium env with discrete actions and a Box observation (CartPole-v1, Acrobot-v1, ...).
    The episodes of a batch are stepped together and acted on with ONE batched forward pass per step.
    group_size episodes share a reset seed, so grpo / rloo compare episodes from the same start."""

    def __init__(self, cfg):
        self.cfg = cfg
        spec = gym.spec(cfg.env)
        self.envs = [gym.make(cfg.env, disable_env_checker=True)
                     for _ in range(max(cfg.batch_size, cfg.eval_episodes))]
        space, obs_space = self.envs[0].action_space, self.envs[0].observation_space
        if not isinstance(space, gym.spaces.Discrete) or not isinstance(obs_space, gym.spaces.Box):
            raise SystemExit(f"config error: env {cfg.env} needs Discrete actions and Box observations")
        self.obs_dim, self.n_actions = int(np.prod(obs_space.shape)), int(space.n)
        self.max_len = spec.max_episode_steps or 1000  # the constant L_max of seq_mean_token_sum_norm
        self.threshold = spec.reward_threshold  # 475 for CartPole-v1, -100 for Acrobot-v1
        self.eval_seeds = [2**31 + i for i in range(cfg.eval_episodes)]  # training seeds are < 2**31

    def rollout(self, policy, step):
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        seeds = [rng.randrange(2**31) for _ in range(self.cfg.batch_size // self.cfg.group_size)]
        return self.run(policy, [s for s in seeds for _ in range(self.cfg.group_size)], greedy=False)

    def evaluate(self, policy):
        return {"eval_return": self.run(policy, self.eval_seeds, greedy=True).seq_reward.mean().item()}

    def solved(self, metrics):
        return self.threshold is not None and metrics.get("eval_return", -np.inf) >= self.threshold

    def run(self, policy, seeds, greedy):
        n, T = len(seeds), self.max_len
        obs = np.zeros((n, T, self.obs_dim), np.float32)
        actions, rewards = np.zeros((n, T), np.int64), np.zeros((n, T), np.float32)
        length, truncated = np.zeros(n, np.int64), np.zeros(n, bool)
        cur = np.stack([env.reset(seed=s)[0] for env, s in zip(self.envs, seeds)]).reshape(n, -1)
        alive = list(range(n))
        for t in range(T):
            obs[alive, t] = cur[alive]
            acts = policy.act(torch.from_numpy(cur[alive]), greedy).numpy()  # one forward for all
            still = []
            for i, a in zip(alive, acts):
                o, r, term, trunc, _ = self.envs[i].step(a)
                actions[i, t], rewards[i, t], cur[i] = a, r, np.asarray(o).reshape(-1)
                if term or trunc:
                    length[i], truncated[i] = t + 1, trunc and not term
                else:
                    still.append(i)
            alive = still
            if not alive:
                break
        length[alive] = T  # a gymnasium TimeLimit always ends them first; this is for envs without one
        L = int(length.max())
        mask = torch.arange(L)[None, :] < torch.from_numpy(length)[:, None]
        return Batch(obs=torch.from_numpy(obs[:, :L]), actions=torch.from_numpy(actions[:, :L]),
                     mask=mask.float(), rewards=torch.from_numpy(rewards[:, :L]),
                     group=torch.arange(n) // self.cfg.group_size, truncated=torch.from_numpy(truncated))


TASKS = {"cartpole": GymTask, "gym": GymTask}
