"""Replaying golden points on a candidate and judging them."""
