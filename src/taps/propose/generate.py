"""`taps generate` as one library call: a prompt decoded by the composition a VariantSpec names
(the baseline: plain decoding), on a target given as a directory, a GGUF file or a known name."""

from __future__ import annotations

from dataclasses import dataclass, replace

from taps.core.config import DecodeConfig, SpeculationConfig
from taps.core.decode import DecodeResult, chat_ids, generate, reply_text
from taps.drafter.profile import tree_policy
from taps.propose.factory import HeadPool
from taps.propose.spec import VariantSpec
from taps.core.target import TargetRef


@dataclass
class Generated:
    text: str  # the new tokens, stop tokens left out
    result: DecodeResult

    def as_json(self) -> dict:
        """What `taps generate --json` prints."""
        r = self.result
        infos = [s.info.as_json() for s in r.steps]
        return {
            "text": self.text,
            "token_ids": r.tokens,
            "new_tokens": len(r.tokens),
            "prompt_tokens": r.prompt_tokens,
            "steps": len(r.steps),
            "verifier_calls": r.verifier_calls,
            "acceptance_length": r.acceptance_length,
            "accepted_per_step": [s.accepted for s in r.steps],
            "drafter_per_step": [s.credited_drafter for s in r.steps],
            "step_info": infos if any(infos) else None,
            "tokens_per_second": r.tokens_per_second,
            "stop_reason": r.stop_reason,
            "time_split_s": r.time_split(),
            "total_s": r.total_s,
        }

    def summary(self) -> str:
        r = self.result
        return (f"[{len(r.tokens)} tokens, {r.verifier_calls} verifier calls, acceptance length "
                f"{r.acceptance_length:.2f}, {r.tokens_per_second:.1f} tokens/s]")


def generate_prompt(target: TargetRef, spec: VariantSpec, prompt: str | list[int], raw: bool = False,
                    speculation: SpeculationConfig = SpeculationConfig(),
                    decode: DecodeConfig | None = None) -> Generated:
    """Decode one prompt: token ids as they are, or a user message through the chat template
    (`raw`: tokenized as plain text). `speculation`: the tree mode and shape (a drafter's; plain
    decoding drafts none).
    `decode`: length, sampling and seed (default: DecodeConfig's); no stop tokens: the target's."""
    loaded = target.load()
    tok = loaded.tokenizer
    if not isinstance(prompt, str):
        ids = list(prompt)
    elif tok is None:
        raise ValueError(f"{target.path} has no tokenizer; use --prompt-ids")
    elif raw:
        ids = tok(prompt)["input_ids"]
    else:
        ids = chat_ids(tok, [{"role": "user", "content": prompt}])
    pool = HeadPool(loaded, target.attn)
    policy = tree_policy(loaded, pool.heads(spec).values(), speculation)
    cfg = decode or DecodeConfig()
    cfg = cfg if cfg.stop_token_ids else replace(cfg, stop_token_ids=loaded.stop_token_ids())
    result = generate(loaded, pool.proposer(spec, speculation.tree, policy), ids, cfg)
    text = reply_text(tok, result.tokens, cfg.stop_token_ids) if tok else ""
    return Generated(text, result)
