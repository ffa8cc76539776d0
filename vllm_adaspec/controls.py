"""Per-request speculation controls, read from `SamplingParams.extra_args` (the OpenAI server's `vllm_xargs`).

    adaspec_speculation   "auto" (default): the cost model decides; "off": no drafts for this request;
                          "chain": drafts verified as a chain only; "tree": a token tree whenever the request drafts
                          (the cost model still sizes it, but never trades it for a chain)
    adaspec_max_drafts    int 0..128: the most drafts (tree nodes) per step for this request (0 = none)

Flat keys, because `vllm_xargs` carries no nested objects. Checked when the request arrives (engine/plugin.py turns
a ValueError here into vLLM's 400 naming the field); pure Python, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATION = "adaspec_speculation"
MAX_DRAFTS = "adaspec_max_drafts"
MODES = ("auto", "off", "chain", "tree")
MAX_DRAFTS_LIMIT = 128  # as num_speculative_tokens (config.K_LIMIT)


class ControlError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class RequestControls:
    """speculation: one of MODES; max_drafts: a cap on drafts per step (None: the engine's)."""
    speculation: str = "auto"
    max_drafts: int | None = None

    @property
    def off(self) -> bool:
        return self.speculation == "off" or self.max_drafts == 0


DEFAULT = RequestControls()


def parse_controls(extra_args) -> RequestControls:
    """extra_args (a dict or None) -> RequestControls; ControlError naming the key for a bad value. Keys of other
    components (anything not starting with "adaspec_") are left alone; an unknown adaspec_ key is an error (a typo
    must not silently change nothing)."""
    if not extra_args:
        return DEFAULT
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith("adaspec_")}
    if not ours:
        return DEFAULT
    unknown = sorted(set(ours) - {SPECULATION, MAX_DRAFTS})
    if unknown:
        raise ControlError(unknown[0], f"unknown per-request setting; known: {SPECULATION}, {MAX_DRAFTS}")
    mode = ours.get(SPECULATION, "auto")
    if not isinstance(mode, str) or mode not in MODES:
        raise ControlError(SPECULATION, f"must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    cap = ours.get(MAX_DRAFTS)
    if cap is not None:
        # vllm_xargs may carry numbers as strings ("4"): accept a decimal string, nothing else
        if isinstance(cap, str) and cap.strip().isdigit():
            cap = int(cap)
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_DRAFTS_LIMIT:
            raise ControlError(MAX_DRAFTS, f"must be an integer from 0 to {MAX_DRAFTS_LIMIT}, got {cap!r}")
    return RequestControls(mode, cap)
