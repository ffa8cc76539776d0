"""vLLM glue: the only package that touches vLLM internals.

- plugin.py     the `vllm.general_plugins` entry point; installs our worker and scheduler for adaspec configs
- worker.py     worker subclasses that hand the model runner to the drafter and report scheduling
- scheduler.py  reserves lookahead KV slots for draft tokens
- drafting.py   runs the target's first N layers for a batch of draft tokens (attention metadata, forward context)
"""
