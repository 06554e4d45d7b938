"""torch's AdamW without the torch.compile entry points that import `torch._dynamo`.

`torch.optim.Optimizer` imports `torch._dynamo` on its first `add_param_group`, `zero_grad` or `step` (its
decorators disable compilation inside them, and reach dynamo to do so). The import pulls in sympy, inductor
and FSDP: 1.2 s of CPU on a quiet core, more than importing torch itself, and 2 to 3 s of every worker start
on a loaded machine, which a restarted island spends before its first step. The built-in trainer never
compiles, so its optimizer calls the undecorated methods (`__wrapped__`, which the decorators keep through
`functools.wraps`); the arithmetic, the state and the state-dict format are torch's own.
"""

from __future__ import annotations

import torch
from torch.optim import AdamW as _TorchAdamW
from torch.optim import Optimizer


class AdamW(_TorchAdamW):
    """`torch.optim.AdamW`, minus the dynamo import; not for use under `torch.compile`."""

    add_param_group = Optimizer.add_param_group.__wrapped__  # type: ignore[attr-defined]
    zero_grad = Optimizer.zero_grad.__wrapped__  # type: ignore[attr-defined]
    # The decorator runs the step without autograd recording (differentiable=False, the default).
    step = torch.no_grad()(_TorchAdamW.step.__wrapped__)  # type: ignore[attr-defined]
