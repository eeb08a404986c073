"""Notices of other libraries that tell a trl_ppo user nothing, dropped one by one where they are logged (never a
whole logger, never a level)."""

from __future__ import annotations

import logging
import warnings

# DeepSpeed probes for an accelerator when it is first imported, which accelerate does whenever a model is unwrapped
# (`Trainer.__init__`) if DeepSpeed is installed, and warns on every machine without a GPU that it "Setting
# accelerator to CPU". DeepSpeed's check is torch's own (`torch.cuda.is_available()`), so a run that lands on the CPU
# learns nothing from it. Its logger is created with `getLogger("DeepSpeed")`, so a filter added now stays on it.
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU."


class DropMessage(logging.Filter):
    """Drops the records whose message starts with `prefix`; lets every other record through."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def drop_deepspeed_cpu_notice() -> None:
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, DropMessage) and f.prefix == DEEPSPEED_CPU_NOTICE for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(DropMessage(DEEPSPEED_CPU_NOTICE))


drop_deepspeed_cpu_notice()


# FSDP2 warns when a sharded module returns a view, since an in-place change of it would skip FSDP's pre-backward
# hook. `PolicyAndValueWrapper` returns slices (the response tokens' values and log-probs) that trl_ppo only ever
# reads, so the warning says nothing to a user; modules of their own still get it.
warnings.filterwarnings(
    "ignore", message=r"FSDP2-wrapped module \(FSDPPolicyAndValueWrapper\) returned a view tensor", category=UserWarning
)
