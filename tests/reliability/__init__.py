"""Helpers of the reliability suite (tests/test_reliability.py) and the soak (bench/soak.py)."""
