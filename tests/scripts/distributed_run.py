"""A tiny PPO run for the multi-process tests, launched with `accelerate launch` (DDP, DeepSpeed or FSDP2; FSDP2 on
the CPU with TRL_PPO_TEST_FSDP2_ON_CPU=1, see fsdp2_on_cpu.py).

    accelerate launch ... tests/scripts/distributed_run.py --report_dir DIR [--value head] [--final_model_dir D]
        [any PPOConfig flag]

A tiny random-init policy, value model and reward model (a sequence classifier) built from configs; the
reference is the trainer's own frozen copy. Each process writes `DIR/rank<i>.json` (its log history, seed,
world size, DeepSpeed all-gathers per rollout's sampling) and `DIR/weights_rank<i>.pt` (the full policy and
value weights after training, gathered under ZeRO-3); `DIR/initial_weights.pt` holds the weights before training.
"""

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field

import torch

torch.set_num_threads(1)  # one thread per process: two processes share the two cores
if os.environ.get("TRL_PPO_TEST_FSDP2_ON_CPU") == "1":
    import fsdp2_on_cpu  # noqa: E402  (beside this script)

    fsdp2_on_cpu.enable()

from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from trl_ppo import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer, default_prompts  # noqa: E402


@dataclass
class RunArgs:
    report_dir: str = field(metadata={"help": "Where each process writes its report and weights."})
    value: str = field(
        default="separate", metadata={"help": "'separate' value model, a value 'head', or 'none' (critic-free)."}
    )
    final_model_dir: str | None = field(default=None, metadata={"help": "`save_model()` here after training."})


class RecordSeed(TrainerCallback):
    """The seed of this process's global RNG when training begins."""

    seed = None

    def on_train_begin(self, args, state, control, **kwargs):
        RecordSeed.seed = torch.initial_seed()


def full_weights(trainer) -> dict:
    """The wrapper's full state dict on this process (ZeRO-3 partitions and FSDP2 shards gathered), on the CPU."""
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(trainer.accelerator, "is_fsdp2", False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)  # on every process
        state_dict = get_model_state_dict(wrapper, options=options)
        return {name: tensor.detach().cpu().clone() for name, tensor in state_dict.items()}
    gathered = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(wrapper.parameters()))
    with gathered:
        return {name: tensor.detach().cpu().clone() for name, tensor in wrapper.state_dict().items()}


def count_sampling_gathers(trainer) -> list[int]:
    """Count DeepSpeed's (or FSDP2's) all-gathers inside each sampling call (`rollout.sample_responses`; one entry
    per call; empty without either)."""
    counts, calls = [], [0]
    if trainer.is_deepspeed_enabled:
        import deepspeed.comm.comm as ds_comm

        backend = ds_comm.cdb
        names = [name for name in dir(backend) if "gather" in name and callable(getattr(backend, name))]
    elif getattr(trainer.accelerator, "is_fsdp2", False):
        backend, names = torch.distributed, ["all_gather_single"]  # what FSDP2 gathers a unit's weights with
    else:
        return counts
    for name in names:

        def counted(*args, _function=getattr(backend, name), **kwargs):
            calls[0] += 1
            return _function(*args, **kwargs)

        setattr(backend, name, counted)
    from trl_ppo import rollout

    sample = rollout.sample_responses

    def counted_sample(*args, **kwargs):
        before = calls[0]
        responses = sample(*args, **kwargs)
        counts.append(calls[0] - before)
        return responses

    rollout.sample_responses = counted_sample
    return counts


def shard_sizes(trainer) -> dict:
    """Per model: (the elements this process holds, the model's elements, FSDP2 units in it) after training."""
    from torch.distributed.fsdp import FSDPModule

    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    sizes = {}
    for role, model in (("policy", wrapper.policy), ("value_model", wrapper.value_model), ("ref", trainer.ref_model)):
        if model is not None:
            local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
            units = sum(isinstance(module, FSDPModule) for module in model.modules())
            sizes[role] = (local, sum(p.numel() for p in model.parameters()), units)
    return sizes


def output_dtypes(trainer) -> dict:
    """The dtypes of the log-probs and values the policy-and-value wrapper returns, and of the reference's log-probs
    (on every process: a collective under ZeRO-3 and FSDP2)."""
    from trl_ppo.fsdp import root_call
    from trl_ppo.logprobs import response_logprobs

    models = trainer._models()
    ids = torch.tensor([[5, 6, 7, 8, 9]], device=trainer.accelerator.device)
    inputs = (ids, torch.ones_like(ids), ids[:, -2:], 1.0)
    with torch.no_grad(), trainer.accelerator.autocast():
        output = models.wrapper(*inputs)
        reference = root_call(models.ref_model, response_logprobs, *inputs)
    tensors = {"logprobs": output.logprobs, "values": output.values, "ref": reference.logprobs}
    return {name: str(tensor.dtype) for name, tensor in tensors.items() if tensor is not None}  # no values: no critic


def main() -> None:
    run_args, config = HfArgumentParser((RunArgs, PPOConfig)).parse_args_into_dataclasses()
    tokenizer = build_word_tokenizer()
    policy, value_model = build_tiny_models(tokenizer, hidden_size=64, seed=0)
    _, reward_model = build_tiny_models(tokenizer, hidden_size=64, seed=1)
    if run_args.value in ("head", "none"):
        value_model = None
    initial = {f"policy.{k}": v.clone() for k, v in policy.state_dict().items()}
    if value_model is not None:
        initial.update({f"value_model.{k}": v.clone() for k, v in value_model.state_dict().items()})

    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=default_prompts(),
        callbacks=[RecordSeed()],
    )
    sampling_gathers = count_sampling_gathers(trainer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    weights = full_weights(trainer)
    if run_args.final_model_dir:
        trainer.save_model(run_args.final_model_dir)

    rank = trainer.accelerator.process_index
    os.makedirs(run_args.report_dir, exist_ok=True)
    torch.save(weights, os.path.join(run_args.report_dir, f"weights_rank{rank}.pt"))
    if rank == 0:
        torch.save(initial, os.path.join(run_args.report_dir, "initial_weights.pt"))
    report = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "seed": RecordSeed.seed,
        "global_step": trainer.state.global_step,
        "log_history": trainer.state.log_history,
        "sampling_gathers": sampling_gathers,
        "policy_tensors": len(list(trainer.accelerator.unwrap_model(trainer.model).lm.parameters())),
        "shards": shard_sizes(trainer),
        "output_dtypes": output_dtypes(trainer),
    }
    with open(os.path.join(run_args.report_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    trainer.accelerator.wait_for_everyone()


def exit_at_once() -> None:
    """End this process now, its reports written and every process past the last barrier, skipping the
    interpreter's teardown (gloo, DeepSpeed, their threads). A process of a finished two-process run has aborted
    (SIGABRT), rarely: twice at exit in a loaded `make test` ("terminate called without an active exception"), and
    once in CI (stop 51) after its last update was logged, with the process group destroyed before exiting; that
    one was not placed more precisely. Nothing is written after this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_at_once()
