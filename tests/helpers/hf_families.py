"""One row of the Hugging Face support table: a causal LM family of the installed transformers,
built from its tiny config in float64 on CPU, adapted, and checked label by label."""

from __future__ import annotations

import dataclasses
import warnings

import torch

import remat
from remat.config.parallel import ParallelLayout
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.models.hf import catalog
from remat.models.hf.family import FAMILY
from remat.sites.apply import find_sites

SEQ, LOSS_SEQ = 16, 48  # the loss head takes over from HF's above hidden_size / 2 tokens
LAYOUTS = {"tp 2": ParallelLayout(tp=2), "pp 2": ParallelLayout(pp=2), "cp 2": ParallelLayout(cp=2)}


@dataclasses.dataclass
class Row:
    family: str
    refused: str = ""  # why remat does not adapt it (ConfigError), or why transformers cannot run it
    effective: tuple[str, ...] = ()  # labels bit-identical and freeing bytes
    failing: dict[str, str] = dataclasses.field(default_factory=dict)  # labels that are not
    full: bool = False  # full recompute of every layer bit-identical
    loss_head: str = ""  # "yes", or why it is refused
    layouts: tuple[str, ...] = ()  # the layouts remat's checks accept for it

    def line(self) -> str:
        if self.refused:
            return f"| {self.family} | refused: {self.refused} | | | |"
        labels = ", ".join(self.effective) + "".join(f", **{k}: {v}**" for k, v in self.failing.items())
        return (
            f"| {self.family} | {labels} | {'yes' if self.full else '**no**'} | {self.loss_head} |"
            f" {', '.join(self.layouts) or 'one process'} |"
        )


def _build(family: str, dropout: float) -> torch.nn.Module:
    config = FAMILY.config(f"hf:{family}").hf
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, dropout)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
    except ValueError:  # a model without experts takes no experts_implementation
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.config.use_cache = False
    return model.train()


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(0, catalog.VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120]}" if str(err).strip() else type(err).__name__


def _trained_once(family: str, ids: torch.Tensor) -> torch.nn.Module:
    """The family's model after one step of its own: with dropout where it trains with dropout."""
    for dropout in (0.1, 0.0):
        try:
            model = _build(family, dropout)
            model(input_ids=ids, labels=ids).loss.backward()
            return model
        except ValueError:  # a model that refuses dropout (DiffLlama) is tried without
            if dropout == 0.0:
                raise
    raise AssertionError("unreachable")


def check(family: str) -> Row:
    """The family's row; an error remat raises past its checks shows as a failing entry."""
    try:
        return _check(family)
    except Exception as err:
        return Row(family, failing={"error": _first_line(err)})


def _check(family: str) -> Row:
    row = Row(family)
    ids = _ids(SEQ)
    try:
        model = _trained_once(family, ids)
    except ConfigError as err:
        row.refused = str(err).splitlines()[-1].strip()
        return row
    except Exception as err:  # transformers itself cannot train this tiny config
        row.refused = f"transformers does not train its tiny config ({_first_line(err)})"
        return row
    try:
        remat.adapt(model)
    except ConfigError as err:
        row.refused = str(err).splitlines()[-1].strip()
        return row
    labels = sorted(set().union(*find_sites(model).model_sites.labels))
    effective = []
    for label in labels:
        report = remat.verify(
            model, RecomputeConfig(recompute_granularity="selective", recompute_modules=[label]), ids, ids
        )
        if not report.bit_identical:
            row.failing[label] = f"differs by {report.max_grad_diff:.2g}"
        elif report.freed_bytes <= 0:
            row.failing[label] = f"frees {report.freed_bytes} B"
        else:
            effective.append(label)
    row.effective = tuple(effective)
    full = RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    row.full = remat.verify(model, full, ids, ids).bit_identical
    row.loss_head = _loss_head(family)
    config = FAMILY.config(f"hf:{family}")
    row.layouts = tuple(name for name, layout in LAYOUTS.items() if not list(FAMILY.layout_problems(config, layout)))
    return row


def _loss_head(family: str) -> str:
    """'yes' if the chunked loss head gives HF's loss (HF reduces in float32), else the refusal."""
    ids = _ids(LOSS_SEQ)
    model = _trained_once(family, ids)
    torch.manual_seed(0)
    plain = model(input_ids=ids, labels=ids).loss
    try:
        remat.adapt(model, loss_head=True)
        torch.manual_seed(0)
        chunked = model(input_ids=ids, labels=ids).loss
    except ConfigError as err:
        return "refused: " + str(err).split(":", 1)[-1].strip().split(";")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = torch.allclose(chunked.float(), plain.float(), rtol=1e-6, atol=1e-6)
    return "yes" if same else f"**differs: {float(chunked):.6f} vs {float(plain):.6f}**"
