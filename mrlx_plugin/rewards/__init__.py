"""Rewards: grading answers (`grading`), and the host-facing reward, normalisation and
episode-level shaping (`shaping`). They use only `core`."""
