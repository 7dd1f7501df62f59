"""What users look at: ``report`` (chain and conversion tables), ``draw`` (graph pictures), ``render`` (the
matplotlib fallback when Graphviz is missing) and ``explain`` (what the compile backend did to each graph)."""
