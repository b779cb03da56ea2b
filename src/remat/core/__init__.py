"""remat's vocabulary, imported by every layer: problems and advice, sizes, the spread of timings,
and the site labels and actions."""
