"""Speculative decoding's parts that need no model: n-gram drafts (ngram.py) and the
controller that decides how many drafted tokens a step verifies (controller.py). The
scheduler wires them into the decode step (scheduler/speculative.py)."""
