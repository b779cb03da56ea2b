"""A run's peak memory and step time per pipeline rank from shapes alone, and a plan per rank."""
