"""OOM diagnosis: a fragmentation OOM told from a capacity OOM, and what to change; `watch` catches
one around a training loop, `diagnose` reads the allocator now."""

from remat.doctor.allocator import (
    AllocatorState,
    capture,
    load_snapshot,
    oom_messages,
    oom_state,
    parse_oom_message,
    snapshot_limit_problems,
)
from remat.doctor.report import (
    EXPANDABLE_SEGMENTS,
    MIN_FRAGMENTATION_GAP,
    PLAN_BUDGET_SHARE,
    Diagnosis,
    Doctor,
    Recommendation,
    Report,
    attribution_rows,
    classify,
    diagnose,
    recommend,
    report_of,
    watch,
)

__all__ = [
    "AllocatorState",
    "Diagnosis",
    "Doctor",
    "EXPANDABLE_SEGMENTS",
    "MIN_FRAGMENTATION_GAP",
    "PLAN_BUDGET_SHARE",
    "Recommendation",
    "Report",
    "attribution_rows",
    "capture",
    "classify",
    "diagnose",
    "load_snapshot",
    "oom_messages",
    "oom_state",
    "parse_oom_message",
    "recommend",
    "report_of",
    "snapshot_limit_problems",
    "watch",
]
