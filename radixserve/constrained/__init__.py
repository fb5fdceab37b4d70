"""Constrained decoding: grammar backends (llguidance by default), per-step token masks and
jump-forward. The scheduler talks to it only through `grammars.Grammars`; the HTTP process
loads `schema` alone (no torch)."""
