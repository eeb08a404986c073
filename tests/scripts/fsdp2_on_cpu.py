"""Test-only: let accelerate's FSDP2 shard over gloo on a CPU-only machine.

accelerate turns FSDP on only for GPU-type process groups (`AcceleratorState` ignores the FSDP plugin when the
processes run on the CPU), while `torch.distributed.fsdp.fully_shard` itself shards on the CPU over gloo. Before
anything builds accelerate's state, `enable()` makes it take the launched CPU processes for such a group and keep
the CPU as their device; everything after that (`accelerator.prepare`, trl_ppo's sharding, gathering, saving and
resuming) is the FSDP2 code a GPU run takes.
"""

import os


def enable() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # the device `PartialState` keeps
    prepare_backend = PartialState._prepare_backend

    def on_cpu(self, cpu=False, sagemaker_dp=False, backend=None):
        found, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        if distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU) and "LOCAL_RANK" in os.environ:
            return "gloo", DistributedType.MULTI_GPU  # a process group accelerate may shard over (device: the CPU)
        return found, distributed_type

    PartialState._prepare_backend = on_cpu
