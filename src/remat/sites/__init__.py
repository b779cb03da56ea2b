"""Sites: the one wrapper models call their computations through, how a step calls a model, Sites
placed on models remat did not write, and installing a plan's actions on a model's Sites."""
