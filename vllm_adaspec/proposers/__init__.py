"""Drafting methods, one vLLM proposer per file (vLLM's custom-proposer interface: load_model + propose)."""
