"""The optimizer a step runs, in the precision Megatron names.

By default AdamW on the model's own parameters (torch's: weights, gradients and moments in the
compute dtype). With `main_params_dtype` (Megatron's --main-params-dtype, fp32 in its bf16 runs),
Megatron's mixed precision: main parameters in that dtype beside the model's, the moments in it
too, and main gradients (`main_grads_dtype`, Megatron's --main-grads-dtype, fp32) that each
backward adds into as each parameter's gradient is ready (which then frees it); after the update
the model's parameters are copied from the main ones. Per parameter that is Megatron's 18 bytes
(2 weights, 4 main gradients, 4 main parameters, 4 + 4 moments). `use_distributed_optimizer`
keeps 1/dp of the main parameters and moments on each data-parallel rank: by shape, for estimates
(on meta); a run under torchrun does it with FSDP2, each layer gathered through the step and
gradients reduced once (`fully_shard_layers(reduce_once_a_step=True)`). `use_torch_fsdp2`
(Megatron's --use-torch-fsdp2, what a data-parallel run does otherwise): FSDP2 shards the
parameters in the main dtype, their gradients and the moments over data parallel, and gathers
each layer's in the compute dtype for its forward and backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.config.fields import optional, parse_bool, parse_str, setting
from remat.core.problems import Problem, one_of
from remat.memory.meter import local_tensor

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# AdamW as Megatron's recipes set it
LR, BETAS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 0.1


def _dtype(help: str) -> Any:
    """An optional dtype flag, one of DTYPES."""
    return setting(
        None, parse=optional(parse_str), flag=True, choices=tuple(sorted(DTYPES)), metavar="DTYPE", help=help
    )


@dataclass(frozen=True)
class OptimizerPrecision:
    """Megatron's optimizer precision flags; all unset: AdamW on the model's parameters."""

    main_params_dtype: str | None = _dtype(
        "Megatron's mixed-precision optimizer: AdamW on main parameters of this dtype beside the model's (fp32"
        " in Megatron's bf16 runs); default: AdamW on the model's parameters"
    )
    main_grads_dtype: str | None = _dtype(
        "with --main_params_dtype: the main gradients each backward adds into (default: the main parameters' dtype)"
    )
    use_distributed_optimizer: bool = setting(
        False,
        parse=parse_bool,
        flag=True,
        help="with --main_params_dtype: each data-parallel rank keeps 1/dp of the main parameters and moments (6 +"
        " 12/dp bytes a parameter; bench: FSDP2 keeping each layer gathered through a step and reducing"
        " gradients once, at its last micro-batch)",
    )
    use_torch_fsdp2: bool = setting(
        False,
        parse=parse_bool,
        flag=True,
        help="data parallel by torch's FSDP2, as Megatron's --use-torch-fsdp2: parameters (in the main dtype),"
        " gradients and moments sharded over data parallel, each layer gathered in the compute dtype; what"
        " remat bench runs with data parallelism unless told --use_distributed_optimizer (estimate; bench:"
        " implied)",
    )

    def problems(self) -> Iterator[Problem]:
        for name in ("main_params_dtype", "main_grads_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                yield Problem(name, f"{value!r} is not a dtype remat knows; use one of {one_of(DTYPES)}")
        if self.main_params_dtype is None:
            for name in ("main_grads_dtype", "use_distributed_optimizer"):
                if getattr(self, name):
                    yield Problem(
                        name, "needs main parameters to act on; set main_params_dtype (Megatron's bf16 runs use fp32)"
                    )
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            yield Problem(
                "use_distributed_optimizer",
                "FSDP2 shards the main parameters and moments itself, and Megatron refuses the two together; drop one",
            )

    def describe(self) -> str:
        if self.main_params_dtype is None:
            return "AdamW on the model's parameters"
        grads = self.main_grads_dtype or self.main_params_dtype
        shard = (
            ", FSDP2-sharded"
            if self.use_torch_fsdp2
            else ", sharded over data parallel"
            if self.use_distributed_optimizer
            else ""
        )
        return f"AdamW on {self.main_params_dtype} main parameters, {grads} main gradients{shard}"


def adamw(params: Iterable[torch.Tensor], fused: bool) -> torch.optim.AdamW:
    """AdamW as Megatron's recipes set it: fused on GPU (moments updated in place, no
    temporaries); elsewhere torch's loop over the tensors, which allocates a few per tensor."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=fused)


class MainParamsAdamW(torch.optim.Optimizer):
    """AdamW on main parameters beside the model's (see the module's docstring). Its `state`
    per model parameter: main_param, main_grad, and after the first step exp_avg, exp_avg_sq."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        precision: OptimizerPrecision,
        *,
        fused: bool = False,
        shards: int = 1,
        inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    ) -> None:
        """`inner`: the AdamW over the main parameters (default torch's, fused if `fused`)."""
        params = [p for p in params if p.requires_grad]
        super().__init__(params, {"lr": LR})
        if shards > 1 and any(p.device.type != "meta" for p in params):
            raise ValueError(
                "the distributed optimizer's 1/dp share is taken by shape, on meta; a real"
                " sharded run shards with FSDP2"
            )
        main_dtype = DTYPES[precision.main_params_dtype or "fp32"]
        grad_dtype = DTYPES[precision.main_grads_dtype or precision.main_params_dtype or "fp32"]
        mains = []
        for p in params:
            share = -(-p.numel() // shards)
            main = (
                p.detach().to(main_dtype, copy=True)
                if shards == 1
                else torch.empty(share, dtype=main_dtype, device=p.device)
            )
            self.state[p] = {"main_param": main, "main_grad": torch.zeros_like(p, dtype=grad_dtype)}
            # Megatron's name: where what runs after backward (a pipeline's tied-weight sum) finds it
            p.main_grad = self.state[p]["main_grad"]  # type: ignore[attr-defined]
            mains.append(main)
        self._inner = inner(mains) if inner is not None else adamw(mains, fused)
        owner = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p: _into_main_grad(owner, p)) for p in params]
        weakref.finalize(self, _remove, self._hooks, params)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            main, grad = self.state[p]["main_param"], self.state[p]["main_grad"]
            # itself where dtype matches (a DTensor stays sharded); a rank's share (by shape) otherwise
            main.grad = (
                grad.to(main.dtype)
                if main.shape == grad.shape
                else grad.reshape(-1)[: main.numel()].to(main.dtype).view_as(main)
            )
        self._inner.step()
        for p in params:
            state = self.state[p]
            main = state["main_param"]
            state.update({k: v for k, v in self._inner.state[main].items() if k != "step"})
            if main.numel() == p.numel():
                p.copy_(main.view_as(p))
            main.grad = None
            state["main_grad"].zero_()


def _into_main_grad(owner: weakref.ref[MainParamsAdamW], p: torch.Tensor) -> None:
    """A parameter's gradient is ready: add it into its main gradient and free it."""
    optimizer = owner()
    if optimizer is None or p.grad is None:
        return
    optimizer.state[p]["main_grad"].add_(p.grad)
    p.grad = None


def _remove(hooks: list[Any], params: list[nn.Parameter]) -> None:
    for hook in hooks:
        hook.remove()
    for p in params:
        if hasattr(p, "main_grad"):
            del p.main_grad


def main_grad_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the main gradients a MainParamsAdamW holds (0 for any other optimizer)."""
    if not isinstance(optimizer, MainParamsAdamW):
        return 0
    grads = [local_tensor(s["main_grad"]) for s in optimizer.state.values()]  # a DTensor's shard on this rank
    return sum(g.numel() * g.element_size() for g in grads)


def make(
    params: Iterable[nn.Parameter],
    precision: OptimizerPrecision,
    *,
    fused: bool,
    shards: int = 1,
    inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """The step's optimizer for `precision`; `inner` replaces torch's AdamW (estimates on meta)."""
    if precision.main_params_dtype is None:
        return inner(list(params)) if inner is not None else adamw(params, fused)
    return MainParamsAdamW(params, precision, fused=fused, shards=shards, inner=inner)
