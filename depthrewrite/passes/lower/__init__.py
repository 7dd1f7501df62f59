"""Lowering passes the compile backend runs on graphs of converted models (parameter-free)."""

from .two_phase import TwoPhaseGroup, apply_two_phase, find_two_phase_groups

__all__ = ["TwoPhaseGroup", "find_two_phase_groups", "apply_two_phase"]
