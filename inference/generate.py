"""The command line: chat-render a prompt, decode it with a heads directory's `Speculator`, stream the text.

    python -m headstart.inference.generate --heads DIR_OR_ID --prompt "Hi!" --max_new_tokens 64 [--temperature 0.7] \
        [--tree auto|default|PATH] [--no_lookup] [--fixed_tree]

It prints tau (tokens per target forward) and tokens/s at the end. The Python entry point is re-exported here:
`from headstart.inference.speculator import Speculator` (inference/speculator.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from headstart.heads.chat import prompt_ids
from headstart.heads.target import TargetLoadError
from headstart.inference.decode import SpeculatorError
from headstart.inference.speculator import Speculator



class TextStream:
    """on_tokens callback that decodes incrementally and writes only the new text."""

    def __init__(self, tokenizer, write: Callable[[str], None] | None = None):
        self.tokenizer = tokenizer
        self.write = write or (lambda s: print(s, end="", flush=True))
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next tokens
            return
        self.write(text[len(self.text):])
        self.text = text

    def end(self) -> None:
        """Write whatever is still held back (an output that ends inside a multi-byte character)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.write(text[len(self.text):])
        self.text = text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headstart.inference.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True, help="heads directory or Hub id")
    parser.add_argument("--prompt", required=True, help="the user message (the chat template is applied)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (with temperature > 0); 1 = off")
    parser.add_argument("--tree", default=None, help="auto | default | PATH to a JSON with 'choices' "
                                                      "(default: the heads' tree.json if present)")
    parser.add_argument("--target", default=None, help="target name/path (default: the one named by the heads)")
    parser.add_argument("--dtype", default="float32", help="the target's dtype: float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (on a busy machine 1 is often faster)")
    parser.add_argument("--typical", action="store_true", help="Medusa typical acceptance (lossy)")
    parser.add_argument("--fixed_tree", action="store_true", help="verify the tree every step instead of adapting "
                                                                  "what to verify to what is accepted (inference/adapt.py)")
    parser.add_argument("--no_lookup", action="store_true", help="draft with the heads only, never from repeats in the "
                                                                 "context (inference/lookup.py)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        spec = Speculator.from_pretrained(args.heads, target=args.target, tree=args.tree, dtype=args.dtype,
                                          device=args.device)
        ids = prompt_ids(spec.tokenizer, args.prompt)
        stream = TextStream(spec.tokenizer)
        out = spec.generate(ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            acceptance="typical" if args.typical else "auto", seed=args.seed, on_tokens=stream,
                            lookup=not args.no_lookup, adaptive=not args.fixed_tree)
        stream.end()
    except (SpeculatorError, TargetLoadError) as err:  # a bad --heads / --tree / --target / prompt
        print(f"error: {err}", file=sys.stderr)
        return 2
    s = out.stats
    steps = (", steps " + ", ".join(f"{kind} {n}" for kind, n in sorted(s.proposals.items()))) if s.proposals else ""
    print(f"\n\n{s.new_tokens} tokens, tau {s.tau:.2f} (tokens per target forward), {s.tokens_per_s:.1f} tokens/s, "
          f"tree {spec.tree_size} nodes{steps}, {s.lookup_steps} of {s.decode_forwards} steps drafted from the context, "
          f"draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s, prefill {s.prefill_s:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
