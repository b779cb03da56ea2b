"""Sweep entries: Megatron's usual recompute presets, by name, or config/plan files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remat.config.plan import Plan, PlanLike, load_plan_or_config
from remat.config.recompute import RecomputeConfig
from remat.core.labels import recompute_labels
from remat.core.problems import ConfigError, Problem


def megatron_presets(labels: frozenset[str], num_layers: int) -> list[str]:
    """none, each label the model has alone, mlp+core_attn, core_attn+layernorm, full uniform 1
    and full block over half the layers."""
    singles = [label for label in recompute_labels() if label in labels]
    pairs = [p for p in ("mlp+core_attn", "core_attn+layernorm") if set(p.split("+")) <= labels]
    return ["none", *singles, *pairs, "full_uniform_1", f"full_block_{max(num_layers // 2, 1)}"]


def parse_entry(text: str, facts: dict[str, Any]) -> tuple[str, PlanLike]:
    """`none`, `mlp+core_attn` (or `mlp,core_attn`), `full_uniform_2`, `full_block_4`, or a
    YAML/JSON file holding Megatron keys or a per-layer plan. `facts` are Megatron keys
    (num_layers, ...) the config's rules need. Every problem is named by the entry."""
    path = Path(text)
    try:
        return _parse_entry(text, path, facts)
    except ConfigError as err:  # a file's own problems (unreadable, not YAML) already name it
        raise ConfigError(
            [p if p.field == str(path) else Problem(f"{text}: {p.field}", p.message) for p in err.problems]
        ) from None


def _parse_entry(text: str, path: Path, facts: dict[str, Any]) -> tuple[str, PlanLike]:
    if path.suffix in (".yaml", ".yml", ".json"):
        loaded = load_plan_or_config(path)
        if isinstance(loaded, RecomputeConfig):
            loaded = RecomputeConfig.from_megatron({**loaded.to_megatron(), **facts})
        return path.stem, loaded
    if text == "none":
        return text, None
    if text.startswith("full_"):
        _, method, k = (text.split("_") + ["", ""])[:3]
        if not k:
            raise ConfigError(
                [
                    Problem(
                        "entry",
                        "a full-recompute entry is full_uniform_K or full_block_K, with K layers, like full_uniform_1",
                    )
                ]
            )
        keys = {
            "recompute_granularity": "full",
            "recompute_method": method,
            "recompute_num_layers": int(k) if k.isdigit() else k,
        }
    else:
        keys = {"recompute_granularity": "selective", "recompute_modules": text.replace("+", ",")}
    return text, RecomputeConfig.from_megatron({**keys, **facts})


def run_key(plan: PlanLike) -> str | None:
    """What makes two entries the same run: a config's Megatron keys with its labels in any order
    (mlp+core_attn, core_attn,mlp); None for a per-layer plan (each file runs)."""
    if isinstance(plan, Plan):
        return None
    keys = {} if plan is None else plan.to_megatron()
    keys["recompute_modules"] = sorted(keys.get("recompute_modules") or [])
    return json.dumps(keys, sort_keys=True, default=str)
