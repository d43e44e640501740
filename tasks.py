"""Tasks turn a policy into a Batch and score it. Every task implements:
    rollout(policy, step) -> Batch             samples for training step `step` (deterministic in seed, step)
    evaluate(policy, step) -> {"eval_...": x}  greedy, on a fixed held-out set
    solved(metrics) -> bool                    the task's threshold reached (ends the run early)
Control tasks wrap gymnasium; LLM tasks are prompts + reward functions, played as episodes of one or
more turns (LLMTask.play: read it second, after train.py's step; then algos.py). TASKS maps --task to a class.
"""
import ast
import collections
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import math
import operator
import os
import pkgutil
import random
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing
import uuid
from fractions import Fraction

import gymnasium as gym
import numpy as np
import torch

from model import TOOL_CALL, plain_call, python_call, tool_schema
from utils import Batch, all_reduce_sum, non_dumpable, rank, reply_ends, world


class GymTask:
    """Any gymnasium env with discrete actions and Box observations (CartPole-v1, Acrobot-v1, ...). A batch's
    episodes step as one vector env, with ONE forward pass per step; group_size episodes share a reset seed."""
    llm, runs_model_text = False, False

    def __init__(self, cfg):
        self.cfg, self.vecs = cfg, {}
        try:
            spec = gym.spec(cfg.env)
        except gym.error.Error as e:  # names the versions or the closest env gymnasium knows
            raise SystemExit(f"config error: --env {cfg.env}: {e}")
        space, obs_space = self.envs(1).single_action_space, self.envs(1).single_observation_space
        if not isinstance(space, gym.spaces.Discrete) or not isinstance(obs_space, gym.spaces.Box):
            raise SystemExit(f"config error: env {cfg.env} needs Discrete actions and Box observations")
        self.obs_dim, self.n_actions = int(np.prod(obs_space.shape)), int(space.n)
        self.max_len = spec.max_episode_steps or 1000  # the constant L_max of seq_mean_token_sum_norm
        self.threshold = spec.reward_threshold  # 475 for CartPole-v1, -100 for Acrobot-v1
        self.eval_seeds = [2**31 + i for i in range(cfg.eval_episodes)]  # training seeds are < 2**31

    def envs(self, n):
        """n envs stepped as one: the env's own vector version (CartPole's steps all n in numpy, from one seed) unless
        starts are shared (group_size > 1: the sync wrapper, a seed each). Both reset an episode the step after it
        ends."""
        if n not in self.vecs:
            own = gym.spec(self.cfg.env).vector_entry_point is not None and self.cfg.group_size == 1
            self.vecs[n] = (gym.make_vec(self.cfg.env, n, "vector_entry_point") if own else
                            gym.make_vec(self.cfg.env, n, "sync", disable_env_checker=True))
        return self.vecs[n]

    def rollout(self, policy, step):
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        seeds = [rng.randrange(2**31) for _ in range(self.cfg.batch_size // self.cfg.group_size)]
        mine = seeds[rank()::world()]  # data parallel: a share per rank
        return self.run(policy, [s for s in mine for _ in range(self.cfg.group_size)], greedy=False)

    def evaluate(self, policy, step):
        return {"eval_return": self.run(policy, self.eval_seeds, greedy=True).seq_reward.mean().item()}

    def solved(self, metrics):
        return self.threshold is not None and metrics.get("eval_return", -np.inf) >= self.threshold

    def run(self, policy, seeds, greedy):
        n, T, env = len(seeds), self.max_len, self.envs(len(seeds))
        obs = np.zeros((n, T, self.obs_dim), np.float32)
        actions, rewards, logps = np.zeros((n, T), np.int64), np.zeros((n, T), np.float32), np.zeros((n, T), np.float32)
        length, truncated, alive = np.zeros(n, np.int64), np.zeros(n, bool), np.ones(n, bool)
        cur = env.reset(seed=seeds if isinstance(env, gym.vector.SyncVectorEnv) else seeds[0])[0].reshape(n, -1)
        for t in range(T):
            obs[alive, t] = cur[alive]
            acts, logp = policy.act(torch.from_numpy(cur[alive]), greedy)  # one forward for all
            actions[alive, t], logps[alive, t] = acts.numpy(), logp.numpy()
            o, r, term, trunc, _ = env.step(actions[:, t])  # finished episodes step too (their reset), ignored
            rewards[alive, t] = r[alive]
            done = alive & (term | trunc)
            length[done], truncated[done] = t + 1, trunc[done] & ~term[done]
            cur[alive] = o.reshape(n, -1)[alive]  # a finished episode keeps its last observation (bootstraps a cut)
            alive &= ~done
            if not alive.any():
                break
        length[alive] = T  # flatrl's own cap, for envs without a TimeLimit: a time-limit cut too
        truncated[alive] = True
        L = int(length.max())
        mask = torch.arange(L)[None, :] < torch.from_numpy(length)[:, None]
        return Batch(obs=torch.from_numpy(obs[:, :L]), actions=torch.from_numpy(actions[:, :L]),
                     mask=mask.float(), rewards=torch.from_numpy(rewards[:, :L]),
                     group=torch.arange(n) // self.cfg.group_size, truncated=torch.from_numpy(truncated),
                     final_obs=torch.from_numpy(cur),
                     sampler_logp=torch.from_numpy(logps[:, :L]) * mask if self.cfg.record_sampler else None)


# --- LLM tasks: reward helpers -------------------------------------------------------------------

def answer_tag(text):
    """The content of the last <answer>...</answer> in text, or None."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.S)
    return found[-1].strip() if found else None


def numbers(text):
    """The numbers in text, in order (1,234 reads as 1234)."""
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))]


def first_number(text):
    return next(iter(numbers(text)), None)


def numeric_match(prompt, completion, answer, which=0):
    """1 if the reply's first number (which=-1: its last) equals the answer; of its <answer> tag, when it has one."""
    found = numbers(answer_tag(completion) or completion)
    return float(bool(found) and abs(found[which] - float(answer)) < 1e-6)


def final_number_match(prompt, completion, answer):
    """numeric_match on the LAST number: a reply that reasons first ("7 + 5 = 12"), as word problems' replies do,
    starts with an operand (GSM8K's rule)."""
    return numeric_match(prompt, completion, answer, which=-1)


def format_reward(prompt, completion, answer):
    """1 if the reply puts something in <answer>...</answer> tags."""
    return float(bool(answer_tag(completion)))


def overlong_penalty(n_tokens, max_new, buffer):
    """DAPO's soft overlong penalty (arXiv 2503.14476): 0 up to max_new - buffer tokens, then down to -1 at max_new."""
    return min(0.0, (max_new - buffer - n_tokens) / buffer) if buffer else 0.0


def eval_expression(expr, numbers=None):
    """Exact value (a Fraction) of an expression of whole numbers, + - * / and parentheses that uses each of
    `numbers` exactly once (any numbers when None); None for anything else. Python's parser builds the tree,
    which is walked here, never evaluated: no names, no calls, no powers, no unary minus, no decimals, at
    most 200 characters (so the tree stays shallow)."""
    ops, used = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}, []

    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError

    if len(expr) > 200 or not re.fullmatch(r"[\d\s+\-*/()]*", expr):  # digits only: no 1_000, 0x1f, 1e3
        return None
    try:
        result = value(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None
    return result if numbers is None or sorted(used) == sorted(numbers) else None


# --- LLM tasks -------------------------------------------------------------------------------------

def replies(chat):
    """The assistant's replies in an episode's chat, in order."""
    return [m["content"] for m in chat if m["role"] == "assistant"]


@dataclasses.dataclass
class Episode:
    """An episode as play() returns it beside the Batch of its tokens: what rewards, metrics and samples read."""
    chat: list  # after the prompt, as OpenAI messages: the replies and the environment's messages (agents: the replies)
    answer: object  # what correct and reward grade: the last reply's text, or an agent's outcome (a text or a reward)
    error: str = None  # agent runs: why the run got reward 0 (counted in agent_errors_<cause>), else None
    calls: list = dataclasses.field(default_factory=list)  # agent runs: the calls as serve.Chat recorded them


def place_rewards(batch, rewards, penalties, cfg):
    """Each episode's reply rewards onto the last token of its replies, numbered across the episode's rows (batch.run:
    an agent run can be several). rewards[e]: those of episode e's last len(rewards[e]) replies (replies before them
    earn 0). --credit turn: a reply its own, and a row's last reply also the rewards of the replies in its episode's
    later rows, discounted by turn_discount per reply (each row trains alone); --credit episode: the episode's return
    sum_k d^k r_k plus penalties[e] (overlong, undiscounted) on each row's last reply, for every token to share; turn:
    penalties[e] is added to the last reply's reward first."""
    ends, d = reply_ends(batch.mask), cfg.turn_discount  # [N, T]
    count = ends.sum(1)  # [N] replies in each row
    total = torch.zeros(len(rewards), dtype=torch.long).index_add(0, batch.run, count)  # [episodes] replies in each
    r = [([0.0] * k + list(x))[-k:] if k else [] for k, x in zip(total.tolist(), rewards)]  # a reward per reply
    if cfg.credit == "turn":  # the penalty joins the last reply's reward: later rows' discount covers it too
        for x, pen in zip(r, penalties):
            if x:
                x[-1] += pen
    placed = [0] * len(rewards)  # replies of each episode placed so far (rows are in order)
    for row, e in enumerate(batch.run.tolist()):
        cols, k = ends[row].nonzero()[:, 0], int(count[row])
        if not k:  # a row with nothing sampled (an agent that never called)
            continue
        if cfg.credit == "episode":
            batch.rewards[row, cols[-1]] = sum(x * d**j for j, x in enumerate(r[e])) + penalties[e]
        else:
            mine, later = r[e][placed[e]:placed[e] + k], r[e][placed[e] + k:]
            mine[-1] += sum(x * d**(j + 1) for j, x in enumerate(later))  # the episode's later rows, discounted
            batch.rewards[row, cols] = torch.tensor(mine)
        placed[e] += k


def distinct_problems(problem, seed, want, exclude=frozenset()):
    """-> {question: answer} of up to `want` distinct problems of problem(rng) seeded `seed`, none in `exclude`: as
    many as 1000 x want draws find."""
    rng, found = random.Random(seed), {}
    for _ in range(1000 * want):
        if len(found) == want:
            break
        q, a = problem(rng)
        if q not in exclude:
            found.setdefault(q, a)
    return found


def check_training_room(task):
    """Refuse a task that holds out (nearly) all its problems: train_problems would draw forever, or repeat a
    handful. A step's prompts need at least as many distinct problems left to train on."""
    want = task.cfg.batch_size // task.cfg.group_size
    left = distinct_problems(task.problem, 10**9 + 1, want, task.held_keys)
    if len(left) < want:
        raise SystemExit(f"config error: {type(task).__name__} has {len(left)} distinct problems left for training "
                         f"after the {task.cfg.n_eval} held out, fewer than a step's {want} prompts: lower --n-eval")


def answer_text(answer):
    """A problem's answer as text: a reasoning-gym entry's answer, not its metadata."""
    return str(answer["answer"] if isinstance(answer, dict) and "answer" in answer else answer)


def checks_form(task):
    """Does the task's well_formed speak for its correct? Defined with it or below it: a fork with a correct() of its
    own and the default well_formed (numbers) logs no well_formed share."""
    def defined_in(name):
        return next(c for c in type(task).__mro__ if name in vars(c))
    return issubclass(defined_in("well_formed"), defined_in("correct"))


def format_metrics(task, formed, right_formed, n, held_out=False):
    """The share of n replies that are well-formed and the accuracy among those (not when none is); held out
    (eval_), the best constant answer's accuracy too, where there is one."""
    prefix, out = "eval_" if held_out else "", {}
    if checks_form(task):
        out[f"{prefix}well_formed"] = formed / n
        if formed:
            out[f"{prefix}acc_well_formed"] = right_formed / formed
    if held_out and task.constant:
        out["eval_best_constant"] = task.constant[1]
    return out


def graded(task, problems, episodes, n):
    """-> [correct, well-formed, correct and well-formed, all]: sums over episodes played n per problem. An agent run
    that ended in an error is not well-formed. A right answer in another form (a reply that goes on after it) counts
    in eval_acc, not among the well-formed: the accuracy among well-formed replies is theirs alone."""
    right = formed = right_formed = 0.0
    for e, ep in enumerate(episodes):
        question, answer = problems[e // n]
        prompt = task.build_prompt(question)
        hit = float(task.correct(prompt, ep.answer, answer))
        form = float(not ep.error and bool(task.well_formed(prompt, ep.answer, answer)))
        right, formed, right_formed = right + hit, formed + form, right_formed + hit * form
    return [right, formed, right_formed, float(len(episodes))]


def solved_fraction(task, problems, texts, k):
    """Fraction of problems, over all ranks, with at least one of its k completions correct."""
    hits = torch.tensor([task.correct(task.build_prompt(problems[i // k][0]), c, problems[i // k][1])
                         for i, c in enumerate(texts)])
    total = all_reduce_sum(torch.stack([hits.view(-1, k).amax(1).sum(), torch.tensor(float(len(problems)))]))
    return (total[0] / total[1]).item()


def best_constant(task):
    """Where the held-out answers take few values (at most 10, each held out twice on average: Yes / No), the one
    reply, bare or in <answer> tags, that scores best given to every held-out problem, and its accuracy: an eval_acc
    at that level needs no more than one answer for all. -> (reply, accuracy), or None (also for a task whose
    correct() takes no such reply: an agent's environment that grades by its own means)"""
    values = sorted({answer_text(a) for _, a in task.eval_set})
    if len(values) > min(10, len(task.eval_set) / 2):
        return None
    replies = [form for v in values for form in (v, f"<answer>{v}</answer>")]
    try:
        score = {r: sum(task.correct(task.build_prompt(q), r, a) for q, a in task.eval_set) / len(task.eval_set)
                 for r in replies}
    except Exception:  # the task's correct() is for its own completions only
        return None
    best = max(replies, key=score.get)
    return best, score[best]


def save_samples(cfg, step, problems, episodes):
    """An evaluation's first four episodes, appended to the run's samples.jsonl (rank 0)."""
    if rank() > 0 or not cfg.out:
        return
    with open(os.path.join(cfg.out, "samples.jsonl"), "a") as f:
        for (q, a), ep in list(zip(problems, episodes))[:4]:
            more = {"turns": ep.chat} if cfg.max_turns > 1 else {}
            sample = {"step": step, "prompt": q, "answer": answer_text(a), "completion": str(ep.answer), **more}
            f.write(json.dumps(sample) + "\n")


class LLMTask:
    """Prompts and weighted rewards. A new task: a subclass with problem(rng) -> (question, answer), its own rewards /
    correct / build_prompt if needed, one line in TASKS. Multi-turn: env_response answers each reply (None ends it).
    Held out: the first n_eval distinct problems of a fixed stream; training never draws those."""
    llm = True
    rewards = [(1.0, numeric_match)]  # (weight, fn(prompt, completion, answer) -> float), summed
    tools = None  # functions the chat template describes to the model (ToolTask)
    runs_model_text = False  # rewards or tools run model text: non-dumpable from the start, a token (README "Tokens")
    cut_by = "--max-new-tokens"  # what cuts a reply short (a step where most are cut says so: train.step_notes)
    first_reply_answers = True  # multi-turn: the first reply is an answer too (eval_acc_turn1); an agent's call is not

    def __init__(self, cfg):
        self.cfg, self.max_len = cfg, cfg.max_new_tokens * cfg.max_turns  # L_max: sampled tokens per episode
        self.eval_set = self.held_out()
        self.held_keys = {q for q, _ in self.eval_set}
        check_training_room(self)

    @functools.cached_property
    def constant(self):  # best_constant: on the first evaluation (a rollout worker never needs it)
        return best_constant(self)

    def grading_rule(self):  # a line for the run's start on how its rewards grade (exact, or partial credit)
        return None

    def held_out(self):
        found = distinct_problems(self.problem, 10**9, self.cfg.n_eval)
        if len(found) < self.cfg.n_eval:
            raise SystemExit(f"config error: {type(self).__name__} has {len(found)} distinct problems: lower --n-eval")
        return list(found.items())

    def build_prompt(self, question):
        return question

    def correct(self, prompt, completion, answer):  # what accuracy and eval_acc count
        return numeric_match(prompt, completion, answer)

    def well_formed(self, prompt, completion, answer):
        """Is the reply an answer in the task's form, right or wrong? Here: its <answer> tag, or the whole reply, holds
        one number ("7 + 5 = 12" starts with an operand). Agents: completion may be the environment's float reward."""
        return len(numbers(answer_tag(completion) or completion)) == 1

    def reward(self, prompt, completion, answer):
        return sum(w * fn(prompt, completion, answer) for w, fn in self.rewards)

    def train_problems(self, step):
        """The step's batch_size / group_size (question, answer) pairs, the same on every rank."""
        rng, problems = random.Random(self.cfg.seed * 1_000_003 + step), []
        while len(problems) < self.cfg.batch_size // self.cfg.group_size:
            q, a = self.problem(rng)
            if q not in self.held_keys:
                problems.append((q, a))
        return problems

    def env_response(self, question, answer, turns):
        """The environment's message after the assistant's replies so far (strings), or None to end."""
        return None

    def episode_reward(self, question, answer, turns):
        """The episode's outcome: the last reply's reward."""
        return self.reward(self.build_prompt(question), turns[-1], answer)

    def turn_rewards(self, question, answer, turns):
        """One reward per reply: by default 0 but for the last, which gets episode_reward. A reward k replies in counts
        turn_discount^k."""
        return [0.0] * (len(turns) - 1) + [self.episode_reward(question, answer, turns)]

    def episode_rewards(self, question, answer, episode):
        """The rewards of the episode's last replies (place_rewards): here one per reply, turn_rewards'."""
        return self.turn_rewards(question, answer, replies(episode.chat))

    def episode_stats(self, episodes):
        """The task's own metrics of some episodes (means): logged in training, and as eval_ ones."""
        return {}

    def play(self, policy, problems, n, greedy=False):
        """n episodes per (question, answer): the model replies, env_response answers (as model.env_ids) or ends it;
        at most max_turns replies and max_episode_tokens tokens (reaching it: truncated). Each turn is ONE generate
        call. An episode is one token sequence: the prompt, replies as sampled (mask 1), messages (mask 0).
        -> (Batch, [Episode]: each one's chat after the prompt, its last reply the answer)"""
        cfg, cap = self.cfg, self.cfg.max_episode_tokens or sys.maxsize
        prompts = [policy.prompt_ids(self.build_prompt(q), self.tools) for q, _ in problems]
        problem_of = [i for i in range(len(problems)) for _ in range(n)]  # episode -> its problem
        tails, masks, logps, chats = ([[] for _ in problem_of] for _ in range(4))
        cut, live = [False] * len(problem_of), list(range(len(problem_of)))  # live: the episodes going on

        def add(e, ids, trained, lp):
            tails[e], masks[e], logps[e] = tails[e] + ids, masks[e] + [trained] * len(ids), logps[e] + lp[:len(ids)]

        for turn in range(cfg.max_turns):
            seqs = prompts if turn == 0 else [prompts[problem_of[e]] + tails[e] for e in live]
            budget = min(cfg.max_new_tokens, max(cap - len(tails[e]) for e in live))
            sampled, sampler_logps = policy.sample(seqs, n if turn == 0 else 1, greedy, max_new=budget)
            for e, ids, lp in zip(live, sampled, sampler_logps or [[]] * len(live)):
                ids = ids[:cap - len(tails[e])]
                cut[e] = not policy.ended(ids)  # cut at max_new_tokens or at the episode cap
                add(e, ids, 1, lp)
                chats[e].append({"role": "assistant", "content": policy.tok.decode(ids, skip_special_tokens=True)})
            going_on = []
            for e in live:
                q, a = problems[problem_of[e]]
                said = None if cut[e] or turn + 1 == cfg.max_turns else self.env_response(q, a, replies(chats[e]))
                if said is not None:  # a user message, or {"role": "tool", "content": ...}
                    said = said if isinstance(said, dict) else {"role": "user", "content": said}
                    env = policy.env_ids(said["content"], tails[e][-1], said["role"])
                    cut[e] = len(tails[e]) + len(env) >= cap  # no room for the message and a reply: it ends here
                    if not cut[e]:
                        add(e, env, 0, [0.0] * len(env))
                        chats[e].append(said)
                        going_on.append(e)
            live = going_on
            if not live:
                break
        batch = policy.to_batch([prompts[i] for i in problem_of], tails, masks,
                                logps if sampler_logps is not None else None, cut, n)
        return batch, [Episode(chat, replies(chat)[-1]) for chat in chats]

    def rollout(self, policy, step):
        """The step's episodes (play), their rewards on their replies' last tokens (place_rewards), the step's stats."""
        problems, G, t = self.train_problems(step)[rank()::world()], self.cfg.group_size, time.time()  # a share each
        batch, episodes = self.play(policy, problems, G)
        gen_s = time.time() - t
        sampled = torch.zeros(len(episodes)).index_add(0, batch.run, batch.mask.sum(1)).tolist()  # tokens per episode
        penalties = [overlong_penalty(n, self.max_len, self.cfg.overlong_buffer) for n in sampled]
        place_rewards(batch, [self.episode_rewards(*problems[e // G], ep) for e, ep in enumerate(episodes)],
                      penalties, self.cfg)
        right, formed, right_formed, n = graded(self, problems, episodes, G)
        batch.stats = {"accuracy": right / n, **format_metrics(self, formed, right_formed, n),
                       "gen_s": gen_s, "gen_tok_s": batch.mask.sum().item() / gen_s, **self.episode_stats(episodes)}
        if self.cfg.max_turns > 1:  # assistant replies per episode
            batch.stats["turns"] = sum(len(replies(ep.chat)) for ep in episodes) / len(episodes)
        return batch

    def evaluate(self, policy, step):
        """Greedy held-out eval_acc, its format (graded), the best constant's; eval_acc_turn1; episode_stats; pass@k."""
        mine = self.eval_set[rank()::world()]
        episodes = self.play(policy, mine, 1, greedy=True)[1]
        right, formed, right_formed, n = all_reduce_sum(torch.tensor(graded(self, mine, episodes, 1))).tolist()
        out = {"eval_acc": right / n, **format_metrics(self, formed, right_formed, n, held_out=True)}
        if self.cfg.max_turns > 1 and self.first_reply_answers:
            out["eval_acc_turn1"] = solved_fraction(self, mine, [replies(ep.chat)[0] for ep in episodes], 1)
        for k, v in self.episode_stats(episodes).items():  # a mean over ranks: each holds as many episodes
            out[f"eval_{k}"] = all_reduce_sum(torch.tensor(v)).item() / world()
        if self.cfg.eval_k:
            answers = [ep.answer for ep in self.play(policy, mine, self.cfg.eval_k)[1]]
            out[f"eval_pass@{self.cfg.eval_k}"] = solved_fraction(self, mine, answers, self.cfg.eval_k)
        save_samples(self.cfg, step, mine, episodes)
        return out

    def solved(self, metrics):
        return False


class Arith(LLMTask):
    """Generated arithmetic: 'What is a + b? Reply with just the number.' (--digits, --ops)."""

    def problem(self, rng):
        a, b = (rng.randint(10 ** (self.cfg.digits - 1) if self.cfg.digits > 1 else 1, 10**self.cfg.digits - 1)
                for _ in range(2))
        op = rng.choice(self.cfg.ops)
        return f"What is {a} {op} {b}? Reply with just the number.", {"+": a + b, "-": a - b, "*": a * b}[op]

    def env_response(self, question, answer, turns):  # multi-turn: a wrong reply is told so and asked again
        if numeric_match(question, turns[-1], answer):
            return None
        return "That is not right. Try again: reply with just the number."


CONFINE = """import ctypes, os, resource, struct, sys
libc = ctypes.CDLL(None)
for cap in range(64):  # as root: no capability comes back with an exec (PR_CAPBSET_DROP; EPERM for other users)
    libc.prctl(24, cap)
libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())  # and none now: no CAP_SYS_PTRACE
libc.prctl(4, 0)  # non-dumpable: without Landlock, code cannot reach this process's pipes through /proc/PID/fd


def limit(cpu, mem, out):
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # seconds of CPU, then SIGXCPU
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))  # bytes of address space: a bigger allocation fails
    resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))  # bytes written to a file (stdout is one), then EFBIG


def landlock(writable):
    \"\"\"Linux's Landlock (5.13 and later, a no-op before): files may be read beneath Python's own folders and the
    system's, and changed beneath `writable` alone (None: nowhere); no TCP connection or bind (6.7); no signal to a
    process outside (6.12): not the trainer's run folder, token file or routes.\"\"\"
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
    if abi < 1:
        return
    fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # every file right this kernel knows
    attr = struct.pack("=QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # files; TCP; signals, abstract sockets
    ruleset = libc.syscall(444, attr, len(attr), 0)
    read = 1 | 4 | 8  # execute, read a file, read a folder
    roots = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), "/usr", "/lib", "/lib64"}
    for path, rights in [*((p, read) for p in roots), *([(writable, fs)] if writable else [])]:
        try:
            folder = os.open(path, os.O_PATH)
        except OSError:
            continue
        libc.syscall(445, ruleset, 1, struct.pack("=Qi", rights, folder), 0)  # PATH_BENEATH
        os.close(folder)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which restrict_self asks of a process without CAP_SYS_ADMIN
    libc.syscall(446, ruleset, 0)
"""  # the start of every child that runs model text (run_python's and the graders')

RUNNER = CONFINE + """limit(*map(int, sys.argv[1:4]))
landlock(os.getcwd())
del ctypes, os, resource, struct, sys, libc, cap, limit, landlock
exec(compile(open("main.py").read(), "main.py", "exec"))
"""

GRADER = CONFINE + """import json, select, signal
import reasoning_gym
name, config, cpu, mem, wall = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:5]), float(sys.argv[5])
data = reasoning_gym.create_dataset(name, **config)
print("ready", flush=True)
for line in sys.stdin:  # {"answer": text, "index": i, "question": item i's}: its score on the next line of stdout
    ask = json.loads(line)
    entry = data[ask["index"]]
    if entry["question"] != ask["question"]:  # built otherwise than in the trainer (a hash seed of its own)
        print("other item", flush=True)
        continue
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # one fresh process per reply: what one reply changes (the grader itself) dies with it
        os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDWR), 0)
        os.dup2(0, 1)
        limit(cpu, mem, 0)
        landlock(None)
        try:
            score = float(data.score_answer(ask["answer"], entry))
        except BaseException:  # a grader that trips over a malformed answer: the answer is worth nothing
            score = 0.0
        os.write(w, repr(score).encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 64) if select.select([r], [], [], wall)[0] else b""  # nothing within wall seconds: 0
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)  # the reply's process and any it started
    except OSError:
        pass
    os.waitpid(pid, 0)
    try:
        print(min(max(float(out), 0.0), 1.0), flush=True)
    except ValueError:
        print(0.0, flush=True)
"""


def run_python(code, wall_s=10.0, cpu_s=5, mem_mb=512, out_kb=64):
    """Model-written Python in a subprocess with CPU, memory, output and wall-clock limits, an empty environment,
    a temporary folder, no capabilities (a root trainer's code cannot read what a non-dumpable process hides); then
    its process group killed. The trainer is made non-dumpable first. -> its output, or "error: ..." naming the limit.
    Not a security sandbox (README)."""
    non_dumpable()
    with tempfile.TemporaryDirectory(prefix="flatrl-run-") as d:
        with open(os.path.join(d, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(d, "out"), "w+") as out:
            limits = [str(cpu_s), str(mem_mb * 2**20), str(out_kb * 1024)]
            proc = subprocess.Popen([sys.executable, "-I", "-c", RUNNER, *limits], cwd=d, env={},
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
            try:
                status = proc.wait(wall_s)
            except subprocess.TimeoutExpired:
                status = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the program and every child it left in its group
            proc.wait()
            full = os.fstat(out.fileno()).st_size >= out_kb * 1024
            out.seek(0)
            text = out.read()
    if status is None or full or status == -signal.SIGXCPU:
        why = (f"still running after {wall_s:g} s" if status is None else f"wrote more than {out_kb} KB" if full
               else f"used more than {cpu_s} s of CPU")
        return f"error: {why}; stopped\n{text[-500:]}"
    return text if status == 0 else f"error: exit code {status}\n{text[-2000:]}"


class Graders:
    """reasoning-gym's grader, in a child process: several datasets' graders hand the reply to eval() or sympy's
    parser, so a reply could read the trainer's environment, rewrite the grader for every later reply, or hold the
    step for minutes. The child (no capabilities, an empty environment, a temporary folder) builds the dataset once,
    then forks a process per reply that may write no file and scores it within cpu_s of CPU and wall_s of time
    (else 0). A reply can still forge its own score (it runs in the process that scores it), not another's; a
    process it leaves behind can slow the next replies' grading (no process-count limit)."""
    cpu_s, mem_mb, wall_s = 5, 4096, 10.0

    def __init__(self, name, config):
        self.args, self.proc, self.lock = [name, json.dumps(config)], None, threading.Lock()

    def start(self):
        self.folder = tempfile.TemporaryDirectory(prefix="flatrl-grade-")
        limits = [str(self.cpu_s), str(self.mem_mb * 2**20), str(self.wall_s)]
        seed = {"PYTHONHASHSEED": os.environ["PYTHONHASHSEED"]} if "PYTHONHASHSEED" in os.environ else {}
        with open(os.path.join(self.folder.name, "stderr"), "w+") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", GRADER, *self.args, *limits], env=seed, stderr=err,
                                         cwd=self.folder.name, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, start_new_session=True)
            if self.answer(600) != "ready\n":  # imports and the dataset: a failure here is no reply's doing
                err.seek(0)
                said = err.read().strip().splitlines() or ["no output"]
                raise SystemExit(f"the graders' child did not start: {said[-1]}")

    def answer(self, timeout):
        """The child's next line, or "" if none comes within timeout seconds (a stopped or killed child)."""
        if select.select([self.proc.stdout], [], [], timeout)[0]:
            return self.proc.stdout.readline()
        return ""

    def score(self, answer, index, question):
        with self.lock:
            if self.proc is None:
                self.start()
            try:
                self.proc.stdin.write(json.dumps({"answer": answer, "index": index, "question": question}) + "\n")
                self.proc.stdin.flush()
                out = self.answer(self.wall_s + 5)
            except OSError:
                out = ""
            if out == "other item\n":
                raise SystemExit("the grader's child built another item than this process did: the dataset "
                                 "iterates Python sets (README, reasoning-gym): set PYTHONHASHSEED=0")
            try:
                return float(out)
            except ValueError:  # the reply stopped or killed the child: a new one for the next reply, this one 0
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                return 0.0


class ToolTask(LLMTask):
    """Tools are environment replies: a reply that calls one of `tools` (typed, documented functions) gets the result
    as the next message; a reply without a call is the answer. A call: <tool_call>{"name": ..., "arguments": {...}}
    </tool_call> (Hermes), or a first line `name: argument`. A bad call is answered "error: ...", never raised."""

    def find_call(self, reply):
        """The call a reply makes, as JSON text, or None when the reply is an answer."""
        if found := TOOL_CALL.search(reply):
            return found.group(1)
        schemas = [tool_schema(f) for f in self.tools]
        plain = plain_call(reply, schemas) or python_call(reply, schemas)
        return json.dumps({"name": plain[0], "arguments": plain[1]}) if plain else None

    def env_response(self, question, answer, turns):
        call = self.find_call(turns[-1])
        if call is None:
            return None
        return {"role": "tool", "content": self.call(call, sum(self.find_call(t) is not None for t in turns[:-1]))}

    def call(self, text, calls_before):
        tools = {f.__name__: f for f in self.tools}
        if calls_before >= self.cfg.max_tool_calls:
            return f"error: no tool calls left (at most {self.cfg.max_tool_calls}); reply with the answer"
        try:
            spec = json.loads(text)
            name, args = spec["name"], spec["arguments"]
        except (json.JSONDecodeError, TypeError, KeyError):
            return 'error: write a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, in JSON'
        if not isinstance(name, str) or name not in tools:
            return f"error: no tool {name!r}; the tools are {', '.join(tools)}"
        try:
            inspect.signature(tools[name]).bind(**args)
        except TypeError as e:
            return f"error: bad arguments for {name}: {e}"
        try:
            return f"{name} result: {tools[name](**args)}"
        except Exception as e:  # whatever the tool raises is the model's to read, never the trainer's to crash on
            return f"error: {name} raised {type(e).__name__}: {e}"

    def episode_stats(self, episodes):
        tool = [[m for m in ep.chat if m["role"] == "tool"] for ep in episodes]
        n = len(episodes)
        return {"tool_calls": sum(map(len, tool)) / n, "tool_use": sum(map(bool, tool)) / n,
                "tool_errors": sum(m["content"].startswith("error:") for t in tool for m in t) / n}

    def correct(self, prompt, completion, answer):  # an answer, not a call (an empty call is a malformed call)
        return 0.0 if self.find_call(completion) is not None else numeric_match(prompt, completion, answer)

    def well_formed(self, prompt, completion, answer):  # an answer, not a call, and one number
        return self.find_call(completion) is None and super().well_formed(prompt, completion, answer)

    def reward(self, prompt, completion, answer):
        return self.correct(prompt, completion, answer)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "(12 + 3) * 4"
    """
    value = eval_expression(expression)  # tasks.py's own parser: never eval()
    if value is None:
        raise ValueError("use numbers, + - * / and parentheses")
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


class Calc(ToolTask):
    """'What is 347 * 28?': too hard for SmolLM2-135M alone, easy with the calculator. The prompt is a worked example
    (an addition, which shows the call's form: a tool named in words alone goes uncalled), then the question.
    --max-tool-calls 0: no tool."""
    tools = [calculator]

    def problem(self, rng):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        return f"What is {a} * {b}?", a * b

    def build_prompt(self, question):
        if not self.cfg.max_tool_calls:
            return question + " Reply with just the number."
        ask = " You can use a calculator."  # the example adds: the model must carry the format over to *
        return [{"role": "user", "content": "What is 1234 + 5678?" + ask},
                {"role": "assistant", "content": "calculator: 1234 + 5678"},
                {"role": "tool", "content": "calculator result: 6912"}, {"role": "assistant", "content": "6912"},
                {"role": "user", "content": question + ask}]


def agent_rows(calls):
    """An agent run's recorded calls -> its training rows [(prompt, tail, mask, sampler logps)]. A call whose prompt
    is the previous call's prompt and reply plus what the agent added continues the row (the added ids trained 0,
    the reply 1): tasks.play's episode, token for token. A call whose prompt does not extend it (the agent rewrote
    its history) starts a row of its own."""
    rows = []
    for c in calls:
        seen = rows[-1][0] + rows[-1][1] if rows else None
        if seen is not None and c["prompt"][:len(seen)] == seen:
            prompt, tail, mask, logps = rows[-1]
            added = c["prompt"][len(seen):]
            rows[-1] = (prompt, tail + added + c["ids"], mask + [0] * len(added) + [1] * len(c["ids"]),
                        logps + [0.0] * len(added) + c["logps"])
        else:
            rows.append((c["prompt"], c["ids"], [1] * len(c["ids"]), c["logps"]))
    return rows


class AgentTask(LLMTask):
    """An agent program written against the OpenAI chat API, trained as it is. A subclass gives problem(rng) and
    agent(client, question): `client` is an openai.OpenAI on this process's endpoint (serve.Chat, on the run's
    sampler; any model name), and the agent returns its answer, a text scored by the task's rewards and correct as a
    reply is, or a float reward (an environment's own grader). A step's agent runs go at once, in threads (their
    calls sampled together); each call's tokens are recorded and become training rows (agent_rows). An agent that
    raises, runs past --agent-timeout, calls more than --max-turns times, never calls, or answers neither a text nor
    a number gets reward 0, counted in agent_errors_<cause>."""
    server = None  # this process's endpoint, started by the first play
    runs_model_text = True  # an agent's tools may
    cut_by = "--max-new-tokens, or the max_tokens its agent's calls ask"
    first_reply_answers = False  # an agent's first call is no answer (no eval_acc_turn1)

    def __init__(self, cfg):
        if importlib.util.find_spec("openai") is None:  # the agents' client
            raise SystemExit('config error: agent tasks need the openai package: pip install -e ".[agents]"')
        super().__init__(cfg)

    def agent(self, client, question):
        raise NotImplementedError

    def reward(self, prompt, completion, answer):
        return completion if isinstance(completion, float) else super().reward(prompt, completion, answer)

    def correct(self, prompt, completion, answer):
        return float(completion >= 1) if isinstance(completion, float) else super().correct(prompt, completion, answer)

    def well_formed(self, prompt, completion, answer):  # a reward of the environment's own grader, or a text's form
        return isinstance(completion, float) or super().well_formed(prompt, completion, answer)

    def endpoint(self, policy):
        """-> this process's endpoint's Chat and url, the endpoint started by the first play."""
        import httpx
        from serve import serve_chat
        if self.server is None:
            self.key = secrets.token_urlsafe(32)  # the agents' key: model code their tools run has none
            self.server, self.http = serve_chat(policy, self.cfg, token=self.key), httpx.Client()  # one pool for all
        return self.server.chat, f"http://127.0.0.1:{self.server.server_port}/v1"

    def run_agents(self, policy, problems, n, greedy):
        """n agent runs per problem, at once -> [Episode] (agent_result)."""
        import openai
        chat, url = self.endpoint(policy)
        runs = [uuid.uuid4().hex for _ in range(len(problems) * n)]
        outcomes = [None] * len(runs)
        chat.open(runs, greedy)

        clients = [openai.OpenAI(base_url=url, api_key=self.key, max_retries=0,
                                 timeout=self.cfg.agent_timeout, http_client=self.http,
                                 default_headers={"X-Flatrl-Episode": run}) for run in runs]

        def go(e):
            try:
                outcomes[e] = self.agent(clients[e], problems[e // n][0])
            except Exception as error:  # the agent's own failure: reward 0, and the run goes on
                outcomes[e] = error
            finally:
                chat.returned(runs[e])
        threads = [threading.Thread(target=go, args=(e,), daemon=True) for e in range(len(runs))]
        for t in threads:
            t.start()
        end = time.time() + self.cfg.agent_timeout
        for t in threads:
            t.join(max(0.0, end - time.time()))
        records = chat.close(runs)  # a thread still running is cut off: its later calls are refused
        return [agent_result(out, rec, t.is_alive()) for out, rec, t in zip(outcomes, records, threads)]

    def play(self, policy, problems, n, greedy=False):
        """-> (Batch: every run's rows, each group's rows adjacent, batch.run each row's run; [Episode] of the runs)"""
        runs, rows, of = self.run_agents(policy, problems, n, greedy), [], []
        for e, run in enumerate(runs):
            mine = agent_rows(run.calls) or [(policy.prompt_ids(self.build_prompt(problems[e // n][0]), self.tools),
                                              [], [], [])]  # no call: an empty row keeps the group whole
            rows += mine
            of += [e] * len(mine)
        prompts, tails, masks, logps = map(list, zip(*rows))
        cut = [bool(t) and not policy.ended(t) and of[r + 1:r + 2] != [of[r]] for r, t in enumerate(tails)]
        batch = policy.to_batch(prompts, tails, masks, logps if self.cfg.record_sampler else None, cut,
                                group=[e // n for e in of], run=of)
        return batch, runs

    def episode_rewards(self, question, answer, episode):
        """The run's reward, on its last reply (place_rewards)."""
        return [self.reward(self.build_prompt(question), episode.answer, answer)]

    def episode_stats(self, episodes):
        n, causes = len(episodes), collections.Counter(ep.error for ep in episodes if ep.error)
        ignored, self.server.chat.ignored = self.server.chat.ignored, 0
        return {"turns": sum(len(ep.calls) for ep in episodes) / n, "agent_errors": sum(causes.values()),
                **{f"agent_errors_{k}": causes[k] for k in AGENT_ERRORS}, "agent_sampling_ignored": ignored,
                "rows_per_run": sum(len(agent_rows(ep.calls)) or 1 for ep in episodes) / n}


AGENT_ERRORS = ("timeout", "turns", "raised", "no_call", "answer")  # agent_result's causes


def agent_result(outcome, record, still_running):
    """-> the run as an Episode: its answer (the agent's outcome, or 0.0 on an error), the error's cause (one of
    AGENT_ERRORS) or None, the replies and calls the endpoint recorded."""
    number = isinstance(outcome, (int, float)) and not isinstance(outcome, bool) and math.isfinite(outcome)
    if still_running:
        cause = "timeout"
    elif record["error"]:  # the endpoint's: "turns"
        cause = record["error"]
    elif isinstance(outcome, Exception):
        cause = "raised"
    elif not record["calls"]:
        cause = "no_call"
    else:
        cause = None if isinstance(outcome, str) or number else "answer"
    answer = 0.0 if cause else float(outcome) if number else outcome
    return Episode([c["reply"] for c in record["calls"]], answer, cause, record["calls"])


class CalcAgent(AgentTask, Calc):
    """Calc's problems and prompt, played by an agent written against the OpenAI API: it offers the calculator as a
    tool, runs the calls the replies make (Calc's own tool, its results word for word) and sends the results back,
    until a reply calls nothing: that reply is the answer."""

    def agent(self, client, question):
        messages = self.build_prompt(question)
        for calls in range(self.cfg.max_turns):
            reply = client.chat.completions.create(model="flatrl", messages=messages,
                                                   tools=[tool_schema(calculator)]).choices[0].message
            if not reply.tool_calls:
                return reply.content or ""
            messages.append(reply.model_dump(exclude_none=True))
            for call in reply.tool_calls:
                spec = json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": self.call(spec, calls)})
        return ""  # out of turns: no answer


class ReasoningGym(LLMTask):
    """--task rg:NAME: reasoning-gym's procedural dataset NAME (pip install -e ".[tasks]"), its config from
    --rg-config (JSON). Problems are the dataset's items, each generated from the dataset's seed and its index:
    the run's seed and step pick the indices. Rewarded by the dataset's own grader, score_answer, on the reply's
    last <answer> tag, or on the whole reply without one (0 to 1); correct = a score of 1."""
    instruction = "\n\nGive your final answer in <answer></answer> tags."
    runs_model_text = True  # several graders eval() the reply (in Graders' child)
    retry = "That is not right. Try again, with your final answer in <answer></answer> tags."

    def __init__(self, cfg):
        self.data, config = rg_dataset(cfg.task.partition(":")[2], cfg.rg_config)
        self.graders = Graders(cfg.task.partition(":")[2], config)
        super().__init__(cfg)
        self.longest = max(len(answer_text(a)) for _, a in self.eval_set)  # well_formed's bound
        for _, entry in self.eval_set[:8]:  # now, not at the first reward: does the child build the same items?
            self.score("", entry)

    def grading_rule(self):
        """Does the grader give partial credit? Tried on near misses of 8 held-out answers (32 replies)."""
        partial = {score for _, entry in self.eval_set[:8] for reply in near_misses(entry["answer"])
                   if 0 < (score := self.score(f"<answer>{reply}</answer>", entry)) < 1}
        if not partial:
            return f"grading: {self.cfg.task} gave no partial credit (near misses of 8 held-out answers scored 0)"
        low, high = min(partial), max(partial)
        line = (f"grading: {self.cfg.task} gives partial credit (near misses of 8 held-out answers scored "
                f"{low:.3g}{'' if low == high else f' to {high:.3g}'}): reward can rise while accuracy stays 0")
        if self.cfg.algo == "grpo" and self.cfg.norm_std:
            line += "; GRPO's std division makes a 0.01 difference a full-size advantage (--no-norm-std: to scale)"
        return line

    def problem(self, rng):
        i = rng.randrange(len(self.data))
        entry = self.data[i]
        entry["metadata"]["source_index"] = i  # the grader's child builds entry i again
        return entry["question"], entry  # the whole entry: graders read its metadata

    def build_prompt(self, question):
        return question + self.instruction

    def score(self, completion, entry):
        answer = answer_tag(completion)  # the last tagged answer; a reply without tags is graded whole
        return self.graders.score(completion.strip() if answer is None else answer, entry["metadata"]["source_index"],
                                  entry["question"])

    def reward(self, prompt, completion, answer):
        return self.score(completion, answer)

    def correct(self, prompt, completion, answer):
        return float(self.score(completion, answer) == 1)

    def well_formed(self, prompt, completion, answer):
        """A tagged answer, or a whole reply no longer than the longest held-out answer: only an answer ("No")."""
        return bool(answer_tag(completion)) or 0 < len(completion.strip()) <= self.longest

    def env_response(self, question, answer, turns):  # multi-turn: a reply that is not right is asked again
        return None if self.score(turns[-1], answer) == 1 else self.retry


def near_misses(answer):
    """Wrong replies close to an answer: a grader that gives partial credit scores some of them between 0 and 1."""
    answer = str(answer)
    return ["", answer[:-1], answer[:-1] + ("1" if answer[-1:] != "1" else "2"), "0"]


def json_fits(value, hint):
    """Does a JSON value fit a config field typed `hint`? int, float (an int fits), str, bool and Optional of them are
    checked, and Literal choices; other types (lists, tuples) are left to the dataset's own checks."""
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:  # Optional[X]: null, or an X
        return value is None or any(json_fits(value, h) for h in typing.get_args(hint) if h is not type(None))
    if hint not in (int, float, str, bool):
        return True
    if hint is bool or isinstance(value, bool):
        return type(value) is hint
    return isinstance(value, (int, float) if hint is float else hint)


def type_words(hint):  # a field's type as an error says it: "an integer", "a number or null"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(json.dumps, typing.get_args(hint)))
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(words.get(h, "null") for h in typing.get_args(hint))
    return words.get(hint, str(hint))


def rg_dataset(name, config_json):
    """reasoning-gym's dataset `name` built with the JSON config, or a one-line config error. Its seed is fixed (0)
    and its size 10,000 unless the JSON says otherwise: the same problems for every run, the held-out ones too.
    -> (the dataset, its whole config: the graders' child builds it again)"""
    try:
        import reasoning_gym  # optional: pip install -e ".[tasks]"
    except ImportError:
        raise SystemExit('config error: --task rg:NAME needs the reasoning-gym package: pip install -e ".[tasks]"')
    names = sorted(reasoning_gym.factory.DATASETS)
    if name not in names:  # the close names, else them all
        near = difflib.get_close_matches(name, names, n=5, cutoff=0.6) or names
        raise SystemExit(f"config error: reasoning-gym has no dataset {name!r} (--task rg:NAME); "
                         f"{'close names' if len(near) < len(names) else 'its datasets'}: {', '.join(near)}")
    try:
        config = json.loads(config_json or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"config error: --rg-config is not JSON ({e}): write it as '{{\"min_terms\": 2}}'")
    if not isinstance(config, dict):
        raise SystemExit(f"config error: --rg-config must be a JSON object such as '{{\"min_terms\": 2}}', not "
                         f"{config_json}")
    kind = reasoning_gym.factory.DATASETS[name][1]  # its config dataclass
    defaults = {f.name: f.default for f in dataclasses.fields(kind)}
    shown = ", ".join(k if v is dataclasses.MISSING else f"{k} (default {v!r})" for k, v in defaults.items())
    if unknown := [key for key in config if key not in defaults]:
        raise SystemExit(f"config error: --rg-config: rg:{name} has no field {unknown[0]!r}; its fields: {shown}")
    hints = typing.get_type_hints(kind)
    for key, value in config.items():  # its own checks would fail on a wrong type with Python's words
        number = type(defaults[key]) is float and type(value) is float  # a float default of an int field (rearc's)
        if not json_fits(value, hints.get(key)) and not number:
            raise SystemExit(f"config error: --rg-config: rg:{name}'s {key} takes {type_words(hints[key])} (default "
                             f"{defaults[key]!r}), not {json.dumps(value)}")
    try:
        config = {"seed": 0, "size": 10_000, **config}
        return reasoning_gym.create_dataset(name, **config), config
    except (TypeError, ValueError, AssertionError) as e:  # a value its validate refuses
        raise SystemExit(f"config error: --rg-config {config_json}: rg:{name} refuses it ({e}); its fields: {shown}")


FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # datasets' loader per suffix


class DataTask(LLMTask):
    """Question / numeric answer rows (GSM8K's '... #### 42' too) of a hub dataset (--data openai/gsm8k --data-config
    main) or a local .jsonl / .json / .parquet / .csv. Held out: the first n_eval rows of --eval-split, else the
    last n_eval rows."""
    rewards = [(0.1, format_reward), (1.0, final_number_match)]

    def __init__(self, cfg):
        if cfg.eval_split and os.path.splitext(cfg.data)[1] in FILE_KINDS:
            raise SystemExit("config error: --eval-split names a split of a hub dataset; a local file holds out its "
                             "last --n-eval rows (drop --eval-split)")
        rows = self.load(cfg, cfg.data_split)
        self.held = self.load(cfg, cfg.eval_split)[:cfg.n_eval] if cfg.eval_split else rows[-cfg.n_eval:]
        self.rows = rows if cfg.eval_split else rows[:-cfg.n_eval]
        if not self.rows or len(self.held) < cfg.n_eval:
            raise SystemExit(f"config error: --data {cfg.data} has too few rows for {cfg.n_eval} held out and some to "
                             f"train on: lower --n-eval")
        super().__init__(cfg)

    @staticmethod
    def load(cfg, split):
        try:
            import datasets  # optional (pip install datasets): only this task needs it
        except ImportError:
            raise SystemExit("config error: the data task needs the datasets package: pip install datasets")
        datasets.disable_progress_bars()  # its bars would bury the run's own output
        kind = FILE_KINDS.get(os.path.splitext(cfg.data)[1])
        if kind and not os.path.isfile(cfg.data) or not cfg.data:
            raise SystemExit(f"config error: --data {cfg.data!r}: no such file (give a local .jsonl / .json / "
                             ".parquet / .csv file, or a Hugging Face dataset id such as openai/gsm8k)")
        try:
            ds = (datasets.load_dataset(kind, data_files=cfg.data, split="train") if kind else
                  datasets.load_dataset(cfg.data, cfg.data_config or None, split=split))
        except Exception as e:  # not on the hub, not cached while offline, no such config or split: many types
            first_line = str(e).splitlines()[0][:300]
            raise SystemExit(f"config error: --data {cfg.data}: {type(e).__name__}: {first_line} (a hub dataset must "
                             "be cached to load offline: load it once online, or give a local file)")
        fields = [cfg.question_field, cfg.answer_field]
        if missing := [f for f in fields if f not in ds.column_names]:
            raise SystemExit(f"config error: --data {cfg.data} has no field {missing[0]!r} (it has "
                             f"{', '.join(ds.column_names)}): set --question-field / --answer-field")
        rows = [(r[fields[0]], str(r[fields[1]]).split("####")[-1].strip().replace(",", "")) for r in ds]
        for i, (q, a) in enumerate(rows):  # refused at load, not by the first evaluation that meets the row
            if not q or not re.fullmatch(r"-?\d+(\.\d+)?", a):
                field, value = (fields[0], q) if not q else (fields[1], ds[i][fields[1]])
                raise SystemExit(f"config error: --data {cfg.data}: row {i + 1} has no usable {field!r} ({value!r}; "
                                 f"answers must be numbers, e.g. 42 or '... #### 42'): fix or drop that row")
        return [(str(q), a) for q, a in rows]

    def held_out(self):
        return self.held

    def problem(self, rng):
        return self.rows[rng.randrange(len(self.rows))]

    def build_prompt(self, question):
        return question + self.cfg.data_prompt

    def correct(self, prompt, completion, answer):
        return final_number_match(prompt, completion, answer)

    def well_formed(self, prompt, completion, answer):  # a number to read: the last one (the reasoning comes first)
        return bool(numbers(answer_tag(completion) or completion))


class VerifiersTask(AgentTask):
    """--task vf:NAME: the verifiers (0.4) environment NAME as it is published (pip install -e ".[verifiers]"), its
    config from --vf-config (JSON, verifiers' own env config). Its tasks are the problems; each run is one rollout of
    its harness against this process's endpoint, through verifiers' interception server, which names every call's
    model as the rollout's: flatrl-run:<run id> (serve.run_named), so a run's calls are recorded apart as an agent's.
    The reward is the environment's own (its rewards, weighted and summed as verifiers does); correct = a reward of at
    least 1 (verifiers' own solved mark). Held out: the last n_eval tasks. The environment runs in a child process
    (VfChild): its rewards, tools and harness read model text, and none of that runs here."""

    def __init__(self, cfg):
        if importlib.util.find_spec("verifiers") is None:
            raise SystemExit('config error: --task vf:NAME needs the verifiers package: pip install -e ".[verifiers]"')
        self.child = VfChild(cfg.task.partition(":")[2], cfg.vf_config, cfg.agent_timeout)
        super().__init__(cfg)

    def held_out(self):  # (LLMTask's start) the environment's tasks, from its child: its last n_eval held out
        questions = self.child.start()
        alike = collections.Counter(questions)  # flatrl keys problems by question: tasks that ask alike are told apart
        tasks = [(q if alike[q] == 1 else f"{q} [task {i}]", i) for i, q in enumerate(questions)]
        if len(tasks) <= self.cfg.n_eval:
            raise SystemExit(f"config error: --task {self.cfg.task} has {len(tasks)} tasks, and --n-eval "
                             f"{self.cfg.n_eval} would hold out all of them: lower --n-eval")
        self.rows = tasks[:-self.cfg.n_eval]
        return tasks[-self.cfg.n_eval:]

    def problem(self, rng):
        return self.rows[rng.randrange(len(self.rows))]

    def build_prompt(self, question):  # for a run that made no call: its empty row's prompt
        return [{"role": "user", "content": question}]

    def run_agents(self, policy, problems, n, greedy):
        """n rollouts per problem, at once, in the child -> [Episode] (agent_result)."""
        chat, url = self.endpoint(policy)
        runs = [uuid.uuid4().hex for _ in range(len(problems) * n)]
        chat.open(runs, greedy)
        try:
            said = self.child.play(url, self.key, [(run, problems[e // n][1]) for e, run in enumerate(runs)], chat)
        finally:
            records = chat.close(runs)  # a run still going is cut off: its later calls are refused
        outcomes = [said.get(run, {"error": "timeout"}) for run in runs]
        return [agent_result(out.get("reward", RuntimeError(out.get("why"))), record, out.get("error") == "timeout")
                for out, record in zip(outcomes, records)]


class VfChild:
    """The process that holds a verifiers environment (vf_child): started with the task (its tasks, or a one-line
    error), and again after one that stopped answering (a rollout that blocked it: that step's unanswered runs time
    out). It speaks JSON lines on its stdin and stdout; whatever the environment prints goes to its stderr."""

    def __init__(self, name, config_json, timeout):
        self.name, self.args, self.timeout = name, [name, config_json, str(timeout)], timeout
        self.proc, self.prompts, self.why = None, None, set()  # the child; its tasks; the failures already told

    def start(self):
        """-> the environment's tasks' questions; a SystemExit if it cannot be trained here."""
        self.err = tempfile.TemporaryFile("w+")
        code = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import tasks; " \
               "tasks.vf_child(*sys.argv[1:])"
        self.proc, self.unread = subprocess.Popen([sys.executable, "-c", code, *self.args], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, stderr=self.err, start_new_session=True), b""
        try:
            said = json.loads(self.line(600) or "{}")
        except ValueError:
            said = {}
        if "prompts" not in said:
            why = said.get("error") or self.last_words()
            self.stop()
            raise SystemExit(f"config error: --task vf:{self.name}: {why}")
        if self.prompts is not None and said["prompts"] != self.prompts:  # a new child, after one that hung
            raise SystemExit(f"--task vf:{self.name}: the environment's tasks came back in another order: flatrl "
                             "needs a taskset that loads the same tasks every time (seed its shuffles)")
        self.prompts = said["prompts"]
        return self.prompts

    def last_words(self):
        """The last line the child wrote to its stderr (where the environment's output goes)."""
        self.err.seek(0)
        return (self.err.read().strip().splitlines() or ["it exited saying nothing"])[-1][:300]

    def line(self, timeout):
        """The child's next line, or "" if none comes within timeout seconds. Read from the pipe itself: a buffered
        reader could hold the next lines where select does not see them."""
        end = time.time() + timeout
        while b"\n" not in self.unread:
            if not select.select([self.proc.stdout], [], [], max(end - time.time(), 0))[0]:
                return ""
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:  # the child exited
                return ""
            self.unread += chunk
        line, self.unread = self.unread.split(b"\n", 1)
        return line.decode()

    def stop(self):  # at a hang or a bad start (when the trainer ends, the child ends itself: outlive_not)
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc.wait()
            self.proc = None

    def play(self, url, key, runs, chat):
        """runs [(run id, task index)] at once -> {run id: {"reward": r} or {"error": cause, "why": ...}}, each run
        returned to chat as it ends (Chat.returned: no call waits for it). A run not answered within the timeout (and
        10 s for the child to say so) is missing: the child is stopped, and the next play starts a new one."""
        if self.proc is None:
            self.start()
        said, end = {}, time.time() + self.timeout + 10
        try:
            self.proc.stdin.write(json.dumps({"url": url, "key": key, "runs": runs}).encode() + b"\n")
            self.proc.stdin.flush()
            while len(said) < len(runs) and (line := self.line(end - time.time())):
                out = json.loads(line)
                run = out.pop("run")
                said[run] = out
                chat.returned(run)
        except (OSError, ValueError, KeyError):  # the child died, or wrote something else than its line
            pass
        if len(said) < len(runs):
            print(f"vf:{self.name}: the environment's process stopped answering ({self.last_words()}): the step's "
                  "unanswered runs time out; a new one starts", file=sys.stderr)
            self.stop()
        for out in said.values():  # each new cause once (a few dozen at most): its first line, printable
            why = "".join(c for c in (str(out.get("why") or "").strip().splitlines() or ["(no message)"])[0]
                          if c.isprintable())[:200]
            if "why" in out and why not in self.why and len(self.why) < 50:
                print(f"vf:{self.name}: a rollout failed: {why}", file=sys.stderr)
                self.why.add(why)
        return said


VF_MAX_TASKS = 100_000  # of an endless taskset, the first ones


def vf_child(name, config_json, timeout):
    """--task vf:NAME's child process (VfChild): loads the environment, prints {"prompts": [each task's question]}
    (or {"error": why}), then for each line it reads ({"url", "key", "runs": [[run id, task index], ...]}) runs
    those rollouts at once against url, printing {"run": id, "reward": r} or {"run": id, "error": cause} as each
    ends. The prints go to its own copy of stdout: the environment's go to stderr."""
    import asyncio
    out, commands = os.fdopen(os.dup(1), "w"), os.fdopen(os.dup(0), "rb")  # private: programs it starts inherit 0-2
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = sys.stderr
    trainer = os.getppid()
    threading.Thread(target=outlive_not, args=(trainer,), daemon=True).start()
    try:
        env, tasks = vf_environment(name, config_json)
    except Exception as e:  # the one-line error the trainer shows
        print(json.dumps({"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:500]}), file=out, flush=True)
        return
    print(json.dumps({"prompts": [vf_question(t.data) for t in tasks]}), file=out, flush=True)
    asyncio.run(vf_serve(env, tasks, float(timeout), commands, out))


def outlive_not(trainer):
    """(A thread of the child) once the trainer is gone, however it went (os._exit skips atexit): end the child
    and every process under it, even while a rollout blocks the child's event loop."""
    while os.getppid() == trainer:
        time.sleep(1)
    kill_tree(os.getpid())


def kill_tree(pid):
    """SIGKILL a process and all its descendants, those in sessions of their own too (verifiers starts each harness
    program in a new session): found through /proc, children first listed, the parent stopped first."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)  # no new children while the tree is read
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for child in children:
        kill_tree(child)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def vf_question(data):
    """A verifiers task's question as text: its prompt, or the last user message of a prompt of messages."""
    if isinstance(data.prompt, str) or data.prompt is None:
        return data.prompt or ""
    said = [m.content for m in data.prompt if m.role == "user" and isinstance(m.content, str)]
    return said[-1] if said else json.dumps(data.model_dump(mode="json")["prompt"])


def vf_environment(name, config_json):
    """verifiers' own loaders on NAME and the config -> (its Env, its tasks), or an error saying why not. Every role
    runs as a local subprocess unless the config names a runtime; anything needing a container is refused."""
    import pydantic
    import verifiers.v1 as vf
    from verifiers.v1.utils import loaders
    try:
        raw = json.loads(config_json or "{}")
    except ValueError as e:
        raise ValueError(f"--vf-config is not JSON ({e}): give verifiers' env config, e.g. '{{\"taskset\": {{}}}}'")
    if not isinstance(raw, dict) or not isinstance(raw.get("taskset", {}), dict):
        raise ValueError("--vf-config must be a JSON object, its taskset one too: verifiers' env config")
    if raw.get("taskset", {}).get("id", name) != name:
        raise ValueError(f"--vf-config names the taskset {raw['taskset']['id']!r}, and --task vf:{name} another")
    if not name:
        raise ValueError("give the environment's name: --task vf:NAME")
    raw.setdefault("taskset", {})["id"] = name
    try:
        loaders.import_taskset(name)  # verifiers' own resolution of NAME to a module
    except ModuleNotFoundError as e:
        missing = getattr(e.__cause__, "name", None) or name
        installed = [m.name for m in pkgutil.iter_modules()] + [m.name for m in pkgutil.iter_modules(
            importlib.import_module("verifiers.v1.tasksets").__path__)]
        close = difflib.get_close_matches(missing, installed, n=3)
        raise ValueError(f"no verifiers environment {name!r} is installed (no module {missing!r} to import)" +
                         (f"; did you mean {', '.join(close)}?" if close else "; install its package first"))
    kind = loaders.environment_class(name, raw.get("id", ""))
    if kind is not vf.SingleAgentEnv:  # best-of-n, judges, user simulators: several traces an episode
        raise ValueError(f"the environment is a {kind.__name__}: flatrl trains one agent's calls per run, so it takes "
                         "single-agent environments (verifiers' SingleAgentEnv) only")
    raw.setdefault("agent", {}).setdefault("runtime", {"type": "subprocess"})  # verifiers' default: a remote sandbox
    try:
        config = vf.resolve_env_config(raw)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"--vf-config: {'.'.join(map(str, first['loc'])) or 'the config'}: {first['msg']}")
    if config.agent.model or config.agent.client:
        raise ValueError("the agent names a model or endpoint of its own, and flatrl trains the one it serves: drop "
                         "agent.model / agent.client from --vf-config")
    if any(r.max_retries or r.rules for r in (config.retries, config.agent.retries)):
        raise ValueError("retries are on: a retried rollout's first calls would be trained with the last attempt's "
                         "reward: drop retries from --vf-config")
    if config.agent.runtime.type != "subprocess":
        raise ValueError(f"the agent runs in verifiers' {config.agent.runtime.type} runtime (a container or a remote "
                         "sandbox), which flatrl does not give: its harnesses run as local subprocesses")
    harness = config.agent_harnesses()["agent"].id
    if loaders.harness_class(harness).NEEDS_CONTAINER:
        raise ValueError(f"harness {harness!r} needs a container, which flatrl does not give (its harnesses run as "
                         "local subprocesses): pick another, e.g. the taskset's own, bash or null")
    env = vf.load_environment(config)
    tasks = list(env.taskset if env.taskset.bounded else env.taskset.take(VF_MAX_TASKS))
    if imaged := [t for t in tasks if t.data.image or getattr(type(t), "NEEDS_CONTAINER", False)]:
        why = imaged[0].data.image or "its task class says so"
        raise ValueError(f"task {imaged[0].data.idx} needs a container ({why}), which flatrl does not give")
    return env, tasks


async def vf_serve(env, tasks, timeout, commands, out):
    """The child's loop: each line's rollouts at once, inside the environment's serving resources."""
    import asyncio

    import verifiers.v1 as vf
    from verifiers.v1.env import RunSlot
    from serve import RUN_MODEL

    async def rollout(run, index, client):
        ctx = vf.ModelContext(model=RUN_MODEL + run, client=client)
        try:
            episode = await asyncio.wait_for(env.run_slot(RunSlot(tasks[index]), ctx), timeout)
            errors = [*episode.errors, *(t.last_error for t in episode.traces if t.last_error)]
            said = {"reward": sum(t.reward for t in episode.traces)} if episode.ok else {
                "error": "raised", "why": errors[0].message if errors else "the episode failed"}
        except TimeoutError:
            said = {"error": "timeout"}
        except Exception as e:  # the harness's, the reward's: this run's alone
            said = {"error": "raised", "why": f"{type(e).__name__}: {e}"}
        print(json.dumps({"run": run, **said}), file=out, flush=True)

    loop = asyncio.get_running_loop()
    async with env.serving():
        while line := await loop.run_in_executor(None, commands.readline):
            ask = json.loads(line)
            os.environ["FLATRL_VF_API_KEY"] = ask["key"]  # read as the client is built; subprocesses never get it
            client = vf.EvalClientConfig(base_url=ask["url"], api_key_var="FLATRL_VF_API_KEY")
            await asyncio.gather(*(rollout(run, index, client) for run, index in ask["runs"]))


def task_class(name):
    """--task's class: rg:NAME is the rg task (reasoning-gym's dataset NAME), vf:NAME the verifiers environment."""
    return TASKS[name[:3] + "NAME" if name.startswith(("rg:", "vf:")) else name]


TASKS = {"cartpole": GymTask, "gym": GymTask, "arith": Arith, "calc": Calc,
         "calc_agent": CalcAgent, "data": DataTask, "rg:NAME": ReasoningGym, "vf:NAME": VerifiersTask,
         "jsonl": DataTask}  # jsonl: data's other name, which older configs use
