"""The episode engine (issue 54): episodes that do not wait for each other, each with its KV cache kept across its
tool calls. A tiny random model writes the turns (its stop token is likely, so turns are short), a stand-in chat
turns every finished turn into one call of a `wait` tool until an episode's last turn, and the tool answers with a
few fixed ids. The tokens the engine samples must be scored the same by a plain forward over the whole episode."""

import math
import threading
import time

import pytest
import torch
from conftest import needs_tool_parsing
from test_agent_training import agent_trainer
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from trl_ppo import ppo
from trl_ppo.agents.chat import ToolAnswer
from trl_ppo.agents.execution import ToolCall
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.agents.tools import toolbox
from trl_ppo.compat import cache_keyword
from trl_ppo.rollout.agreement import agreement_metrics, agreement_sums
from trl_ppo.rollout.engine import CacheNotPlain, TurnLimits, _plain_layers, play_episodes
from trl_ppo.rollout.turn_loop import Episode, episodes_rollout

VOCAB, STOP, PAD = 12, 3, 0
ANSWER = [30, 31, 32]  # a tool answer's ids (never sampled)
CALLS = 3  # an episode's turns that call the tool; the next one answers


class Waits:
    """The tool's log: when each call of each episode started and ended; `delays[episode]`: its first call's sleep."""

    def __init__(self, delays: dict[int, float]) -> None:
        self.delays, self.calls, self.lock = delays, [], threading.Lock()  # delays: of each episode's first call

    def tool(self):
        def wait(episode: int) -> str:
            """Wait.

            Args:
                episode: whose call it is.
            """
            started = time.monotonic()
            time.sleep(self.delays.get(episode, 0.0) if all(e != episode for e, _, _ in self.calls) else 0.0)
            with self.lock:
                self.calls.append((episode, started, time.monotonic()))
            return "ok"

        return wait


class CallingChat:
    """A chat stand-in: a turn that ends with the stop token calls `wait` while its episode has called fewer than
    `CALLS` times; the answer is `ANSWER`."""

    stop_token_id = STOP

    def parse_tool_calls(self, ids: list[int], prefix: list[int]):
        episode, calls_so_far = prefix[0] - 20, prefix.count(ANSWER[0])  # the first prompt id names the episode
        return ([ToolCall("wait", {"episode": episode})] if calls_so_far < CALLS else []), False

    def answer_ids(self, results, max_tokens=None) -> ToolAnswer:
        return ToolAnswer(list(ANSWER), 0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB + 30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512)
    lm = Qwen2ForCausalLM(config).eval()
    head = torch.nn.Linear(32, config.vocab_size, bias=True)  # a bias: the stop token likely (turns of a few
    with torch.no_grad():  # tokens), ids >= VOCAB (episode names, tool answers) never sampled
        head.weight.copy_(lm.lm_head.weight)
        head.bias.zero_()
        head.bias[STOP], head.bias[VOCAB:] = 1.5, -30.0
    lm.lm_head = head
    return lm


def episodes(count: int, waits: Waits) -> list[Episode]:
    tools = toolbox([waits.tool()])
    return [Episode([20 + i] + [1, 2] * (i + 1), tools) for i in range(count)]  # prompts of different lengths


def play(model, played: list[Episode], budget: int = 160, seed: int = 0) -> list[Episode]:
    torch.manual_seed(seed)
    limits = TurnLimits(max_turns=CALLS + 1, budget=budget, stop_token_id=STOP, temperature=1.0)
    forward = lambda **inputs: model(**inputs)  # noqa: E731
    with torch.no_grad():
        return play_episodes(played, forward, torch.device("cpu"), cache_keyword(model), CallingChat(), limits)


def test_every_sampled_token_is_scored_the_same_by_a_forward_over_the_whole_episode(model):
    """The caches kept across tool calls, joined into and cut from the batch at other rows' lengths, give the
    log-probs of a plain forward: no token lost, shifted or attended wrongly."""
    played = play(model, episodes(6, Waits({})))
    assert sum(e.tool_calls for e in played) >= 6  # several turns were played after tool answers
    for episode in played:
        ids = torch.tensor([episode.query + episode.response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(episode.query) - 1 : -1].float()
        forward = torch.log_softmax(logits, -1).gather(1, ids[0, len(episode.query) :, None])[:, 0]
        mask = torch.tensor(episode.model_mask)
        sampled = torch.tensor(episode.sampler_logprobs)
        assert len(sampled) == len(episode.response) and mask.any() and not mask.all()
        assert torch.allclose(sampled[mask], forward[mask], atol=1e-4), (sampled[mask] - forward[mask]).abs().max()
        assert (sampled[~mask] == 0).all()


def test_a_slow_tool_does_not_hold_the_other_episodes(model):
    """Episode 0's first call takes 1 s; meanwhile the other episodes play on and call the tool again (in lockstep
    no call could start before every call of the turn had answered)."""
    waits = Waits({0: 1.0})
    play(model, episodes(4, waits))
    slow_start, slow_end = next((start, end) for episode, start, end in waits.calls if episode == 0)
    later_calls = [start for i, (episode, start, _) in enumerate(waits.calls)
                   if episode != 0 and any(e == episode for e, _, _ in waits.calls[:i])]  # not their first calls
    assert sum(slow_start < start < slow_end for start in later_calls) >= 2, waits.calls


def test_an_episode_samples_the_same_tokens_whichever_order_the_tools_answer_in(model):
    """Each episode draws from its own generator: tools finishing in another order change which rows decode
    together, not the tokens."""
    fast = play(model, episodes(4, Waits({})), seed=3)
    shuffled = play(model, episodes(4, Waits({0: 0.3, 2: 0.1})), seed=3)
    assert [e.response for e in fast] == [e.response for e in shuffled]


def test_the_episodes_become_the_same_rollout_as_the_lockstep_loops(model):
    """`episodes_rollout` of engine-played episodes: model tokens masked in, tool answers attended, the sampler's
    log-probs on the model's tokens only."""
    played = play(model, episodes(3, Waits({})))
    rollout = episodes_rollout(played, PAD, 160, "cpu")
    assert rollout.sampler_logprobs.shape == rollout.responses.shape
    assert torch.equal(rollout.sampler_logprobs != ppo.INVALID_LOGPROB, rollout.response_mask)
    assert torch.equal(rollout.response_mask, rollout.response_mask & rollout.response_attention_mask)


def test_a_cache_that_is_not_plain_full_attention_is_refused_before_any_token():
    config = Qwen2Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0, layer_types=["sliding_attention"] * 2)
    sliding = Qwen2ForCausalLM(config).eval()
    cache = sliding(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_keyword(sliding): DynamicCache(
        config=config)}).past_key_values  # fmt: skip
    with pytest.raises(CacheNotPlain, match="Sliding"):
        _plain_layers(cache)
    waits = Waits({})
    with pytest.raises(CacheNotPlain):
        play(sliding, episodes(2, waits))
    assert waits.calls == []


def test_the_agreement_metrics_on_hand_worked_numbers():
    sampled = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    trained = torch.tensor([[-1.0, -2.2, -3.05], [-0.4, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    sums = agreement_sums(sampled, trained, mask)
    # |diff| = 0, 0.2, 0.05, 0.1; ratios 1, e^-0.2 = 0.82 (outside), e^-0.05 = 0.95, e^0.1 = 1.105 (outside)
    assert torch.allclose(sums, torch.tensor([0.35, 0.2, 2.0, 4.0], dtype=torch.float64), atol=1e-6)
    metrics = agreement_metrics(torch.stack([sums, torch.tensor([0.05, 0.05, 0.0, 1.0], dtype=torch.float64)]))
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(0.4 / 5)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.2)
    assert metrics["rollout/logprob_diff_ratio_outside"] == pytest.approx(2 / 5)


@pytest.mark.slow  # a whole run: `make test` has it, the quick loop (3 minutes) does not
@needs_tool_parsing
def test_train_plays_continuously_by_default_and_logs_the_sampler_agreement(make_config):
    """A run with tools and an environment, sampled by the tiny random policy through the engine: the sampler's
    log-probs agree with the training forward's (no dropout, float32), and the metrics say so."""
    tokenizer = build_tool_tokenizer()
    trainer = agent_trainer(make_config, tokenizer, lambda completions, **kw: [0.0] * len(completions),
                            response_length=64)  # fmt: skip
    assert trainer.args.agent_rollout == "continuous"
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rollout/logprob_diff_mean" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert entry["rollout/logprob_diff_mean"] < 1e-4 and entry["rollout/logprob_diff_max"] < 1e-3
        assert entry["rollout/logprob_diff_ratio_outside"] == 0.0


@pytest.mark.slow
@needs_tool_parsing
def test_the_engine_and_the_update_run_under_bf16_autocast(make_config):
    """The run above in bfloat16 autocast on the CPU (`bf16=True, use_cpu=True`), what a GPU run in bf16 does: the
    engine's sampling, the no-grad forwards and the update take the autocast's dtypes without an error, the weights
    move, and the sampler's log-probs are compared with the training forward's (finite; they may differ by bf16's
    rounding)."""
    tokenizer = build_tool_tokenizer()
    trainer = agent_trainer(make_config, tokenizer, lambda completions, **kw: [float(len(c) % 2) for c in completions],
                            response_length=64, bf16=True, use_cpu=True)  # fmt: skip
    assert trainer.accelerator.mixed_precision == "bf16"
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    logged = [entry for entry in trainer.state.log_history if "rollout/logprob_diff_mean" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert math.isfinite(entry["rollout/logprob_diff_max"]) and 0 <= entry["rollout/logprob_diff_mean"] < 0.5
