"""The cross-check (issue 42, part 3): TRL 1.12's GRPOTrainer on a credit task, from the same SFT start, with the
same budget, group size, epochs and learning rate as `run.py --estimator grpo`; one row in run.py's format.

    OMP_NUM_THREADS=1 python benchmark/credit/trl_grpo.py --task chain_4 --seed 0 --lr 1e-3 --out rows.jsonl

TRL's GRPO gets the environment unchanged (`environment_factory`; its `get_reward` is the reward, as TRL reads
it), `num_generations` samples per prompt, `num_iterations` = run.py's 2 PPO epochs (one generation serves two
optimizer steps), and TRL's own defaults for everything that is its algorithm (its loss type, no KL term: beta 0,
clipping 0.2). The success curve is counted from the environments themselves (each episode's success at its
`get_reward` call, in batches of `--batch` episodes), so both trainers' curves mean the same thing. TRL reads a
tool's answer as text, so a payment a tool makes (`(observation, reward)`: random_start's end payment,
key_to_door's apples) cannot reach it as a reward: it is added to `get_reward` instead and the tool answers with
the observation alone. The return is the same sum (trl_ppo's runs use no discount), and GRPO gives every token of
an episode the advantage of that sum, so for GRPO the task is the same. The row's estimator is "trl_grpo".
"""

from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (run.py's arguments, dataset and cell; it puts benchmark/ on the path)
import tasks  # noqa: E402  isort: skip

def recording(task: str, outcomes: list[float]):
    """The task's environment factory for TRL, its environments appending each episode's success to `outcomes`
    and paying what their tools paid in `get_reward()` (a subclass: TRL looks for `get_reward` on the environment's
    class)."""
    factory = tasks.TASKS[task]  # a partial of the environment class

    class Recorded(factory.func):
        def reset(self, **row) -> str:
            self.paid = 0.0
            return super().reset(**row)

        def _act(self, letter: str) -> str:
            answer = super()._act(letter)
            if isinstance(answer, tuple):  # (observation, reward): the reward moves to get_reward
                answer, reward = answer
                self.paid += reward
            return answer

        def get_reward(self) -> float:
            outcomes.append(super().get_reward())
            return outcomes[-1] + self.paid

    Recorded.__name__ = factory.func.__name__  # TRL logs the reward under the class name
    return partial(Recorded, *factory.args, **factory.keywords)


def trainer(args, tokenizer, model, outcomes: list[float]):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=run.run_dir(args),
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, learning_rate=args.lr,
        max_steps=args.updates * 2, num_iterations=2, num_generations=args.num_generations, temperature=1.0,
        max_completion_length=run.budget(args.task), max_tool_calling_iterations=tasks.TASKS[args.task]().steps,
        seed=args.seed, save_strategy="no", report_to="none", logging_steps=1, bf16=False, use_cpu=True,
        disable_tqdm=True,
    )
    rows = run.dataset(args)  # one row per prompt, each with its seed; TRL appends `reset`'s text to the prompt
    prompts = [[{"role": "user", "content": f"{tasks.PROMPT}\n\n"}]] * len(rows)  # as trl_ppo's runner joins them
    data = Dataset.from_dict({"prompt": prompts, "seed": rows["seed"]})
    return GRPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                       environment_factory=recording(args.task, outcomes))


def train_trl(args, tokenizer, model, sft_path: str) -> tuple[list[float], dict]:
    """Train the cell with TRL's GRPOTrainer -> (the success curve counted from the environments, the row's
    episode count and trainer)."""
    import trl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    outcomes: list[float] = []
    trainer(args, tokenizer, model, outcomes).train()
    curve = [round(sum(outcomes[i:i + args.batch]) / args.batch, 4) for i in range(0, len(outcomes), args.batch)]
    return curve, {"episodes": len(outcomes), "trainer": f"trl {trl.__version__}"}


def main(argv=None) -> None:
    args = run.parse_args(["--estimator", "grpo", *(argv if argv is not None else sys.argv[1:])])
    args.estimator = "trl_grpo"
    run.cell(args, train_trl)


if __name__ == "__main__":
    main()
