"""What a run is asked to do, as values that check themselves: Megatron's recompute settings and
rules, the per-layer plan, a config against a model's sites, and the parallel layout."""
