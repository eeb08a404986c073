"""The PPO update loop's own decisions, on values small enough to check by hand: the loss divisor per pass and the
verdict of each minibatch's guards (`update.py`); and that `transformers`' Accelerator settings cannot scale the
loss a second time."""

from types import SimpleNamespace

import pytest
import torch
from conftest import build_trainer

from trl_ppo.models import PreparedModels
from trl_ppo.update import Verdict, backward_scale, gradient_norm, judge_minibatch, shuffled_minibatches


class OneProcess:
    """What `judge_minibatch` reads of an Accelerator, for one process."""

    num_processes = 1

    def reduce(self, tensor, reduction="sum"):
        return tensor


def settings(**overrides):
    values = dict(ratio_threshold=None, early_stopping=False, target_kl=1.0)
    return SimpleNamespace(**{**values, **overrides})


def stats(policy_losses=(0.1, 0.2), ratios=(1.0, 1.0), approxkl=(0.0, 0.0)):
    as_list = lambda values: [torch.tensor(v) for v in values]  # noqa: E731
    return {
        "loss/policy_avg": as_list(policy_losses),
        "loss/value_avg": as_list([0.5] * len(policy_losses)),
        "val/ratio": as_list(ratios),
        "policy/approxkl_avg": as_list(approxkl),
    }


def test_backward_scale_undoes_the_averaging_over_processes_and_deepspeeds_division():
    # Each pass's loss is already its share of the minibatch's loss: nothing to divide on one process.
    assert backward_scale(num_processes=1, passes=2, deepspeed=False) == 1
    # DDP averages the gradients of 4 processes, each holding its share of the global minibatch loss.
    assert backward_scale(num_processes=4, passes=2, deepspeed=False) == 4
    # DeepSpeed divides by its gradient_accumulation_steps (2 passes) and averages over processes.
    assert backward_scale(num_processes=4, passes=2, deepspeed=True) == 8


@pytest.mark.parametrize("max_grad_norm, clipped", [(0.0, [3.0, 4.0]), (1.0, [0.6, 0.8]), (10.0, [3.0, 4.0])])
def test_gradient_norm_is_the_norm_before_clipping_to_max_grad_norm(max_grad_norm, clipped):
    from accelerate import Accelerator

    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5
    norm = gradient_norm(PreparedModels(Accelerator(cpu=True), model, None), settings(max_grad_norm=max_grad_norm))
    assert norm.item() == pytest.approx(5.0)  # 0 clips nothing
    assert model.weight.grad.flatten().tolist() == pytest.approx(clipped)


def test_minibatch_verdicts():
    accelerator = OneProcess()
    assert judge_minibatch(stats(), accelerator, settings(), update=1) is Verdict.STEP
    assert judge_minibatch(stats((0.1, float("nan"))), accelerator, settings(), 1) is Verdict.NONFINITE
    # Mean ratio 1.5 > 1.4: skipped; the non-finite check comes first.
    assert judge_minibatch(stats(ratios=(1.0, 2.0)), accelerator, settings(ratio_threshold=1.4), 1) is Verdict.SKIP
    nan_and_high = stats((float("inf"), 0.1), ratios=(1.0, 2.0))
    assert judge_minibatch(nan_and_high, accelerator, settings(ratio_threshold=1.4), 1) is Verdict.NONFINITE
    # Mean approximate KL 0.2 > 1.5 * 0.1: stop; at 0.1 * 1.5 = 0.15 < 0.2 too, at target 0.2 (0.3) not.
    early = settings(early_stopping=True, target_kl=0.1)
    assert judge_minibatch(stats(approxkl=(0.1, 0.3)), accelerator, early, 1) is Verdict.STOP
    assert judge_minibatch(
        stats(approxkl=(0.1, 0.3)), accelerator, settings(early_stopping=True, target_kl=0.2), 1
    ) is (Verdict.STEP)
    assert [v.ends_update for v in Verdict] == [False, False, True, True, False]  # ZERO goes on


def test_minibatches_cover_every_episode_once_per_epoch():
    args = SimpleNamespace(num_ppo_epochs=3, local_batch_size=8, local_mini_batch_size=4)
    torch.manual_seed(0)
    minibatches = [m for m, value_only in shuffled_minibatches(args, torch.device("cpu")) if not value_only]
    assert len(minibatches) == 6 and all(len(m) == 4 for m in minibatches)
    for epoch in range(3):
        assert sorted(torch.cat(minibatches[2 * epoch : 2 * epoch + 2]).tolist()) == list(range(8))


def test_num_critic_epochs_follows_each_ppo_epoch_with_value_only_epochs():
    args = SimpleNamespace(num_ppo_epochs=2, num_critic_epochs=3, local_batch_size=8, local_mini_batch_size=4)
    minibatches = list(shuffled_minibatches(args, torch.device("cpu")))
    # per PPO epoch: 2 minibatches of policy and value, then 2 value-only epochs of 2 minibatches each
    assert [value_only for _, value_only in minibatches] == ([False] * 2 + [True] * 4) * 2
    for epoch in range(6):
        assert sorted(torch.cat([m for m, _ in minibatches[2 * epoch : 2 * epoch + 2]]).tolist()) == list(range(8))


def _policy_after_one_update(trainer):
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    return {name: value.detach().clone() for name, value in policy.state_dict().items()}


def test_an_accelerator_built_with_gradient_accumulation_does_not_scale_the_loss_twice(
    make_config, tokenizer, load_models, prompt_dataset, monkeypatch
):
    """Some transformers versions (5.5.0 for one) give `Accelerator` `gradient_accumulation_steps`, whose
    `backward` then divides the loss by it: with SGD the step would be that many times too small."""
    from transformers import Trainer

    config = dict(
        total_episodes=8, gradient_accumulation_steps=2, num_ppo_epochs=1, optim="sgd", max_grad_norm=0.0, seed=5
    )
    expected = _policy_after_one_update(build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset))

    original = Trainer.create_accelerator_and_postprocess

    def as_in_older_versions(self):
        original(self)
        self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps

    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", as_in_older_versions)
    trainer = build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset)
    changed = _policy_after_one_update(trainer)
    for name in expected:
        torch.testing.assert_close(changed[name], expected[name], rtol=0, atol=0, msg=name)
    assert trainer.accelerator.gradient_accumulation_steps == 1


def test_a_skipped_update_still_steps_the_schedule(make_config, tokenizer, load_models, prompt_dataset):
    """Decided: the learning-rate schedule follows the update count, skipped (non-finite) updates included, so a
    run ends its schedule where it was planned to and `lr` at update k is the schedule's value at k."""
    config = make_config(total_episodes=24, skip_nonfinite_updates=True, learning_rate=1e-3, lr_scheduler_type="linear")
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    head = trainer.accelerator.unwrap_model(trainer.model).value_model.score
    head.register_forward_hook(lambda m, i, out: out * float("nan") if torch.is_grad_enabled() else out)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "lr" in entry]
    assert [entry["loss/skipped_updates"] for entry in logs] == [1, 2, 3]
    assert [entry["lr"] for entry in logs] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])


def test_a_nonfinite_total_loss_is_nonfinite_even_when_the_policy_and_value_losses_are_finite():
    from trl_ppo.update import TOTAL_LOSS

    finite_parts = stats()
    finite_parts[TOTAL_LOSS] = [torch.tensor(0.3), torch.tensor(float("inf"))]  # e.g. entropy_coef * entropy
    assert judge_minibatch(finite_parts, OneProcess(), settings(), 1) is Verdict.NONFINITE


def _weights(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# Issue 28.1: with these values one update trained a model of NaNs that `train()` and `save_model()` accepted. The
# config refuses them now; set after the trainer is built, the update's guards must still stop them.
@pytest.mark.parametrize(
    "field, value, what",
    [
        ("entropy_coef", float("inf"), "PPO loss"),
        ("vf_coef", float("inf"), "PPO loss"),
        ("kl_loss_coef", float("inf"), "PPO loss"),
        ("vf_coef", 1e38, "gradient norm"),  # a finite loss, an infinite gradient
    ],
)
def test_a_nonfinite_total_loss_stops_the_update_before_any_step(
    field, value, what, make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, prompt_dataset)
    setattr(trainer.args, field, value)
    before = _weights(trainer)
    with pytest.raises(FloatingPointError, match=rf"^Non-finite {what} at update 1; no optimizer step was taken"):
        trainer.train()
    after = _weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before), "the weights changed"


def test_a_nonfinite_gradient_norm_stops_the_update_or_is_skipped(make_config, tokenizer, load_models, prompt_dataset):
    """The losses are finite, one gradient is not: no step, and with `skip_nonfinite_updates` the run goes on."""
    for skip in (False, True):
        config = make_config(total_episodes=8, skip_nonfinite_updates=skip)
        trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
        head = trainer.accelerator.unwrap_model(trainer.model).value_model.score.weight
        head.register_hook(lambda grad: grad * float("nan"))
        before = _weights(trainer)
        if skip:
            trainer.train()
            assert [e["loss/skipped_updates"] for e in trainer.state.log_history if "episode" in e] == [1]
        else:
            with pytest.raises(FloatingPointError, match=r"^Non-finite gradient norm at update 1; no optimizer step"):
                trainer.train()
        after = _weights(trainer)
        assert all(torch.equal(before[name], after[name]) for name in before), "the weights changed"


def test_a_nan_max_grad_norm_set_after_the_config_was_checked_clips_nothing(
    make_config, tokenizer, load_models, prompt_dataset
):
    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, prompt_dataset)
    trainer.args.max_grad_norm = float("nan")  # clipping to NaN made every weight NaN
    trainer.train()
    assert all(torch.isfinite(tensor).all() for tensor in _weights(trainer).values())


def _flat_after_first_update():
    """A reward that splits each group of 4 in its first 8 episodes (update 1) and scores every later episode 1.0,
    so that from update 2 on every group is flat: with no KL term, each advantage and the gradient are exactly 0."""
    scored = []

    def reward(prompts, completions, **kwargs):
        first = len(scored) < 8
        scored.extend(completions)
        return [float(i % 2) for i in range(len(completions))] if first else [1.0] * len(completions)

    return reward


@pytest.mark.parametrize("skip", [False, True])
def test_a_zero_gradient_moves_adamw_by_its_momentum_unless_skipped(
    skip, make_config, tokenizer, load_models, prompt_dataset
):
    from transformers import TrainerCallback

    class AfterEachUpdate(TrainerCallback):
        weights, exp_avg = [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.weights.append(_weights(trainer))
            moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values() if "exp_avg" in s]
            self.exp_avg.append(moments)

    config = make_config(advantage_estimator="grpo", num_generations=4, kl_coef=0.0, num_ppo_epochs=1,
                         total_episodes=16, skip_zero_gradient_steps=skip)  # fmt: skip
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=_flat_after_first_update(),
                            value_model=None, callbacks=[AfterEachUpdate()])  # fmt: skip
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "episode" in entry and "grad_norm" in entry]
    assert logs[0]["grad_norm"] > 0 and logs[1]["grad_norm"] == 0.0  # update 2: every group flat
    (first, second), (moments_first, moments_second) = AfterEachUpdate.weights, AfterEachUpdate.exp_avg
    unchanged = all(torch.equal(first[name], second[name]) for name in first)
    if skip:  # no step: the weights and AdamW's state stay as update 1 left them
        assert unchanged and all(torch.equal(a, b) for a, b in zip(moments_first, moments_second))
        assert [entry["policy/zero_gradient_steps"] for entry in logs] == [0.0, 1.0]
    else:  # AdamW steps on the zero gradient: its momentum (0.9 of update 1's) moves the weights
        assert not unchanged and "policy/zero_gradient_steps" not in logs[1]


def test_skip_zero_gradient_steps_is_refused_with_fp16_and_under_deepspeed(make_config):
    from trl_ppo.config_checks import validate_config
    from trl_ppo.distributed import check_supported

    with pytest.raises(ValueError, match=r"`skip_zero_gradient_steps` reads the gradient's norm before each step"):
        validate_config(make_config(skip_zero_gradient_steps=True, fp16=True))

    with pytest.raises(ValueError, match=r"`skip_zero_gradient_steps` cannot be used under DeepSpeed"):
        check_supported(make_config(skip_zero_gradient_steps=True), True, None, 2, False)


def _sgd_step(make_config, tokenizer, load_models, max_grad_norm):
    """One update (one PPO epoch of one minibatch: a single optimizer step) with plain SGD on the hand-made
    episodes of test_step_api -> (the logged grad_norm, each trainable weight's change)."""
    from test_step_api import hand_made_episodes

    config = make_config(total_episodes=80, num_ppo_epochs=1, optim="sgd", learning_rate=0.1,
                         max_grad_norm=max_grad_norm)  # fmt: skip
    trainer = build_trainer(config, tokenizer, load_models)
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    queries, responses, scores = hand_made_episodes(tokenizer)
    update = trainer.update_on_episodes(queries, responses, torch.tensor(scores))
    assert update.result.stats["grad_norm"].numel() == 1  # one step: its norm is the logged mean
    deltas = {name: p.detach() - before[name] for name, p in model.named_parameters() if name in before}
    return update.metrics["grad_norm"], deltas


def _total_norm(tensors):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])).item()


def test_grad_norm_is_logged_before_a_clip_that_shrinks_the_step(make_config, tokenizer, load_models):
    """SGD moves the weights by -lr * gradient: unclipped, the step's norm / lr is the gradient's norm, which the
    update logs; clipped to a quarter of it, the same norm is logged and the step is the unclipped one scaled to
    max_grad_norm."""
    norm, free = _sgd_step(make_config, tokenizer, load_models, max_grad_norm=0.0)
    assert norm == pytest.approx(_total_norm(free.values()) / 0.1, rel=1e-3)  # measured from the weights
    clip = norm / 4
    clipped_norm, clipped = _sgd_step(make_config, tokenizer, load_models, max_grad_norm=clip)
    assert clipped_norm == pytest.approx(norm, rel=1e-5)  # the same episodes and weights: the same gradient
    assert _total_norm(clipped.values()) / 0.1 == pytest.approx(clip, rel=1e-3)
    for name in free:  # the same direction, a quarter of the length (clip_grad_norm_ scales by clip / (norm + 1e-6))
        torch.testing.assert_close(clipped[name], free[name] * clip / (norm + 1e-6), rtol=1e-3, atol=1e-7, msg=name)
