"""The credit tasks: multi-turn environments where one early choice decides a reward that arrives at the end.

Every turn the model says one letter, `a`, `b`, `c` or `d` (one byte token, then its stop token); each letter is
a tool without arguments (an environment method, `environment_factory`'s style), and the tiny chat format here
parses a lone letter as a call to it (`CHAT_TEMPLATE`, `RESPONSE_TEMPLATE`: no JSON). The tool answers with the
next observation; after the last one ("end") the model ends the episode with an empty turn. `get_reward()` is 1.0
when the early choice was right (`success`), else 0.0. An untrained policy that picks letters uniformly succeeds
1 time in 4.

* `KeyToDoor` (Hung et al. 2019; Mesnard et al. 2021): the first room holds a key, taken by saying `KEY`; then
  `distractors` rooms of apples whose turn rewards are small noise (0, 0.1 or 0.2 whatever is said); then the
  door, which pays 1.0 only if the key was taken.
* `Chain` (bsuite's umbrella chain, Osband et al. 2020): the first letter sets a switch; `length - 1` more turns
  where nothing said matters; the end pays 1.0 when the switch was `TARGET`. `length` (2, 4, 8) is the knob.
* `RandomStart`: every episode starts from its own state, three letters drawn by the environment in `reset` (so
  no two members of a group share one); the first letter said decides success as in `Chain` (`TARGET`, paid after
  `length` turns), and the state adds its own payment at the end, `BONUS` x the place of its first letter in
  `ACTIONS` (0 to 0.75), whatever is said: a return that differs by start, which a critic reading the state can
  predict and a group baseline cannot pair. `HELD_OUT` states are never drawn in training. (A first version paid
  for copying the state's first letter: neither GRPO nor turn-level GAE learnt it in 1,600-3,200 episodes.)

Each environment draws its noise and start from its own `random.Random`, seeded from the row's `seed` and a
per-process counter, so runs repeat; `reset(start=...)` fixes the start (evaluation).
"""

from __future__ import annotations

import itertools
import random
from functools import partial

ACTIONS = ("a", "b", "c", "d")
PROMPT = "go"  # the user message; `reset` adds the first observation to it
KEY, TARGET = "a", "c"
BONUS = 0.25  # RandomStart's payment per place of its first letter
STATES = ["".join(s) for s in itertools.product(ACTIONS, repeat=3)]  # RandomStart's 64 starts
# 16 starts for evaluation only: 4 per first letter, every letter in every place among them
HELD_OUT = [s for s in STATES if sum(map(ACTIONS.index, s[1:])) % 4 == ACTIONS.index(s[0])]
TRAIN_STATES = [s for s in STATES if s not in HELD_OUT]
_EPISODES = itertools.count()  # distinct draws for the members of a group, which share a row

# A system line naming the letters, the user's prompt, then turns of one letter each; roles are one byte (`a`
# assistant, `o` observation, `u` user, `s` system) so an episode of 8 turns stays under 100 tokens. The letters
# take no arguments; a call's arguments would render as ` key=value` (TRL's GRPOTrainer checks that they render).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>s{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>{% endif %}"
    "{% for message in messages %}{% if message.role == 'assistant' %}<|im_start|>a{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{{ call.function.name }}"
    "{% for key, value in (call.function.arguments or {}).items() %} {{ key }}={{ value }}{% endfor %}{% endfor %}"
    "<|im_end|>"
    "{% else %}<|im_start|>{{ 'o' if message.role == 'tool' else 'u' }}{{ message.content }}<|im_end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>a{% endif %}"
)
# A lone action letter (not inside a word) is a call to the tool of that name; anything else is text.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>a",
    "fields": {
        "tool_calls": {
            "open_pattern": r"(?<![a-z])(?P<name>[" + "".join(ACTIONS) + r"])(?![a-z])",
            "close": "<|im_end|>",
            "repeats": True,
            "content": "text",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": {}}},
        },
        "content": {"close_pattern": r"<\|im_end\|>", "content": "text"},
    },
}


def build_tokenizer():
    """tiny_chat's byte-level tokenizer with the one-letter chat format above."""
    from trl_ppo.agents.tiny_chat import SPECIAL, build_byte_tokenizer

    tokenizer = build_byte_tokenizer(SPECIAL, eos_token=SPECIAL[2], pad_token=SPECIAL[0])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


class Task:
    """An episode of `steps` answered letters; subclasses say what each step observes and pays (`_step`)."""

    steps = 1

    def reset(self, **row) -> str:
        self._rng = random.Random(f"{row.get('seed', 0)}-{next(_EPISODES)}")
        self.said: list[str] = []
        self.success = False
        return self._start(row.get("start"))

    def _start(self, start: str | None) -> str:
        return "start"

    def _step(self, letter: str) -> tuple[str, float]:
        raise NotImplementedError

    def _act(self, letter: str) -> str | tuple[str, float]:
        if len(self.said) >= self.steps:  # past the end: nothing changes
            return "end"
        self.said.append(letter)
        observation, reward = self._step(letter)
        if len(self.said) == self.steps:
            observation = "end"
        return (observation, reward) if reward else observation

    def get_reward(self) -> float:
        return 1.0 if self.success else 0.0

    def a(self) -> str:
        """Say a."""
        return self._act("a")

    def b(self) -> str:
        """Say b."""
        return self._act("b")

    def c(self) -> str:
        """Say c."""
        return self._act("c")

    def d(self) -> str:
        """Say d."""
        return self._act("d")


class KeyToDoor(Task):
    def __init__(self, distractors: int = 4) -> None:
        self.distractors, self.steps = distractors, distractors + 2

    def _start(self, start: str | None) -> str:
        return "key"

    def _step(self, letter: str) -> tuple[str, float]:
        turn = len(self.said)
        if turn == 1:
            self.has_key = letter == KEY
        elif turn == self.steps:  # the door
            self.success = self.has_key
            return "door", 0.0
        reward = 0.0 if turn == 1 else 0.1 * self._rng.randint(0, 2)  # apples: noise the key's effect hides in
        return ("apple" if turn < self.steps - 1 else "door"), reward


class Chain(Task):
    def __init__(self, length: int = 4) -> None:
        self.steps = length

    def _step(self, letter: str) -> tuple[str, float]:
        if len(self.said) == 1:
            self.switch = letter
        self.success = self.switch == TARGET and len(self.said) == self.steps
        return "wait", 0.0


class RandomStart(Task):
    def __init__(self, length: int = 4, bonus: float = BONUS) -> None:
        self.steps, self.bonus = length, bonus

    def _start(self, start: str | None) -> str:
        self.state = start or self._rng.choice(TRAIN_STATES)
        return self.state

    def _step(self, letter: str) -> tuple[str, float]:
        if len(self.said) == 1:
            self.switch = letter
        if len(self.said) < self.steps:
            return "wait", 0.0
        self.success = self.switch == TARGET
        return "end", self.bonus * ACTIONS.index(self.state[0])


# name -> environment factory (`environment_factory=`), a zero-argument callable
TASKS = {
    "key_to_door": partial(KeyToDoor, distractors=4),
    "chain_2": partial(Chain, length=2),
    "chain_4": partial(Chain, length=4),
    "chain_8": partial(Chain, length=8),
    "random_start": partial(RandomStart, length=4),
    # the knob's far end (issue 57): the start pays 0 to 3.0, up to 3x the success; a group baseline sees the
    # start's payment as noise several times the signal, a critic reading the state can predict it
    "random_start_wide": partial(RandomStart, length=4, bonus=1.0),
}


def eval_starts(task: str) -> list[str | None]:
    """The starts evaluation plays: RandomStart's held-out states; one fixed start (None) for the others."""
    return list(HELD_OUT) if task.startswith("random_start") else [None]


def random_episode(env: Task, rng: random.Random, start: str | None = None, seed: int = 0) -> list[dict]:
    """The messages of an episode of uniformly random letters (the SFT demonstrations), ending in an empty turn."""
    added = env.reset(seed=seed, start=start)
    messages = [{"role": "user", "content": f"{PROMPT}\n\n{added}"}]
    for _ in range(env.steps):
        letter = rng.choice(ACTIONS)
        answer = getattr(env, letter)()
        call = {"type": "function", "function": {"name": letter, "arguments": {}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": letter, "content": answer if isinstance(answer, str) else answer[0]}]
    return messages + [{"role": "assistant", "content": ""}]
