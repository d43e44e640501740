"""One flat, typed run configuration: defaults here, a YAML preset over them, CLI flags over that.

Every field is one line with a comment; the CLI (`--field-name`, booleans `--x/--no-x`) and its help
are generated from this file, and validate() rejects bad combinations before anything runs. Read the
fields as the list of every knob; the reading path goes on in train.py.
"""
import argparse
import dataclasses
import difflib
import inspect
import math
import os
import re
import sys

import yaml

ONE_SHOT = ("check_parity", "ask", "serve")  # act once and exit: never written to a run's config.yaml
DROPPED = {"probe_tol": "the worker sync probe is gone: gap_tol warns on logp_gap instead"}  # in older config.yaml
DTYPES = ("auto", "bfloat16", "float32", "float16")
CHOICES = {  # fields with fixed names
    "role": ("sync", "trainer", "rollout"), "credit": ("episode", "turn"), "generator": ("hf", "vllm"),
    "vllm_lora": ("merge", "adapter"), "vllm_compile": ("auto", "on", "off"), "plot": ("auto", "on", "off"),
    "kl_estimator": ("k1", "k2", "k3"), "loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "gen_dtype": DTYPES, "wire_dtype": DTYPES, "old_logp": ("trainer", "sampler")}
# Numeric fields' valid ranges (low, high), ends included but POSITIVE's low end; None: no upper end.
POSITIVE = ("lr", "turn_discount", "vllm_kv_gib", "body_limit_mb")
RANGES = {
    "steps": (1, None), "epochs": (1, None), "minibatches": (1, None), "batch_size": (1, None), "group_size": (1, None),
    "eval_episodes": (1, None), "n_eval": (1, None), "digits": (1, None), "max_new_tokens": (1, None),
    "max_turns": (1, None), "gen_batch": (1, None), "vllm_max_len": (1, None), "hidden": (1, None),
    "lora_alpha": (1, None), "max_queue": (1, None), "micro_batch": (0, None), "eval_every": (0, None),
    "save_every": (0, None), "threads": (0, None), "max_staleness": (0, None), "max_tool_calls": (0, None),
    "max_episode_tokens": (0, None), "eval_k": (0, None), "overlong_buffer": (0, None), "lora_r": (0, None),
    "weight_decay": (0, None), "max_grad_norm": (0, None), "kl_coef": (0, None), "vf_coef": (0, None),
    "vclip": (0, None), "adv_eps": (0, None), "peak_tflops": (0, None), "parity_tol": (0, None),
    "gap_tol": (0, None), "connect_timeout": (0, None), "port": (0, 65535), "gamma": (0, 1), "lam": (0, 1),
    "eps": (0, 1), "vllm_mem": (0, 1), "lr": (0, None), "temperature": (1e-3, None), "turn_discount": (0, 1),
    "vllm_kv_gib": (0, None), "body_limit_mb": (0, None), "agent_timeout": (0, None),
    "seed": (0, 2**32 - 1)}
# seed: numpy's range (vLLM seeds numpy with it). temperature: vLLM samples greedily below 1e-5, so the loss would
# model a distribution nobody drew from, and logits / T overflow float32 near 1e-36.


def need(ok, msg):  # Config.validate's check: a config error naming the fix
    if not ok:
        raise SystemExit(f"config error: {msg}")


@dataclasses.dataclass
class Config:
    # --- run ---
    task: str = "cartpole"  # what to learn: a gymnasium env (cartpole, with --env), a name in tasks.TASKS, rg:NAME
    env: str = "CartPole-v1"  # gymnasium id for control tasks: discrete actions, Box observations
    algo: str = "reinforce"  # advantage estimator, one of algos.ADVANTAGES
    seed: int = 0  # seeds python, torch, env resets and prompt order
    steps: int = 300  # maximum training steps (one batch + one update each)
    out: str = ""  # run directory ("" = runs/<task>-<algo>-<time>)
    resume: str = ""  # run directory to continue from ("" = start fresh)
    eval_every: int = 5  # greedy evaluation every N steps, and always at step 0 (0 = step 0 only)
    save_every: int = 10  # checkpoint every N steps, and at the end (0 = only at the end)
    stop_when_solved: bool = True  # end the run when greedy evaluation reaches the task's threshold
    device: str = "cpu"  # torch device for LLM tasks: cpu, cuda, cuda:1 ... (control tasks always run on the CPU)
    threads: int = 0  # torch CPU threads; 0 = all cores, or a trainer's or worker's share of one machine (README)
    peak_tflops: float = 0.0  # the device's matmul peak, for gen_mfu / train_mfu (0 = measured once per dtype, cached)
    log_to: str = ""  # trackers next to metrics.csv, comma-separated: tensorboard, wandb
    plot: str = "auto"  # curves.png when the run ends; auto = LLM runs only (matplotlib is slow to import)
    # --- async (serve.py): a trainer and any number of rollout workers ---
    role: str = "sync"  # sync (one process), trainer (serves weights, trains on pushed batches) or rollout
    port: int = 8000  # trainer: port to listen on (0 = any free port)
    bind: str = "127.0.0.1"  # trainer: address to listen on; anything but loopback needs FLATRL_TOKEN
    trainer_url: str = ""  # rollout: the trainer, e.g. http://127.0.0.1:8000
    token_file: str = ""  # the bearer token, read once from this file instead of FLATRL_TOKEN (README "Tokens")
    max_staleness: int = 1  # drop batches sampled more than this many versions ago (0 = on-policy only)
    max_queue: int = 4  # trainer: batches waiting at most; beyond it workers wait for new weights (503)
    wire_dtype: str = "auto"  # weights sent to workers: auto = gen_dtype for LLMs (bf16 halves the bytes), else float32
    body_limit_mb: float = 256.0  # trainer: larger POST bodies get 413 before being read
    connect_timeout: float = 300.0  # rollout: seconds to keep retrying an unreachable trainer, then exit
    # --- rollout ---
    batch_size: int = 16  # samples per step: episodes, or prompts x group_size completions
    group_size: int = 1  # samples per prompt (or per env reset seed); grpo and rloo need >= 2
    eval_episodes: int = 10  # held-out episodes (fixed seeds) per control-task evaluation
    # --- LLM tasks ---
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # hub id or local folder of a causal LM
    data: str = ""  # data task: a Hugging Face dataset id (openai/gsm8k) or a local .jsonl / .json / .parquet / .csv
    data_config: str = ""  # data task: the dataset's configuration, e.g. main for openai/gsm8k
    data_split: str = "train"  # data task: the split trained on; its last n_eval rows are held out unless eval_split
    eval_split: str = ""  # data task: a split of a hub dataset to hold out from instead (its first n_eval rows)
    question_field: str = "question"  # data task: the column holding the question
    answer_field: str = "answer"  # data task: the column holding the answer (GSM8K's "... #### 42" is understood)
    data_prompt: str = "\nThink step by step, then put the final number in <answer></answer> tags."  # after a question
    rg_config: str = ""  # rg:NAME tasks: the reasoning-gym dataset's config as JSON, e.g. '{"min_terms": 2}'
    vf_config: str = ""  # vf:NAME tasks (a verifiers environment NAME): verifiers' own env config as JSON
    digits: int = 1  # arith: digits per operand
    ops: str = "+"  # arith: operators to draw from, e.g. "+-*"
    max_new_tokens: int = 32  # tokens per reply; max_turns x this is the constant L_max of seq_mean_token_sum_norm
    max_turns: int = 1  # assistant replies per episode; > 1 = multi-turn: the task's env_response answers each
    turn_discount: float = 1.0  # multi-turn: a reward k replies later counts turn_discount^k (0 < d <= 1)
    credit: str = "episode"  # multi-turn: episode = every reply gets the episode's return; turn = its own reward-to-go
    max_tool_calls: int = 2  # tool tasks: calls run per episode, later ones answered with an error (0 = tools off)
    max_episode_tokens: int = 0  # multi-turn: tokens after the prompt, replies and messages together (0 = no cap)
    temperature: float = 1.0  # sampling temperature; the trainer scores logits / temperature too
    gen_batch: int = 64  # rows decoded together by the HF sampler (whole groups: at least group_size)
    gen_dtype: str = "auto"  # the sampler's weights: auto = bfloat16 where the device has fast bf16, else float32
    generator: str = "hf"  # sampler: hf (flatrl's decode loop on the transformers model) or vllm
    vllm_lora: str = "merge"  # vllm: merge = each adapter merged into the engine's weights; adapter = vLLM's LoRA
    vllm_compile: str = "auto"  # vllm: torch.compile the model (and CUDA graphs); auto = on a GPU only
    vllm_mem: float = 0.5  # vllm on a GPU: fraction of its memory for weights and KV cache
    vllm_kv_gib: float = 2.0  # vllm on a CPU: GiB of KV cache; rows that do not fit wait their turn (slower)
    vllm_max_len: int = 2048  # vllm: max tokens per sequence, prompt + completion
    check_parity: bool = False  # score fixed prompts with the generator and the trainer, report, exit
    ask: str = ""  # with --resume RUN: print the trained policy's greedy reply to this prompt, then exit
    serve: bool = False  # with --resume RUN: serve the trained policy on /v1/chat/completions (--bind, --port)
    agent_timeout: float = 60.0  # agent tasks: seconds a step's agent runs may take; later ones get reward 0
    parity_tol: float = 0.0  # largest mean |delta logp| --check-parity accepts (0 = 1e-3 in fp32, 0.1 with bf16)
    gap_tol: float = 0.25  # trainer warns when a batch's logp_gap is larger: a worker whose weights did not load
    n_eval: int = 64  # held-out prompts per LLM evaluation (greedy)
    eval_k: int = 0  # pass@k on the held-out prompts with k samples at temperature (0 = off)
    overlong_buffer: int = 0  # penalise completions in the last N tokens before the cap, -1 at the cap (0 = off)
    # --- policy and optimizer ---
    hidden: int = 128  # MLP hidden width (control tasks)
    lora_r: int = 16  # LoRA rank (0 = full fine-tuning)
    lora_alpha: int = 32  # LoRA scale alpha / r
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # modules LoRA adapts
    grad_ckpt: bool = False  # gradient checkpointing: less memory, one more forward per backward
    fsdp: bool = False  # under torchrun, shard the LLM policy over the ranks with FSDP2
    bf16: bool = True  # bf16 autocast for the trainer where the device has fast bf16 (weights stay fp32)
    lr: float = 0.005  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW's decoupled decay of weight matrices; biases, norms, embeddings: none (0 = off)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = off)
    # --- advantage ---
    gamma: float = 0.99  # discount for return-to-go and GAE
    whiten_returns: bool = True  # reinforce: A = (G - mean) / std over the batch's real steps (false = A = G)
    lam: float = 0.95  # GAE lambda (ppo)
    norm_std: bool = True  # grpo: divide by the group std; false = Dr.GRPO advantage R - mean
    adv_eps: float = 1e-6  # grpo: (R - mean) / (std + adv_eps), std unbiased (n - 1)
    # --- update ---
    epochs: int = 1  # passes over each batch; old_logp is fixed before the first
    minibatches: int = 1  # optimizer steps per epoch (the batch is split by rows)
    micro_batch: int = 0  # rows per forward/backward inside a minibatch (0 = whole minibatch)
    loss_agg: str = "token_mean"  # token_mean, seq_mean_token_mean, seq_mean_token_sum_norm
    eps: float = 0.2  # PPO clip: ratio kept within [1 - eps, 1 + eps_high]
    eps_high: float = 0.2  # upper clip; > eps is DAPO's clip-higher (e.g. 0.28)
    dual_clip: float = 0.0  # dual-clip c > 1 bounds the loss at -c * A for A < 0 (0 = off)
    ent_coef: float = 0.0  # entropy bonus coefficient (0 = off)
    kl_coef: float = 0.0  # KL penalty to the reference policy (0 = off, no reference kept)
    kl_estimator: str = "k3"  # k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d, with d = logp - ref_logp
    kl_in_reward: bool = False  # put -kl_coef * k1 into the per-token reward (ppo) instead of the loss
    vf_coef: float = 0.5  # value loss coefficient (ppo)
    vclip: float = 0.2  # value clip around the OLD values (0 = off)
    tis_clip: float = 0.0  # truncated importance weight min(exp(old_logp - sampler_logp), C) (0 = off)
    old_logp: str = "trainer"  # trainer: recomputed under the weights that sampled; sampler: a teaching ablation

    def validate(self, choices=()):
        """Reject bad values and combinations with a message that names the fix. `choices`: more fields with a
        fixed set of names (train.py passes --task's and --algo's registries)."""
        for key, names in {**CHOICES, **dict(choices)}.items():
            value = getattr(self, key)
            if key == "task" and value.startswith(("rg:", "vf:")):  # rg:NAME, vf:NAME: the task checks NAME
                value = value[:3] + "NAME"
            if value not in names:  # (the did-you-mean search only then: it reads the source)
                need(False, f"{key} {value!r} is unknown{_closest(value, list(names))}; pick one of {', '.join(names)}")
        for f in dataclasses.fields(self):  # NaN passes every comparison below, and inf trains on nonsense
            value = getattr(self, f.name)
            need(f.type is not float or math.isfinite(value),
                 f"{f.name} must be a finite number, not {value} ({_field_help()[f.name][0]})")
        for key, (low, high) in RANGES.items():
            value = getattr(self, key)
            if value < low or value == low and key in POSITIVE or high is not None and value > high:
                span = (">" if key in POSITIVE else ">=") + f" {low}" + ("" if high is None else f" and <= {high}")
                need(False, f"{key} must be {span}, not {value} ({_field_help()[key][0]})")  # help: reads the source
        need(self.ops and set(self.ops) <= set("+-*"), f"ops {self.ops!r}: arith draws from + - and *, e.g. --ops +-*")
        need(self.batch_size % self.group_size == 0,
             f"batch_size {self.batch_size} is not a multiple of group_size {self.group_size}")
        need(self.eps_high >= self.eps, f"eps_high {self.eps_high} < eps {self.eps}: set --eps-high >= --eps")
        need(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip must be 0 (off) or > 1 (3 is usual)")
        ranks = int(os.environ.get("WORLD_SIZE", 1))
        prompts = self.batch_size // self.group_size
        need(prompts % ranks == 0, f"{prompts} prompts per step do not split over {ranks} ranks: change --batch-size")
        need(not self.fsdp or ranks > 1, "--fsdp shards the policy over ranks: run under torchrun --nproc-per-node 2")
        need(self.batch_size % self.minibatches == 0,
             f"batch_size {self.batch_size} is not divisible by minibatches {self.minibatches}")
        need(not self.kl_in_reward or self.algo == "ppo", "kl_in_reward needs per-token credit: use --algo ppo")
        need(self.role != "rollout" or self.trainer_url, "a rollout worker needs --trainer-url http://HOST:PORT")
        need(self.generator == "hf" or self.vllm_lora == "merge" or self.lora_r > 0,
             "--vllm-lora adapter serves LoRA adapters; full fine-tuning (lora_r 0) needs --vllm-lora merge")
        need(self.tis_clip == 0 or self.tis_clip >= 1,
             f"tis_clip {self.tis_clip} < 1 would down-weight every token: use 0 (off) or a cap >= 1 (2 is usual)")
        need(set(self.log_to.split(",")) <= {"", "tensorboard", "wandb"},
             f"log_to {self.log_to!r}: use tensorboard, wandb or both")
        need(self.credit == "episode" or self.algo != "grpo" or not self.norm_std,
             "--credit turn with grpo's std division is biased (the std includes the episode itself, over episodes "
             "the policy chose to prolong): add --no-norm-std")
        return self

    @property
    def record_sampler(self):  # the sampler's own logprobs travel with each batch: a worker's, or the ablation
        return self.role == "rollout" or self.old_logp == "sampler"


def _field_help():
    """Field -> (the trailing comment of its line: its --help text, the section it sits under)."""
    out, section = {}, ""
    for line in inspect.getsource(Config).splitlines():
        if m := re.match(r"\s+# --- (.*) ---", line):
            section = m[1]
        elif m := re.match(r"^\s+(\w+): \w+ = .*?  # (.*)$", line):
            out[m[1]] = (m[2], section)
    return out


def _closest(key, valid):
    """' (did you mean X?)' for a near-miss of a field or flag name: by spelling, else by meaning (a
    field whose help says the key's words: learning_rate -> lr, "Adam learning rate")."""
    helps, words = _field_help(), key.strip("-").replace("-", " ").replace("_", " ")
    hit = difflib.get_close_matches(key, valid, n=1) or [
        v for v in valid if len(words) > 3 and words in helps.get(v.strip("-").replace("-", "_"), ("",))[0]]
    return f" (did you mean {hit[0]!r}?)" if hit else ""


def _typed(key, value, typ, where):
    """A YAML value as the field's type, or a config error. YAML 1.1 reads 1e-4 as a string, so a float
    field takes a numeric string; nothing else is converted: "false" is not a bool, "abc" not an int."""
    if type(value) is typ or typ is float and type(value) in (int, str):
        try:
            return typ(value)
        except ValueError:
            pass
    example = {bool: "true or false", int: "an integer such as 8", float: "a number such as 3e-4", str: "a string"}[typ]
    raise SystemExit(f"config error: {key} must be {example}, not {value!r} (in {where})")


def load_yaml(path):
    if not os.path.isfile(path):
        folder, name = os.path.split(path)
        there = os.listdir(folder or ".") if os.path.isdir(folder or ".") else []
        near = difflib.get_close_matches(name, there, n=1, cutoff=0.5)  # arith_grpo.yaml -> arith_grpo_cpu.yaml
        hint = f"did you mean {os.path.join(folder, near[0])}?" if near else "the presets are in configs/"
        raise SystemExit(f"config error: no config file {path!r} ({hint})")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark, start = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)  # lines numbered from 0
        where = f"{path}:{mark.line + 1}" if mark else path
        opened = f"{e.context} from line {start.line + 1}: " if start and e.context else ""  # e.g. an unclosed [
        raise SystemExit(f"config error: {where}: not valid YAML ({opened}{getattr(e, 'problem', None) or e}): "
                         f"write it as 'key: value' lines")
    if not isinstance(data, dict):
        raise SystemExit(f"config error: {path} must hold 'key: value' lines")
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for key in DROPPED.keys() & data.keys():  # a run written before a field went still resumes
        print(f"note: {path}: {key} ignored ({DROPPED[key]})", file=sys.stderr)
        del data[key]
    for key, value in data.items():
        if key not in types:
            raise SystemExit(f"config error: unknown key {key!r} in {path}{_closest(str(key), list(types))}")
        data[key] = _typed(key, value, types[key], path)
    return data


def resumed(run_dir):
    """--resume RUN_DIR: the run's own config, or a one-line error when there is nothing to resume."""
    if os.path.isfile(run_dir):
        raise SystemExit(f"config error: --resume takes a run directory, and {run_dir} is a file: to start from a "
                         f"preset use --config {run_dir}; to resume, --resume {os.path.dirname(run_dir) or '.'}")
    if not os.path.isdir(run_dir):
        raise SystemExit(f"config error: --resume {run_dir}: no such run directory")
    if not os.path.isfile(os.path.join(run_dir, "checkpoint.safetensors")):
        raise SystemExit(f"config error: --resume {run_dir}: no checkpoint.safetensors there (a run saves one every "
                         "--save-every steps and at the end); to start afresh use --out")
    return load_yaml(os.path.join(run_dir, "config.yaml"))


def _shown(default):  # as it would be typed
    if isinstance(default, bool):
        return str(default).lower()
    return repr(default) if isinstance(default, str) and (default == "" or "\n" in default) else str(default)


def _one_line(message):
    raise SystemExit(f"config error: {message} (python train.py --help lists the flags)")


def parse(argv=None, choices=None):
    """CLI -> Config: defaults, then --config FILE.yaml, then explicit flags; validated. `choices` maps a
    field to its registered names (train.py passes tasks.TASKS and algos.ADVANTAGES): --help lists them,
    and any other value is an error."""
    helps, choices = _field_help(), choices or {}
    parser = argparse.ArgumentParser(description="flatrl: RL post-training in seven flat files",
                                     allow_abbrev=False, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="YAML preset; flags given here override it")
    groups = {}  # --help lists the flags under config.py's section comments
    for f in dataclasses.fields(Config):
        help, section = helps[f.name]
        flag = "--" + f.name.replace("_", "-")
        names = {**CHOICES, **choices}.get(f.name)
        if names:
            help += f" [{', '.join(names)}]"
        help += f" (default: {_shown(f.default)})".replace("%", "%%")  # argparse formats help with %
        group = groups.setdefault(section, parser.add_argument_group(section))
        if f.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        else:
            group.add_argument(flag, type=f.type, help=help, metavar=f.name.upper())
    parser.error = _one_line  # a bad value (--lr=fast) is one line, without the usage block
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(Config)]
        raise SystemExit(f"config error: unknown argument {unknown[0]!r}{_closest(unknown[0].split('=')[0], flags)}")
    args = vars(args)
    preset = load_yaml(args.pop("config")) if "config" in args else {}
    if args.get("resume"):  # a resumed run keeps its own config; flags (e.g. --steps) still win
        preset = {**resumed(args["resume"]), **preset}
    cfg = Config(**{**preset, **args})
    return cfg.validate(choices)


def save(cfg, path):
    tmp = f"{path}.{os.getpid()}.tmp"  # this process's own: two processes saving at once never take each other's
    with open(tmp, "w") as f:
        yaml.safe_dump({k: v for k, v in dataclasses.asdict(cfg).items() if k not in ONE_SHOT}, f, sort_keys=False)
    os.replace(tmp, path)  # whole or not at all: --resume reads it
