"""The training step every measurement runs: its spec, the model of a recipe, mock data, the
optimizer, and verifying a plan against no recompute."""
