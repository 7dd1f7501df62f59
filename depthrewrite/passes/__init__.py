"""Graph passes: ``analyse`` (read-only detection) and, per scheme, the rewrites."""
