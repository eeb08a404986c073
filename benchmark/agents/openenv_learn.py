"""The shipped OpenEnv environments learnt by the tests' tiny model (issue 56): SFT on the format, then RL through a
real server process (`OpenEnvServer`, every episode a WebSocket session paid by the server); success before and
after, one JSON row appended to `--out`.

    OMP_NUM_THREADS=1 python benchmark/agents/openenv_learn.py --env guess --seed 0       # or --env arithmetic

The chat format is compact, as benchmark/credit's (one byte per role, the tools named in a system line): a tiny model
learns where the choice is most of the turn (RESULTS, "Credit across turns, round 2": in JSON markup, the step that
moved the one digit of a ~45-token turn also broke the markup).
* guess: a turn is the number guessed ("3" is `guess(number=3)`), answered "higher", "lower" or "correct". The start:
  SFT on guess_game's "consistent" random guesser (success 0.62 in expectation; halving the range: 0.875).
* arithmetic: a turn is `name key=value ...` ("multiply a=3 b=4"), a tool's name one token; the question reads
  "3*4+5" (one-digit operands, the rows' `a`, `b`, `c`). The start: SFT on demonstrations that chain multiply, add
  and answer (copying the numbers is what is slow to learn), then on a mix where only `tool_rate` of them do and the
  rest answer at once with a guess (as agent_task's calculator): RL has to learn to use the tools.
The row: success before and after (greedy; sampled; guess: the exact expected success), per update the mean return
and the success rate, the CPU seconds of SFT, of RL (this process) and of the server process, the commit.

`--model FOLDER` (arithmetic) takes a pretrained ChatML model instead, SmolLM2-135M-Instruct
(`examples/scripts/get_smollm2.py`), in its own format: the shipped tool template and the server's tool schemas, the
question as the server words it, the prompt of `examples/scripts/openenv_train.py`. Its start is a short SFT of the
model on the same mix of demonstrations (`CHAT_MODEL`), and RL runs at the settings of the SmolLM2 tool task
(`benchmark/agents/smollm2_tool.py`: 8 episodes an update, one PPO epoch, lr 3e-5, lam 1.0).

    OMP_NUM_THREADS=1 python benchmark/agents/openenv_learn.py --env arithmetic --model .cache/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # rows.py; agent_task and guess_game are here, learning_task in learning/
sys.path[:0] = [HERE, BENCH, os.path.join(BENCH, "learning")]
import agent_task  # noqa: E402
import guess_game  # noqa: E402
from openenv_formats import build_tokenizer, chat_tokenizer, render_arithmetic, render_guess  # noqa: E402
from rows import append_row  # noqa: E402


# ------------------------------------------------------------------------------------------- the environments
@dataclasses.dataclass(frozen=True)
class Env:
    """What the benchmark needs of one shipped environment."""

    name: str
    classes: tuple  # OpenEnvServer's (environment, action, observation)
    render: object
    prompt: str  # the user message, to which the runner adds `reset`'s text
    columns: tuple  # the rows' columns, which the server's `reset` takes
    budget: int  # `response_length`: three turns and their answers, tool errors cut to `ANSWER_TOKENS`
    sft: dict  # `SFTSettings` fields
    rl: dict  # the command line's defaults
    eval_batch: int = 0  # episodes sampled together in an evaluation (0: all of them)


MAX_TURNS = 4  # three answered calls; the server ends the episode there (the third guess, or `answer`)
ANSWER_TOKENS = 8  # `max_tool_response_length`: an error message (an invalid guess) is cut, not read


def environments() -> dict[str, Env]:
    from trl_ppo.agents import openenv_envs as shipped

    guess = (shipped.GuessEnvironment, shipped.GuessAction, shipped.GuessObservation)
    # arithmetic: at lr 2e-3 the policy collapsed onto empty turns (seed 0), at 1e-3 seed 2's training success fell
    # from 0.75 to 0 for 7 updates (then came back), 5e-4 did not; from a start calling the tools in 0.3 of its
    # episodes, seed 2 of the test's reduced run dropped them (its first batch paid once): 0.5 kept them (seeds 0-2)
    return {
        "guess": Env("guess", guess, render_guess, "guess 1-8", ("target",), 64, {"steps": 600},
                     {"updates": 50, "batch": 64, "lr": 2e-3, "eval_repeats": 32}),
        "arithmetic": Env("arithmetic", (shipped.ArithmeticEnvironment,), render_arithmetic, "solve", ("a", "b", "c"),
                          96, {"copy_steps": 600, "digit_weight": 10.0, "steps": 100, "mix_lr_ratio": 3.0,
                               "tool_rate": 0.5}, {"updates": 25, "batch": 32, "lr": 5e-4, "eval_repeats": 2}),
    }


# A pretrained chat model on arithmetic: the prompt of examples/scripts/openenv_train.py, the question as the adapter
# renders it by default, room for three JSON calls; its SFT a few steps on the mix (half of the demonstrations answer
# at once with a guess, so that RL has the tools' use to learn); its RL the SmolLM2 tool task's recipe
# (`CHAT_MODEL_CONFIG`: a value head on the policy's backbone starting at zero, a constant rate, no missing-EOS
# penalty, the update in passes of 2 episodes). A first pilot (seed 0) with a separate value model whose head was
# drawn at random, a linear schedule and the EOS penalty reached a training success of 1.0 at update 2 and collapsed
# from update 7 (entropy and KL up tenfold, half the turns without a stop token).
CHAT_MODEL = {"prompt": "Use the tools to compute it, then call `answer` with the result.", "budget": 192,
              "sft": {"steps": 16, "batch_size": 8, "learning_rate": 1e-4, "tool_rate": 0.5},
              "rl": {"updates": 16, "batch": 8, "lr": 3e-5, "eval_repeats": 1, "ppo_epochs": 1, "minibatches": 1,
                     "lam": 1.0}, "eval_batch": 16}
CHAT_MODEL_CONFIG = {"lr_scheduler_type": "constant", "missing_eos_penalty": None, "micro_batch": 2}


def chat_model_env(env: Env) -> Env:
    """`env` (arithmetic) as a pretrained chat model plays it (`CHAT_MODEL`)."""
    from trl_ppo.agents.openenv_adapter import render

    return dataclasses.replace(env, render=render, **CHAT_MODEL)


def problems(held_out: bool) -> list[tuple[int, int, int]]:
    """Arithmetic's 576 problems (one-digit operands) shuffled once: 64 held out for evaluation, the rest trained on."""
    every = [(a, b, c) for a in range(2, 10) for b in range(2, 10) for c in range(1, 10)]
    shuffled = random.Random(1234).sample(every, len(every))
    return shuffled[:64] if held_out else shuffled[64:]


def training_rows(env: Env, count: int, seed: int) -> dict:
    """`count` rows: a target from 1 to 8, or a problem of the training pool, drawn with `seed`."""
    draw = random.Random(seed)
    prompts = [[{"role": "user", "content": env.prompt}]] * count
    if env.name == "guess":
        return {"prompt": prompts, "target": [draw.randint(1, 8) for _ in range(count)]}
    drawn = [draw.choice(problems(held_out=False)) for _ in range(count)]
    return {"prompt": prompts, **{name: [p[i] for p in drawn] for i, name in enumerate(env.columns)}}


def evaluation_rows(env: Env, repeats: int, held_out: int | None = None) -> list[dict]:
    """Every target, or every held-out problem (the first `held_out` of them), `repeats` times."""
    cases = [(t,) for t in range(1, 9)] if env.name == "guess" else problems(held_out=True)[:held_out]
    return [dict(zip(env.columns, case)) for case in cases for _ in range(repeats)]


def demonstration(env: Env, row: dict, rng: random.Random, settings) -> list[dict]:
    """An SFT episode, ending where the server ends it (no turn after "correct", the third guess or `answer`)."""
    if env.name == "guess":
        messages = [{"role": "user", "content": env.prompt}]
        for message in guess_game.random_game(row["target"], rng, settings.guesser)[1:]:
            for call in message.get("tool_calls") or []:  # guess_game's tool takes `n`
                call["function"]["arguments"] = {"number": call["function"]["arguments"]["n"]}
            if message["role"] == "tool" or message.get("tool_calls"):  # not its closing "Found it."
                messages.append(message)
        return messages
    a, b, c = (row[name] for name in env.columns)
    steps = [("multiply", {"a": a, "b": b}, a * b), ("add", {"a": a * b, "b": c}, a * b + c)]
    steps = steps if rng.random() < settings.tool_rate else []  # else a guess from the answers' range: 1 in 86
    steps.append(("answer", {"value": a * b + c if steps else rng.randint(5, 90)}, "recorded"))
    question = env.render({"metadata": {"question": f"What is ({a} * {b}) + {c}?"}})  # as the server words it
    messages = [{"role": "user", "content": f"{env.prompt}\n\n{question}"}]
    for name, arguments, result in steps:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": name, "content": str(result)}]
    return messages[:-1]  # the server ends the episode at `answer`


# ----------------------------------------------------------------------------------------------------- SFT
@dataclasses.dataclass(frozen=True)
class SFTSettings(guess_game.SFTSettings):
    """A tiny Qwen2 from scratch (agent_task.build_policy), loss on the model's turns: `copy_steps` one-cycle steps on
    demonstrations that all use the tools (their digits' loss weighing `digit_weight`), then `steps` at
    `learning_rate / mix_lr_ratio` on demonstrations that use them with probability `tool_rate` (guess: no copy
    stage; every game is the guesser's)."""

    hidden_size: int = 64
    num_heads: int = 4
    steps: int = 300
    learning_rate: float = 3e-3
    copy_steps: int = 0
    digit_weight: float = 1.0
    mix_lr_ratio: float = 1.0
    tool_rate: float = 0.3

    def key(self, env: str) -> str:
        return f"openenv-sft-{env}-" + "-".join(f"{k}{v}" for k, v in dataclasses.asdict(self).items())


def train_sft(env: Env, tokenizer, tools: list[dict], settings: SFTSettings, work_dir: str, log=print,
              base: str | None = None):
    """Train (or reuse) the start, a tiny model from scratch or the pretrained model in the folder `base` fine-tuned
    -> (its folder, the CPU seconds it took when it was trained, whether reused)."""
    import torch
    from learning_task import one_cycle_steps, save_sft
    from transformers import AutoModelForCausalLM

    key = settings.key(env.name) if base is None else f"{model_name(base)}-{settings.key(env.name)}"
    path = os.path.join(work_dir, "sft", key)
    cost = os.path.join(path, "cpu_seconds.json")
    if os.path.exists(os.path.join(path, "done.json")) and os.path.exists(cost):
        with open(cost) as file:
            return path, json.load(file)["cpu_seconds"], True
    start = time.process_time()
    model = agent_task.build_policy(tokenizer, settings) if base is None else AutoModelForCausalLM.from_pretrained(base)
    rng = random.Random(settings.seed)
    drawn = training_rows(env, 4096, seed=-1 - settings.seed)  # not RL's draws (its seeds are >= 0)
    rows = [{name: drawn[name][i] for name in env.columns} for i in range(4096)]
    every_row = torch.ones(settings.batch_size, dtype=torch.bool)
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    copies = dataclasses.replace(settings, steps=settings.copy_steps, tool_rate=1.0)
    mix = dataclasses.replace(settings, learning_rate=settings.learning_rate / settings.mix_lr_ratio, digit_weight=1.0)
    for stage in [copies, mix] if settings.copy_steps else [mix]:
        def loss(stage=stage):  # agent_task's, the digits of every row weighing `stage.digit_weight`
            examples = [agent_task.sft_example(tokenizer, demonstration(env, rng.choice(rows), rng, stage), tools)
                        for _ in range(stage.batch_size)]
            batch = agent_task.sft_batch(tokenizer, examples)
            return agent_task.sft_loss(model, batch, every_row, digits, stage.digit_weight)

        one_cycle_steps(model, stage, loss, log, f"SFT {env.name} (tool rate {stage.tool_rate})", logs=4)
    seconds = round(time.process_time() - start, 1)
    save_sft(model, tokenizer, settings, path)
    with open(cost, "w") as file:
        json.dump({"cpu_seconds": seconds}, file)
    return path, seconds, False


# ------------------------------------------------------------------------------------------------ evaluation
def prompt_ids(tokenizer, env: Env, tools: list[dict], added: str | None) -> list[int]:
    """An episode's prompt as trl_ppo's AgentRunner renders it: the tools' line, the prompt and `reset`'s text."""
    content = f"{env.prompt}\n\n{added}" if added else env.prompt
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def succeeded(environment) -> bool:
    """The server paid 1.0 for a step: the number found, or the right answer."""
    return max(environment.rewards, default=0.0) >= 1.0


def evaluate(model, tokenizer, factory, env: Env, rows: list[dict], temperature: float | None, seed: int = 0):
    """An episode per row, each a session on the server, played by trl_ppo's turn loop, greedy (`temperature` None)
    or sampled -> {"success", "reward" (mean return), "first" (the share of each first token), "sample"}."""
    import torch

    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.environments import Environments, close_environments
    from trl_ppo.agents.tools import schemas, toolbox
    from trl_ppo.agents.turn_loop import Episode, run_turns

    made = [Environments(factory).create(row) for row in rows]  # (the episode's session, `reset`'s text)
    played = [Episode(prompt_ids(tokenizer, env, schemas(toolbox([], e)), text), toolbox([], e), e) for e, text in made]
    chat = ToolChat(tokenizer, schemas(played[0].tools), tokenizer.eos_token_id)
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            sampler = agent_task.model_sampler(model, tokenizer, temperature, batch_size=env.eval_batch or len(played))
            run_turns(played, sampler, chat, MAX_TURNS, env.budget, ANSWER_TOKENS)
    finally:
        close_environments([environment for environment, _ in made])
        model.train(was_training)
    firsts = [tokenizer.convert_ids_to_tokens(e.response[:1])[0] if e.response else "" for e in played]
    return {"success": round(sum(succeeded(e.environment) for e in played) / len(played), 4),
            "reward": round(sum(sum(e.environment.rewards) for e in played) / len(played), 4),
            "first": {token: round(firsts.count(token) / len(played), 3) for token in sorted(set(firsts))},
            "sample": tokenizer.decode(played[0].response)}


def turn_probabilities(model, sequences: list[list[int]]):
    """The probability of each sequence's last two tokens together (a one-token turn and its stop), given the rest."""
    from trl_ppo.data import LeftPaddingCollator

    batch = LeftPaddingCollator(0)([{"input_ids": ids} for ids in sequences])
    positions = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)  # left padding: positions from the mask
    logits = model(**batch, position_ids=positions).logits[:, -3:-1].float()
    return logits.log_softmax(-1).gather(-1, batch["input_ids"][:, -2:, None]).sum((1, 2)).exp()


def expected_success(model, tokenizer, env: Env, tools: list[dict]) -> float:
    """guess: the probability that the policy sampling at 1.0 finds the number, over the 8 targets, on the game's
    tree with the model's own probabilities (a turn other than a digit and the stop token counts as lost): exact, so
    that before and after compare without sampling noise."""
    import torch

    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.execution import ToolResult

    chat, stop = ToolChat(tokenizer, tools, tokenizer.eos_token_id), tokenizer.eos_token_id
    answer = {f: chat.answer_ids([ToolResult("guess", f)]).ids for f in ("higher", "lower")}
    digits = tokenizer.convert_tokens_to_ids([str(n) for n in range(1, 9)])
    frontier, found = [(prompt_ids(tokenizer, env, tools, None), 1.0, t) for t in range(1, 9)], 0.0
    was_training = model.training
    model.eval()
    for turn in range(3):  # the game's three guesses
        contexts = sorted({tuple(context) for context, _, _ in frontier})
        with torch.no_grad():
            turns = turn_probabilities(model, [list(c) + [d, stop] for c in contexts for d in digits])
        table = dict(zip(contexts, turns.view(len(contexts), 8).tolist()))
        grown = []
        for context, p, target in frontier:
            for number, q in enumerate(table[tuple(context)], start=1):
                if number == target:
                    found += p * q
                elif turn < 2:
                    reply = answer["higher" if number < target else "lower"]
                    grown.append((context + [digits[number - 1], stop] + reply, p * q, target))
        frontier = grown
    model.train(was_training)
    return round(found / 8, 4)


def evaluation(model, tokenizer, factory, env: Env, repeats: int, seed: int, tools: list[dict],
               held_out: int | None = None) -> dict:
    """Greedy on every case once; sampled at 1.0 (the training temperature) `repeats` times; guess: `expected`."""
    result = {"greedy": evaluate(model, tokenizer, factory, env, evaluation_rows(env, 1, held_out), None),
              "sampled": evaluate(model, tokenizer, factory, env, evaluation_rows(env, repeats, held_out), 1.0, seed)}
    if env.name == "guess":
        result["expected"] = expected_success(model, tokenizer, env, tools)
    return result


# ------------------------------------------------------------------------------------------------------ RL
def counted(factory, successes: list):
    """`factory`, its episodes appending whether they succeeded to `successes` when scored (the training curve)."""

    class Counted(factory):
        async def get_reward(self) -> float:
            reward = await super().get_reward()
            successes.append(succeeded(self))
            return reward

    return Counted


def trainer(args, env: Env, tokenizer, model, sft_path: str, factory):
    """PPOTrainer on the server's episodes; with `--method gae` a critic: the tiny model's of its SFT backbone and a
    fresh head drawn at random, a chat model's a head on the policy's backbone starting at zero (`CHAT_MODEL_CONFIG`).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    from trl_ppo import PPOConfig, PPOTrainer

    critic, chat = args.method == "gae", args.model is not None
    micro_batch = CHAT_MODEL_CONFIG["micro_batch"] if chat else args.batch
    config = PPOConfig(
        output_dir=os.path.join(args.work_dir, "runs", f"{env.name}-{args.method}-{args.seed}"
                                + (f"-{model_name(args.model)}" if chat else "")),
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=args.batch // micro_batch,
        num_mini_batches=args.minibatches, num_ppo_epochs=args.ppo_epochs, learning_rate=args.lr, lam=args.lam,
        total_episodes=args.updates * args.batch, temperature=1.0, seed=args.seed, response_length=env.budget,
        max_turns=MAX_TURNS, max_tool_response_length=ANSWER_TOKENS, stop_token="eos",
        missing_eos_penalty=CHAT_MODEL_CONFIG["missing_eos_penalty"] if chat else 1.0,
        lr_scheduler_type=CHAT_MODEL_CONFIG["lr_scheduler_type"] if chat else "linear",
        advantage_estimator=args.method, gae_level="turn", local_rollout_forward_batch_size=args.batch,
        num_sample_generations=0, save_strategy="no", report_to="none", logging_steps=1, bf16=False, use_cpu=True,
        disable_tqdm=True, **({} if critic else {"num_generations": 4}),
    )
    value_model = None
    if critic and not chat:
        value_model = AutoModelForSequenceClassification.from_pretrained(sft_path, num_labels=1)
        torch.manual_seed(args.seed)
        torch.nn.init.normal_(value_model.score.weight, std=value_model.config.initializer_range)
    rows = training_rows(env, args.updates * args.batch, seed=args.seed)
    return PPOTrainer(args=config, processing_class=tokenizer, model=model, ref_model=None, reward_model=[],
                      value_model=value_model, train_dataset=Dataset.from_dict(rows), environment_factory=factory)


def train_rl(args, env: Env, tokenizer, model, sft_path: str, factory) -> dict:
    """RL -> per update the mean return the server paid and the success rate, and the CPU seconds of `train()`."""
    successes: list[bool] = []
    run = trainer(args, env, tokenizer, model, sft_path, counted(factory, successes))
    start = time.process_time()
    run.train()
    seconds = time.process_time() - start
    rewards = [round(h["env/turn_rewards_mean"], 4) for h in run.state.log_history if "env/turn_rewards_mean" in h]
    success = [round(sum(successes[i : i + args.batch]) / args.batch, 4) for i in range(0, len(successes), args.batch)]
    return {"reward_curve": rewards, "success_curve": success, "rl_cpu_seconds": round(seconds, 1)}


# ----------------------------------------------------------------------------------------------------- a run
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=("guess", "arithmetic"), required=True)
    parser.add_argument("--method", choices=("gae", "grpo"), default="gae", help="gae: PPO with a critic, turn-level "
                        "GAE (the default); grpo: 4 episodes per row")
    parser.add_argument("--seed", type=int, default=0, help="RL's seed (its rows, sampling, the critic's head)")
    parser.add_argument("--updates", type=int, help="default: the environment's (`Env.rl`), as the next three")
    parser.add_argument("--batch", type=int, help="episodes per update")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--eval_repeats", type=int, help="sampled evaluation episodes per target / problem")
    parser.add_argument("--held_out", type=int, help="arithmetic: evaluate on the first N of the 64 held-out problems")
    parser.add_argument("--minibatches", type=int, help="optimizer steps per update and epoch (default 4; --model: 1)")
    parser.add_argument("--ppo_epochs", type=int, help="default 2 (--model: 1)")
    parser.add_argument("--lam", type=float, help="GAE's lambda (default 0.95; --model: 1.0)")
    parser.add_argument("--model", help="arithmetic: a pretrained ChatML model's folder (SmolLM2), not the tiny one")
    parser.add_argument("--sft_steps", type=int, help="SFT's steps on the mix (default: the environment's `Env.sft`)")
    parser.add_argument("--copy_steps", type=int, help="arithmetic: SFT's steps on tool demonstrations first")
    parser.add_argument("--tool_rate", type=float, help="arithmetic: the share of SFT's mix that uses the tools")
    parser.add_argument("--sft_seed", type=int, default=0, help="the start's seed (one start for every RL seed)")
    parser.add_argument("--work_dir", default="/tmp/trl_ppo_openenv_learn", help="SFT starts (cached) and runs")
    parser.add_argument("--out", default=os.path.join(HERE, "openenv_learn.jsonl"), help="'': no row written")
    args = parser.parse_args(argv)
    if args.model and args.env != "arithmetic":
        parser.error("--model: the pretrained model's format is written for --env arithmetic")
    for name, value in {"minibatches": 4, "ppo_epochs": 2, "lam": 0.95, **env_of(args).rl}.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    return args


def model_name(folder: str) -> str:
    return os.path.basename(os.path.normpath(folder))


def env_of(args) -> Env:
    """The environment as the run's model plays it."""
    env = environments()[args.env]
    return chat_model_env(env) if args.model else env


def sft_settings(args) -> SFTSettings:
    given = {"steps": args.sft_steps, "copy_steps": args.copy_steps, "tool_rate": args.tool_rate}
    return SFTSettings(**{**env_of(args).sft, **{k: v for k, v in given.items() if v is not None}},
                       seed=args.sft_seed)


def run(args, log=print) -> dict:
    """Serve the environment, SFT (cached), evaluate, RL, evaluate -> the row."""
    import psutil
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from trl_ppo.agents.openenv_adapter import openenv_environment
    from trl_ppo.agents.openenv_server import OpenEnvServer
    from trl_ppo.agents.tools import schemas, toolbox

    torch.set_num_threads(1)
    env, settings = env_of(args), sft_settings(args)
    sessions = max(len(evaluation_rows(env, args.eval_repeats)), args.batch)
    with OpenEnvServer(*env.classes, max_concurrent_envs=sessions) as server:
        factory = openenv_environment(server, render=env.render)
        tools = schemas(toolbox([], factory()))  # the server's tools, as the trainer offers them
        names = [tool["function"]["name"] for tool in tools]
        tokenizer = chat_tokenizer(args.model) if args.model else build_tokenizer(env.name, names)
        sft_path, sft_seconds, reused = train_sft(env, tokenizer, tools, settings, args.work_dir, log, args.model)
        model = AutoModelForCausalLM.from_pretrained(sft_path)
        before = evaluation(model, tokenizer, factory, env, args.eval_repeats, args.seed, tools, args.held_out)
        learnt = train_rl(args, env, tokenizer, model, sft_path, factory)
        after = evaluation(model, tokenizer, factory, env, args.eval_repeats, args.seed, tools, args.held_out)
        server_seconds = sum(psutil.Process(server.process.pid).cpu_times()[:2])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return {"env": env.name, "model": model_name(args.model) if args.model else "tiny", "method": args.method,
            "seed": args.seed, "lr": args.lr, "updates": args.updates, "episodes_per_update": args.batch,
            "minibatches": args.minibatches, "ppo_epochs": args.ppo_epochs, "lam": args.lam,
            "eval_repeats": args.eval_repeats, "held_out": args.held_out, "sft": settings.key(env.name),
            "sft_cpu_seconds": sft_seconds, "sft_reused": reused, "before": before, "after": after, **learnt,
            "server_cpu_seconds": round(server_seconds, 1), "commit": commit.stdout.strip() or None,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": os.environ.get("OMP_NUM_THREADS")}


def main(argv=None) -> None:
    args = parse_args(argv)
    row = run(args)
    if args.out:
        append_row(args.out, row)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
